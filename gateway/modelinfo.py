"""What the gateway knows about the served model, read from its Hugging Face directory without
torch: vocabulary size, context length, EOS ids, dtype, and the model identity that seeds the
block hashes (the same string the engine computes, so gateway and workers hash alike)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.hashing import model_identity
from tandem.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """The model facts validation, streaming and GetModelInfo need."""

    name: str
    identity: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    tokenizer: Tokenizer


def load_served_model(model_dir: str | Path, *, load_format: str = "auto", max_context: int | None = None,
                      name: str | None = None) -> ServedModel:
    """Read config.json and the tokenizer of `model_dir`.

    `max_context` caps the model's max_position_embeddings (e.g. the workers' max_model_len).
    Raises ValueError naming the file or field when the directory is unusable.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise ValueError(f"model: {str(root)!r} is not a directory")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"model: no config.json in {root}")
    try:
        cfg: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"config.json: not valid JSON ({exc})") from exc
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"config.json: vocab_size must be a positive integer, got {vocab!r}")
    context = cfg.get("max_position_embeddings", 2048)
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise ValueError(f"config.json: max_position_embeddings must be an integer >= 2, got {context!r}")
    if max_context is not None:
        context = min(context, max_context)
    tokenizer = Tokenizer.from_dir(root)
    eos = cfg.get("eos_token_id")
    cfg_eos = eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
    eos_ids = tuple(sorted(set(tokenizer.eos_token_ids) | {int(i) for i in cfg_eos}))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    return ServedModel(
        name=name or root.name,
        identity=model_identity(root, load_format),
        vocab_size=vocab,
        max_context=context,
        eos_token_ids=eos_ids,
        dtype=dtype,
        tokenizer=tokenizer,
    )

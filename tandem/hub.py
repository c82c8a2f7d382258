"""`--model NAME`: a local directory or a Hugging Face repo id, resolved to one directory.

`resolve_model` is what every process that takes `--model` calls (`tandem up` resolves once and
hands its children the directory, so workers and gateway read the same files). A repo id is
looked up in the Hugging Face cache first (`HF_HOME` / `HF_HUB_CACHE`, the revision's snapshot),
as vLLM and SGLang do, and downloaded only when it is not there and the hub is not offline
(`HF_HUB_OFFLINE=1`). Torch-free; huggingface_hub is imported only for a repo id.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# owner/name (or a bare name), as the hub spells repo ids.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]{0,95}(/[A-Za-z0-9][\w.\-]{0,95})?")
# What a served model needs; the rest of a repo (original/ checkpoints, gguf, onnx, ...) is not fetched.
_WANTED = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.tiktoken", "tokenizer*"]


class ModelSourceError(ValueError):
    """--model names neither a model directory nor a repo id that can be found; one line, naming the flag."""


def resolve_model(model: str, revision: str | None = None, cache_dir: str | Path | None = None,
                  flag: str = "--model") -> str:
    """The directory of `model`: itself when it is a directory with a config.json, else the
    snapshot of Hugging Face repo `model` at `revision` (default: main) from the cache, fetched
    first if missing and the hub is reachable. Raises ModelSourceError naming `flag`."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{flag} {model}: no config.json in that directory")
        if revision is not None:
            logger.warning("--revision %s ignored: %s is a local directory", revision, model)
        return str(path.resolve())
    if model.startswith((".", "/", "~")) or model.count("/") > 1 or not _REPO_ID.fullmatch(model):
        raise ModelSourceError(f"{flag} {model}: no such directory, and not a Hugging Face repo id (owner/name)")
    try:
        import huggingface_hub
        from huggingface_hub.utils import LocalEntryNotFoundError
    except ImportError:
        raise ModelSourceError(f"{flag} {model}: no such directory; install huggingface_hub to serve a repo id") from None
    try:
        snapshot = huggingface_hub.snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                                     local_files_only=True, allow_patterns=_WANTED)
        logger.info("%s %s: the cached snapshot %s", flag, model, snapshot)
    except (LocalEntryNotFoundError, FileNotFoundError):
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            raise ModelSourceError(f"{flag} {model}: not in the Hugging Face cache "
                                   f"({cache_dir or huggingface_hub.constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set"
                                   ) from None
        try:
            snapshot = _download(model, revision, cache_dir)
        except Exception as exc:  # noqa: BLE001 - HTTP, connection (its type depends on the hub's HTTP library), disk
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelSourceError(f"{flag} {model}: not cached, and fetching it failed: {first}") from None
    if not (Path(snapshot) / "config.json").is_file():
        raise ModelSourceError(f"{flag} {model}: the snapshot {snapshot} has no config.json")
    return str(snapshot)


def _download(model: str, revision: str | None, cache_dir: str | Path | None) -> str:
    """Fetch the files a served model needs (PyTorch *.bin only when there are no safetensors)."""
    import huggingface_hub

    files = huggingface_hub.list_repo_files(model, revision=revision)
    ignore = ["*.bin"] if any(f.endswith(".safetensors") for f in files) else None
    logger.info("--model %s: downloading into the Hugging Face cache", model)
    return huggingface_hub.snapshot_download(model, revision=revision, cache_dir=cache_dir,
                                             allow_patterns=_WANTED, ignore_patterns=ignore)

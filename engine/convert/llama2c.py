"""Convert a llama2.c checkpoint and its tokenizer.bin into a Hugging Face Llama directory.

Reads karpathy/llama2.c's float32 checkpoints (legacy v0 and version 1) and its
sentencepiece-derived tokenizer.bin, and writes config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, special_tokens_map.json and generation_config.json
that the engine and transformers' LlamaForCausalLM / AutoTokenizer load. Needs numpy,
safetensors and tokenizers; no torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

logger = logging.getLogger(__name__)

_MAGIC = 0x616B3432  # "ak42": versioned llama2.c checkpoints start with it
_V1_HEADER_BYTES = 256
_LEGACY_HEADER_BYTES = 7 * 4
_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
_SPACE = "\u2581"  # SentencePiece's visible space
# llama2.c's tokenizer.bin always holds unk, BOS, EOS at ids 0, 1, 2 (BOS/EOS spelled "\n<s>\n").
SPECIAL_PIECES = ("<unk>", "<s>", "</s>")
BOS_ID, EOS_ID = 1, 2


@dataclass(frozen=True)
class Llama2cConfig:
    """The seven header integers of a llama2.c checkpoint plus the shared-classifier flag."""

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def validate(self, where: str) -> None:
        for name in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{where}: header field {name} must be positive, got {getattr(self, name)}")
        if self.dim % self.n_heads or self.head_dim % 2:
            raise ValueError(f"{where}: dim {self.dim} must split into {self.n_heads} heads of even size")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{where}: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")


def read_llama2c_checkpoint(path: str | Path) -> tuple[Llama2cConfig, dict[str, np.ndarray]]:
    """Header and float32 arrays of a llama2.c checkpoint, under llama2.c's own names.

    Names: token_embedding [V, D], rms_att [L, D], wq [L, D, D], wk/wv [L, KV, D],
    wo [L, D, D], rms_ffn [L, D], w1/w3 [L, H, D], w2 [L, D, H], rms_final [D], and wcls
    [V, D] when the classifier is not shared. Matrices are (out, in); wq/wk rows are in
    llama2.c's interleaved-pair rotary order. Arrays are read-only views of a memory map.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(_V1_HEADER_BYTES)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read checkpoint: {exc}") from exc
    if len(head) < _LEGACY_HEADER_BYTES:
        raise ValueError(f"{path}: too short to be a llama2.c checkpoint ({size} bytes)")
    if struct.unpack_from("<I", head, 0)[0] == _MAGIC:
        version = struct.unpack_from("<i", head, 4)[0]
        if version != 1:
            raise ValueError(f"{path}: llama2.c checkpoint version {version} is not supported (only 0 and 1, float32)")
        fields = struct.unpack_from("<7i", head, 8)
        config = Llama2cConfig(*fields, shared_classifier=bool(head[36]))
        offset = _V1_HEADER_BYTES
    else:
        fields = struct.unpack_from("<7i", head, 0)
        # Legacy files flag an unshared classifier with a negative vocab size.
        config = Llama2cConfig(*fields[:5], abs(fields[5]), fields[6], shared_classifier=fields[5] > 0)
        offset = _LEGACY_HEADER_BYTES
    config.validate(str(path))
    layout = _legacy_layout(config) if offset == _LEGACY_HEADER_BYTES else _v1_layout(config)
    count = sum(int(np.prod(shape)) for _, shape in layout)
    expected = offset + 4 * count
    if size != expected:
        raise ValueError(
            f"{path}: size {size} bytes does not match the header {config} (expected {expected} bytes)"
        )
    flat = np.memmap(path, dtype="<f4", mode="r", offset=offset, shape=(count,))
    arrays: dict[str, np.ndarray] = {}
    position = 0
    for name, shape in layout:
        n = int(np.prod(shape))
        arrays[name] = flat[position : position + n].reshape(shape)
        position += n
    arrays.pop("rope_tables", None)
    return config, arrays


def _legacy_layout(c: Llama2cConfig) -> list[tuple[str, tuple[int, ...]]]:
    L, D, H, KV = c.n_layers, c.dim, c.hidden_dim, c.kv_dim
    layout = [
        ("token_embedding", (c.vocab_size, D)), ("rms_att", (L, D)), ("wq", (L, D, D)),
        ("wk", (L, KV, D)), ("wv", (L, KV, D)), ("wo", (L, D, D)), ("rms_ffn", (L, D)),
        ("w1", (L, H, D)), ("w2", (L, D, H)), ("w3", (L, H, D)), ("rms_final", (D,)),
        # Precomputed cos/sin tables, [max_seq_len, head_dim / 2] each; unused.
        ("rope_tables", (2, c.max_seq_len, c.head_dim // 2)),
    ]
    return layout if c.shared_classifier else layout + [("wcls", (c.vocab_size, D))]


def _v1_layout(c: Llama2cConfig) -> list[tuple[str, tuple[int, ...]]]:
    L, D, H, KV = c.n_layers, c.dim, c.hidden_dim, c.kv_dim
    layout = [
        ("rms_att", (L, D)), ("rms_ffn", (L, D)), ("rms_final", (D,)), ("token_embedding", (c.vocab_size, D)),
        ("wq", (L, D, D)), ("wk", (L, KV, D)), ("wv", (L, KV, D)), ("wo", (L, D, D)),
        ("w1", (L, H, D)), ("w2", (L, D, H)), ("w3", (L, H, D)),
    ]
    return layout if c.shared_classifier else layout + [("wcls", (c.vocab_size, D))]


def read_llama2c_tokenizer(path: str | Path, vocab_size: int) -> list[tuple[bytes, float]]:
    """(piece bytes, score) for every id of a llama2.c tokenizer.bin.

    Format: int32 max_token_length, then per token float32 score, int32 length, bytes.
    The file must hold exactly `vocab_size` tokens (the model's vocabulary).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read tokenizer: {exc}") from exc
    pieces: list[tuple[bytes, float]] = []
    position = 4
    try:
        while position < len(data):
            score, length = struct.unpack_from("<fi", data, position)
            position += 8
            if length < 0 or position + length > len(data):
                raise ValueError(f"{path}: token {len(pieces)} has a bad length {length}")
            pieces.append((data[position : position + length], score))
            position += length
    except struct.error as exc:
        raise ValueError(f"{path}: truncated after {len(pieces)} tokens") from exc
    if len(pieces) != vocab_size:
        raise ValueError(f"{path}: holds {len(pieces)} tokens but the checkpoint's vocabulary is {vocab_size}")
    return pieces


def build_tokenizer(pieces: list[tuple[bytes, float]], where: str = "tokenizer") -> Tokenizer:
    """A `tokenizers` BPE that encodes exactly like llama2.c's `encode(text, bos=1, eos=0)`.

    llama2.c prepends a space, starts from one symbol per UTF-8 character (bytes + 3 for a
    character outside the vocabulary) and repeatedly merges the adjacent pair whose
    concatenation is the best-scoring vocabulary piece. As BPE: every split of a piece into
    two vocabulary pieces is a merge ranked by the piece's score; byte fallback covers the
    rest; the normalizer adds the leading ▁ and turns spaces into ▁.
    """
    vocab: dict[str, int] = {}
    for token_id, (raw, _) in enumerate(pieces):
        if token_id < len(SPECIAL_PIECES):
            token = SPECIAL_PIECES[token_id]
        else:
            try:
                token = raw.decode("utf-8").replace(" ", _SPACE)
            except UnicodeDecodeError as exc:
                raise ValueError(f"{where}: token {token_id} is not valid UTF-8: {raw!r}") from exc
        if token in vocab:
            raise ValueError(f"{where}: token {token_id} {token!r} duplicates token {vocab[token]}")
        vocab[token] = token_id
    mergeable = {t: i for t, i in vocab.items() if i >= len(SPECIAL_PIECES) and not _BYTE_PIECE.fullmatch(t)}
    ranked = []
    for token, token_id in mergeable.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-pieces[token_id][1], token_id, cut, left, right))
    ranked.sort()
    _warn_on_rank_ties(ranked, where)
    merges = [(left, right) for *_, left, right in ranked]
    missing_bytes = 256 - sum(1 for t in vocab if _BYTE_PIECE.fullmatch(t))
    if missing_bytes:
        logger.warning("%s: %d byte-fallback tokens missing; such bytes encode as <unk>", where, missing_bytes)

    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=SPECIAL_PIECES[0], fuse_unk=True, byte_fallback=True)
    )
    # Normalizer, not the Metaspace pre-tokenizer: Metaspace skips the prefix ▁ when the
    # text already starts with a space, while llama2.c (and SentencePiece) always add it.
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), normalizers.Replace(" ", _SPACE)])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    bos = SPECIAL_PIECES[BOS_ID]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, BOS_ID)]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_PIECES])
    return tokenizer


def _warn_on_rank_ties(ranked: list[tuple[float, int, int, str, str]], where: str) -> None:
    """Warn where BPE's strict merge ranks could differ from llama2.c's leftmost-on-tie rule.

    Two cases: different pieces with equal scores, and one piece reachable from two
    different pairs that can overlap (x, y, z with x+y == y+z); neither occurs in the
    tokenizers llama2.c ships, and both change the result only for rare inputs.
    """
    scores: dict[float, set[int]] = {}
    splits: dict[int, list[tuple[str, str]]] = {}
    for neg_score, token_id, _, left, right in ranked:
        scores.setdefault(neg_score, set()).add(token_id)
        splits.setdefault(token_id, []).append((left, right))
    tied = sum(len(ids) for ids in scores.values() if len(ids) > 1)
    overlapping = [
        left + right
        for pairs in splits.values()
        for left, right in pairs
        for left2, right2 in pairs
        if (left, right) != (left2, right2) and right == left2
    ]
    if tied or overlapping:
        logger.warning(
            "%s: %d merged pieces share a score and %d can be built from overlapping pairs; "
            "BPE ranks may break such ties differently from llama2.c on rare inputs",
            where, tied, len(overlapping),
        )


def _permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder q/k rows from interleaved pairs (x0, x1), (x2, x3)... to rotate_half halves.

    Same as transformers' convert_llama_weights_to_hf `permute`.
    """
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def hf_state_dict(config: Llama2cConfig, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama2.c arrays renamed (and q/k permuted) into LlamaForCausalLM's state dict."""
    out = {"model.embed_tokens.weight": w["token_embedding"], "model.norm.weight": w["rms_final"]}
    for layer in range(config.n_layers):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = w["rms_att"][layer]
        out[p + "self_attn.q_proj.weight"] = _permute_rotary(w["wq"][layer], config.n_heads)
        out[p + "self_attn.k_proj.weight"] = _permute_rotary(w["wk"][layer], config.n_kv_heads)
        out[p + "self_attn.v_proj.weight"] = w["wv"][layer]
        out[p + "self_attn.o_proj.weight"] = w["wo"][layer]
        out[p + "post_attention_layernorm.weight"] = w["rms_ffn"][layer]
        out[p + "mlp.gate_proj.weight"] = w["w1"][layer]
        out[p + "mlp.up_proj.weight"] = w["w3"][layer]
        out[p + "mlp.down_proj.weight"] = w["w2"][layer]
    if not config.shared_classifier:
        out["lm_head.weight"] = w["wcls"]
    return {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in out.items()}


def hf_config(config: Llama2cConfig) -> dict:
    """config.json for LlamaForCausalLM (RMSNorm eps 1e-5 and rope theta 10000, as llama2.c)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.shared_classifier,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def convert_llama2c(checkpoint_path: str | Path, tokenizer_path: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face Llama directory for a llama2.c model; return its path.

    Raises ValueError when an input is missing, malformed, or the two disagree on the
    vocabulary size, or when `out_dir` exists and is not a directory.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} exists and is not a directory")
    config, arrays = read_llama2c_checkpoint(checkpoint_path)
    pieces = read_llama2c_tokenizer(tokenizer_path, config.vocab_size)
    tokenizer = build_tokenizer(pieces, str(tokenizer_path))

    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(config, arrays), str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": SPECIAL_PIECES[BOS_ID], "eos_token": SPECIAL_PIECES[EOS_ID], "unk_token": SPECIAL_PIECES[0]}
    tokenizer_config = {
        # The generic fast class loads tokenizer.json as written; the Llama class would swap
        # the normalizer for a Metaspace pre-tokenizer that encodes a leading space differently.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_seq_len,
    }
    files = {
        "config.json": hf_config(config),
        "generation_config.json": {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID},
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special,
    }
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    logger.info("converted %s (%s) to %s", checkpoint_path, config, out)
    return out


def main_convert(argv: list[str] | None = None) -> int:
    """`tandem convert` entry point; `argv` is what follows `convert`, e.g.
    ["llama2c", CHECKPOINT, TOKENIZER, OUT_DIR]. Returns the process exit code."""
    parser = argparse.ArgumentParser(prog="tandem convert", description="Convert checkpoints to Hugging Face format.")
    formats = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    llama2c = formats.add_parser("llama2c", help="llama2.c checkpoint + tokenizer.bin -> Hugging Face Llama directory")
    llama2c.add_argument("checkpoint", help="llama2.c model file (legacy or version 1 float32), e.g. stories15M.bin")
    llama2c.add_argument("tokenizer", help="llama2.c tokenizer file, e.g. tokenizer.bin or tok512.bin")
    llama2c.add_argument("out_dir", help="output directory (created if missing)")
    args = parser.parse_args(argv)
    try:
        out = convert_llama2c(args.checkpoint, args.tokenizer, args.out_dir)
    except ValueError as exc:
        print(f"tandem convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0

"""Chained 64-bit block hashes, identical in every process and on every machine.

h_{-1} = xxh64(model identity), h_i = xxh64(le64(h_{i-1}) || le32 tokens of block i).
Workers publish these hashes and the gateway looks them up, so both must call this module.
"""
from __future__ import annotations

import hashlib
import json
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path

import xxhash

_LE64 = struct.Struct("<Q")


def model_identity(model_dir: str | Path, load_format: str = "auto") -> str:
    """A stable name for (config, tokenizer, weights source): seeds block hashes and names the
    index namespace. Independent of the directory's path, so two machines serving the same
    model share index entries."""
    d = Path(model_dir)
    h = hashlib.blake2b(digest_size=8)
    for name in ("config.json", "tokenizer.json"):
        p = d / name
        if p.is_file():
            h.update(p.read_bytes())
    h.update(load_format.encode())
    cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
    return f"{cfg.get('model_type', 'model')}-{h.hexdigest()}"


def seed_hash(model_identity: str) -> int:
    """The chain's starting value for one model (two models never share entries)."""
    return xxhash.xxh64_intdigest(model_identity.encode("utf-8"))


def _token_bytes(tokens: Sequence[int]) -> bytes:
    buf = array("I", tokens)  # uint32; vocabularies are far below 2**32
    if buf.itemsize != 4:  # pragma: no cover - exotic platforms
        buf = array("L", tokens)
    if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian hosts
        buf.byteswap()
    return buf.tobytes()


def next_hash(parent: int, block_tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash."""
    return xxhash.xxh64_intdigest(_LE64.pack(parent) + _token_bytes(block_tokens))


def block_hashes(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Hashes of every *full* block of `tokens` (a trailing partial block has none)."""
    out: list[int] = []
    h = seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = next_hash(h, tokens[start : start + block_size])
        out.append(h)
    return out


def hash_hex(h: int) -> str:
    return f"{h:016x}"

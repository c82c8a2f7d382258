"""Wire format of a KV transfer: frame headers, element types and checksums.

Transport-independent, so the contract between a prefill sender and a decode receiver can be
read here on its own. A transfer is a stream of messages for one request id:

    layer   header + K bytes + V bytes    one per layer, any layer order
    commit  header (carries `meta`)       after every layer
    abort   header (carries `reason`)     instead of commit

`seq` numbers the messages of one request 0, 1, 2, ... in sending order, so a receiver sees a
lost message as a gap. K and V bytes are the blocks' raw little-endian elements in
[n, block_size, num_kv_heads, head_dim] order, with a checksum of each in the header (xxh64
by default; `alg` names it). A header is a JSON object; a layer's source and destination
block ids travel in it as base64 of little-endian uint32 arrays (`src`, `dst`), which encode
and parse several times faster than JSON lists of numbers.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

PROTOCOL_VERSION = 2  # 2: block ids as base64 uint32 arrays
MAX_BLOCK_ID = 2**32 - 1  # block ids travel as uint32
DEFAULT_CHECKSUM = "xxh64"
# Receivers verify with whichever algorithm the header names. xxh3_64 hashes about twice as
# fast as xxh64, which matters when the checksum is on the critical path of a busy host.
CHECKSUMS = {"xxh64": xxhash.xxh64_intdigest, "xxh3_64": xxhash.xxh3_64_intdigest}

KIND_LAYER = "layer"
KIND_COMMIT = "commit"
KIND_ABORT = "abort"
KINDS = (KIND_LAYER, KIND_COMMIT, KIND_ABORT)

# torch dtype name -> bytes per element. Names, not numpy dtypes: bfloat16 and the float8
# types have no numpy equivalent, so payloads travel as raw bytes tagged with this name.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}


class FrameError(ValueError):
    """A message that does not follow this wire format."""


def dtype_name(dtype: Any) -> str:
    """Canonical name of a torch dtype, numpy dtype or string; ValueError naming `dtype` if unsupported."""
    name = str(getattr(dtype, "name", None) or dtype)  # numpy dtypes have .name; torch prints "torch.x"
    name = name.removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"dtype: {dtype!r} is not supported for KV transfer; supported: {sorted(DTYPE_ITEMSIZE)}")
    return name


def checksum(buf: Any, algorithm: str = DEFAULT_CHECKSUM) -> int:
    """Checksum of a bytes-like buffer (xxhash releases the GIL while hashing)."""
    return CHECKSUMS[algorithm](buf)


def check_checksum_algorithm(algorithm: str) -> str:
    if algorithm not in CHECKSUMS:
        raise ValueError(f"checksum: unknown algorithm {algorithm!r}; supported: {sorted(CHECKSUMS)}")
    return algorithm


def encode_block_ids(ids: tuple[int, ...]) -> str:
    """Block ids (each in [0, MAX_BLOCK_ID]) as base64 of a little-endian uint32 array."""
    return base64.b64encode(np.asarray(ids, dtype="<u4").tobytes()).decode("ascii")


def decode_block_ids(value: Any, field_name: str) -> tuple[int, ...]:
    """The inverse of `encode_block_ids`; FrameError naming the field otherwise."""
    try:
        raw = base64.b64decode(value, validate=True) if isinstance(value, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None or len(raw) % 4:
        raise FrameError(f"{field_name}: expected base64 of little-endian uint32 block ids")
    return tuple(np.frombuffer(raw, dtype="<u4").tolist())


def _int_tuple(value: Any, field_name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise FrameError(f"{field_name}: expected a list of integers")
    return tuple(value)


@dataclass(frozen=True)
class FrameHeader:
    """The first part of every message. Fields a kind does not use keep their defaults."""

    kind: str
    request_id: str
    seq: int
    layer: int = -1
    src_block_ids: tuple[int, ...] = ()
    dst_block_ids: tuple[int, ...] = ()
    dtype: str = ""
    shape: tuple[int, ...] = ()
    checksum_k: int = 0
    checksum_v: int = 0
    checksum_alg: str = DEFAULT_CHECKSUM
    meta: dict[str, Any] = field(default_factory=dict)
    reason: str = ""

    @property
    def payload_nbytes(self) -> int:
        """Bytes of the K buffer (and of the V buffer) a layer message must carry."""
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype] if self.shape else 0

    def encode(self) -> bytes:
        doc: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": self.kind, "rid": self.request_id, "seq": self.seq}
        if self.kind == KIND_LAYER:
            doc.update(
                layer=self.layer,
                src=encode_block_ids(self.src_block_ids),
                dst=encode_block_ids(self.dst_block_ids),
                dtype=self.dtype,
                shape=list(self.shape),
                alg=self.checksum_alg,
                ck=self.checksum_k,
                cv=self.checksum_v,
            )
        elif self.kind == KIND_COMMIT:
            doc["meta"] = self.meta
        elif self.kind == KIND_ABORT:
            doc["reason"] = self.reason
        return json.dumps(doc, separators=(",", ":")).encode("utf-8")

    @classmethod
    def decode(cls, data: bytes | memoryview) -> FrameHeader:
        """Parse and check a header; FrameError naming the bad field otherwise."""
        try:
            doc = json.loads(bytes(data))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FrameError(f"header: not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise FrameError("header: expected a JSON object")
        if doc.get("v") != PROTOCOL_VERSION:
            raise FrameError(f"v: unsupported protocol version {doc.get('v')!r}")
        kind, rid, seq = doc.get("kind"), doc.get("rid"), doc.get("seq")
        if kind not in KINDS:
            raise FrameError(f"kind: unknown message kind {kind!r}")
        if not isinstance(rid, str) or not rid:
            raise FrameError("rid: request id must be a non-empty string")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise FrameError("seq: must be a non-negative integer")
        if kind == KIND_COMMIT:
            meta = doc.get("meta")
            if not isinstance(meta, dict):
                raise FrameError("meta: commit metadata must be a JSON object")
            return cls(kind=kind, request_id=rid, seq=seq, meta=meta)
        if kind == KIND_ABORT:
            return cls(kind=kind, request_id=rid, seq=seq, reason=str(doc.get("reason", "")))
        layer = doc.get("layer")
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise FrameError("layer: must be an integer")
        dtype = doc.get("dtype")
        if dtype not in DTYPE_ITEMSIZE:
            raise FrameError(f"dtype: unsupported element type {dtype!r}")
        alg = doc.get("alg")
        if alg not in CHECKSUMS:
            raise FrameError(f"alg: unsupported checksum algorithm {alg!r}")
        ck, cv = doc.get("ck"), doc.get("cv")
        if not isinstance(ck, int) or not isinstance(cv, int):
            raise FrameError("ck/cv: checksums must be integers")
        shape = _int_tuple(doc.get("shape"), "shape")
        if any(d < 0 for d in shape):
            raise FrameError("shape: dimensions must be non-negative")
        return cls(
            kind=kind,
            request_id=rid,
            seq=seq,
            layer=layer,
            src_block_ids=decode_block_ids(doc.get("src"), "src"),
            dst_block_ids=decode_block_ids(doc.get("dst"), "dst"),
            dtype=dtype,
            shape=shape,
            checksum_k=ck,
            checksum_v=cv,
            checksum_alg=alg,
        )

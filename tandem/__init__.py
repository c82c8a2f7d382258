"""Tandem client SDK: `from tandem import Client, AsyncClient, SamplingParams, Tier`.

`SamplingParams` and `Tier` are torch- and grpc-free; the clients load grpc on first use.
"""
from __future__ import annotations

from tandem.types import SamplingParams, Tier

_CLIENT_NAMES = {"Client", "AsyncClient", "Completion", "ChunkStream", "AsyncChunkStream"}
_WIRE_NAMES = {"Chunk", "ModelInfo", "Usage", "TokenLogprob"}

__all__ = ["SamplingParams", "Tier", "TandemError", *sorted(_CLIENT_NAMES | _WIRE_NAMES)]


def __getattr__(name: str):
    if name in _CLIENT_NAMES:
        from tandem import client

        return getattr(client, name)
    if name in _WIRE_NAMES:
        from tandem import wire

        return getattr(wire, name)
    if name == "TandemError":
        from tandem.errors import TandemError

        return TandemError
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")

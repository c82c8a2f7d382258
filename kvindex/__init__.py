"""Global prefix index: which worker holds which KV block, so the gateway routes a prompt to
the worker that already has its prefix. Backends: embedded memory (default) and Redis."""
from __future__ import annotations

from kvindex.base import IndexStats, PrefixIndex, WorkerInfo, backends, coalesce, make_index, register_index
from kvindex.memory import MemoryIndex
from kvindex.redis_index import RedisIndex

__all__ = [
    "IndexStats",
    "MemoryIndex",
    "PrefixIndex",
    "RedisIndex",
    "WorkerInfo",
    "backends",
    "coalesce",
    "make_index",
    "register_index",
]

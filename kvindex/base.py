"""The global prefix index contract: which worker holds which KV block, and which workers are live.

Backends (embedded memory, Redis) implement `PrefixIndex` and register under a name;
`make_index(url, namespace)` picks one from a URL (None -> memory, redis:// -> Redis).
"""
from __future__ import annotations

import asyncio
import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from tandem.types import ROLES

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

MAX_HASH = 2**64 - 1
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_MISSES = 3  # a worker is dead after this many missed heartbeats
MAX_NAME_CHARS = 200


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker announces with each heartbeat.

    address: where its gRPC service listens ("host:port").
    role: "prefill", "decode" or "both".
    capacity: KV blocks in its pool.
    load: the worker's own load figure (queued prefill tokens for prefill, running requests
          for decode); informational, the gateway's `LoadTracker` is what routing uses.
    """

    address: str
    role: str
    capacity: int = 0
    load: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address or any(c.isspace() for c in self.address):
            raise ValueError(f"address: must be a non-empty string without whitespace, got {self.address!r}")
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 0:
            raise ValueError(f"capacity: must be an integer >= 0, got {self.capacity!r}")
        if isinstance(self.load, bool) or not isinstance(self.load, (int, float)) or not math.isfinite(self.load):
            raise ValueError(f"load: must be a finite number, got {self.load!r}")
        if self.load < 0:
            raise ValueError(f"load: must be >= 0, got {self.load}")


@dataclass(frozen=True)
class IndexStats:
    """Counters for metrics. `pending_ops` / `dropped_ops` count block hashes waiting in, or
    dropped from, the write buffer while the store was unreachable; `errors` failed calls;
    `reconnects` recoveries from a degraded state."""

    backend: str
    degraded: bool
    pending_ops: int = 0
    dropped_ops: int = 0
    errors: int = 0
    reconnects: int = 0


class PrefixIndex(ABC):
    """Which worker holds which KV block (by chained block hash), and which workers are live.

    Writers: each worker (or the gateway relaying the worker's KV events) calls
      - `clear(worker)` when the worker starts, restarts or leaves (before publishing again),
      - `publish(worker, stored, removed)` with the block hashes it cached / evicted since its
        previous call; `stored` is applied first, then `removed`, so a hash in both ends up
        absent (use `coalesce()` to turn an ordered event stream into the two lists),
      - `heartbeat(worker, info)` every `heartbeat_interval_s`; when it returns True the
        index did not know the worker as live (first beat, a lapse, or a store that lost its
        data, e.g. a Redis restart without persistence), so the worker republishes everything
        it holds (`clear` then `publish`).
    Readers (gateways) call `match(block_hashes)` / `amatch(...)` and `workers()`.

    Liveness: a worker is live from a heartbeat until `heartbeat_ttl_s` (3 intervals) after
    its latest one. `match` and `workers` report live workers only, so entries of a worker
    that died without `clear` (kill -9) are never reported. They are also removed: every
    `heartbeat` call reaps the entries of workers whose heartbeat lapsed (a worker that comes
    back after lapsing starts with no entries), and backends may expire them on their own.

    `match(hashes)` -> {worker: n}: n >= 1 is the number of leading hashes, consecutive from
    the first, that the live worker holds (blocks 0, 1, 3 held -> 2). Workers holding no
    leading block are absent; `match([])` is `{}`.

    The index is a hint: a stale entry costs a recompute, never a wrong answer. No method
    raises because the backing store is unreachable: `match` returns `{}`, `workers` returns
    `{}`, writes are buffered (bounded) or dropped and counted, and `degraded` is True until
    a call succeeds again. Bad arguments raise ValueError naming the argument.

    Every method may be called from any thread. The `a*` coroutines are for asyncio callers
    (the gateway): a backend that does network I/O runs the blocking call in a worker thread
    (`asyncio.to_thread`); the memory backend answers inline.
    """

    name: ClassVar[str] = "abstract"
    blocking_io: ClassVar[bool] = False  # True: a* methods run the sync call in a thread

    def __init__(self, namespace: str, *, heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S) -> None:
        self.namespace = check_name("namespace", namespace)
        if isinstance(heartbeat_interval_s, bool) or not isinstance(heartbeat_interval_s, (int, float)) or not (
            math.isfinite(heartbeat_interval_s) and heartbeat_interval_s > 0
        ):
            raise ValueError(f"heartbeat_interval_s: must be a finite number > 0, got {heartbeat_interval_s!r}")
        self.heartbeat_interval_s = float(heartbeat_interval_s)

    @property
    def heartbeat_ttl_s(self) -> float:
        return HEARTBEAT_MISSES * self.heartbeat_interval_s

    @abstractmethod
    def publish(self, worker_id: str, stored: Sequence[int], removed: Sequence[int]) -> None:
        """Record that `worker_id` now holds `stored` and no longer holds `removed`."""

    @abstractmethod
    def clear(self, worker_id: str) -> None:
        """Forget every block `worker_id` published (its registration stays)."""

    @abstractmethod
    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """{live worker: consecutive leading blocks held}, see the class docstring."""

    @abstractmethod
    def heartbeat(self, worker_id: str, info: WorkerInfo) -> bool:
        """Register or refresh `worker_id` (live for `heartbeat_ttl_s`); reap lapsed workers.

        True when the worker was not registered as live before this call (its published
        entries may be gone); False when it was, or when the store could not be reached.
        """

    @abstractmethod
    def deregister(self, worker_id: str) -> None:
        """A worker leaves for good: clear its blocks and drop its registration at once."""

    @abstractmethod
    def workers(self) -> dict[str, WorkerInfo]:
        """Live workers and what they last announced."""

    @abstractmethod
    def stats(self) -> IndexStats:
        """Current counters."""

    @property
    def degraded(self) -> bool:
        """True while the backing store is unreachable (routing should fall back to load)."""
        return self.stats().degraded

    def flush(self) -> None:
        """Send buffered writes now (no-op for backends that write through)."""

    def close(self) -> None:
        """Release connections; the index must not be used afterwards."""

    def __enter__(self) -> PrefixIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        if self.blocking_io:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)

    async def amatch(self, block_hashes: Sequence[int]) -> dict[str, int]:
        return await self._run(self.match, block_hashes)

    async def apublish(self, worker_id: str, stored: Sequence[int], removed: Sequence[int]) -> None:
        await self._run(self.publish, worker_id, stored, removed)

    async def aheartbeat(self, worker_id: str, info: WorkerInfo) -> bool:
        return await self._run(self.heartbeat, worker_id, info)



def check_name(field: str, value: object) -> str:
    """A namespace or worker id: non-empty, printable, no whitespace or braces (Redis Cluster hash tags)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}: must be a non-empty string, got {value!r}")
    if len(value) > MAX_NAME_CHARS:
        raise ValueError(f"{field}: at most {MAX_NAME_CHARS} characters, got {len(value)}")
    if any(c.isspace() or not c.isprintable() or c in "{}" for c in value):
        raise ValueError(f"{field}: must not contain whitespace, control characters or braces, got {value!r}")
    return value


def check_hashes(field: str, hashes: Iterable[int]) -> list[int]:
    """Block hashes as a list of ints in [0, 2**64)."""
    if isinstance(hashes, (str, bytes)):
        raise ValueError(f"{field}: must be a sequence of 64-bit unsigned ints, got {type(hashes).__name__}")
    out = list(hashes)
    for h in out:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= MAX_HASH:
            raise ValueError(f"{field}: block hashes must be ints in [0, 2**64), got {h!r}")
    return out


def coalesce(events: Iterable[tuple[bool, Sequence[int]]]) -> tuple[list[int], list[int]]:
    """Turn an ordered stream of (stored?, hashes) events into disjoint (stored, removed) lists.

    Each hash keeps its last event, so evict-then-store publishes it as stored and
    store-then-evict as removed. A worker feeds its radix cache's events as
    `(isinstance(ev, BlockStored), ev.block_hashes)`.
    """
    last: dict[int, bool] = {}
    for is_stored, hashes in events:
        for h in hashes:
            last.pop(h, None)  # re-insert so dict order follows the latest event
            last[h] = bool(is_stored)
    stored = [h for h, s in last.items() if s]
    removed = [h for h, s in last.items() if not s]
    return stored, removed


def leading_runs(holders: Sequence[Iterable[str]], live: set[str] | None) -> dict[str, int]:
    """Consecutive-from-the-start counts given the holders of each block, in prompt order."""
    result: dict[str, int] = {}
    if not holders:
        return result
    active = set(holders[0])
    if live is not None:
        active &= live
    for i, held in enumerate(holders):
        if i:
            active.intersection_update(held)
        if not active:
            break
        for w in active:
            result[w] = i + 1
    return result


_BACKENDS: dict[str, type[PrefixIndex]] = {}
_SCHEME_BACKEND = {"memory": "memory", "redis": "redis", "rediss": "redis", "unix": "redis"}


def register_index(name: str) -> Callable[[type[PrefixIndex]], type[PrefixIndex]]:
    """Class decorator: make a backend available to `make_index` under `name`.

    The class must offer `from_url(url, namespace, **options)`.
    """

    def deco(cls: type[PrefixIndex]) -> type[PrefixIndex]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return deco


def backends() -> dict[str, type[PrefixIndex]]:
    _load_builtin()
    return dict(_BACKENDS)


def make_index(url: str | None, namespace: str, **options: Any) -> PrefixIndex:
    """The index for `url`: None, "" or "memory://" -> embedded memory index; redis://,
    rediss:// or unix:// -> Redis. `namespace` is normally the model identity; `options` go
    to the backend's constructor (e.g. heartbeat_interval_s)."""
    _load_builtin()
    if url is None or not url.strip():
        scheme = "memory"
    elif "://" in url:
        scheme = url.split("://", 1)[0].lower()
    else:
        raise ValueError(f"index_url: expected memory:// or redis://host:port[/db], got {url!r}")
    backend = _SCHEME_BACKEND.get(scheme, scheme)
    if backend not in _BACKENDS:
        raise ValueError(f"index_url: unknown scheme {scheme!r}; known: {', '.join(sorted(_SCHEME_BACKEND))}")
    cls: Any = _BACKENDS[backend]
    return cls.from_url(url, namespace, **options)


def _load_builtin() -> None:
    # Imported here, not at module top: the backends import this module.
    from kvindex import memory, redis_index  # noqa: F401

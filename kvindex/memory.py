"""Embedded prefix index: the default when no Redis URL is given; lives inside the gateway
process, fed by the workers' KV events and heartbeats. Thread-safe."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvindex.base import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    IndexStats,
    PrefixIndex,
    WorkerInfo,
    check_hashes,
    check_name,
    leading_runs,
    register_index,
)

logger = logging.getLogger(__name__)


@register_index("memory")
class MemoryIndex(PrefixIndex):
    """Dict of block hash -> holders, plus each worker's set of hashes so `clear` is exact.

    `clock` (seconds, monotonic) decides liveness; tests may pass their own.
    """

    def __init__(
        self,
        namespace: str,
        *,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(namespace, heartbeat_interval_s=heartbeat_interval_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}
        self._workers: dict[str, tuple[WorkerInfo, float]] = {}  # id -> (info, deadline)

    @classmethod
    def from_url(cls, url: str | None, namespace: str, **options: Any) -> MemoryIndex:
        return cls(namespace, **options)

    def publish(self, worker_id: str, stored: Sequence[int], removed: Sequence[int]) -> None:
        check_name("worker_id", worker_id)
        stored = check_hashes("stored", stored)
        removed = check_hashes("removed", removed)
        with self._lock:
            mine = self._blocks.setdefault(worker_id, set())
            for h in stored:
                self._holders.setdefault(h, set()).add(worker_id)
                mine.add(h)
            for h in removed:
                self._drop(h, worker_id)
                mine.discard(h)
            if not mine:
                del self._blocks[worker_id]

    def clear(self, worker_id: str) -> None:
        check_name("worker_id", worker_id)
        with self._lock:
            self._clear_locked(worker_id)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        hashes = check_hashes("block_hashes", block_hashes)
        if not hashes:
            return {}
        empty: set[str] = set()
        with self._lock:
            live = self._live_locked()
            holders: list[set[str]] = []
            for h in hashes:
                held = self._holders.get(h, empty)
                if not held:
                    break  # nobody can extend a run past a block no one holds
                holders.append(held)
            return leading_runs(holders, live)

    def heartbeat(self, worker_id: str, info: WorkerInfo) -> bool:
        check_name("worker_id", worker_id)
        if not isinstance(info, WorkerInfo):
            raise ValueError(f"info: must be a WorkerInfo, got {type(info).__name__}")
        with self._lock:
            now = self._clock()
            for dead in [w for w, (_, deadline) in self._workers.items() if deadline <= now]:
                logger.info("prefix index: worker %s missed its heartbeats; dropping its entries", dead)
                self._clear_locked(dead)
                del self._workers[dead]
            fresh = worker_id not in self._workers
            self._workers[worker_id] = (info, now + self.heartbeat_ttl_s)
            return fresh

    def deregister(self, worker_id: str) -> None:
        check_name("worker_id", worker_id)
        with self._lock:
            self._clear_locked(worker_id)
            self._workers.pop(worker_id, None)

    def workers(self) -> dict[str, WorkerInfo]:
        with self._lock:
            now = self._clock()
            return {w: info for w, (info, deadline) in self._workers.items() if deadline > now}

    def stats(self) -> IndexStats:
        return IndexStats(backend=self.name, degraded=False)

    def num_entries(self) -> int:
        """(hash, worker) pairs stored, for tests and metrics."""
        with self._lock:
            return sum(len(s) for s in self._holders.values())

    def _live_locked(self) -> set[str]:
        now = self._clock()
        return {w for w, (_, deadline) in self._workers.items() if deadline > now}

    def _clear_locked(self, worker_id: str) -> None:
        for h in self._blocks.pop(worker_id, ()):
            self._drop(h, worker_id)

    def _drop(self, h: int, worker_id: str) -> None:
        held = self._holders.get(h)
        if held is not None:
            held.discard(worker_id)
            if not held:
                del self._holders[h]

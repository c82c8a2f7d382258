"""Harness for running a gateway against real worker processes from synchronous code (tests,
local experiments): `start_workers` starts worker processes through `entrypoints.cluster` and
waits until each is ready; `GatewayThread` runs an in-process Gateway on its own uvloop event
loop so callers can inspect its dispatch log and metrics. Torch-free."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from entrypoints.cluster import Cluster, ClusterProcess, worker_process
from gateway.adapters import WorkerStatsView
from gateway.config import GatewayConfig
from gateway.server import Gateway

logger = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass
class WorkerProcess(ClusterProcess):
    """A worker process started by `start_workers`; `address` is its gRPC host:port."""

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (graceful drain), SIGKILL after `timeout`; returns the exit code."""
        return super().stop(timeout)


def stop_workers(workers: Sequence[WorkerProcess], timeout: float = 20.0) -> None:
    """SIGTERM every worker at once, then wait for each (SIGKILL after `timeout`)."""
    Cluster(workers).stop(timeout)


def start_workers(specs: Sequence[tuple[str, Sequence[str]] | tuple[str, Sequence[str], dict[str, str]]],
                  model_dir: str | Path, work_dir: str | Path, timeout: float = 120.0) -> list[WorkerProcess]:
    """Start one worker per (role, extra flags[, extra env]) in parallel on free ports (role:
    prefill, decode or both); wait until each is ready. On failure every started process is
    killed and ClusterError (a RuntimeError) carries the failing worker's log."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    workers = []
    for n, spec in enumerate(specs):
        role, extra = spec[0], list(spec[1])
        env = spec[2] if len(spec) > 2 else {}  # type: ignore[misc]
        p = worker_process(f"{role}{n}", role, model_dir, work, extra, env)
        workers.append(WorkerProcess(**vars(p)))
    Cluster(workers).start(timeout)
    return workers


def wait_until(predicate: Callable[[], R], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> R:
    """Poll until `predicate()` is truthy; returns it. TimeoutError names `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what or predicate}")
        time.sleep(interval)


def wait_idle(worker: WorkerProcess, timeout: float = 30.0) -> WorkerStatsView:
    """Wait until the worker runs nothing and every KV block is free again; returns its stats."""
    def idle() -> WorkerStatsView | None:
        s = worker.stats()
        return s if (s.running == 0 and s.waiting == 0 and s.free_kv_blocks == s.total_kv_blocks) else None

    try:
        return wait_until(idle, timeout, what=f"{worker.role} worker {worker.worker_id} to free its blocks")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; last stats {worker.stats()}") from None


class GatewayThread:
    """A Gateway serving on its own uvloop event loop in a daemon thread.

    `call(fn)` runs `fn()` on that loop (so it may read gateway state safely) and returns its
    result; `stop()` drains and joins.
    """

    def __init__(self, config: GatewayConfig) -> None:
        try:
            import uvloop

            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway-loop", daemon=True)
        self._thread.start()
        self.gateway: Gateway = self._run(self._start(config))
        self.port = self.gateway.port
        self.target = f"127.0.0.1:{self.port}"

    async def _start(self, config: GatewayConfig) -> Gateway:
        gateway = Gateway(config)
        await gateway.start()
        return gateway

    def _run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], R]) -> R:
        async def run() -> R:
            return fn()

        return self._run(run())

    def wait_ready(self, timeout: float = 30.0) -> bool:
        return self._run(self.gateway.registry.wait_ready(timeout), timeout + 5)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """A sample of the gateway's registry; the `model` label is filled in (every gateway series has it)."""
        full = {"model": self.gateway.metrics.model, **(labels or {})}
        value = self.call(lambda: self.gateway.metrics.registry.get_sample_value(name, full))
        return value or 0.0

    def stop(self, grace_s: float = 2.0) -> None:
        if self.loop.is_closed():
            return
        try:
            self._run(self.gateway.stop(grace_s))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

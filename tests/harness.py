"""Harness for running a gateway against real worker processes from synchronous code (tests,
local experiments): `start_workers` launches `python -m worker|prefill|decode` processes and
waits for their ready files; `GatewayThread` runs an in-process Gateway on its own uvloop
event loop so callers can inspect its dispatch log and metrics. Torch-free."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from gateway import adapters
from gateway.adapters import WorkerStatsView
from gateway.config import GatewayConfig
from gateway.server import Gateway
from tandem import wire

logger = logging.getLogger(__name__)
R = TypeVar("R")

_MODULES = {"both": ["worker", "--role", "both"], "prefill": ["prefill"], "decode": ["decode"]}


@dataclass
class WorkerProcess:
    """A worker process started by `start_workers`; `address` is its gRPC host:port."""

    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""
    worker_id: str = ""
    kv_address: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def stats(self, timeout: float = 5.0) -> WorkerStatsView:
        with grpc.insecure_channel(self.address) as channel:
            stub = wire.PrefillWorkerStub(channel) if self.role == "prefill" else wire.DecodeWorkerStub(channel)
            return adapters.stats_from_proto(stub.Stats(adapters.stats_request(), timeout=timeout))

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL (a crash), then reap."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (graceful drain), SIGKILL after `timeout`; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        return self.proc.returncode


def stop_workers(workers: Sequence[WorkerProcess], timeout: float = 20.0) -> None:
    """SIGTERM every worker at once, then wait for each (SIGKILL after `timeout`)."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGTERM)
    for w in workers:
        w.stop(timeout)


def start_workers(specs: Sequence[tuple[str, Sequence[str]] | tuple[str, Sequence[str], dict[str, str]]],
                  model_dir: str | Path, work_dir: str | Path, timeout: float = 120.0) -> list[WorkerProcess]:
    """Start one worker per (role, extra flags[, extra env]) in parallel on free ports; wait
    until each has written its ready file. On failure every started process is stopped and
    RuntimeError carries the failing worker's log."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    started: list[tuple[WorkerProcess, Path]] = []
    try:
        for spec in specs:
            role, extra = spec[0], list(spec[1])
            env = {**os.environ, **(spec[2] if len(spec) > 2 else {})}  # type: ignore[misc]
            n = len(started)
            ready, log = work / f"{role}{n}.ready.json", work / f"{role}{n}.log"
            ready.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", *_MODULES[role], "--model", str(model_dir), "--port", "0",
                   "--ready-file", str(ready), "--log-level", "WARNING", *extra]
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            started.append((WorkerProcess(role, proc, log), ready))
        deadline = time.monotonic() + timeout
        for w, ready in started:
            while not ready.is_file():
                if w.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{w.role} worker did not start:\n{w.log_tail()}")
                time.sleep(0.05)
            w.info = json.loads(ready.read_text())
            w.address, w.worker_id, w.kv_address = w.info["address"], w.info["worker_id"], w.info.get("kv_address", "")
        return [w for w, _ in started]
    except BaseException:
        for w, _ in started:
            w.kill()
        raise


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
        value = self.call(lambda: self.gateway.metrics.registry.get_sample_value(name, labels or {}))
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

"""Worker process bootstrap: engine, engine thread, KV transport, gRPC (aio) server with health
and reflection, Prometheus endpoint, optional prefix-index publishing, graceful drain.

Why grpc.aio: a worker's RPCs are long waits (a Decode stream lives as long as its request)
while the work happens on the engine thread. One event loop holds every stream without a
thread per request, and the engine thread hands a whole step's outputs over with a single
wake-up (`worker.streams.AsyncBridge`), instead of waking one handler thread per request
and having them all contend for the GIL with the engine thread.

Drain (SIGTERM or SIGINT): health turns NOT_SERVING, Stats says draining, Reserve answers
ok=false and new Prefill / PrefillAndDecode calls UNAVAILABLE; in-flight requests and
reservations finish (up to --drain-timeout); then everything stops and `main` returns 0.
A second signal skips the wait.

Tensor parallel (--tp N): this process is rank 0 and starts ranks 1..N-1 (`worker.tp_ranks`)
before building its engine shard; the drain ends by releasing them. A rank that dies makes
this worker stop at once (in-flight RPCs fail with UNAVAILABLE) and exit with a non-zero code.
A decode worker advertises one KV receiver per rank (`worker.transfer`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from tandem import security, wire
from tandem.heap import freeze_startup_heap
from tandem.netaddr import advertised_host, host_port
from worker.config import WorkerConfig
from worker.engine_loop import EngineLoop
from worker.device_fault import exit_device_lost
from worker.faults import DeviceLossInjection, StepDelay
from worker.gpu_turn import GpuTurn, make_turn
from worker.step_profiler import StepProfiler
from worker.runtime import WorkerRuntime
from worker.streams import AsyncBridge

if TYPE_CHECKING:
    from grpc_health.v1.health import HealthServicer

    from engine.device_idle import DeviceIdleClock
    from engine.engine import Engine
    from kvtransfer import KVReceiver, KVSender
    from worker.index_publisher import IndexPublisher
    from worker.tp_ranks import TPRanks

logger = logging.getLogger(__name__)

_GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),  # a second worker on the same port must fail, not share it
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
]


# Registers a role's servicer on the gRPC server and sets up its KV transport (the worker's
# `sender` or `receiver` and `kv_address`, and `runtime.kv_stats`); returns the service names.
# The entry point hands it over (entrypoints.worker.add_role_services), so this package never
# imports prefill or decode.
AddServices = Callable[["WorkerServer", grpc.aio.Server, WorkerRuntime], list[str]]


class WorkerServer:
    """One worker: `await start()`, then `await shutdown()` (or `serve_forever()` in a process)."""

    def __init__(self, config: WorkerConfig, add_services: AddServices, engine: Engine | None = None) -> None:
        from engine.engine import Engine

        self.config = config
        self.auth_token = security.load_token(config.auth_token_file)  # the cluster token (None: open)
        self.add_services = add_services
        self.ranks: TPRanks | None = None  # on rank 0 of a tensor-parallel worker
        self.exit_code = 0
        if engine is None and config.tp > 1:
            engine = self._start_ranks()
        self.engine = engine if engine is not None else Engine(config.engine_config())
        self.server: grpc.aio.Server | None = None
        self.runtime: WorkerRuntime | None = None
        self.sender: KVSender | None = None  # prefill: set by the role's services
        self.receiver: KVReceiver | None = None  # decode: set by the role's services
        self.publisher: IndexPublisher | None = None
        self.turn = GpuTurn()  # the GPU shared with other workers: made at start (worker.gpu_turn)
        self.profiler: StepProfiler | None = None  # TANDEM_PROFILE_DIR (worker.step_profiler)
        self.health: HealthServicer | None = None
        self.port = 0
        self.kv_address = ""  # as advertised: set by the role's services, wildcard hosts rewritten
        self.advertised_host = advertised_host(config.host, config.advertise_host)
        self.metrics_port: int | None = None
        self._step_fault = StepDelay.from_env(config.worker_id)  # test-only fault hook (worker/faults.py)
        self._idle_clock: DeviceIdleClock | None = None  # engine.device_idle, where metrics are on and a GPU runs
        self._stopping = False
        self._skip_wait = asyncio.Event()
        self._stopped = asyncio.Event()

    def _start_ranks(self) -> Any:
        """Start the other tensor-parallel ranks and build this rank's engine with them."""
        from engine.engine import Engine
        from worker.tp_ranks import TPRanks

        self.ranks = TPRanks(self.config, auth_token=self.auth_token)
        try:
            engine = Engine(self.config.engine_config(0), self.ranks.join())
            self.ranks.wait_ready()
        except BaseException:
            self.ranks.kill()
            raise
        return engine

    @property
    def address(self) -> str:
        """host:port others reach the gRPC server at (tandem.netaddr: never a wildcard host)."""
        return host_port(self.advertised_host, self.port)

    @property
    def worker_id(self) -> str:
        return self.runtime.worker_id if self.runtime else ""

    async def start(self) -> None:
        cfg = self.config
        server = grpc.aio.server(options=_GRPC_OPTIONS, interceptors=[security.AuthInterceptor(self.auth_token)])
        security.warn_if_exposed(f"{cfg.role} worker", cfg.host, self.auth_token, bool(cfg.tls_cert))
        try:
            self.port = security.add_port(server, f"{cfg.host}:{cfg.port}", cfg.tls_cert, cfg.tls_key)
        except RuntimeError as exc:  # grpc's way of saying the address is taken
            raise OSError(f"port: cannot bind {cfg.host}:{cfg.port}: {exc}") from None
        worker_id = cfg.worker_id or f"{cfg.role}-{self.advertised_host}-{self.port}"
        self.turn = make_turn(cfg.role, cfg.gpu_turn, cfg.gpu_turn_max_wait_ms / 1000, cfg.gpu_turn_hold,
                              cfg.gpu_turn_max_batch)
        self.profiler = StepProfiler.from_env(worker_id)
        injection = DeviceLossInjection.from_env(self.engine.device, worker_id)  # test-only fault hook
        loop = EngineLoop(self.engine, name=f"engine-{cfg.role}", batch_window_s=cfg.batch_window_s,
                          on_step=self._observe_step, turn=self.turn, on_turn_wait=self._observe_turn_wait,
                          profiler=self.profiler, before_step=injection.before_step if injection else None,
                          on_device_lost=exit_device_lost)
        runtime = WorkerRuntime(cfg, self.engine, loop, worker_id)
        runtime.bridge = AsyncBridge(asyncio.get_running_loop())
        self.server, self.runtime = server, runtime
        if self.ranks is not None:
            event_loop = asyncio.get_running_loop()
            self.ranks.on_failure = lambda reason: event_loop.call_soon_threadsafe(self._on_rank_failure, reason)
        names = self.add_services(self, server, runtime)
        self.health = wire.add_health_and_reflection(server, names, reflection_on=cfg.reflection)
        self._start_metrics(runtime)
        loop.start()
        self._start_publisher(runtime)
        await server.start()
        self._write_ready_file()
        logger.info("%s worker %s serving on %s (kv %s, metrics %s, model %s)", cfg.role, worker_id, self.address,
                    self.kv_address or "-", self.metrics_port if self.metrics_port is not None else "off",
                    self.engine.identity)

    def _start_metrics(self, runtime: WorkerRuntime) -> None:
        if self.config.metrics_port is None:
            return
        from worker.metrics import WorkerMetrics

        model = Path(self.config.engine.model_path)
        metrics = WorkerMetrics(runtime.worker_id, runtime.role, lambda: runtime.loop.stats, runtime.kv_stats,
                                lambda: runtime.draining, model=model.name or model.resolve().name)
        self.metrics_port = metrics.serve(self.config.host, self.config.metrics_port)
        self._idle_clock = self.engine.measure_device_idle()  # read after each step, on the engine thread
        runtime.metrics = metrics

    def _observe_step(self, seconds: float) -> None:
        if self._step_fault is not None:
            seconds += self._step_fault.after_step()
        if self.runtime is not None and self.runtime.metrics is not None:
            self.runtime.metrics.observe_step(seconds)
            if self._idle_clock is not None:
                self.runtime.metrics.observe_device_idle(self._idle_clock.take_gaps())

    def _observe_turn_wait(self, seconds: float) -> None:
        if self.runtime is not None and self.runtime.metrics is not None:
            self.runtime.metrics.observe_turn_wait(seconds)

    def _start_publisher(self, runtime: WorkerRuntime) -> None:
        if not self.config.index.redis_url:
            return
        from kvindex import WorkerInfo, make_index
        from worker.index_publisher import IndexPublisher

        role = runtime.role

        def info() -> WorkerInfo:
            s = runtime.loop.stats
            load = s.queued_prefill_tokens if role == "prefill" else s.running
            return WorkerInfo(self.address, role, s.total_blocks, float(load))

        cfg = self.config.index
        index = make_index(cfg.redis_url, cfg.namespace or self.engine.identity,
                           heartbeat_interval_s=cfg.heartbeat_s, block_ttl_s=cfg.block_ttl_s)
        self.publisher = IndexPublisher(index, runtime.worker_id, runtime.loop, info)
        self.publisher.start()

    def _write_ready_file(self) -> None:
        if not self.config.ready_file:
            return
        path = Path(self.config.ready_file)
        data = {"role": self.config.role, "worker_id": self.worker_id, "address": self.address,
                "kv_address": self.kv_address, "metrics_port": self.metrics_port, "pid": os.getpid(),
                "model_identity": self.engine.identity, "tp": self.config.tp}
        if self.ranks is not None:
            data["tp_pids"] = self.ranks.pids  # ranks 1..tp-1
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)

    # ---- stopping -----------------------------------------------------------------------------
    async def shutdown(self, graceful: bool = True) -> None:
        """Drain (when `graceful`), then stop everything. A second call skips the drain wait."""
        if self._stopping:
            self._skip_wait.set()
            await self._stopped.wait()
            return
        self._stopping = True
        runtime = self.runtime
        runtime.draining = True
        logger.info("%s worker %s draining (%d in flight)", runtime.role, runtime.worker_id, runtime.in_flight)
        await self.health.enter_graceful_shutdown()
        if graceful:
            await self._wait_idle(time.monotonic() + self.config.drain_timeout_s)
        await self.server.stop(grace=1.0)
        await asyncio.to_thread(self._close_parts)
        self._stopped.set()
        logger.info("%s worker %s stopped", runtime.role, runtime.worker_id)

    async def _wait_idle(self, deadline: float) -> None:
        runtime = self.runtime
        while time.monotonic() < deadline and not self._skip_wait.is_set():
            s = runtime.loop.stats
            if runtime.in_flight == 0 and s.held == 0 and s.running + s.waiting + s.swapped == 0:
                return
            try:
                await asyncio.wait_for(self._skip_wait.wait(), 0.05)
            except TimeoutError:
                pass
        if not self._skip_wait.is_set():
            logger.warning("drain timeout: stopping with %d requests in flight", runtime.in_flight)

    def _on_rank_failure(self, reason: str) -> None:
        """Event loop: a tensor-parallel rank died; stop without draining, exit non-zero."""
        from worker.tp_ranks import FAILURE_EXIT_CODE

        self.exit_code = FAILURE_EXIT_CODE
        if self.runtime is not None:
            self.runtime.draining = True
        asyncio.get_running_loop().create_task(self.shutdown(graceful=False))

    def _close_parts(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.runtime.loop.stop()
        self.turn.close()
        if self.profiler is not None:
            self.profiler.close()
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        if self.ranks is not None and not self.ranks.stop(self.engine):
            self.exit_code = self.exit_code or 1
        if self.runtime.metrics is not None:
            self.runtime.metrics.close()
        if self.config.ready_file:
            Path(self.config.ready_file).unlink(missing_ok=True)

    async def serve_forever(self, install_signals: bool = True) -> None:
        """Start, then run until SIGTERM / SIGINT has drained the worker."""
        await self.start()
        freeze_startup_heap()  # the engine is built and warm: what lives now lives on
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if install_signals else ()
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        await self._stopped.wait()
        for sig in signals:
            # Stopped already: closing the loop would restore the default handlers, and a
            # repeated signal would then kill the process in the middle of its exit.
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)

    def _on_signal(self, sig: signal.Signals) -> None:
        logger.info("received %s", sig.name)
        asyncio.get_running_loop().create_task(self.shutdown(graceful=True))

"""The gateway process: composes model facts, worker registry, prefix index, tier queues,
dispatcher and the Tandem servicer into one grpc.aio server; `serve(config)` runs it. The
process's flags live in entrypoints/gateway.py:

    tandem gateway --model DIR --port 50051 --worker 127.0.0.1:50061
    tandem gateway --prefill 127.0.0.1:50071 --decode 127.0.0.1:50081 --redis-url redis://...
    tandem gateway --worker 127.0.0.1:50061 --http-port 8000    # + the OpenAI-compatible HTTP API

SIGTERM / SIGINT drain: health turns NOT_SERVING, new calls get UNAVAILABLE, running streams
get `grace_s` to finish, then the server stops.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING, Any

import grpc

from gateway.admin import AdminService
from gateway.admission import Admission
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher, Waiter
from gateway.malformed import add_servicer
from gateway.metrics import GatewayMetrics
from gateway.modelinfo import ServedModel, load_served_model
from gateway.placement import Placer
from gateway.request import RequestRunner
from gateway.routing import CacheAwareRouter
from gateway.service import TandemService
from gateway.tiers import TierQueues
from gateway.worker_client import WorkerCredentials
from gateway.workers import WorkerRegistry
from tandem import security, wire
from tandem.hashing import seed_hash
from tandem.heap import freeze_startup_heap

if TYPE_CHECKING:
    from kvindex.base import PrefixIndex

logger = logging.getLogger(__name__)


class Gateway:
    """One gateway: `await start()` binds and serves (returns the port), `await stop()` drains.

    Must be created and used inside one running event loop.
    """

    def __init__(self, config: GatewayConfig, model: ServedModel | None = None) -> None:
        self.config = config
        self.model = model or load_served_model(config.model_dir, load_format=config.load_format,
                                                max_context=config.max_context, name=config.model_name)
        self.metrics = GatewayMetrics(self.model.name)
        self.index, feed = self._make_index()
        options = [("grpc.max_send_message_length", config.max_message_bytes),
                   ("grpc.max_receive_message_length", config.max_message_bytes)]
        sec = config.security
        self.registry = WorkerRegistry(config.workers, index=self.index, feed_index=feed, metrics=self.metrics,
                                       channel_options=options, on_change=self._wake, liveness=config.liveness,
                                       credentials=WorkerCredentials(sec.auth_token, sec.tls_ca))
        self.router = CacheAwareRouter(config.routing, block_size=config.block_size)
        queues: TierQueues[Waiter] = TierQueues({t: c.capacity for t, c in config.tiers.items()},
                                                {t: c.aging_s for t, c in config.tiers.items()})
        self.placer = Placer(registry=self.registry, router=self.router, index=self.index,
                             hash_seed=seed_hash(self.model.identity), block_size=config.block_size,
                             local_prefill_tokens=config.workers.local_prefill_tokens,
                             sticky_bonus=config.routing.decode_sticky_bonus, metrics=self.metrics)
        self.dispatcher = Dispatcher(queues, self.registry, self.placer, self.metrics)
        self.runner = RequestRunner(dispatcher=self.dispatcher, placer=self.placer, block_size=config.block_size,
                                    max_retries=config.max_retries, metrics=self.metrics, liveness=config.liveness,
                                    prefill_target_follows=config.workers.prefill_target_follows)
        self.admission = Admission(config=config, model=self.model, runner=self.runner, placer=self.placer,
                                   dispatcher=self.dispatcher, registry=self.registry, metrics=self.metrics)
        self.service = TandemService(config=config, model=self.model, admission=self.admission, metrics=self.metrics)
        self.metrics.bind_queue_depth(queues.depth)
        self.metrics.running.set_function(lambda: sum(h.inflight for h in self.registry.decode_workers()))
        self.metrics.index_degraded.set_function(lambda: float(self.index is not None and self.index.degraded))
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self._http: Any = None
        self._health: Any = None
        self._serving = False  # what health says: the workers can serve (WorkerRegistry.ready)
        self._health_tasks: set[asyncio.Task[None]] = set()

    def _make_index(self) -> tuple[PrefixIndex | None, bool]:
        """(index or None, whether the gateway feeds it from KvEvents)."""
        if self.config.routing.policy != "cache_aware":
            return None, False
        try:
            from kvindex import make_index
        except ImportError as exc:  # routing degrades to load-only
            logger.warning("prefix index unavailable (%s); routing by load only", exc)
            return None, False
        namespace = self.config.namespace or self.model.identity
        if not self.config.index_url:
            return make_index(None, namespace), True
        return make_index(self.config.index_url, namespace, block_ttl_s=self.config.index_block_ttl_s), False

    def _wake(self) -> None:
        self.dispatcher.wake()
        self._update_health()

    def _update_health(self) -> None:
        """Health says SERVING only while a request can be served: a decode-capable worker is up
        and, when prefill workers are configured without role-both ones, a prefill worker too
        (`WorkerRegistry.ready`); NOT_SERVING before that, and from the drain on."""
        if self._health is None or self.admission.draining:
            return
        ready = self.registry.ready()
        if ready == self._serving:
            return
        self._serving = ready
        logger.info("gateway health: %s", "SERVING" if ready else "NOT_SERVING (waiting for workers)")
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", wire.TANDEM_SERVICE):
            task = asyncio.get_running_loop().create_task(self._health.set(name, status))
            self._health_tasks.add(task)
            task.add_done_callback(self._health_tasks.discard)

    async def start(self) -> int:
        cfg = self.config
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0), *overload_options(self.admission.max_calls)]
        sec = cfg.security  # Tandem needs the API key (if set), Admin the cluster token (if set)
        auth = security.AuthInterceptor(sec.auth_token, sec.api_key, public_services=[wire.TANDEM_SERVICE])
        self.server = grpc.aio.server(options=options, interceptors=[auth])
        add_servicer(wire.add_tandem_servicer, self.service, self.server)
        wire.add_admin_servicer(AdminService(self.registry), self.server)
        self._health = wire.add_health_and_reflection(self.server, [wire.TANDEM_SERVICE, wire.ADMIN_SERVICE],
                                                      reflection_on=sec.reflection)
        from grpc_health.v1 import health_pb2

        for name in ("", wire.TANDEM_SERVICE):  # until the workers are up (_update_health)
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        security.warn_if_exposed("gateway", cfg.host, sec.auth_token, bool(sec.tls_cert))
        self.port = security.add_port(self.server, f"{cfg.host}:{cfg.port}", sec.tls_cert, sec.tls_key)
        if self.port == 0:
            raise RuntimeError(f"port: cannot bind {cfg.host}:{cfg.port}")
        await self.registry.start()
        self.dispatcher.start()
        self._update_health()
        await self.server.start()
        if cfg.metrics_port is not None:
            self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.host)
        if cfg.http_port is not None:
            from gateway.http.app import HttpServer  # FastAPI is loaded only when HTTP is on

            self._http = HttpServer(self.admission, cfg.host, cfg.http_port, cfg.grace_s, api_key=sec.api_key,
                                    tls_cert=sec.tls_cert, tls_key=sec.tls_key)
            self.http_port = await self._http.start()
        logger.info("gateway serving %s on %s:%d (%d workers)", self.model.name, cfg.host, self.port,
                    cfg.workers.num_workers)
        return self.port

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: refuse new requests, let running ones finish for `grace_s`, then stop."""
        self.admission.draining = True
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        grace = self.config.grace_s if grace_s is None else grace_s
        stops = []
        if self.server is not None:
            stops.append(self.server.stop(grace))
        if self._http is not None:
            self._http.grace_s = grace
            stops.append(self._http.stop())
        await asyncio.gather(*stops)
        await self.runner.close()
        await self.dispatcher.close()
        await self.registry.close()
        if self.index is not None:
            self.index.close()
        self.metrics.close()


def overload_options(max_calls: int) -> list[tuple[str, Any]]:
    """gRPC server options that leave overload to the gateway's own admission.

    The C core queues calls the application has not picked up yet, and past
    `grpc.server.max_pending_requests` (default 1000) it cancels a growing share of new calls
    (all of them past the hard limit, 3000), and any waiting longer than
    `grpc.server_max_unrequested_time_in_server` (30 s): a client sees CANCELLED that Tandem
    never saw. Sized here well above the gateway's own bound (`max_calls`, answered
    RESOURCE_EXHAUSTED naming the tier), so a burst reaches our admission: calls queue in the
    core only while the event loop is busy, and our bound keeps what the gateway holds finite.
    """
    pending = max(8 * max_calls, 16384)
    return [("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", 2 * pending),
            ("grpc.server_max_unrequested_time_in_server", 3600)]


# ---------------------------------------------------------------- command line

async def serve(config: GatewayConfig, model: ServedModel | None = None) -> None:
    """Run a gateway until SIGTERM or SIGINT, then drain."""
    gateway = Gateway(config, model)
    port = await gateway.start()
    freeze_startup_heap()
    metrics = f" (metrics on port {gateway.metrics_port})" if gateway.metrics_port is not None else ""
    http = f" (OpenAI-compatible HTTP on port {gateway.http_port})" if gateway.http_port is not None else ""
    print(f"tandem gateway listening on {config.host}:{port}{metrics}{http}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down: draining for up to %.1f s", config.grace_s)
    await gateway.stop()

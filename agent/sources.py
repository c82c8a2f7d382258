"""Where the workers are and how they are doing: discovery (the gateway's Admin.ListWorkers, or
the Redis worker registry), each worker's gRPC health check and its /metrics page, and the
supervisor's process list. Blocking calls with timeouts; the agent's loop runs one probe per
worker in a thread pool, so one hung worker never delays the others' checks.
"""
from __future__ import annotations

import logging
import urllib.request
from dataclasses import dataclass

import grpc

from agent.signals import Scrape, parse_metrics
from tandem import security, wire
from tandem._proto.tandem.v1 import admin_pb2, worker_pb2

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Discovered:
    name: str
    address: str
    role: str
    up: bool = True
    mark: str = ""
    routable: bool = True
    metrics_port: int = 0  # 0: unknown (ask the worker's Stats)


class GatewaySource:
    """The workers the gateway routes to, with its marks (tandem.v1.Admin/ListWorkers)."""

    def __init__(self, target: str, timeout_s: float = 2.0, token: str | None = None,
                 tls_ca: str | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.channel = security.channel(target, tls_ca=tls_ca)
        self.stub = wire.AdminStub(self.channel)
        self._md = security.token_metadata(token)

    def workers(self) -> list[Discovered]:
        """Raises grpc.RpcError when the gateway does not answer."""
        resp = self.stub.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=self.timeout_s, metadata=self._md)
        return [Discovered(w.name, w.address, w.role, w.up, w.mark, w.routable, w.metrics_port) for w in resp.workers]

    def close(self) -> None:
        self.channel.close()


class RedisSource:
    """The workers registered in the shared prefix index (Redis): address and role; no marks."""

    def __init__(self, url: str, namespace: str) -> None:
        from kvindex import make_index

        self.index = make_index(url, namespace)

    def workers(self) -> list[Discovered]:
        return [Discovered(wid, info.address, info.role) for wid, info in sorted(self.index.workers().items())]

    def close(self) -> None:
        self.index.close()


class Prober:
    """Health checks and scrapes, with one cached channel per worker address (TLS with `tls_ca`;
    Stats calls carry the cluster `token`)."""

    def __init__(self, timeout_s: float, token: str | None = None, tls_ca: str | None = None) -> None:
        self.timeout_s = timeout_s
        self._md = security.token_metadata(token)
        self._tls_ca = tls_ca
        self._channels: dict[str, grpc.Channel] = {}
        self._metrics_ports: dict[str, int] = {}

    def healthy(self, address: str) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            resp = health_pb2_grpc.HealthStub(self._channel(address)).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=self.timeout_s)
        except grpc.RpcError:
            return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def metrics_port(self, w: Discovered) -> int:
        """The worker's Prometheus port: the registry's, else its Stats' (cached); 0: none."""
        if w.metrics_port:
            return w.metrics_port
        port = self._metrics_ports.get(w.address)
        if port is None:
            try:
                stub = (wire.PrefillWorkerStub if w.role == "prefill" else wire.DecodeWorkerStub)(self._channel(w.address))
                reply = stub.Stats(worker_pb2.StatsRequest(), timeout=self.timeout_s, metadata=self._md)
                port = int(reply.metrics_port)
            except grpc.RpcError:
                return 0
            self._metrics_ports[w.address] = port
        return port

    def scrape(self, w: Discovered, now: float) -> tuple[Scrape | None, bool]:
        """(the worker's metrics, whether reading them failed); (None, False) when it serves none."""
        port = self.metrics_port(w)
        if not port:
            return None, False
        host = w.address.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=self.timeout_s) as resp:
                text = resp.read().decode("utf-8", errors="replace")
            return parse_metrics(text, now), False
        except (OSError, ValueError) as exc:
            logger.debug("scrape of %s failed: %r", w.name, exc)
            self._metrics_ports.pop(w.address, None)  # a restarted worker may have another port
            return None, True

    def forget(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            ch.close()
        self._metrics_ports.pop(address, None)

    def close(self) -> None:
        for address in list(self._channels):
            self.forget(address)

    def _channel(self, address: str) -> grpc.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = security.channel(address, tls_ca=self._tls_ca)
        return ch

"""The Prometheus `/metrics` HTTP endpoint of one process's registry, shared by the gateway, the
workers and the agent (each subclasses it and fills `registry` with its own series).

Contract: `_serve(host, port)` starts the endpoint in a daemon thread (port 0: any free one) and
returns the bound port, also kept in `port`; `close()` stops it (idempotent). prometheus_client
is imported here only, never by `import tandem`.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server


class MetricsEndpoint:
    registry: CollectorRegistry
    _server: Any = None
    port: int | None = None

    def _serve(self, host: str, port: int) -> int:
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server.server_address[1])
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

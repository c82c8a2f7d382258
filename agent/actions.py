"""Carrying decisions out: drain / isolate / clear through the gateway's Admin RPCs, restart
through the supervisor of `tandem up` (a Unix socket speaking one JSON object per line:
{"op": "list"} -> {"processes": [{"name", "role", "address", "pid", "alive"}]};
{"op": "restart", "address": A} -> {"ok": true} or {"error": why}; the server side is
entrypoints/supervisor.py). With `dry_run`, nothing is carried out.
"""
from __future__ import annotations

import json
import logging
import socket
from typing import Any

import grpc

from agent.policy import Decision
from tandem import security, wire
from tandem._proto.tandem.v1 import admin_pb2

logger = logging.getLogger(__name__)


class SupervisorError(RuntimeError):
    """The supervisor did not answer, or refused."""


class SupervisorClient:
    """token: the cluster token, sent in every request (the supervisor refuses requests without it)."""

    def __init__(self, path: str, timeout_s: float = 5.0, token: str | None = None) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._token = token

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._token:
            request = {**request, "token": self._token}
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout_s)
                s.connect(self.path)
                s.sendall((json.dumps(request) + "\n").encode())
                data = b""
                while not data.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError as exc:
            raise SupervisorError(f"supervisor {self.path}: {exc}") from None
        try:
            reply = json.loads(data)
        except json.JSONDecodeError:
            raise SupervisorError(f"supervisor {self.path}: bad reply {data[:200]!r}") from None
        if "error" in reply:
            raise SupervisorError(str(reply["error"]))
        return reply

    def processes(self) -> dict[str, dict[str, Any]]:
        """address -> {name, role, address, pid, alive}."""
        return {p["address"]: p for p in self.call({"op": "list"}).get("processes", [])}

    def restart(self, address: str) -> None:
        self.call({"op": "restart", "address": address})


class Actuator:
    """`carry_out(decision)` -> outcome text ("done", "dry-run", "failed: ...")."""

    def __init__(self, gateway: str | None, supervisor: SupervisorClient | None, dry_run: bool,
                 timeout_s: float = 5.0, token: str | None = None, tls_ca: str | None = None) -> None:
        self.dry_run = dry_run
        self.supervisor = supervisor
        self.timeout_s = timeout_s
        self._md = security.token_metadata(token)  # Admin needs the cluster token
        self._channel = security.channel(gateway, tls_ca=tls_ca) if gateway else None
        self._admin = wire.AdminStub(self._channel) if self._channel is not None else None

    def carry_out(self, d: Decision) -> str:
        if d.action == "warn":
            return "logged"
        if self.dry_run:
            return "dry-run"
        try:
            if d.action == "restart":
                if self.supervisor is None:
                    return "failed: no supervisor"
                self.supervisor.restart(d.worker.address)
                return "done"
            if self._admin is None:
                return "failed: no gateway admin (--gateway)"
            call = {"drain": self._admin.Drain, "isolate": self._admin.Isolate, "clear": self._admin.Clear}[d.action]
            call(admin_pb2.WorkerMarkRequest(worker=d.worker.address, reason=f"agent: {d.reason}"),
                 timeout=self.timeout_s, metadata=self._md)
            return "done"
        except grpc.RpcError as exc:
            return f"failed: {exc.code().name}: {exc.details()}"
        except SupervisorError as exc:
            return f"failed: {exc}"

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()

"""The supervisor's admin socket: lets the infra agent see `tandem up`'s processes and restart one.

A Unix socket (mode 0600, in a private temp directory) that answers one JSON object per line;
with a cluster token every request carries it as "token" (else {"error": "unauthenticated: ..."}):
{"op": "list"} -> {"processes": [{"name", "role", "address", "pid", "alive"}]};
{"op": "restart", "address": A} (or "name") -> {"ok": true} | {"error": why}. A restart is a
SIGKILL of the process (a hung process cannot be asked to stop); the cluster's `watch` loop
then starts it again as after any crash (same command line and address, with its backoff and
its give-up rule). The gateway cannot be restarted this way. The client is agent/actions.py.
"""
from __future__ import annotations

import json
import logging
import os
import socketserver
import tempfile
import threading
from pathlib import Path
from typing import Any

from entrypoints.cluster import Cluster, ClusterProcess
from tandem.security import same_secret

logger = logging.getLogger(__name__)


class SupervisorSocket:
    """`start()` serves on `path` in a daemon thread; `close()` stops and removes it."""

    def __init__(self, cluster: Cluster, path: str | Path | None = None, token: str | None = None) -> None:
        self.cluster = cluster
        self._token = token  # the cluster token every request must carry (None: none needed)
        self._dir = None if path else tempfile.mkdtemp(prefix="tandem-supervisor-")
        self.path = str(path or Path(self._dir) / "supervisor.sock")
        self._server: socketserver.UnixStreamServer | None = None

    def start(self) -> str:
        supervisor = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(65536)
                try:
                    reply = supervisor.handle(json.loads(line))
                except (ValueError, TypeError) as exc:
                    reply = {"error": f"bad request: {exc}"}
                self.wfile.write((json.dumps(reply) + "\n").encode())

        Path(self.path).unlink(missing_ok=True)
        self._server = socketserver.ThreadingUnixStreamServer(self.path, Handler)
        os.chmod(self.path, 0o600)
        threading.Thread(target=self._server.serve_forever, name="supervisor-socket", daemon=True).start()
        return self.path

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        if self._token is not None and not same_secret(str(request.get("token", "")), self._token):
            logger.warning("supervisor socket: refused a request without the cluster token")
            return {"error": "unauthenticated: missing or wrong cluster token"}
        op = request.get("op")
        if op == "list":
            return {"processes": [{"name": p.name, "role": p.role, "address": p.address, "pid": p.pid,
                                   "alive": p.alive()} for p in self.cluster.processes]}
        if op == "restart":
            p = self._find(request)
            if p is None:
                return {"error": f"no process {request.get('address') or request.get('name')!r}"}
            if p.role in ("gateway", "agent"):
                return {"error": f"{p.name}: only workers are restarted through the supervisor"}
            logger.warning("restart of %s (%s) requested; killing it, the supervisor starts it again", p.name,
                           p.address)
            p.kill()
            return {"ok": True}
        return {"error": f"op: unknown {op!r} (list, restart)"}

    def _find(self, request: dict[str, Any]) -> ClusterProcess | None:
        for p in self.cluster.processes:
            if request.get("address") in (p.address,) or request.get("name") == p.name:
                return p
        return None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        Path(self.path).unlink(missing_ok=True)
        if self._dir:
            os.rmdir(self._dir)


def agent_process(gateway: str, supervisor_path: str, log_dir: Path | None, extra: list[str],
                  ready_file: Path | None = None) -> ClusterProcess:
    """The infra agent as one of `tandem up`'s processes: it watches through the gateway's Admin
    service, restarts through `supervisor_path`, and logs its decisions to
    `log_dir/agent-decisions.jsonl` (with its own log in `log_dir/agent.log`). With `ready_file`
    it is ready once it has written that file (it watches then)."""
    argv = ["--gateway", gateway, "--supervisor", supervisor_path]
    if log_dir is not None:
        argv += ["--decision-log", str(log_dir / "agent-decisions.jsonl")]
    if ready_file is not None:
        argv += ["--ready-file", str(ready_file)]
    return ClusterProcess("agent", "agent", [*argv, *extra], log_path=log_dir / "agent.log" if log_dir else None,
                          ready_file=ready_file, serves=False)

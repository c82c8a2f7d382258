"""Start, watch and stop a cluster's processes: the gateway and its prefill, decode and role-both
workers, each one `python -m entrypoints <role> ...`. `tandem up`, the tests and the bench scripts
all start processes through here.

Readiness: a process with a ready file (workers started with `--port 0`) is ready once it has
written the file (its bound address, worker id and KV address) and its gRPC health check says
SERVING; one without (the gateway, workers on fixed ports) once its health check on its port
says SERVING. A process that exits while starting fails the start at once, naming it with the
tail of its log. Every child gets SIGTERM if the process that started it dies (Linux), so no
worker outlives its launcher. Stopping sends SIGTERM to the agent and then the gateways first and
waits for them (no new work reaches workers that are going away, and the agent neither acts on
nor reports the shutdown), then to every worker at once; a process that has not exited after the
grace period is killed.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.native import parent_death_signal

if TYPE_CHECKING:
    from gateway.adapters import WorkerStatsView

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0
RESTART_WINDOW_S = 60.0
MAX_RESTARTS = 5  # per process within RESTART_WINDOW_S; one more crash and `watch` gives up
POLL_S = 0.05


class ClusterError(RuntimeError):
    """A process did not become ready, or kept crashing."""


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FIXED_PORTS_FROM = 10000  # fixed ports are drawn from here up to the kernel's ephemeral range
_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range is 32768-60999


def keep_off(*ports: int | None) -> None:
    """Ports this process's children will bind that are not bound yet (a user's --port, say):
    free_port never returns them, or the child that binds second fails."""
    _handed_out.update(p for p in ports if p)


def free_port() -> int:
    """A TCP port free on every address now, for a process to bind later (a restarted child
    keeps it). Drawn at random below the kernel's ephemeral port range: a port that bind(0)
    returned is one the kernel hands out again to any process's outgoing connection or bind(0)
    meanwhile, and a worker binds only after loading its model (seconds on a busy host). Never
    the same port twice in this process."""
    import random

    low = _ephemeral_low()
    if low - _FIXED_PORTS_FROM >= 1000:
        for _ in range(200):
            port = random.randrange(_FIXED_PORTS_FROM, low)
            if port not in _handed_out and not port_in_use("0.0.0.0", port):
                _handed_out.add(port)
                return port
    with socket.socket() as s:  # a host whose ephemeral range leaves no room below it
        s.bind(("127.0.0.1", 0))
        _handed_out.add(s.getsockname()[1])
        return s.getsockname()[1]


def healthy(address: str, timeout: float = 1.0, tls_ca: str | None = None) -> bool:
    """Whether the gRPC health service at `address` says SERVING for the whole server (over TLS
    verified with `tls_ca` when given; health needs no token)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.security import channel

    try:
        with channel(address, tls_ca=tls_ca) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def port_in_use(host: str, port: int) -> bool:
    """Whether `host:port` cannot be bound now (something listens there, or it is reserved).
    Connections of an earlier server lingering in TIME_WAIT do not count: the servers bind with
    SO_REUSEADDR (gRPC, ZMQ and the metrics server all do), and so does this probe."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP `port` (any address), from /proc/net; None without /proc."""
    inodes: set[str] = set()
    found = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        found = True
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes if found else None


def owns_port(pid: int, port: int) -> bool:
    """Whether process `pid` itself listens on TCP `port` (Linux /proc; True where it cannot be
    told), so that a health check on the port reaches that process and not another one."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return True
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return True
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def command(role: str, argv: Iterable[str]) -> list[str]:
    """The command line of a `role` process (`ps` shows `-m entrypoints <role>`)."""
    return [sys.executable, "-m", "entrypoints", role, *argv]


# The starting process's pid, for the child to watch (see die_with_parent).
PARENT_PID_ENV = "TANDEM_PARENT_PID"


def die_with_parent() -> None:
    """Child side, the first thing `python -m entrypoints` does: get SIGTERM if the process
    that started it (ClusterProcess.start, which names itself in $TANDEM_PARENT_PID) dies, so no
    child outlives it (Linux). Done in the child after exec rather than in a preexec_fn: a
    preexec_fn makes Popen fork without exec'ing at once, and a fork of a process whose gRPC
    threads are running can crash the child inside gRPC (its fork handlers restart a poller on a
    closed epoll fd) before it ever runs; without one, Popen spawns without fork handlers."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if not parent:
        return
    if not parent_death_signal(signal.SIGTERM):
        return
    if os.getppid() != int(parent):  # it died before this process could watch it
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class ClusterProcess:
    """One process of a cluster: `python -m entrypoints <role> <argv>`.

    role: gateway, prefill, decode, worker (give `--role both` in argv) or agent. port: the gRPC port
    on 127.0.0.1 (0 with a ready file: read from it). log_path None: the output goes to this
    process's terminal. After a ready file was read, `info` holds it. auth_token: the cluster
    token, handed to the child in its environment (TANDEM_AUTH_TOKEN, never on its command
    line) and sent on this side's Stats calls; tls_ca: the CA its TLS certificate is checked
    with (health checks, Stats).
    """

    name: str
    role: str
    argv: list[str]
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    ready_file: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    restarts: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    auth_token: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    serves: bool = True  # False: no server to health-check (the agent); ready once its ready file is in

    @property
    def address(self) -> str:
        return self.info.get("address") or f"127.0.0.1:{self.port}"

    @property
    def worker_id(self) -> str:
        return self.info.get("worker_id", "")

    @property
    def kv_address(self) -> str:
        return self.info.get("kv_address", "")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        cmd = command(self.role, self.argv)
        if self.ready_file is not None:
            self.ready_file.unlink(missing_ok=True)
            self.info = {}
        logger.info("starting %s: %s", self.name, " ".join(cmd[1:]))
        out = open(self.log_path, "ab") if self.log_path is not None else None
        env = {**os.environ, **self.env}
        if self.auth_token:
            from tandem.security import TOKEN_ENV, TOKEN_FILE_ENV

            env.pop(TOKEN_FILE_ENV, None)  # it would take precedence over the token given here
            env[TOKEN_ENV] = self.auth_token
        try:
            env[PARENT_PID_ENV] = str(os.getpid())
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                         env=env, start_new_session=True)
        finally:
            if out is not None:
                out.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        """Whether it has written its ready file (if it has one; it must name this process's pid
        when it gives one), it listens on its fixed port itself (not some other process that
        answers there) and its health check says SERVING."""
        if self.ready_file is not None and not self.info:
            if not self.ready_file.is_file():
                return False
            info = json.loads(self.ready_file.read_text())
            if info.get("pid") not in (None, self.pid):
                return False  # a stale file of an earlier process
            self.info = info
        if not self.serves:
            return self.ready_file is not None and bool(self.info)
        if self.port and self.pid is not None and not owns_port(self.pid, self.port):
            return False
        return healthy(self.address, tls_ca=self.tls_ca)

    def stats(self, timeout: float = 5.0) -> WorkerStatsView:
        """A worker's Stats RPC (free and total KV blocks, running, prefix-cache counters)."""
        from gateway import adapters
        from tandem import security, wire

        with security.channel(self.address, tls_ca=self.tls_ca) as channel:
            stub = wire.PrefillWorkerStub(channel) if self.role == "prefill" else wire.DecodeWorkerStub(channel)
            return adapters.stats_from_proto(stub.Stats(adapters.stats_request(), timeout=timeout,
                                                        metadata=security.token_metadata(self.auth_token)))

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def terminate(self) -> None:
        """SIGTERM (a graceful drain) without waiting."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = STOP_GRACE_S) -> int | None:
        """Wait for it to exit, SIGKILL after `timeout`; returns the exit code."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop in %.0fs; killing it", self.name, timeout)
            self.proc.kill()
            self.proc.wait(30)
        return self.proc.returncode

    def stop(self, timeout: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, then wait (SIGKILL after `timeout`); returns the exit code."""
        self.terminate()
        return self.wait(timeout)

    def kill(self) -> None:
        """SIGKILL (a crash), then reap."""
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(30)


def worker_process(name: str, role: str, model: str | Path, work_dir: Path, argv: Iterable[str] = (),
                   env: dict[str, str] | None = None, log_level: str = "WARNING",
                   auth_token: str | None = None) -> ClusterProcess:
    """A worker on a free port that reports its addresses in `work_dir/<name>.ready.json`
    (`role`: prefill, decode or both), logging to `work_dir/<name>.log`; with `auth_token`, it
    requires that cluster token."""
    ready = work_dir / f"{name}.ready.json"
    head = ["--role", "both"] if role == "both" else []
    return ClusterProcess(name, "worker" if role == "both" else role,
                          [*head, "--model", str(model), "--port", "0", "--ready-file", str(ready),
                           "--log-level", log_level, *argv],
                          env=dict(env or {}), log_path=work_dir / f"{name}.log", ready_file=ready,
                          auth_token=auth_token)


class Cluster:
    """Processes started together: `start()` waits until all are ready, `watch()` restarts the
    ones that crash, `stop()` stops them all (gateways first)."""

    def __init__(self, processes: Iterable[ClusterProcess]) -> None:
        self.processes = list(processes)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, timeout: float = HEALTH_TIMEOUT_S, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Start every process at once and wait until each is ready. On failure (a process
        exits, or `timeout` passes) every process is killed and ClusterError names the first
        one not ready, with its log tail. Returns early, without error, once `should_stop()`."""
        try:
            for p in self.processes:
                p.start()
            self.wait_ready(timeout, should_stop)
        except BaseException:
            self.kill()
            raise

    def add(self, process: ClusterProcess, timeout: float = HEALTH_TIMEOUT_S) -> ClusterProcess:
        """Start one more process (e.g. a gateway once its workers' addresses are known) and wait
        until it is ready; on failure it is killed (the others keep running) and ClusterError raised."""
        self.processes.append(process)
        try:
            process.start()
            self.wait_ready(timeout, processes=[process])
        except BaseException:
            process.kill()
            raise
        return process

    def wait_ready(self, timeout: float = HEALTH_TIMEOUT_S, should_stop: Callable[[], bool] = lambda: False,
                   processes: Iterable[ClusterProcess] | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.processes if processes is None else processes)
        while pending and not should_stop():
            for p in list(pending):
                if not p.alive():
                    code = p.proc.returncode if p.proc is not None else None
                    raise ClusterError(f"{p.name} exited during start-up (code {code})\n{p.log_tail()}")
                if p.ready():
                    pending.remove(p)
            if pending and time.monotonic() > deadline:
                raise ClusterError(f"not ready in {timeout:g}s: {', '.join(p.name for p in pending)}\n"
                                   f"{pending[0].log_tail()}")
            time.sleep(POLL_S)

    def watch(self, should_stop: Callable[[], bool], interval: float = 0.5, backoff: float = 0.5,
              on_exit: Callable[[ClusterProcess, int | None], None] | None = None) -> None:
        """Restart a process that exits (after `backoff` s, doubling to 10 s) until `should_stop()`;
        ClusterError, with the cause and the process's log tail, once a process has exited more
        than MAX_RESTARTS times in RESTART_WINDOW_S. `on_exit(process, code)` hears of each exit
        first (it may stop other processes, which are then restarted in turn)."""
        while not should_stop():
            for p in self.processes:
                if should_stop() or p.alive():
                    continue
                code = p.proc.returncode if p.proc is not None else None
                if on_exit is not None:
                    on_exit(p, code)
                now = time.monotonic()
                p.restarts = [t for t in p.restarts if now - t < RESTART_WINDOW_S] + [now]
                if len(p.restarts) > MAX_RESTARTS:
                    tail = p.log_tail()
                    raise ClusterError(f"{p.name} exited with code {code}, {len(p.restarts)} times in "
                                       f"{RESTART_WINDOW_S:g}s; giving up"
                                       + (f". The end of its log ({p.log_path}):\n{tail}" if tail else ""))
                delay = min(10.0, backoff * 2 ** (len(p.restarts) - 1))
                logger.error("%s exited with code %s; restarting in %.1fs", p.name, code, delay)
                time.sleep(delay)
                if not should_stop():
                    p.start()
            time.sleep(interval)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM the agent (a client of the gateways: it must not act on, or report, the
        cluster going down) and the gateways and wait for them, then SIGTERM every other process
        at once and wait for each; SIGKILL whatever is still running after `grace`."""
        for role in ("agent", "gateway"):
            first = [p for p in self.processes if p.role == role]
            for p in first:
                p.terminate()
            for p in first:
                p.wait(grace)
        for p in self.processes:
            p.terminate()
        for p in self.processes:
            p.wait(grace)

    def kill(self) -> None:
        for p in self.processes:
            p.kill()

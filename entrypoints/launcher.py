"""`tandem up`: start a gateway and its workers as separate OS processes on loopback, and supervise them.

Children run as `python -m tandem <role> ...` so `ps` shows each one's role. The launcher waits
until every child's gRPC health check says SERVING, prints the endpoint, restarts a child that
crashes (with backoff), and on Ctrl-C / SIGTERM stops the gateway first, then the workers.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("tandem.up")

HEALTH_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Child side: get SIGTERM if the launcher dies, so no worker outlives it (Linux)."""
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Child:
    name: str
    role: str
    argv: list[str]
    port: int
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, log_dir: Path | None) -> None:
        out = open(log_dir / f"{self.name}.log", "ab") if log_dir else None
        cmd = [sys.executable, "-m", "tandem", self.role, *self.argv]
        logger.info("starting %s: %s", self.name, " ".join(cmd[1:]))
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                     preexec_fn=_die_with_parent)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def healthy(address: str, timeout: float = 1.0) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def kv_transport(choice: str) -> str:
    """The KV transport for `choice`; "auto": every worker of `tandem up` runs on this host, so
    CUDA IPC where there is a GPU (KV moves GPU to GPU, never through host memory), else ZMQ."""
    if choice != "auto":
        return choice
    try:
        import torch
    except ImportError:
        return "zmq"
    return "cuda_ipc" if torch.cuda.is_available() else "zmq"


def build_children(a: argparse.Namespace, model: str) -> list[Child]:
    common = ["--model", model, "--load-format", a.load_format]
    if a.dtype:
        common += ["--dtype", a.dtype]
    if a.redis_url:
        common += ["--redis-url", a.redis_url]
    for flag, value in (("--num-kv-blocks", a.num_kv_blocks), ("--max-running", a.max_running)):
        if value:
            common += [flag, str(value)]
    if a.tp > 1:  # every worker: prefill and decode workers that exchange KV need the same degree
        common += ["--tp", str(a.tp)]
    disagg = common + ["--kv-transport", kv_transport(a.kv_transport)]
    children: list[Child] = []
    if a.colocated:
        for i in range(a.decode_workers):
            port = free_port()
            children.append(Child(f"worker-{i}", "worker", ["--role", "both", "--port", str(port),
                                                            "--worker-id", f"both-{i}", *common], port))
    else:
        for i in range(a.prefill_workers):
            port = free_port()
            children.append(Child(f"prefill-{i}", "prefill", ["--port", str(port), "--worker-id", f"prefill-{i}", *disagg],
                                  port))
        for i in range(a.decode_workers):
            port = free_port()
            kv = ",".join(f"tcp://127.0.0.1:{free_port()}" for _ in range(a.tp))  # one receiver per rank
            children.append(Child(f"decode-{i}", "decode", ["--port", str(port), "--worker-id", f"decode-{i}",
                                                            "--kv-address", kv, *disagg], port))
    gw = ["--model", model, "--host", a.host, "--port", str(a.port)]
    for c in children:
        gw += {"prefill": ["--prefill"], "decode": ["--decode"], "worker": ["--worker"]}[c.role] + [c.address]
    if a.redis_url:
        gw += ["--redis-url", a.redis_url]
    if a.metrics_port:
        gw += ["--metrics-port", str(a.metrics_port)]
    if a.routing:
        gw += ["--routing", a.routing]
    if a.local_prefill_tokens is not None:
        gw += ["--local-prefill-tokens", str(a.local_prefill_tokens)]
    children.append(Child("gateway", "gateway", gw, a.port))
    return children


class Supervisor:
    def __init__(self, children: list[Child], log_dir: Path | None) -> None:
        self.children, self.log_dir = children, log_dir
        self.stopping = False

    def start_all(self) -> bool:
        for c in self.children:
            c.start(self.log_dir)
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        pending = list(self.children)
        while pending and time.monotonic() < deadline and not self.stopping:
            for c in list(pending):
                if not c.alive():
                    logger.error("%s exited during start-up (code %s)", c.name, c.proc.returncode if c.proc else None)
                    return False
                if healthy(c.address):
                    pending.remove(c)
            time.sleep(0.2)
        if pending:
            logger.error("not healthy in time: %s", ", ".join(c.name for c in pending))
        return not pending

    def watch(self) -> None:
        while not self.stopping:
            for c in self.children:
                if not self.stopping and not c.alive():
                    code = c.proc.returncode if c.proc else None
                    now = time.monotonic()
                    c.restarts = [t for t in c.restarts if now - t < 60] + [now]
                    delay = min(10.0, 0.5 * 2 ** (len(c.restarts) - 1))
                    logger.error("%s exited with code %s; restarting in %.1fs", c.name, code, delay)
                    time.sleep(delay)
                    if not self.stopping:
                        c.start(self.log_dir)
            time.sleep(0.5)

    def stop_all(self) -> None:
        self.stopping = True
        # Gateway first (it is last in the list), so no new work reaches workers that are going away.
        for c in reversed(self.children):
            if c.alive():
                c.proc.send_signal(signal.SIGTERM)
                if c.role == "gateway":
                    _wait(c, STOP_GRACE_S)
        for c in self.children:
            _wait(c, STOP_GRACE_S)


def _wait(c: Child, timeout: float) -> None:
    if c.proc is None:
        return
    try:
        c.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.warning("%s did not stop in %.0fs; killing it", c.name, timeout)
        c.proc.kill()
        c.proc.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem up", description="Start a local Tandem cluster and supervise it.")
    p.add_argument("--model", default=None, help="Hugging Face model directory (default: the built-in demo model)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--dtype", default=None)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--colocated", action="store_true", help="run --decode-workers role-both workers, no disaggregation")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per worker (one GPU each on CUDA; each worker starts its own ranks)")
    p.add_argument("--kv-transport", default="auto", choices=["auto", "zmq", "nccl", "cuda_ipc"],
                   help="prefill -> decode KV transport (auto: cuda_ipc on a GPU host, else zmq)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--redis-url", default=None, help="share the prefix index through Redis (default: embedded)")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--max-running", type=int, default=None)
    p.add_argument("--metrics-port", type=int, default=None, help="gateway Prometheus port")
    p.add_argument("--routing", default=None, choices=["cache_aware", "round_robin", "load"],
                   help="prefill routing policy (default: cache_aware)")
    p.add_argument("--local-prefill-tokens", type=int, default=None,
                   help="prefill on the decode worker when it lacks fewer tokens than this")
    p.add_argument("--log-dir", default=None, help="write each child's log here (default: inherit the terminal)")
    p.add_argument("--demo-request", action="store_true", help="send one request once healthy and print it")
    p.add_argument("--exit-after-demo", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for name in ("prefill_workers", "decode_workers", "tp"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    a = parse_args(argv)
    model = a.model
    if model is None:
        from engine.demo import demo_model_dir

        model = str(demo_model_dir())
        print("Serving the built-in demo model (random weights): its text is not meaningful. "
              "Use --model DIR for a real model.", flush=True)
    elif not (Path(model) / "config.json").is_file():
        print(f"tandem up: --model {model}: no config.json there", file=sys.stderr)
        return 2
    log_dir = Path(a.log_dir) if a.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(build_children(a, model), log_dir)

    def on_signal(signum, _frame):
        sup.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if not sup.start_all():
            return 1
        endpoint = f"{a.host}:{a.port}"
        print(f"Tandem is up: gRPC endpoint {endpoint} "
              f"({sum(c.role != 'gateway' for c in sup.children)} workers). Ctrl-C stops it.", flush=True)
        if a.demo_request:
            demo_request(endpoint)
            if a.exit_after_demo:
                return 0
        sup.watch()
        return 0
    finally:
        sup.stop_all()
        print("Tandem stopped.", flush=True)


def demo_request(endpoint: str) -> None:
    from tandem.client import Client

    prompt = "Once upon a time"
    with Client(endpoint) as client:
        out = client.generate(prompt, max_tokens=32, temperature=0.0)
    print(f"demo request: {prompt!r} -> {out.text!r}\n  finish={out.finish_reason} usage={out.usage}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

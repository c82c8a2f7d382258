"""`tandem up`: start a gateway and its workers as separate OS processes on loopback, and supervise them.

Children run as `python -m entrypoints <role> ...` so `ps` shows each one's role; `entrypoints.cluster`
starts them, waits until every child's gRPC health check says SERVING, restarts a child that
crashes (with backoff, giving up on one that keeps crashing), and on Ctrl-C / SIGTERM stops the
gateway first, then the workers. The launcher prints the endpoint once all are up.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
from pathlib import Path

from entrypoints.cluster import HEALTH_TIMEOUT_S, Cluster, ClusterError, ClusterProcess, free_port
from entrypoints.supervisor import SupervisorSocket, agent_process

logger = logging.getLogger("tandem.up")


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


def build_children(a: argparse.Namespace, model: str, log_dir: Path | None = None) -> list[ClusterProcess]:
    """The cluster's processes on fixed free ports (a restarted child keeps its address), the gateway last."""
    common = ["--model", model, "--load-format", a.load_format]
    if a.dtype:
        common += ["--dtype", a.dtype]
    if a.redis_url:
        common += ["--redis-url", a.redis_url]
    for flag, value in (("--num-kv-blocks", a.num_kv_blocks), ("--max-running", a.max_running)):
        if value:
            common += [flag, str(value)]
    common += ["--metrics-port", "0"]  # each worker on a free port; Stats reports it (the agent reads it)
    if a.tp > 1:  # every worker: prefill and decode workers that exchange KV need the same degree
        common += ["--tp", str(a.tp)]
    disagg = common + ["--kv-transport", kv_transport(a.kv_transport)]
    children: list[ClusterProcess] = []

    def child(name: str, role: str, argv: list[str], port: int) -> ClusterProcess:
        return ClusterProcess(name, role, argv, port, log_path=log_dir / f"{name}.log" if log_dir else None)

    if a.colocated:
        for i in range(a.decode_workers):
            port = free_port()
            children.append(child(f"worker-{i}", "worker", ["--role", "both", "--port", str(port),
                                                            "--worker-id", f"both-{i}", *common], port))
    else:
        for i in range(a.prefill_workers):
            port = free_port()
            children.append(child(f"prefill-{i}", "prefill", ["--port", str(port), "--worker-id", f"prefill-{i}", *disagg],
                                  port))
        for i in range(a.decode_workers):
            port = free_port()
            kv = ",".join(f"tcp://127.0.0.1:{free_port()}" for _ in range(a.tp))  # one receiver per rank
            children.append(child(f"decode-{i}", "decode", ["--port", str(port), "--worker-id", f"decode-{i}",
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
    children.append(child("gateway", "gateway", gw, a.port))
    return children


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
    p.add_argument("--no-agent", action="store_true", help="do not start the infra agent (tandem agent)")
    p.add_argument("--agent-args", default="", help="extra flags for the agent, e.g. \"--dry-run --config a.json\"")
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
    cluster = Cluster(build_children(a, model, log_dir))
    supervisor: SupervisorSocket | None = None
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        try:
            cluster.start(HEALTH_TIMEOUT_S, should_stop=lambda: stopping)
        except ClusterError as exc:
            logger.error("%s", exc)
            return 1
        endpoint = f"{a.host}:{a.port}"
        if not a.no_agent:  # the agent restarts workers through the supervisor's socket
            supervisor = SupervisorSocket(cluster)
            cluster.processes.append(agent_process(f"127.0.0.1:{a.port}", supervisor.start(), log_dir,
                                                   shlex.split(a.agent_args)))
            cluster.processes[-1].start()
        print(f"Tandem is up: gRPC endpoint {endpoint} "
              f"({sum(c.role != 'gateway' for c in cluster.processes)} workers). Ctrl-C stops it.", flush=True)
        if a.demo_request:
            demo_request(endpoint)
            if a.exit_after_demo:
                return 0
        try:
            cluster.watch(lambda: stopping)
        except ClusterError as exc:
            logger.error("%s", exc)
            return 1
        return 0
    finally:
        cluster.stop()
        if supervisor is not None:
            supervisor.close()
        print("Tandem stopped.", flush=True)


def demo_request(endpoint: str) -> None:
    from tandem.client import Client

    prompt = "Once upon a time"
    with Client(endpoint) as client:
        out = client.generate(prompt, max_tokens=32, temperature=0.0)
    print(f"demo request: {prompt!r} -> {out.text!r}\n  finish={out.finish_reason} usage={out.usage}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

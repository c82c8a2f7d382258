"""Two-GPU benchmarks: NCCL KV-transfer bandwidth against the GPU-to-GPU copy ceiling, and
goodput of 1 prefill + 1 decode worker against 2 colocated workers (DistServe's method).

    python bench/multi_gpu_bench.py kv --out kv.json               # needs 2 GPUs (or --backend gloo)
    python bench/multi_gpu_bench.py goodput --shape llama3-8b --rates 1,2,4,8,16 \\
        --slo-ttft-ms 400 --slo-tpot-ms 40 --out goodput.json        # needs 2 GPUs (or --device cpu)

kv: one transfer = layers x (K, V) x blocks of [block_size, kv_heads, head_dim]. Reported: the
device copy cuda:0 -> cuda:1 (torch copy_, the ceiling), raw NCCL send/recv of the same bytes
between two processes, and each transport of --transports end to end (nccl: gather on cuda:0,
headers over ZMQ, payload through NCCL, scatter into the cache on cuda:1), each in GB/s.
--trace-dir adds one more transfer per transport under the torch profiler, both sides.

goodput: for each mode a cluster is started with one worker per GPU (CUDA_VISIBLE_DEVICES),
`tandem bench` offers a sharegpt-like Poisson load at each rate, and a rate passes when >= 90%
of its requests meet both the TTFT and the TPOT SLO. Goodput is the highest passing rate,
refined by bisection between the last pass and the first failure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ATTAINMENT = 0.9
KV_TRANSPORTS = ("nccl", "zmq", "cuda_ipc")
GIL_SWITCH_INTERVAL_S = 0.0005  # worker.server's: KV transfer threads get the GIL within 0.5 ms


def _gbps(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    rates = [nbytes / s / 1e9 for s in seconds]
    return {"gbps_median": round(statistics.median(rates), 2), "gbps_best": round(max(rates), 2),
            "ms_median": round(statistics.median(seconds) * 1e3, 3), "runs": [round(r, 2) for r in rates]}


# -- kv: bandwidth -----------------------------------------------------------------------------

def copy_ceiling(nbytes: int, iters: int) -> dict[str, Any]:
    """torch copy_ between cuda:0 and cuda:1 in both directions (the NVLink / PCIe ceiling)."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    out: dict[str, Any] = {"peer_access": torch.cuda.can_device_access_peer(0, 1)}
    for name, dst, src in (("0->1", b, a), ("1->0", a, b)):
        times = []
        for i in range(iters + 1):
            torch.cuda.synchronize(0), torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(0), torch.cuda.synchronize(1)
            if i:  # the first is a warm-up
                times.append(time.perf_counter() - t0)
        out[name] = _gbps(nbytes, times)
    return out


def _raw_peer(store_port: int, nbytes: int, iters: int, backend: str, device: str) -> None:
    """Spawned: rank 1 of a pair group, receiving `iters` + 1 payloads."""
    import torch

    from kvtransfer import nccl_group as ng

    if backend == "nccl":
        torch.cuda.set_device(device)
    store = ng.connect_store(f"127.0.0.1:{store_port}", 60.0)
    group = ng.pair_group(store, "bench-raw", ng.RECEIVER_RANK, backend, 60.0)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    for _ in range(iters + 1):
        ng.wait_work(group.recv([buf], ng.SENDER_RANK, 0), backend, 60.0, "raw recv")
    ng.close_group(group, broken=False)


def raw_p2p(nbytes: int, iters: int, backend: str, src: str, dst: str) -> dict[str, Any]:
    """Plain send/recv of `nbytes` through a two-rank group: the transport's floor."""
    import multiprocessing as mp

    import torch

    from kvtransfer import nccl_group as ng

    if backend == "nccl":
        torch.cuda.set_device(src)
    store = ng.host_store("127.0.0.1", 0, 60.0)
    proc = mp.get_context("spawn").Process(target=_raw_peer, args=(store.port, nbytes, iters, backend, dst))
    proc.start()
    group = ng.pair_group(store, "bench-raw", ng.SENDER_RANK, backend, 60.0)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=src)
    times = []
    for i in range(iters + 1):
        t0 = time.perf_counter()
        ng.wait_work(group.send([buf], ng.RECEIVER_RANK, 0), backend, 60.0, "raw send")
        if i:
            times.append(time.perf_counter() - t0)
    proc.join(60)
    ng.close_group(group, broken=False)
    return _gbps(nbytes, times)


def _cache(a: argparse.Namespace, device: str, seed: int | None) -> list:
    import torch

    shape = (2 * a.blocks, a.block_size, a.kv_heads, a.head_dim)
    dtype = getattr(torch, a.dtype)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(a.layers)]
    gen = torch.Generator(device=device).manual_seed(seed)  # on the device: GBs of noise in seconds
    return [torch.randn(shape, generator=gen, device=device).to(dtype) for _ in range(a.layers)]


def _transport_receiver(a: argparse.Namespace, transport: str, options: dict, ctrl: Any, done: Any) -> None:
    """Spawned: the decode side, a cache on `a.dst` and a receiver of `transport`."""
    import torch

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)

    from kvtransfer import get_transport
    from kvtransfer.sinks import TensorKVSink

    if a.dst.startswith("cuda"):
        torch.cuda.set_device(a.dst)
    sink = TensorKVSink(_cache(a, a.dst, None), _cache(a, a.dst, None))
    receiver = get_transport(transport).create_receiver(sink, bind="tcp://127.0.0.1:*", **options)
    done.put(receiver.address)
    while (cmd := ctrl.get()) is not None:
        rid, dst_ids, trace = cmd
        prof = _profiler(trace)
        receiver.expect(rid, dst_ids, a.layers, deadline_s=120.0)
        done.put("ready")
        results = receiver.poll_completed(timeout_s=120.0)
        done.put((time.monotonic(), bool(results) and results[0].ok))
        if prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.stop()
            prof.export_chrome_trace(trace)
    receiver.close()


def _profiler(trace: str | None):
    """A started torch profiler (CPU ops and the device timeline) when `trace` names a file."""
    if not trace:
        return None
    import torch

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                              torch.profiler.ProfilerActivity.CUDA])
    prof.start()
    return prof


def transport_bandwidth(a: argparse.Namespace, transport: str, sender_options: dict,
                        receiver_options: dict) -> dict[str, Any]:
    """End to end through `transport`: gather on the source, send, scatter into the destination
    cache; the clock stops when the receiver has the commit (same host, same monotonic clock)."""
    import multiprocessing as mp

    import torch

    from kvtransfer import get_transport

    if a.src.startswith("cuda"):
        torch.cuda.set_device(a.src)
    ctx = mp.get_context("spawn")
    ctrl, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_transport_receiver, args=(a, transport, receiver_options, ctrl, done), daemon=True)
    proc.start()
    address = done.get(timeout=120)
    src_k, src_v = _cache(a, a.src, 1), _cache(a, a.src, 2)
    gen = torch.Generator().manual_seed(3)
    src_ids = torch.randperm(2 * a.blocks, generator=gen)[: a.blocks].tolist()
    dst_ids = torch.randperm(2 * a.blocks, generator=gen)[: a.blocks].tolist()
    nbytes = 2 * a.layers * a.blocks * src_k[0][0].numel() * src_k[0].element_size()
    times = []
    sender = get_transport(transport).create_sender(**sender_options)
    try:
        last = a.iters + (1 if a.trace_dir else 0)  # a warm-up, the timed ones, then the traced one
        for it in range(last + 1):
            rid = f"bench-{transport}-{it}"
            trace = f"{a.trace_dir}/{transport}-%s.json" if a.trace_dir and it == last else None
            ctrl.put((rid, dst_ids, trace and trace % "receiver"))
            done.get(timeout=60)
            if a.src.startswith("cuda"):
                torch.cuda.synchronize()
            prof = _profiler(trace and trace % "sender")
            t0 = time.monotonic()
            sender.open(rid, address, a.layers)
            for layer in range(a.layers):
                sender.send_layer(rid, layer, src_k[layer], src_v[layer], src_ids, dst_ids)
            sender.commit(rid, {"num_tokens": a.blocks * a.block_size})
            t_done, ok = done.get(timeout=180)
            if not ok:
                raise RuntimeError(f"transfer {rid} failed")
            if prof is not None:  # the traced transfer is left out of the figures
                prof.stop()
                prof.export_chrome_trace(trace % "sender")
            elif it:
                times.append(t_done - t0)
    finally:
        ctrl.put(None)
        sender.close()
        proc.join(60)
    return {"bytes_per_transfer": nbytes, **_gbps(nbytes, times)}


def run_kv(a: argparse.Namespace) -> dict[str, Any]:
    os.environ.update(NVLS_OFF)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as the workers run (worker.server)
    layer_bytes = 2 * a.blocks * a.block_size * a.kv_heads * a.head_dim * {"float32": 4}.get(a.dtype, 2)
    nbytes = a.layers * layer_bytes
    out: dict[str, Any] = {"config": {k: getattr(a, k) for k in (
        "layers", "blocks", "block_size", "kv_heads", "head_dim", "dtype", "backend", "src", "dst")}}

    def part(name: str, fn) -> None:
        """Measure one part; the result so far is written after each (a killed run keeps them).
        A part that fails is recorded with its error and the rest still run."""
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - one broken path must not hide the others
            out[name] = {"error": repr(exc)}
        print(f"{name}: {json.dumps(out[name])[:300]}", flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(out, indent=1) + "\n")

    if a.backend == "nccl":
        part("copy_ceiling", lambda: copy_ceiling(nbytes, a.iters))
    part("raw_p2p", lambda: raw_p2p(nbytes, a.iters, a.backend, a.src, a.dst))
    if a.trace_dir:
        Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
    transports = list(a.transports) + ["zmq"] * a.with_zmq + ["cuda_ipc"] * a.with_ipc
    options = {  # (sender, receiver) options of each transport
        "nccl": ({"backend": a.backend, "device": a.src if a.backend == "nccl" else None}, {"backend": a.backend}),
        "zmq": ({}, {}),
        "cuda_ipc": ({}, {"device": a.dst}),
    }
    for transport in dict.fromkeys(transports):  # in order, once each
        if transport == "cuda_ipc" and a.backend != "nccl":
            continue  # GPU caches only
        part(f"{transport}_transport", lambda t=transport: transport_bandwidth(a, t, *options[t]))
    ceiling = out.get("copy_ceiling", {}).get("0->1", {}).get("gbps_median")
    raw = out.get("raw_p2p", {}).get("gbps_median")
    for name in ("nccl_transport", "cuda_ipc_transport"):
        rate = out.get(name, {}).get("gbps_median")
        if rate and ceiling:
            out[f"{name.removesuffix('_transport')}_vs_copy"] = round(rate / ceiling, 3)
    if out.get("nccl_vs_copy") is not None:
        out["transport_vs_copy"] = out["nccl_vs_copy"]
    if raw and out.get("nccl_transport", {}).get("gbps_median"):
        out["transport_vs_raw"] = round(out["nccl_transport"]["gbps_median"] / raw, 3)
    return out


# -- goodput: clusters and load ------------------------------------------------------------------

def _model_dir(a: argparse.Namespace, tmp: Path) -> tuple[str, str]:
    """(model directory, load format) for --model / --shape."""
    if a.model:
        if a.model == "demo":
            from engine.demo import demo_model_dir

            return str(demo_model_dir(tmp / "demo")), "auto"
        return a.model, a.load_format
    from bench.h200_bench import LLAMA31_8B, write_model

    return str(write_model(tmp / "llama3-8b", LLAMA31_8B)), "dummy"


class Cluster:
    """One gateway and two workers, each computing on its own GPU (CUDA_VISIBLE_DEVICES)."""

    def __init__(self, mode: str, a: argparse.Namespace, model: str, load_format: str, log_dir: Path) -> None:
        from entrypoints.cluster import Cluster as Processes
        from entrypoints.cluster import free_port

        self.processes = Processes([])
        self.log_dir = log_dir
        common = ["--model", model, "--load-format", load_format, "--device", a.device.split(":")[0]]
        if a.dtype_model:
            common += ["--dtype", a.dtype_model]
        if a.max_model_len:
            common += ["--max-model-len", str(a.max_model_len)]
        if a.device.startswith("cuda") and a.no_cuda_graphs:
            common += ["--no-cuda-graphs"]
        gateway = ["--model", model, "--load-format", load_format]
        if mode == "disagg":
            workers = [("prefill", ["--kv-transport", a.kv_transport]),
                       ("decode", ["--kv-transport", a.kv_transport, "--kv-address", f"tcp://127.0.0.1:{free_port()}"])]
        else:
            workers = [("worker", ["--role", "both"]), ("worker", ["--role", "both"])]
        for gpu, (role, extra) in enumerate(workers):
            port = free_port()
            self._start(f"{role}-{gpu}", role, ["--port", str(port), "--worker-id", f"{role}-{gpu}", *common, *extra],
                        port, {"CUDA_VISIBLE_DEVICES": self.visible_devices(gpu, mode, a)} if a.device.startswith("cuda")
                        else {})
            gateway += [{"prefill": "--prefill", "decode": "--decode", "worker": "--worker"}[role], f"127.0.0.1:{port}"]
        port = free_port()
        self.target = f"127.0.0.1:{port}"
        self.metrics_port = free_port()
        self._start("gateway", "gateway", ["--port", str(port), "--metrics-port", str(self.metrics_port), *gateway],
                    port, {})
        self.num_workers = len(workers)

    @staticmethod
    def visible_devices(gpu: int, mode: str, a: argparse.Namespace) -> str:
        """What worker `gpu` may see: its own GPU, and for cuda_ipc between disaggregated
        workers the other one after it (the decode side reads the prefill GPU's staging pool by
        peer access; each worker still computes on its own GPU, its cuda:0)."""
        if mode == "disagg" and a.kv_transport == "cuda_ipc":
            return f"{gpu},{1 - gpu}"
        return str(gpu)

    def _start(self, name: str, role: str, argv: list[str], port: int, env: dict[str, str]) -> None:
        from entrypoints.cluster import ClusterProcess

        process = ClusterProcess(name, role, argv, port, env={**NVLS_OFF, **env}, log_path=self.log_dir / f"{name}.log")
        self.processes.processes.append(process)
        process.start()

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            self.processes.wait_ready(timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\nsee {self.log_dir}") from None
        while self._workers_up() < self.num_workers:  # else it would prefill on the decode worker
            if not all(p.alive() for p in self.processes.processes):
                raise RuntimeError(f"a cluster process exited during start-up; see {self.log_dir}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {timeout_s:g}s (waiting for the gateway); see {self.log_dir}")
            time.sleep(0.5)

    def _workers_up(self) -> float:
        """Workers the gateway routes to, from its tandem_gateway_workers_up gauge."""
        import urllib.request

        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).read().decode()
        except OSError:
            return 0.0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tandem_gateway_workers_up{"))

    def stop(self) -> None:
        self.processes.stop(30)  # gateway first


def bench_point(target: str, rate: float, a: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    """One `tandem bench` run at `rate`; its summary (goodput.fraction is the SLO attainment)."""
    cmd = [sys.executable, "-m", "entrypoints", "bench", "--target", target, "--dataset", "sharegpt-like",
           "--prompt-format", "tokens", "--num-requests", str(a.num_requests), "--input-len", a.input_len,
           "--output-len", a.output_len, "--request-rate", f"{rate:g}", "--slo-ttft-ms", f"{a.slo_ttft_ms:g}",
           "--slo-tpot-ms", f"{a.slo_tpot_ms:g}", "--seed", str(seed), "--warmup", str(a.warmup),
           "--out", str(out), "--no-progress"]
    if a.request_timeout:
        cmd += ["--timeout", f"{a.request_timeout:g}"]
    subprocess.run(cmd, check=False, timeout=a.point_timeout)
    return json.loads(out.read_text())["runs"][0]["summary"]


def goodput_search(target: str, a: argparse.Namespace, work: Path, mode: str) -> dict[str, Any]:
    """Sweep the rates upwards until attainment drops below 90%, then bisect the gap."""
    points: list[dict[str, Any]] = []

    def measure(rate: float) -> bool:
        s = bench_point(target, rate, a, seed=len(points), out=work / f"{mode}-{len(points)}.json")
        attained = (s.get("goodput") or {}).get("fraction") or 0.0
        points.append({"rate": rate, "attainment": round(attained, 4), "ttft_p90_ms": s["ttft_ms"]["p90"],
                       "tpot_p90_ms": s["tpot_ms"]["p90"], "output_tok_s": round(s["output_token_throughput"], 1),
                       "failed": s["requests"]["failed"]})
        print(f"{mode}: rate {rate:g}/s -> {attained:.1%} within SLO", flush=True)
        return attained >= ATTAINMENT

    best, first_fail = 0.0, None
    for rate in a.rates:
        if not measure(rate):
            first_fail = rate
            break
        best = rate
    for _ in range(a.refine if first_fail is not None else 0):
        mid = (best + first_fail) / 2
        if measure(mid):
            best = mid
        else:
            first_fail = mid
    return {"goodput_rps": best, "goodput_rps_per_gpu": best / 2, "first_failing_rate": first_fail, "points": points}


def run_goodput(a: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"slo": {"ttft_ms": a.slo_ttft_ms, "tpot_ms": a.slo_tpot_ms, "attainment": ATTAINMENT},
                               "dataset": {"name": "sharegpt-like", "num_requests": a.num_requests,
                                           "input_len": a.input_len, "output_len": a.output_len},
                               "kv_transport": a.kv_transport, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="tandem-goodput-") as tmp:
        work = Path(tmp)
        model, load_format = _model_dir(a, work)
        for mode in a.modes:
            log_dir = Path(a.log_dir or work) / mode
            log_dir.mkdir(parents=True, exist_ok=True)
            cluster = Cluster(mode, a, model, load_format, log_dir)
            try:
                cluster.wait_healthy(a.start_timeout)
                results["modes"][mode] = goodput_search(cluster.target, a, work, mode)
            finally:
                cluster.stop()
            if a.out:  # a killed run keeps the modes measured so far
                Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    modes = results["modes"]
    if "disagg" in modes and "colocated" in modes and modes["colocated"]["goodput_rps"]:
        results["disagg_over_colocated"] = round(modes["disagg"]["goodput_rps"] / modes["colocated"]["goodput_rps"], 3)
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    kv = sub.add_parser("kv", help="KV-transfer bandwidth vs the GPU-to-GPU copy")
    kv.add_argument("--layers", type=int, default=32)
    kv.add_argument("--blocks", type=int, default=128, help="blocks per transfer (128 x 16 = a 2k-token prompt)")
    kv.add_argument("--block-size", type=int, default=16)
    kv.add_argument("--kv-heads", type=int, default=8)
    kv.add_argument("--head-dim", type=int, default=128)
    kv.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    kv.add_argument("--iters", type=int, default=7)
    kv.add_argument("--backend", default="nccl", choices=["nccl", "gloo"], help="gloo: CPU caches (a smoke run)")
    kv.add_argument("--src", default=None, help="prefill cache device (default cuda:0, cpu for gloo)")
    kv.add_argument("--dst", default=None, help="decode cache device (default cuda:1, cpu for gloo)")
    kv.add_argument("--transports", type=lambda s: [t for t in s.split(",") if t], default=["nccl"],
                    help="transports to time, in order: nccl, zmq (through pinned host memory), cuda_ipc "
                         "(the decode side reads the prefill GPU's staging by peer access)")
    kv.add_argument("--with-zmq", action="store_true", help="also the ZMQ transport (same as adding zmq to --transports)")
    kv.add_argument("--trace-dir", default=None,
                    help="write a torch profiler trace of one more transfer per transport (sender and receiver)")
    kv.add_argument("--with-ipc", action="store_true", help="also the cuda_ipc transport (same as adding cuda_ipc)")
    gp = sub.add_parser("goodput", help="1 prefill + 1 decode vs 2 colocated workers, DistServe goodput")
    gp.add_argument("--model", default=None, help="model directory, or 'demo' (default: --shape)")
    gp.add_argument("--shape", default="llama3-8b", choices=["llama3-8b"], help="dummy weights at this shape")
    gp.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="with --model")
    gp.add_argument("--dtype", dest="dtype_model", default=None, help="model dtype (default: the checkpoint's)")
    gp.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the harness")
    gp.add_argument("--modes", type=lambda s: s.split(","), default=["disagg", "colocated"])
    gp.add_argument("--kv-transport", default="nccl", choices=["nccl", "zmq", "cuda_ipc"])
    gp.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[1, 2, 4, 8, 12, 16, 24])
    gp.add_argument("--refine", type=int, default=2, help="bisection steps after the sweep")
    gp.add_argument("--num-requests", type=int, default=200)
    gp.add_argument("--input-len", default="4:2048", help="sharegpt-like prompt clip MIN:MAX")
    gp.add_argument("--output-len", default="4:512", help="sharegpt-like output clip MIN:MAX")
    gp.add_argument("--slo-ttft-ms", type=float, default=400.0)
    gp.add_argument("--slo-tpot-ms", type=float, default=40.0)
    gp.add_argument("--warmup", type=int, default=4)
    gp.add_argument("--max-model-len", type=int, default=4096)
    gp.add_argument("--no-cuda-graphs", action="store_true")
    gp.add_argument("--request-timeout", type=float, default=None, help="per-request deadline, seconds")
    gp.add_argument("--point-timeout", type=float, default=900.0, help="bound on one rate's run, seconds")
    gp.add_argument("--start-timeout", type=float, default=600.0)
    gp.add_argument("--log-dir", default=None, help="keep the cluster logs here")
    for sp in (kv, gp):
        sp.add_argument("--out", default=None, help="write the JSON result here")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.cmd == "kv":
        unknown = [t for t in a.transports if t not in KV_TRANSPORTS]
        if unknown:
            parser.error(f"--transports: unknown {unknown}; choose from {', '.join(KV_TRANSPORTS)}")
        cpu = a.backend == "gloo"
        a.src = a.src or ("cpu" if cpu else "cuda:0")
        a.dst = a.dst or ("cpu" if cpu else "cuda:1")
        result = run_kv(a)
    else:
        result = run_goodput(a)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

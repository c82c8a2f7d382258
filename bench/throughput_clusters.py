"""bench/throughput_bench.py's cluster sections, run in the bench's own process against a
`tandem up` it starts (`Clusters`, one at a time, reused by consecutive sections of one mode): the
services burst, the online point and the search for the highest rate within the SLO."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.throughput_context import REPO, Context, log

class Clusters:
    """At most one `tandem up` at a time (bench/up_bench.py's start_up / stop), kept running for
    the next section of the same mode; a mode that failed to start is not retried."""

    MODES = {"disagg": [], "colocated": ["--colocated"],
             "disagg_small_prefill": ["--prefill-memory-ratio", "0.25", "--max-model-len", "8192"],
             "disagg_whole_prefill_context": ["--prefill-max-model-len", "131072"],
             "disagg_hold_reserving": ["--gpu-turn-hold", "reserving"],
             "disagg_own_weights": ["--no-share-weights"], "disagg_gil_100us": [],
             "disagg_fp8": ["--quantization", "fp8"], "colocated_fp8": ["--colocated", "--quantization", "fp8"],
             "disagg_fp8_one_row": ["--quantization", "fp8"],
             "disagg_no_mps": ["--no-mps"], "disagg_fp8_no_mps": ["--quantization", "fp8", "--no-mps"],
             "disagg_mps_no_turn": ["--mps", "--no-gpu-turn"],
             "disagg_mps_layer_push": ["--mps", "--kv-push", "layer"],
             "disagg_fp8_mps_no_turn": ["--quantization", "fp8", "--mps", "--no-gpu-turn"]}
    ENV = {"disagg_gil_100us": {"TANDEM_GIL_SWITCH_US": "100"},  # a mode's environment (entrypoints/worker.py)
           "disagg_fp8_one_row": {"TANDEM_FUSED_GEMV_ROWS": "1"}}

    def __init__(self, model_dir: Path, log_root: Path, up_args: list[str] = ()) -> None:
        self.model_dir, self.log_root, self.up_args = model_dir, log_root, list(up_args)
        self.mode: str | None = None
        self.proc: subprocess.Popen | None = None
        self.target = ""
        self.info: dict = {}
        self.failed: dict[str, str] = {}

    def get(self, mode: str, timeout_s: float) -> tuple[str, dict]:
        """(gRPC target, {"banner", "startup_s", "reused"}) of a running cluster of `mode`."""
        from bench import up_bench
        from entrypoints.cluster import free_port

        if mode in self.failed:
            raise RuntimeError(f"tandem up ({mode}) failed to start earlier in this run: {self.failed[mode]}")
        if self.mode == mode and self.proc is not None and self.proc.poll() is None:
            return self.target, {**self.info, "reused": True}
        self.close()
        port = free_port()
        up_bench.UP_TIMEOUT_S = max(30.0, timeout_s)  # start_up reads it for its deadline
        try:
            proc, banner, up_s = up_bench.start_up(self.model_dir, port, self.log_root / f"logs-{mode}",
                                                   [*self.MODES[mode], *self.up_args], self.ENV.get(mode))
        except Exception as exc:
            self.failed[mode] = repr(exc)[:2000]
            raise
        self.mode, self.proc, self.target = mode, proc, f"127.0.0.1:{port}"
        self.info = {"banner": banner, "startup_s": round(up_s, 1)}
        return self.target, {**self.info, "reused": False}

    def log_tails(self, mode: str) -> dict[str, str]:
        logs = sorted((self.log_root / f"logs-{mode}").glob("*.log"))
        return {f.name: f.read_text(errors="replace")[-3000:] for f in logs}

    def close(self) -> int | None:
        from bench.up_bench import stop

        code = None
        if self.proc is not None:
            code = stop(self.proc)
            log(f"tandem up ({self.mode}) stopped, exit code {code}")
        self.mode, self.proc = None, None
        return code


def run_services(ctx: Context, mode: str = "disagg") -> dict:
    """The same prompts as offline_subset through the SDK, all submitted at once (bench/up_bench.py)."""
    from bench.up_bench import make_prompts
    from tandem import AsyncClient

    a = ctx.args
    prompts = make_prompts(a.services_prompts, a.input_len, ctx.vocab_size)
    target, info = ctx.clusters.get(mode, ctx.left())

    async def run() -> tuple[int, int, float]:
        async with AsyncClient(target, timeout=3600) as client:
            await client.generate(prompts[0], max_tokens=4, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            outs = await asyncio.gather(*(client.generate(x, max_tokens=a.output_len, temperature=0.0,
                                                          ignore_eos=True) for x in prompts))
            return len(outs), sum(len(o.token_ids) for o in outs), time.perf_counter() - t

    async def bounded() -> tuple[int, int, float]:
        return await asyncio.wait_for(run(), timeout=max(1.0, ctx.left()))

    done, n_out, dt = asyncio.run(bounded())
    return {**info, "mode": mode, "completed": done, "prompts": len(prompts), "input_len": a.input_len,
            "output_len": a.output_len, "output_tokens": n_out, "seconds": round(dt, 2),
            "output_tok_s": round(n_out / dt, 1)}


def bench_point(ctx: Context, target: str, rate: float, num_requests: int, seed: int, out: Path) -> dict:
    """One `tandem bench` run: Poisson `rate`, random token prompts of input_len, online_output_len
    new tokens, the SLO of --slo-*; its summary. Its duration is capped by the section's time left."""
    a = ctx.args
    duration = max(5.0, min(a.point_max_s, ctx.left() - 15))
    cmd = [sys.executable, "-m", "entrypoints", "bench", "--target", target, "--dataset", "random",
           "--prompt-format", "tokens", "--num-requests", str(num_requests), "--input-len", str(a.input_len),
           "--output-len", str(a.online_output_len), "--request-rate", f"{rate:g}",
           "--slo-ttft-ms", f"{a.slo_ttft_ms:g}", "--slo-tpot-ms", f"{a.slo_tpot_ms:g}", "--seed", str(seed),
           "--warmup", "2", "--duration", f"{duration:g}", "--out", str(out), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=duration + 60)
    if not out.is_file():
        raise RuntimeError(f"tandem bench exited {proc.returncode} without results: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())["runs"][0]["summary"]


def staged_point(ctx: Context, target: str, info: dict, rate: float, num_requests: int, seed: int,
                 out: Path) -> tuple[dict, dict]:
    """bench_point, and the workers' mean stage times over it (their metrics scraped before and
    after; `info` is the cluster's, its banner names the metrics ports)."""
    from bench import step_gaps

    ports = step_gaps.metrics_ports(info["banner"])
    before = step_gaps.scrape_all(ports)
    summary = bench_point(ctx, target, rate, num_requests, seed, out)
    return summary, step_gaps.stage_means(before, step_gaps.scrape_all(ports))


def _point_row(rate: float, s: dict) -> dict:
    req = s["requests"]
    return {"rate": rate, "requests": req["measured"], "failed": req["failed"],
            "cancelled": req["cancelled_at_deadline"], "skipped": req["skipped"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "output_tok_s": round(s["output_token_throughput"], 1),
            "slo_attainment": (s.get("goodput") or {}).get("fraction")}


def within_slo(row: dict, ttft_ms: float, tpot_ms: float) -> bool:
    """Every request sent and completed, TTFT P99 and TPOT P99 within the targets."""
    if row["failed"] or row["cancelled"] or row["skipped"] or not row["requests"]:
        return False
    return (row["ttft_p99_ms"] is not None and row["ttft_p99_ms"] <= ttft_ms
            and (row["tpot_p99_ms"] is None or row["tpot_p99_ms"] <= tpot_ms))


def run_online(ctx: Context, mode: str = "disagg") -> dict:
    a = ctx.args
    target, info = ctx.clusters.get(mode, ctx.left())
    s, stages = staged_point(ctx, target, info, a.online_rate, a.online_requests, seed=1,
                             out=ctx.work / f"online-{mode}.json")
    return {**info, "mode": mode, "rate": a.online_rate, "input_len": a.input_len, "output_len": a.online_output_len,
            **_point_row(a.online_rate, s), "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"], "itl_ms": s["itl_ms"],
            "stage_means_ms": stages}


def point_requests(rate: float, seconds: float, least: int) -> int:
    return max(least, round(rate * seconds))


def search_max_rate(measure: Callable[[float], dict], rates: list[float], refine: int, ttft_ms: float,
                    tpot_ms: float, fits: Callable[[float], bool]) -> dict:
    """Rates upwards until one misses the SLO, then `refine` bisections between the last rate
    within it (0 if none) and the first miss. `measure(rate)` -> a _point_row; `fits(rate)`: whether
    a point at `rate` still fits the time left (the search stops, recorded, when not)."""
    points: list[dict] = []
    best, first_miss, stopped = 0.0, None, None

    def one(rate: float) -> bool | None:
        if not fits(rate):
            return None
        row = measure(rate)
        row["within_slo"] = within_slo(row, ttft_ms, tpot_ms)
        points.append(row)
        log(f"rate {rate:g}/s: TTFT P99 {row['ttft_p99_ms']} ms, TPOT P99 {row['tpot_p99_ms']} ms, "
            f"failed {row['failed']}, within SLO: {row['within_slo']}")
        return row["within_slo"]

    for rate in rates:
        ok = one(rate)
        if ok is None:
            stopped = f"time budget reached before rate {rate:g}"
            break
        if not ok:
            first_miss = rate
            break
        best = rate
    for _ in range(refine if first_miss is not None and stopped is None else 0):
        mid = round((best + first_miss) / 2, 2)
        ok = one(mid)
        if ok is None:
            stopped = f"time budget reached before rate {mid:g}"
            break
        best, first_miss = (mid, first_miss) if ok else (best, mid)
    return {"max_rate_within_slo": best, "first_rate_missing_slo": first_miss, "stopped": stopped,
            "slo": {"ttft_p99_ms": ttft_ms, "tpot_p99_ms": tpot_ms}, "points": points}


def run_max_rate(ctx: Context, mode: str = "disagg") -> dict:
    a = ctx.args
    target, info = ctx.clusters.get(mode, ctx.left())
    n = [0]

    def measure(rate: float) -> dict:
        n[0] += 1
        s, stages = staged_point(ctx, target, info, rate, point_requests(rate, a.point_s, a.point_min_requests),
                                 seed=100 + n[0], out=ctx.work / f"rate-{mode}-{n[0]}.json")
        return {**_point_row(rate, s), "stage_means_ms": stages}

    def fits(rate: float) -> bool:  # the arrivals, the last requests' tail and the client's start-up
        return ctx.left() > point_requests(rate, a.point_s, a.point_min_requests) / rate + 10

    res = search_max_rate(measure, a.rates, a.rate_refine, a.slo_ttft_ms, a.slo_tpot_ms, fits)
    return {**info, "mode": mode, "input_len": a.input_len, "output_len": a.online_output_len, **res}

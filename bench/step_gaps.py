"""Where a stream's time goes in a running cluster: client TTFT and inter-token time against
the workers' own engine step time, and both against the offline engine at the same batch.

    python bench/step_gaps.py --model DIR [--modes disagg,colocated] [--concurrency 1,4,16]
    python bench/step_gaps.py --llama8b --input-len 1024 --output-len 256     # a GPU box

For each mode it starts `tandem up` (dummy weights), sends one warm-up request, then, for each
concurrency C, keeps C greedy streams (stream_interval 1, as `tandem bench`) in flight until
`--requests` (default max(16, 2C)) have finished. Around each level it reads every worker's
`tandem_engine_step_seconds` sum and count and the KV transfer counters from its /metrics. The
row says, per level: the client's TTFT and inter-token time (P50 and mean), the decode-side
worker's mean step, the inter-token mean minus that step (time a token spends outside the
engine's step: the loop between steps, the listener, the RPC hops), the prefill worker's mean
step, and what the decode worker's steps waited for prefill steps on a shared GPU (per step).
Then, with the cluster stopped, the offline engine (`LLM`, same flags' defaults) runs
C sequences of the same prompt length for `--output-len` steps: its ms/step is what the
services' inter-token time is measured against, and one lone prompt's prefill what TTFT is.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import up_bench  # noqa: E402

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

# Histograms whose mean per level is reported: (series, label holding the stage or None).
HISTOGRAMS = {"tandem_engine_step_seconds": None, "tandem_prefill_stage_seconds": "stage",
              "tandem_gateway_worker_call_seconds": "stage"}
KV_SECONDS = "tandem_kv_transfer_seconds_total"
KV_BYTES = "tandem_kv_transfer_bytes_total"
TURN_WAIT = "tandem_worker_gpu_turn_wait_seconds_total"
DEVICE_IDLE = "tandem_engine_device_idle_seconds"  # a histogram of the gaps between steps
LONG_GAP_S = "0.001"  # its bucket bound: gaps longer than this are the host falling behind, not copies


def metrics_ports(banner: list[str]) -> dict[str, int]:
    """Process name (worker ids and `gateway`) -> metrics port, from `tandem up`'s banner lines
    ("  decode-0 ... metrics :PORT")."""
    ports = {}
    for line in banner:
        m = re.match(r"\s+(\S+)\s.*metrics :(\d+)", line)
        if m and m.group(1) != "agent":
            ports[m.group(1)] = int(m.group(2))
    return ports


def scrape(port: int) -> dict[str, float]:
    """One process's histogram sums and counts (keyed `series[:stage]_sum|_count`), sent KV and
    the seconds its steps waited for their turn on a shared GPU."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {"kv_seconds": 0.0, "kv_bytes": 0.0, "turn_wait_seconds": 0.0, "device_idle_seconds": 0.0,
                             "device_idle_gaps": 0.0, "device_idle_short_gaps": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            for name, label in HISTOGRAMS.items():
                for suffix in ("_sum", "_count"):
                    if s.name == name + suffix:
                        key = name + (":" + s.labels.get(label, "") if label else "") + suffix
                        out[key] = out.get(key, 0.0) + s.value
            if s.name == KV_SECONDS and s.labels.get("direction") == "sent":
                out["kv_seconds"] += s.value
            elif s.name == KV_BYTES and s.labels.get("direction") == "sent":
                out["kv_bytes"] += s.value
            elif s.name == TURN_WAIT:
                out["turn_wait_seconds"] += s.value
            elif s.name == DEVICE_IDLE + "_sum":
                out["device_idle_seconds"] += s.value
            elif s.name == DEVICE_IDLE + "_count":
                out["device_idle_gaps"] += s.value
            elif s.name == DEVICE_IDLE + "_bucket" and s.labels.get("le") == LONG_GAP_S:
                out["device_idle_short_gaps"] += s.value
    return out


def means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, tuple[float, float]]:
    """`series[:stage]` -> (mean ms, count) of the observations between two scrapes."""
    out = {}
    for key, value in after.items():
        if key.endswith("_count"):
            base = key[: -len("_count")]
            n = value - before.get(key, 0.0)
            if n > 0:
                out[base] = ((after[base + "_sum"] - before.get(base + "_sum", 0.0)) / n * 1e3, n)
    return out


SHORT = {"tandem_engine_step_seconds": "step", "tandem_prefill_stage_seconds:compute": "prefill_compute",
         "tandem_prefill_stage_seconds:handover": "prefill_handover",
         "tandem_prefill_stage_seconds:queue": "prefill_queue",
         "tandem_prefill_stage_seconds:finish": "prefill_finish",
         "tandem_prefill_stage_seconds:commit": "prefill_commit",
         "tandem_gateway_worker_call_seconds:reserve": "gw_reserve",
         "tandem_gateway_worker_call_seconds:prefill": "gw_prefill",
         "tandem_gateway_worker_call_seconds:first_chunk": "gw_first_chunk"}


def scrape_all(ports: dict[str, int]) -> dict[str, dict[str, float]]:
    """`scrape` of every process in `ports` (metrics_ports)."""
    return {w: scrape(p) for w, p in ports.items()}


def stage_means(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """"process stage" -> mean ms between two `scrape_all`s (engine steps, the prefill worker's
    stages, the gateway's worker calls), each process's turn wait and device idle time
    (tandem_engine_device_idle_seconds) per engine step, and how many of its gaps between steps
    were longer than 1 ms per 1,000 steps (`long_idle_gaps_per_1k_steps`) with their mean
    (`long_idle_gap_mean`: idle time less 50 µs for each short gap, over the long ones; an upper bound)."""
    out = {}
    for w in after:
        means = means_ms(before[w], after[w])
        for key, (ms, _count) in means.items():
            out[f"{w} {SHORT.get(key, key)}"] = round(ms, 3)
        steps = means.get("tandem_engine_step_seconds", (0.0, 0))[1]
        for key, name in (("turn_wait_seconds", "turn_wait_per_step"), ("device_idle_seconds", "device_idle_per_step")):
            spent = after[w].get(key, 0.0) - before[w].get(key, 0.0)
            if steps and spent:
                out[f"{w} {name}"] = round(spent / steps * 1e3, 3)
        gaps = after[w].get("device_idle_gaps", 0.0) - before[w].get("device_idle_gaps", 0.0)
        short = after[w].get("device_idle_short_gaps", 0.0) - before[w].get("device_idle_short_gaps", 0.0)
        if steps and gaps:
            long_gaps = gaps - short
            out[f"{w} long_idle_gaps_per_1k_steps"] = round(long_gaps / steps * 1e3, 2)
            if long_gaps:
                idle = after[w]["device_idle_seconds"] - before[w].get("device_idle_seconds", 0.0)
                out[f"{w} long_idle_gap_mean"] = round(max(0.0, idle - short * 50e-6) / long_gaps * 1e3, 3)
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def closed_loop(target: str, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    """`concurrency` greedy streams in flight until every prompt is served; per-token client timings."""
    from tandem import AsyncClient

    ttft: list[float] = []
    itl: list[float] = []
    todo = list(prompts)
    async with AsyncClient(target, timeout=600) as client:
        async def worker() -> None:
            while todo:
                prompt = todo.pop()
                t0 = last = time.perf_counter()
                first = True
                async for chunk in client.stream(prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True,
                                                 stream_interval=1):
                    if not chunk.token_ids:
                        continue
                    now = time.perf_counter()
                    if first:
                        ttft.append(now - t0)
                        first = False
                    else:
                        itl.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
                    last = now

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t
    return {"ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_mean_ms": statistics.fmean(ttft) * 1e3,
            "itl_p50_ms": pct(itl, 0.5) * 1e3, "itl_mean_ms": statistics.fmean(itl) * 1e3,
            "seconds": seconds, "requests": len(ttft)}


class PromptPool:
    """Distinct random prompts, each handed out once (a prompt seen before would be a prefix-cache
    hit, and its prefill would not be measured)."""

    def __init__(self, model_dir: Path, count: int, length: int) -> None:

        self._prompts = up_bench.make_prompts(count, length, up_bench.vocab_size(model_dir))

    def take(self, n: int) -> list[list[int]]:
        if n > len(self._prompts):
            raise RuntimeError(f"prompt pool exhausted: {n} wanted, {len(self._prompts)} left")
        out, self._prompts = self._prompts[:n], self._prompts[n:]
        return out


def level_requests(c: int, requests: int | None) -> int:
    return requests or max(16, 2 * c)


def serve(model_dir: Path, mode: str, levels: list[int], requests: int | None, pool: PromptPool, output_len: int,
          log_dir: Path, up_args: list[str]) -> list[dict]:
    from entrypoints.cluster import free_port

    port = free_port()
    extra = (["--colocated"] if mode == "colocated" else []) + ["--no-agent", *up_args]
    proc, banner, _ = up_bench.start_up(model_dir, port, log_dir / mode, extra)
    rows = []
    try:
        ports = metrics_ports(banner)
        target = f"127.0.0.1:{port}"
        asyncio.run(closed_loop(target, pool.take(2), 2, 8))  # warm-up
        for c in levels:
            n = level_requests(c, requests)
            prompts = pool.take(n)
            before = {w: scrape(p) for w, p in ports.items()}
            client = asyncio.run(closed_loop(target, prompts, c, output_len))
            after = {w: scrape(p) for w, p in ports.items()}
            row = {"mode": mode, "concurrency": c, **client}
            for w in ports:
                kind = "gateway" if w == "gateway" else "prefill" if w.startswith("prefill") else "decode"
                for key, (ms, count) in means_ms(before[w], after[w]).items():
                    name = SHORT.get(key, key)
                    if name == "step":
                        row[f"{kind}_steps"] = count
                        name = f"{kind}_step"
                    row[f"{name}_mean_ms"] = ms
                if kind == "decode" and row.get("decode_steps"):
                    waited = after[w]["turn_wait_seconds"] - before[w]["turn_wait_seconds"]
                    row["decode_turn_wait_ms_per_step"] = waited / row["decode_steps"] * 1e3
                sent = after[w]["kv_bytes"] - before[w]["kv_bytes"]
                if sent:
                    row["kv_ms_per_request"] = (after[w]["kv_seconds"] - before[w]["kv_seconds"]) / n * 1e3
                    row["kv_GBps"] = sent / max(after[w]["kv_seconds"] - before[w]["kv_seconds"], 1e-9) / 1e9
            if row.get("decode_step_mean_ms") is not None:
                row["outside_step_ms"] = row["itl_mean_ms"] - row["decode_step_mean_ms"]
            rows.append({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        up_bench.stop(proc)
    return rows


def offline(model_dir: Path, levels: list[int], pool: PromptPool, output_len: int) -> list[dict]:
    """The engine alone: ms per decode step with C sequences of `input_len`, and one prompt's prefill."""
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), load_format="dummy")
    eng = llm.engine
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    eng.admit(pool.take(1)[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    while eng.has_unfinished():
        eng.step()
    params = SamplingParams(max_tokens=output_len + 8, temperature=0.0, ignore_eos=True)
    for c in levels:
        prompts = pool.take(c)
        sync()
        t = time.perf_counter()
        eng.admit(prompts[0], params)
        while not any(eng.step()):  # the lone prompt's first token
            pass
        sync()
        prefill_ms = (time.perf_counter() - t) * 1e3
        for p in prompts[1:c]:
            eng.admit(p, params)
        for _ in range(8):  # every prompt computed, graphs warm
            eng.step()
        sync()
        steps = max(8, output_len - 16)
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        rows.append({"mode": "offline", "concurrency": c, "prefill_ms": round(prefill_ms, 3),
                     "step_ms": round((time.perf_counter() - t) / steps * 1e3, 3)})
        print(json.dumps(rows[-1]), flush=True)
        for rid in eng.request_ids():
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
    del llm, eng
    if cuda:
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    up_bench.add_model_source(p)
    p.add_argument("--modes", default="disagg,colocated", help="comma list of disagg, colocated")
    p.add_argument("--concurrency", default="1,4,16", help="comma list of stream counts")
    p.add_argument("--requests", type=int, default=None, help="requests per level (default max(16, 2C): one stream's lone-prompt figures vary by ~10 ms between 8-request runs)")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--no-offline", action="store_true", help="skip the offline engine's reference rows")
    p.add_argument("--up-args", default="", help="more `tandem up` flags, space-separated")
    p.add_argument("--out", default=None, help="write the JSON rows here too")
    a = p.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in ("disagg", "colocated") for m in modes):
        p.error(f"--modes: expected a comma list of disagg, colocated; got {a.modes!r}")
    try:
        levels = [int(x) for x in a.concurrency.split(",") if x]
    except ValueError:
        p.error(f"--concurrency: expected a comma list of integers, got {a.concurrency!r}")
    for flag, v in (("--input-len", a.input_len), ("--output-len", a.output_len), ("--requests", a.requests or 1),
                    *(("--concurrency", c) for c in levels)):
        if v < 1:
            p.error(f"{flag}: must be >= 1, got {v}")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="step-gaps-") as tmp:
        model_dir = up_bench.model_source(a, Path(tmp))
        served = sum(level_requests(c, a.requests) for c in levels)
        pool = PromptPool(model_dir, len(modes) * (2 + served) + 1 + sum(levels), a.input_len)
        for mode in modes:
            rows += serve(model_dir, mode, levels, a.requests, pool, a.output_len, Path(tmp) / "logs",
                          a.up_args.split())
        if not a.no_offline:
            rows += offline(model_dir, levels, pool, a.output_len)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

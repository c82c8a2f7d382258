"""Where an offline run's time goes, step by step: prefill-carrying steps vs pure decode steps.

    python3 bench/offline_timeline.py --num-prompts 1000 [--kv-cache-dtype fp8] [--quantization fp8] [--out FILE]

Runs the offline workload (Llama-3.1-8B shape, dummy bf16 weights, random 1024-token prompts,
1024 output tokens, EOS ignored; max_running derived as `LLM` derives it unless given) and
records, for every engine step, the prefill tokens and the decode sequences it scheduled and the
wall time to the next step. With overlapped steps a step's time is the time between two
schedules, which is what the run spends per step. Decode-only steps are also reported by batch
size (buckets of 64 sequences), which shows what the waves of equal-length requests cost.
`end` splits the time after the last step's schedule: the rest of that step (its samples), and
what `generate` does after the loop (every request's text and outputs), with the functions that
took the latter (a profile of it alone); `gc` counts the run's garbage collections by generation
and what they took (a full collection walks the whole heap, stopping the host meanwhile).

    --profile-steps 20:3,1000:3 --profile-dir DIR

profiles those windows of the run's steps in place (worker.step_profiler.StepProfiler: a Chrome
trace per window, each step a `tandem_step` range that bench/trace_steps.py reads), so the
overlapped steps' device gaps are seen as the run has them. The profiled steps run slower.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def main() -> int:
    from bench.h200_bench import LLAMA31_8B, write_model
    from engine import LLM, SamplingParams
    from engine.outputs import StepObserver
    from worker.step_profiler import StepProfiler, parse_steps

    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--in-len", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=1024)
    p.add_argument("--max-running", type=int, default=None, help="default: derived, as LLM's")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights, quantized at load")
    p.add_argument("--out", default=None)
    p.add_argument("--profile-steps", default=None, metavar="START:COUNT[,START:COUNT]",
                   help="profile these windows of the run's steps (0 is its first step)")
    p.add_argument("--profile-dir", default="step_profiles", help="where --profile-steps writes its traces")
    a = p.parse_args()
    windows = [parse_steps(w) for w in a.profile_steps.split(",")] if a.profile_steps else []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "llama31-8b", LLAMA31_8B)
        llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_running=a.max_running,
                  max_model_len=a.in_len + a.out_len + 16, max_batched_tokens=8192, kv_cache_dtype=a.kv_cache_dtype,
                  enable_prefix_cache=False, quantization=a.quantization)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 128000, (a.num_prompts, a.in_len), generator=g).tolist()
    params = SamplingParams(max_tokens=a.out_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], params.replace(max_tokens=8))

    steps: list[tuple[float, int, int]] = []  # (schedule time, prefill tokens, decode seqs)

    class Timeline(StepObserver):
        def on_schedule(self, plan, seconds: float) -> None:
            decode = plan.num_decode_requests()
            steps.append((time.perf_counter(), plan.num_tokens - decode, decode))

    llm.engine.observer = Timeline()
    step_ends: list[float] = []
    run_step = llm.engine.step
    profilers = [StepProfiler(a.profile_dir, "offline", start, count) for start, count in windows]

    def step(*args, **kwargs):
        for prof in profilers:
            prof.before_step()
        try:
            return run_step(*args, **kwargs)
        finally:
            for prof in profilers:
                prof.after_step()
            step_ends.append(time.perf_counter())

    llm.engine.step = step
    after_loop = cProfile.Profile()
    has_unfinished = llm.engine.has_unfinished

    def unfinished() -> bool:  # the loop's last check starts the profile of what follows it
        more = has_unfinished()
        if not more:
            after_loop.enable()
        return more

    llm.engine.has_unfinished = unfinished
    collections: list[tuple[int, float]] = []  # (generation, seconds)

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            on_gc.t = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - on_gc.t))

    gc.callbacks.append(on_gc)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    total = time.perf_counter() - t0
    after_loop.disable()
    gc.callbacks.remove(on_gc)
    llm.engine.step, llm.engine.has_unfinished = run_step, has_unfinished
    for prof in profilers:
        prof.close()
    n_out = sum(len(o.token_ids) for o in outs)
    ends = [t for t, _, _ in steps[1:]] + [t0 + total]
    by: dict[str, dict] = defaultdict(lambda: {"steps": 0, "seconds": 0.0, "prefill_tokens": 0, "decode_tokens": 0})
    by_batch: dict[str, dict] = defaultdict(lambda: {"steps": 0, "seconds": 0.0, "prefill_tokens": 0, "decode_tokens": 0})
    for (t, pre, dec), end in zip(steps, ends):
        kind = "mixed" if pre and dec else "prefill_only" if pre else "decode_only" if dec else "empty"
        buckets = [by[kind]]
        if kind == "decode_only":
            low = (dec - 1) // 64 * 64 + 1
            buckets.append(by_batch[f"{low:03d}-{low + 63}"])
        for b in buckets:
            b["steps"] += 1
            b["seconds"] += end - t
            b["prefill_tokens"] += pre
            b["decode_tokens"] += dec
    for b in [*by.values(), *by_batch.values()]:
        b["seconds"] = round(b["seconds"], 2)
        b["ms_per_step"] = round(b["seconds"] / max(1, b["steps"]) * 1e3, 2)
        b["mean_decode_batch"] = round(b["decode_tokens"] / max(1, b["steps"]), 1)
    res = {"prompts": a.num_prompts, "kv_cache_dtype": a.kv_cache_dtype, "quantization": a.quantization,
           "max_running": llm.engine.max_running, "kv_blocks": llm.engine.num_total_blocks,
           "seconds": round(total, 2),
           "output_tok_s": round(n_out / total, 1), "before_first_step_s": round(steps[0][0] - t0, 2) if steps else None,
           "end": {"last_step_s": round(step_ends[-1] - steps[-1][0], 3) if steps else None,
                   "after_last_step_s": round(t0 + total - step_ends[-1], 3) if step_ends else None,
                   "after_loop_profile": _top_functions(after_loop, 12)},
           "gc": _collections(collections),
           "by_step_kind": dict(by), "decode_only_by_batch": dict(sorted(by_batch.items())),
           "profiles": [str(f) for prof in profilers for f in prof.written]}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


def _top_functions(prof: cProfile.Profile, n: int) -> list[str]:
    """The `n` functions with the most cumulative time in `prof`, as pstats prints them."""
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(n)
    return [line.strip() for line in out.getvalue().splitlines() if line.strip()][-n:]


def _collections(collections: list[tuple[int, float]]) -> dict:
    """Per generation: how many collections, their seconds in all and the longest."""
    by: dict[int, list[float]] = defaultdict(list)
    for generation, seconds in collections:
        by[generation].append(seconds)
    return {f"gen{g}": {"count": len(s), "seconds": round(sum(s), 3), "max_s": round(max(s), 4)}
            for g, s in sorted(by.items())}


if __name__ == "__main__":
    raise SystemExit(main())

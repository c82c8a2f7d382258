"""Where an offline run's time goes, step by step: prefill-carrying steps vs pure decode steps.

    python3 bench/offline_timeline.py --num-prompts 1000 [--kv-cache-dtype fp8] [--quantization fp8] [--out FILE]

Runs the offline workload (Llama-3.1-8B shape, dummy bf16 weights, random 1024-token prompts,
1024 output tokens, EOS ignored; max_running derived as `LLM` derives it unless given) and
records, for every engine step, the prefill tokens and the decode sequences it scheduled and the
wall time to the next step. With overlapped steps a step's time is the time between two
schedules, which is what the run spends per step. Decode-only steps are also reported by batch
size (buckets of 64 sequences), which shows what the waves of equal-length requests cost.
"""
from __future__ import annotations

import argparse
import json
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

    p = argparse.ArgumentParser()
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--in-len", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=1024)
    p.add_argument("--max-running", type=int, default=None, help="default: derived, as LLM's")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights, quantized at load")
    p.add_argument("--out", default=None)
    a = p.parse_args()
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
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    total = time.perf_counter() - t0
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
           "by_step_kind": dict(by), "decode_only_by_batch": dict(sorted(by_batch.items()))}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

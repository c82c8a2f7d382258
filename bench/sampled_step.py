"""Decode steps with sampled rows against greedy ones, at a few batch sizes: what a sampled row
costs a step, and how long the device waits for the host between steps.

    python bench/sampled_step.py [--batch 1,64,256] [--ctx 1024] [--steps 100] [--variants greedy,sampled] [--out FILE]
    python bench/sampled_step.py --engine-root OLD_CHECKOUT    # the same against another tree's engine

Llama-3.1-8B shape, dummy bf16 weights. For each batch size, `batch` sequences are prefilled to
`--ctx` tokens and `--steps` decode steps are timed (wall ms a step, after 5 untimed), once with
greedy rows (temperature 0), with the OpenAI API's defaults for a sampled request
(temperature 1, top_p 1), with temperature 0.8, top_p 0.95, with top_k 50 and top_p 0.9,
with min_p 0.05, with a seed (each row's noise
drawn from its own generator at its position), greedy with min_tokens, and with repetition and
frequency penalties (the prompt's and outputs' tokens uploaded each step). Where the engine can
(`Engine.measure_device_idle`), the device's idle time between steps is reported per step.
`--engine-root` puts another checkout's packages first on the path (this script's own helpers
are self-contained), so a change to the step's host path is measured before and after in one run.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0},
            "top_p": {"temperature": 0.8, "top_p": 0.95}, "top_k_top_p": {"temperature": 0.7, "top_k": 50, "top_p": 0.9},
            "min_p": {"temperature": 1.0, "min_p": 0.05}, "seeded": {"temperature": 1.0, "seed": 1234},
            "min_tokens": {"temperature": 0.0, "min_tokens": "max_tokens"},  # EOS masked throughout
            "penalties": {"temperature": 0.8, "repetition_penalty": 1.1, "frequency_penalty": 0.3}}


def time_steps(model_dir: Path, batch: int, ctx: int, steps: int, sampling: dict) -> dict:
    import torch

    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_running=batch,
              max_model_len=ctx + steps + 64, num_kv_blocks=batch * (-(-(ctx + steps + 64) // 16)) + 64)
    eng = llm.engine
    max_tokens = steps + 32
    sampling = {k: max_tokens if v == "max_tokens" else v for k, v in sampling.items()}
    for i in range(batch):
        eng.admit([(7 * i + j) % 1000 + 300 for j in range(ctx)],
                  SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))
    while eng.stats().waiting or eng.stats().queued_prefill_tokens:
        eng.step()
    for _ in range(5):
        eng.step()
    clock = eng.measure_device_idle() if hasattr(eng, "measure_device_idle") else None
    torch.cuda.synchronize()
    if clock is not None:
        clock.take()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t) / steps
    row = {"ms_per_step": round(per_step * 1e3, 3)}
    if clock is not None:
        idle, gaps = clock.take()
        row["device_idle_ms_per_step"] = round(idle * 1e3 / max(gaps, 1), 4)
    for request_id in eng.request_ids():
        eng.abort(request_id)
    del llm, eng
    torch.cuda.empty_cache()
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", default="1,64,256")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--engine-root", default=None, help="a checkout whose engine is measured (default: this one)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants: expected some of {', '.join(VARIANTS)}, got {a.variants!r}")
    root = Path(a.engine_root).resolve() if a.engine_root else Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    here = Path(__file__).resolve().parents[1]
    sys.path.insert(1, str(here))
    from bench.h200_bench import LLAMA31_8B, write_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "llama31-8b", LLAMA31_8B)
        for batch in (int(b) for b in a.batch.split(",")):
            for name in variants:
                sampling = VARIANTS[name]
                row = {"batch": batch, "ctx": a.ctx, "variant": name, **time_steps(model_dir, batch, a.ctx, a.steps, sampling)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    result = {"command": " ".join(sys.argv), "engine_root": str(root), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

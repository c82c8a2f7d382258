"""The offline engine's host work per decode step at a batch size: what the engine thread spends
besides the model, phase by phase, on a tiny random model (on the CPU the model's forward is
timed and set aside; the rest is the host work a GPU step must hide behind its kernels).

    python3 bench/engine_host_cost.py --batch 384 [--ctx 64] [--steps 30] [--rounds 3] [--no-prefix-cache]

Each row: milliseconds a step of schedule, prepare (model_runner.prepare: inputs, slots, block
tables), rows (the sampler's per-row parameters), sample (Sampler.launch on the logits),
process (Engine._process_samples: appending tokens, stop checks), postprocess (the scheduler's
bookkeeping, with the prefix cache's inserts unless --no-prefix-cache), the model's forward and
logits, and `host`: the whole step less forward and logits.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.step_profile import SchedulerPhases, timed  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.demo import make_random_model  # noqa: E402


def measure(model_dir: str, batch: int, ctx: int, steps: int, rounds: int, prefix_cache: bool = True) -> list[dict]:
    # Room for the tokens the early sequences decode while the later ones are still prefilling.
    max_len = 2 * ctx + steps * (rounds + 1) + 64
    llm = LLM(model_dir, max_running=batch, num_kv_blocks=batch * (-(-max_len // 16) + 1), max_model_len=max_len,
              enable_prefix_cache=prefix_cache, max_batched_tokens=max(2048, batch))
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    vocab = eng.model_config.vocab_size
    for p in torch.randint(3, vocab, (batch, ctx), generator=g).tolist():
        eng.admit(p, SamplingParams(max_tokens=max_len - ctx, temperature=0, ignore_eos=True))
    while eng.stats().queued_prefill_tokens:
        eng.step()
    eng.step()
    acc: dict[str, float] = defaultdict(float)
    eng.observer = SchedulerPhases(acc)
    runner = eng.runner
    for obj, name, key in ((runner, "prepare", "prepare"), (runner, "_rows", "rows"),
                           (runner.sampler, "launch", "sample"), (eng, "_process_samples", "process"),
                           (runner.model, "forward", "forward"), (runner.model, "logits", "logits")):
        timed(obj, name, acc, sync=False, key=key)
    rows = []
    for r in range(rounds):
        acc.clear()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        total = time.perf_counter() - t
        row = {"round": r, "batch": eng.stats().running, "ctx": ctx, "prefix_cache": prefix_cache,
               "device": str(eng.device)}
        row.update({k: round(v / steps * 1e3, 3) for k, v in sorted(acc.items())})
        row["step"] = round(total / steps * 1e3, 3)
        row["host"] = round((total - acc["forward"] - acc["logits"]) / steps * 1e3, 3)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=384)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-prefix-cache", action="store_true", help="as LLM(enable_prefix_cache=False)")
    ap.add_argument("--out")
    a = ap.parse_args()
    for name in ("batch", "ctx", "steps", "rounds"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}: must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        d = make_random_model(Path(tmp) / "tiny", "llama", hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=2 * a.ctx + a.steps * (a.rounds + 1) + 64)
        rows = measure(str(d), a.batch, a.ctx, a.steps, a.rounds, not a.no_prefix_cache)
    for row in rows:
        print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Throughput through gateway + prefill + decode processes vs the offline engine, in the same run.

    python bench/services_bench.py [--model DIR | --models stories,llama100m] [--concurrency 1,32]

For each model: the offline engine (engine.LLM) generates for the prompts; then `tandem up`
(1 prefill + 1 decode worker, or --colocated) serves the same prompts through the SDK at each
concurrency. Output tokens per second of wall time, and services / offline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from entrypoints.cluster import Cluster  # noqa: E402


def start_cluster(model: str, port: int, extra: list[str], log_dir: Path) -> Cluster:
    """The processes `tandem up` would start (its flags `extra`), once every one is healthy."""
    from entrypoints.launcher import build_children
    from entrypoints.up_flags import parse_args

    log_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(build_children(parse_args(["--model", model, "--port", str(port), *extra]), model, log_dir))
    cluster.start(timeout=300)
    return cluster


async def run_clients(target: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[int, float]:
    from tandem import AsyncClient

    sem = asyncio.Semaphore(concurrency)
    async with AsyncClient(target) as client:
        async def one(p):
            async with sem:
                out = await client.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                return len(out.token_ids)

        await one(prompts[0])  # warm-up
        t = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts), time.perf_counter() - t


def offline_tok_s(model: str, prompts: list[list[int]], max_tokens: int, load_format: str) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(model, load_format=load_format, max_running=64)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], params.replace(max_tokens=2))
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="stories,llama100m")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=50071)
    p.add_argument("--colocated", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch

    from bench.offline_bench import make_models

    results = {"cells": [], "requests": a.requests, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens,
               "mode": "colocated" if a.colocated else "disaggregated"}
    with tempfile.TemporaryDirectory() as tmp:
        models = make_models(Path(tmp), a.models.split(","))
        for name, path in models.items():
            g = torch.Generator().manual_seed(0)
            prompts = torch.randint(3, 256, (a.requests, a.prompt_len), generator=g).tolist()
            offline = offline_tok_s(str(path), prompts, a.max_tokens, "auto")
            cluster = start_cluster(str(path), a.port, ["--colocated"] if a.colocated else [], Path(tmp) / f"logs-{name}")
            try:
                for c in (int(x) for x in a.concurrency.split(",")):
                    n, dt = asyncio.run(run_clients(f"127.0.0.1:{a.port}", prompts, a.max_tokens, c))
                    cell = {"model": name, "concurrency": c, "services_tok_s": round(n / dt, 1),
                            "offline_tok_s": round(offline, 1), "ratio": round(n / dt / offline, 2)}
                    results["cells"].append(cell)
                    print(json.dumps(cell), flush=True)
            finally:
                cluster.stop(60)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

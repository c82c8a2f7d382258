"""Warm-up: the kinds of step a server meets, run on synthetic prompts before the first request
so that their kernels are compiled (Triton JIT, cuBLAS heuristics) when requests come."""
from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

import torch

from engine.cuda_graphs import time_each, timed_buckets_enabled
from tandem.types import SamplingParams

if TYPE_CHECKING:
    from engine.engine import Engine

logger = logging.getLogger(__name__)


def warm_up(engine: Engine) -> float:
    """Run one prefill, a prefill of several sequences next to running decodes, a prefill behind
    a cached prefix, and plain decodes on `engine`. Leaves no request behind. Returns the seconds
    it took. The prefill graphs (compiled when they were captured) are set aside meanwhile, so
    the eager path that steps no graph takes (more tokens, more sequences, mixed steps) compiles
    too: its token counts are not the graphs' multiples of 16, and Triton specializes on that.
    So is the scheduler's PrefillAlone rule, so that prompts and decodes share steps as they do
    under load."""
    runner = engine.runner
    graphs = runner.prefill_graphs if runner is not None else None
    alone, engine.prefill_alone = engine.prefill_alone, None  # the mixed steps must run too
    if graphs is not None:
        runner.prefill_graphs = None
    try:
        return _run(engine)
    finally:
        engine.prefill_alone = alone
        if graphs is not None:
            runner.prefill_graphs = graphs


def _run(engine: Engine) -> float:
    t0 = time.perf_counter()
    vocab = engine.model_config.vocab_size
    # Prompts fit the context and, all four at once, a quarter of the cache.
    room = max(4, min(engine.max_model_len - 8, 320, engine.allocator.num_total * engine.config.block_size // 4 - 16))
    long = room - room // 8

    def prompt(n: int, salt: int) -> list[int]:
        return [(salt + i * 7919) % (vocab - 1) + 1 for i in range(max(1, n))]

    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    ids = [f"warm-up-{uuid.uuid4().hex[:8]}-{i}" for i in range(6)]
    engine.admit(prompt(min(37, long), 1), params, ids[0])
    engine.step()  # one sequence's prefill; its decodes follow
    engine.admit(prompt(long, 2), params, ids[1])
    # Sampled and penalised requests: the sampling kernels over the model's logits and over
    # penalised float32 ones, and the greedy argmax over float32.
    engine.admit(prompt(min(17, long), 3), SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0,
                                                          top_p=0.95, seed=0), ids[2])
    engine.admit(prompt(min(19, long), 5), SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.8, top_k=20,
                                                          repetition_penalty=1.1), ids[4])
    engine.admit(prompt(min(23, long), 6), SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0,
                                                          frequency_penalty=0.5), ids[5])
    while engine.has_unfinished():  # several prefills beside a decode, then decodes
        engine.step()
    engine.admit(prompt(long, 2) + prompt(room // 8, 4), params, ids[3])  # behind a cached prefix
    while engine.has_unfinished():
        engine.step()
    _warm_logits(engine)
    seconds = time.perf_counter() - t0
    logger.info("warm-up steps ran in %.1f s", seconds)
    return seconds


def _warm_logits(engine: Engine) -> None:
    """The LM head at each of the runner's bucketed row counts (ModelRunner.bucket_logits), so
    that every kernel cuBLAS picks for them is loaded before serving, not in a step; where
    buckets are timed, each is timed and the fastest kept (ModelRunner.keep_fastest_logits)."""
    runner = engine.runner
    if runner is None or not runner.logits_buckets:
        return
    embed = runner.model.embed_tokens.weight
    with torch.inference_mode():
        hidden = torch.zeros(max(runner.logits_buckets), embed.shape[1], dtype=embed.dtype, device=embed.device)
        for rows in runner.logits_buckets:
            runner.model.logits(hidden[:rows])
        if embed.device.type == "cuda" and timed_buckets_enabled():
            before = list(runner.logits_buckets)
            times = time_each({rows: (lambda rows=rows: runner.model.logits(hidden[:rows])) for rows in before})
            kept = runner.keep_fastest_logits(times)
            if kept != before:
                logger.info("LM head row buckets kept %s of %s (ms: %s)", kept, before,
                            {b: round(t, 3) for b, t in sorted(times.items())})

"""The KV pool and max_running defaults (engine/memory.py) and the one-line error when one
request of max_model_len cannot fit. The GPU accounting itself runs in bench/up_bench.py."""
from __future__ import annotations

import pytest

from engine.memory import (EXPECTED_CONTEXT_TOKENS, MAX_RUNNING_CEILING_CPU, MAX_RUNNING_CEILING_CUDA,
                           MemoryPlan, default_max_running, derive_max_running, too_small)


def test_max_running_follows_the_pool_so_fp8_runs_twice_the_sequences() -> None:
    bf16_tokens = 100 * EXPECTED_CONTEXT_TOKENS
    bf16 = derive_max_running(bf16_tokens, 131072, "cuda")
    fp8 = derive_max_running(2 * bf16_tokens, 131072, "cuda")  # the same bytes hold twice the tokens
    assert bf16 == 100 and fp8 == 200
    assert derive_max_running(10**9, 131072, "cuda") == MAX_RUNNING_CEILING_CUDA
    assert derive_max_running(10**9, 512, "cpu") == MAX_RUNNING_CEILING_CPU
    assert derive_max_running(100, 4096, "cuda") == 1  # never zero
    assert derive_max_running(512 * 40, 512, "cuda") == 40  # a short context: more sequences


def test_explicit_values_win() -> None:
    assert default_max_running(7, None, 10**6, 16, 2048, "cuda") == 7
    assert default_max_running(None, 12, 12, 16, 2048, "cpu") == MAX_RUNNING_CEILING_CPU  # hand-sized pool
    assert default_max_running(None, None, 1600, 16, 2048, "cuda") == 12


def test_too_small_names_the_flags() -> None:
    plan = MemoryPlan(limit=40 * 2**30, weights=16 * 2**30, activations=2**30, graphs=2**29, sampler=2**29,
                      other=2**30)
    msg = too_small(plan, 100, 8192, 2**21, 0.3, 131072)
    assert msg.startswith("gpu_memory_fraction: --gpu-memory-fraction 0.3 leaves 21.00 GiB")
    assert "--max-model-len 131072 needs 16.00 GiB" in msg and "\n" not in msg


def test_engine_that_cannot_hold_one_request_says_so(tiny_models) -> None:
    from engine import Engine, EngineConfig

    cfg = EngineConfig(model_path=str(tiny_models["llama"]), cpu_kv_cache_gb=1e-6, device="cpu")
    with pytest.raises(ValueError, match=r"^max_model_len: one request of --max-model-len \d+ needs \d+ KV blocks"):
        Engine(cfg)
    engine = Engine(EngineConfig(model_path=str(tiny_models["llama"]), device="cpu"))
    assert engine.max_running >= 1 and engine.sched_config.max_running == engine.max_running
    pinned = Engine(EngineConfig(model_path=str(tiny_models["llama"]), device="cpu", max_running=3))
    assert pinned.max_running == 3


def test_the_planned_batch_is_the_fewest_rows_whose_pool_derives_no_more() -> None:
    """fitted_batch against a brute-force search, over pools that shrink with the rows planned
    (each row a sampler row's bytes), on fresh random sizes."""
    import random

    from engine.memory import derive_max_running, fitted_batch

    rng = random.Random()
    for _ in range(200):
        total, per_row = rng.randrange(0, 3_000_000), rng.randrange(0, 4000)
        context = rng.choice([512, 2048, 8192, 131072])
        pool = lambda b: max(0, total - b * per_row)  # noqa: E731
        got = fitted_batch(pool, context, 512)
        want = next(b for b in range(1, 513) if derive_max_running(pool(b), context, "cuda") <= b)
        assert got == want, (total, per_row, context)
        assert derive_max_running(pool(got), context, "cuda") <= got



@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_a_derived_max_running_plans_its_own_sampler_rows_not_the_ceilings(monkeypatch, fraction) -> None:
    """derive_num_blocks on a stand-in 80 GB GPU (its total memory and this process's
    allocations given; the step estimated, as a tensor-parallel rank's is): with max_running
    derived, the pool gains the sampler rows and graph batches the ceiling would have planned,
    (fitted_batch, tested above, keeps what it derives within the rows planned)."""
    import types

    import torch

    from bench.h200_bench import LLAMA31_8B
    from engine.config import EngineConfig, ModelConfig
    from engine.kv_cache import KVCache
    from engine.memory import SAMPLER_BYTES_PER_LOGIT, derive_num_blocks, estimate_step

    GiB = 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 15 * GiB)
    mc = ModelConfig.from_dict(LLAMA31_8B)
    block_bytes = KVCache.bytes_per_block(mc, 16, torch.bfloat16)

    def blocks(**kw) -> int:
        cfg = EngineConfig(model_path="unused", gpu_memory_fraction=fraction, **kw)
        return derive_num_blocks(cfg, None, mc, mc, torch.bfloat16, torch.bfloat16, torch.device("cuda"), False, 1,
                                 131072, block_bytes)

    derived, ceiling = blocks(), blocks(max_running=MAX_RUNNING_CEILING_CUDA)
    running = derive_max_running(derived * 16, 131072, "cuda")
    assert running < MAX_RUNNING_CEILING_CUDA
    gained = (derived - ceiling) * block_bytes
    # Its sampler's rows and its step's logits rows (estimate_step, as a tensor-parallel rank plans).
    per_row = mc.vocab_size * SAMPLER_BYTES_PER_LOGIT + estimate_step(mc, torch.bfloat16, 4096, 512).per_row
    assert gained >= (MAX_RUNNING_CEILING_CUDA - running) * per_row - block_bytes


def test_a_steps_peak_is_its_forward_or_its_held_tensors_and_sampled_rows() -> None:
    """StepActivations.peak: the larger of the forward's peak and what it holds plus the rows'
    logits; rows past the step's tokens sample nothing more."""
    from engine.memory import StepActivations

    step = StepActivations(num_tokens=4096, forward=1000, held=100, per_row=3, profiled_rows=512)
    assert step.peak(0) == 1000 and step.peak(300) == 1000  # the forward's peak dominates
    assert step.peak(301) == 100 + 301 * 3 and step.peak(512) == 1636
    assert step.peak(10**6) == 100 + 4096 * 3  # no more rows than tokens
    assert step.per_token == pytest.approx(1636 / 4096)  # the graphs' estimate, at the profiled rows

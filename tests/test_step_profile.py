"""bench/step_profile.py's device-idle arithmetic (the profile itself needs a GPU): the time
between a window's first and last device span that no span covers, per step."""
from __future__ import annotations

import random

from bench.step_profile import idle_ms


def brute_idle_us(spans: list[tuple[int, int]]) -> int:
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    covered = set()
    for a, b in spans:
        covered.update(range(a, b))
    return (hi - lo) - len(covered)


def test_idle_matches_a_unit_by_unit_count_on_random_spans():
    rng = random.Random(7)
    for _ in range(200):
        spans = []
        for _ in range(rng.randint(1, 12)):
            a = rng.randint(0, 3000)
            spans.append((a, a + rng.randint(1, 800)))
        steps = rng.randint(1, 4)
        assert idle_ms(spans, steps) == round(brute_idle_us(spans) / steps / 1e3, 3), spans


def test_gaps_overlaps_and_nothing():
    assert idle_ms([(0, 1000), (3000, 4000)], 1) == 2.0  # one 2 ms gap
    assert idle_ms([(0, 3000), (1000, 2000), (2500, 5000)], 1) == 0.0  # nested and overlapping
    assert idle_ms([(0, 1000), (1000, 2000), (4000, 6000)], 2) == 1.0  # 2 ms over 2 steps
    assert idle_ms([], 3) is None and idle_ms([(5, 5)], 1) is None  # no span with a length


def test_allocator_events_are_per_step_deltas():
    from bench.step_profile import _allocator_events

    before = {"num_alloc_retries": 2, "num_device_alloc": 10, "num_device_free": 1}
    after = {"num_alloc_retries": 8, "num_device_alloc": 10, "num_device_free": 4, "num_sync_all_streams": 3}
    assert _allocator_events(before, after, 3) == {"alloc_retries": 2.0, "device_mallocs": 0.0,
                                                   "device_frees": 1.0, "sync_all_streams": 1.0}


def test_decode_tuning_replaces_every_default_and_restores_them():
    import torch

    import tandem_kernels.decode_attention as da
    from bench.step_profile import decode_tuning

    fp8, wide, bf16 = da.FP8_TUNING, da.FP8_WIDE_TUNING, da.BF16_TUNING
    with decode_tuning('{"num_stages": 4, "defer_sum": true}'):
        for cache, was in ((torch.float8_e4m3fn, fp8), (torch.bfloat16, bf16)):
            got = da.default_tuning(cache)
            assert (got.num_stages, got.defer_sum) == (4, True)
            assert got.block_n == was.block_n and got.opaque_cvt == was.opaque_cvt  # the rest kept
        assert da.default_tuning(torch.float8_e4m3fn, 10**6, 1).num_stages == 4  # the wide batches' too
        for cache in (torch.float8_e4m3fn, torch.bfloat16):  # and the small batches' prefetching ones
            small = da.default_tuning(cache, 1, 132)
            assert small.prefetch and small.num_stages == 4
    assert da.default_tuning(torch.bfloat16, 1, 132) == da.BF16_PREFETCH_TUNING
    assert da.BF16_PREFETCH_TUNING.num_stages != 4 and da.FP8_PREFETCH_TUNING.num_stages != 4
    assert (da.FP8_TUNING, da.FP8_WIDE_TUNING, da.BF16_TUNING) == (fp8, wide, bf16)
    with decode_tuning(None):
        assert (da.FP8_TUNING, da.FP8_WIDE_TUNING, da.BF16_TUNING) == (fp8, wide, bf16)
    try:
        with decode_tuning('{"num_stages": 4}'):
            raise KeyError("inside")
    except KeyError:
        pass
    assert (da.FP8_TUNING, da.FP8_WIDE_TUNING, da.BF16_TUNING) == (fp8, wide, bf16)  # restored on the way out of an error


def test_kv_bytes_per_step_counts_every_running_context(tiny_models):
    from bench.step_profile import _kv_bytes_per_step
    from engine import LLM, SamplingParams

    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_running=8, overlap_schedule=False)
    eng = llm.engine
    cfg = eng.model_config
    lens = [5, 9, 17]
    for n in lens:
        eng.admit(list(range(3, 3 + n)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for _ in range(3):  # the prompts, then two decode steps: each context grows by one a step
        eng.step()
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, fp32
    assert _kv_bytes_per_step(eng) == sum(n + 2 for n in lens) * per_token

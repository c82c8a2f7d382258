"""Which decode-graph buckets an engine keeps (engine/cuda_graphs.py): the candidates above the batch
cap, the rule that drops a bucket slower than a larger one, and the switch that turns both off.
The replay timing itself runs on a GPU (bench/h200_bench.py gpu_parity replays the kept graphs)."""
from __future__ import annotations

import random

import pytest

from engine.cuda_graphs import (DEFAULT_BUCKETS, MAX_GRAPH_BATCH, TIMED_BUCKETS_ENV, fastest_buckets, smallest_bucket,
                                spare_buckets, throughput_cap, timed_buckets_enabled)


def test_spare_buckets_reach_the_next_power_of_two():
    assert spare_buckets(419) == [448, 512]
    assert spare_buckets(512) == []
    assert spare_buckets(100) == [128]
    assert spare_buckets(1) == [] and spare_buckets(3) == [4]
    assert spare_buckets(700) == [768, 896, 1024]
    assert spare_buckets(MAX_GRAPH_BATCH) == []
    assert all(b <= MAX_GRAPH_BATCH for m in range(1, MAX_GRAPH_BATCH + 1) for b in spare_buckets(m))


def test_a_bucket_slower_than_a_larger_one_is_dropped():
    # §17's shape: the GEMMs at 448 rows far slower than at 384 or 512; 419 (the cap) slow too.
    times = {256: 6.0, 320: 7.0, 384: 8.0, 419: 11.0, 448: 12.5, 512: 9.4}
    kept = fastest_buckets(times, 419)
    assert kept == [256, 320, 384, 512]
    assert smallest_bucket(kept, 400) == 512 and smallest_bucket(kept, 300) == 320


def test_spares_above_the_cap_are_dropped_when_the_cap_is_fastest():
    times = {384: 8.0, 419: 8.6, 448: 12.5, 512: 9.4}
    assert fastest_buckets(times, 419) == [384, 419]
    assert fastest_buckets({384: 8.0, 419: 9.5, 448: 12.5, 512: 9.4}, 419) == [384, 419]  # within 2%


def test_within_the_margin_the_smaller_bucket_stays():
    # A larger bucket must be faster by more than 2% to take a smaller one's batches: less is noise.
    assert fastest_buckets({4: 4.50, 8: 4.49}, 8) == [4, 8]
    assert fastest_buckets({4: 4.50, 8: 4.46}, 8) == [4, 8]
    assert fastest_buckets({4: 4.50, 8: 4.40}, 8) == [8]
    assert fastest_buckets({4: 4.30, 8: 4.40}, 8) == [4, 8]


def test_kept_buckets_hold_every_batch_at_its_fastest_replay():
    rng = random.Random(7)
    for _ in range(200):
        cap = rng.randint(1, 600)
        candidates = sorted({b for b in DEFAULT_BUCKETS if b <= cap} | {cap} | set(spare_buckets(cap)))
        times = {b: rng.uniform(1.0, 10.0) for b in candidates}
        kept = fastest_buckets(times, cap, margin=0.0)
        assert kept and smallest_bucket(kept, cap) == kept[-1]
        for n in range(1, cap + 1):
            chosen = smallest_bucket(kept, n)
            assert times[chosen] == min(t for b, t in times.items() if b >= n), (cap, n)


def test_no_bucket_holds_the_cap():
    with pytest.raises(ValueError, match="largest batch 64"):
        fastest_buckets({8: 1.0, 32: 2.0}, 64)


def test_the_switch(monkeypatch):
    monkeypatch.delenv(TIMED_BUCKETS_ENV, raising=False)
    assert timed_buckets_enabled()
    monkeypatch.setenv(TIMED_BUCKETS_ENV, "0")
    assert not timed_buckets_enabled()
    monkeypatch.setenv(TIMED_BUCKETS_ENV, "yes")
    with pytest.raises(ValueError, match=TIMED_BUCKETS_ENV):
        timed_buckets_enabled()


# Replay times (ms) the H200 measured (BENCHMARKS.md §27): bf16 weights and KV at the derived
# max_running 419; FP8 KV (bf16 weights) and FP8 weights + KV at 512.
BF16_419 = {256: 6.528, 320: 7.746, 384: 8.507, 419: 9.865, 448: 14.515, 512: 10.972}
FP8KV_512 = {256: 6.466, 320: 7.706, 384: 8.651, 448: 14.663, 512: 11.302}
FP8_512 = {256: 4.985, 320: 6.029, 384: 6.302, 448: 7.282, 512: 6.984}


def test_throughput_cap_lowers_a_cap_a_smaller_bucket_decodes_faster_a_row():
    """bf16 at 419: 384 rows replay at 45.1 rows a ms against 419's 42.5 (+6%): the cap goes to
    384 (the offline run measured +2.6% there). FP8 at 512 keeps its cap: nothing smaller is
    faster a row."""
    kept = fastest_buckets(BF16_419, 419)
    assert throughput_cap(BF16_419, kept, 419) == 384
    assert throughput_cap(FP8KV_512, fastest_buckets(FP8KV_512, 512), 512) == 512
    assert throughput_cap(FP8_512, fastest_buckets(FP8_512, 512), 512) == 512


def test_throughput_cap_keeps_the_cap_within_the_margin_and_above_the_floor():
    # 256 a hair faster a row than 257 (noise): the cap stays.
    assert throughput_cap({224: 6.31, 256: 6.53, 257: 6.56}, [224, 256, 257], 257) == 257
    # A bucket far below the cap is never taken, however fast a row (concurrency is worth more).
    assert throughput_cap({128: 1.0, 419: 9.9}, [128, 419], 419) == 419
    assert throughput_cap({128: 1.0, 419: 9.9}, [128, 419], 419, floor=0.25) == 128
    # A batch cap that replays a larger bucket is rated by that bucket's time.
    assert throughput_cap({384: 8.5, 512: 11.0}, [384, 512], 419) == 384  # 45.2 vs 419 / 11.0 = 38.1
    assert throughput_cap({}, [], 419) == 419  # not timed


def test_an_engine_runs_no_more_than_its_lowered_cap():
    """Engine.lower_max_running: the scheduler admits no more than the new cap; a cap at or above
    max_running changes nothing."""
    import tempfile
    from pathlib import Path

    from engine import LLM, SamplingParams
    from engine.demo import make_random_model

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(make_random_model(Path(tmp) / "m", "llama", seed=3), num_kv_blocks=64, max_running=8)
        eng = llm.engine
        eng.lower_max_running(8)
        assert eng.max_running == 8
        eng.lower_max_running(3)
        assert eng.max_running == 3 and eng.sched_config.max_running == 3
        for i in range(6):
            eng.admit(list(range(10 + i, 20 + i)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        running = 0
        while eng.has_unfinished():
            eng.step()
            running = max(running, eng.stats().running)
        assert running == 3

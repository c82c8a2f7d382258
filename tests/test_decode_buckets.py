"""Which decode-graph buckets an engine keeps (engine/cuda_graphs.py): the candidates above the batch
cap, the rule that drops a bucket slower than a larger one, and the switch that turns both off.
The replay timing itself runs on a GPU (bench/h200_bench.py gpu_parity replays the kept graphs)."""
from __future__ import annotations

import random

import pytest

from engine.cuda_graphs import (DEFAULT_BUCKETS, MAX_GRAPH_BATCH, TIMED_BUCKETS_ENV, fastest_buckets, smallest_bucket,
                                spare_buckets, timed_buckets_enabled)


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

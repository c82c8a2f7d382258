"""bench/kernel_bench.py's paged KV fixture (the sweeps themselves need a GPU): both block orders
give each sequence distinct blocks of its own covering its tokens; sequential order lays each
sequence's blocks side by side, random order scatters them; an unknown order names the argument.
And the decode sweep's spread contexts (a running batch, oldest first)."""
from __future__ import annotations

import pytest
import torch

from bench.kernel_bench import Shapes, paged_kv, spread_lens


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_each_sequence_gets_its_own_blocks(order):
    s = Shapes(hk=2, d=16, block_size=16)
    lens = [100, 33, 16, 257]
    kc, vc, table, cl = paged_kv(lens, s, torch.float32, "cpu", order=order)
    assert cl.tolist() == lens and kc.shape == vc.shape and kc.shape[1:] == (16, 2, 16)
    used = []
    for row, n in zip(table.tolist(), lens):
        blocks = row[: -(-n // s.block_size)]
        used += blocks
        if order == "sequential":
            assert blocks == list(range(blocks[0], blocks[0] + len(blocks)))
    assert len(set(used)) == len(used) and all(0 <= b < kc.shape[0] for b in used)
    if order == "random":
        torch.manual_seed(0)
        _, _, t, _ = paged_kv([16 * 64], s, torch.float32, "cpu", order=order)
        assert t[0].tolist() != sorted(t[0].tolist())  # 64 blocks in ascending order by chance: 1/64!


def test_unknown_order_names_the_argument():
    with pytest.raises(ValueError, match="order"):
        paged_kv([4], Shapes(), torch.float32, "cpu", order="striped")


@pytest.mark.parametrize("ctx, batch, spread", [(1536, 512, 1 / 3), (1000, 7, 0.5), (64, 2, 0.9)])
def test_spread_contexts_fall_evenly_around_the_mean(ctx, batch, spread):
    lens = spread_lens(ctx, batch, spread)
    assert len(lens) == batch and lens == sorted(lens, reverse=True)
    assert lens[0] == round(ctx * (1 + spread)) and lens[-1] == max(1, round(ctx * (1 - spread)))
    assert abs(sum(lens) / batch - ctx) <= 1
    steps = {a - b for a, b in zip(lens, lens[1:])}
    assert max(steps) - min(steps) <= 1  # evenly spaced, up to rounding


def test_no_spread_and_a_bad_spread():
    assert spread_lens(1024, 5, 0.0) == [1024] * 5 and spread_lens(1024, 1, 0.5) == [1024]
    with pytest.raises(ValueError, match="spread"):
        spread_lens(1024, 4, 1.0)

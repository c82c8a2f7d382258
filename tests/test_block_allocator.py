"""Tests for the reference-counted KV block allocator."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_allocator import BlockAllocator, OutOfBlocks


def test_allocate_gives_distinct_blocks_with_refcount_one() -> None:
    alloc = BlockAllocator(8)
    assert (alloc.num_total, alloc.num_free) == (8, 8)
    got = alloc.allocate(5)
    assert len(got) == len(set(got)) == 5
    assert all(0 <= b < 8 for b in got)
    assert all(alloc.refcount(b) == 1 for b in got)
    assert alloc.num_free == 3 and alloc.num_used == 5
    rest = alloc.allocate(3)
    assert set(got) | set(rest) == set(range(8))
    assert alloc.allocate(0) == []


def test_out_of_blocks_allocates_nothing() -> None:
    alloc = BlockAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfBlocks) as info:
        alloc.allocate(2)
    assert (info.value.requested, info.value.free) == (2, 1)
    assert alloc.num_free == 1
    assert len(alloc.allocate(1)) == 1


def test_refcounts_and_release_to_free_list() -> None:
    alloc = BlockAllocator(4)
    a, b = alloc.allocate(2)
    alloc.incref([a, a, b])
    assert (alloc.refcount(a), alloc.refcount(b)) == (3, 2)
    alloc.decref([a, b])
    assert alloc.num_free == 2
    alloc.decref([b])
    assert alloc.refcount(b) == 0 and alloc.num_free == 3
    # LIFO: the block freed last is handed out first.
    assert alloc.allocate(1) == [b]
    alloc.decref([a, a])
    assert alloc.refcount(a) == 0


def test_decref_of_free_block_raises_and_changes_nothing() -> None:
    alloc = BlockAllocator(4)
    (a,) = alloc.allocate(1)
    free_block = next(x for x in range(4) if x != a)
    with pytest.raises(ValueError, match="free"):
        alloc.decref([a, free_block])
    assert alloc.refcount(a) == 1
    with pytest.raises(ValueError, match="refcount"):
        alloc.decref([a, a])
    assert alloc.refcount(a) == 1 and alloc.num_free == 3
    with pytest.raises(ValueError, match="free"):
        alloc.incref([free_block])


@pytest.mark.parametrize("bad", [-1, 4, 1.0, True, "1"])
def test_bad_block_ids_raise(bad: object) -> None:
    alloc = BlockAllocator(4)
    with pytest.raises(ValueError, match="block_id"):
        alloc.refcount(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_id"):
        alloc.decref([bad])  # type: ignore[list-item]


@pytest.mark.parametrize("bad", [0, -3, 2.5, None])
def test_bad_sizes_raise(bad: object) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must"):
        BlockAllocator(2).allocate(-1 if bad == 0 else bad)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 5), st.integers(0, 10**6))))
def test_random_operations_match_a_model(ops: list[tuple[str, int, int]]) -> None:
    alloc = BlockAllocator(12)
    held: list[int] = []  # one entry per reference we hold
    for op, n, pick in ops:
        if op == "alloc":
            if n > alloc.num_free:
                with pytest.raises(OutOfBlocks):
                    alloc.allocate(n)
            else:
                held += alloc.allocate(n)
        elif held and op == "incref":
            b = held[pick % len(held)]
            alloc.incref([b])
            held.append(b)
        elif held:
            b = held.pop(pick % len(held))
            alloc.decref([b])
        for b in range(12):
            assert alloc.refcount(b) == held.count(b)
        assert alloc.num_free == 12 - len(set(held))
    alloc.decref(held)
    assert alloc.num_free == alloc.num_total

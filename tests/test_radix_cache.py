"""Tests for the block-granular radix prefix cache: lifecycle, refcounts, LRU, events."""
from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_allocator import BlockAllocator
from engine.radix_cache import BlockRemoved, BlockStored, PrefixMatch, RadixCache
from tandem.hashing import block_hashes, seed_hash

BS = 4
SEED = seed_hash("test-model")


def make(num_blocks: int = 32, enabled: bool = True) -> tuple[BlockAllocator, RadixCache]:
    alloc = BlockAllocator(num_blocks)
    return alloc, RadixCache(alloc, BS, SEED, enabled=enabled)


def run_sequence(
    alloc: BlockAllocator, cache: RadixCache, prompt: list[int], decode: list[int]
) -> tuple[PrefixMatch, list[int]]:
    """Admit, prefill, insert, decode (inserting as blocks fill); return the held lock and table."""
    m = cache.match_prefix(prompt)
    cache.lock(m)
    table = m.block_ids + alloc.allocate(-(-len(prompt) // BS) - len(m.block_ids))
    m = _insert(cache, m, prompt, table)
    tokens = list(prompt)
    for t in decode:
        tokens.append(t)
        if len(tokens) > len(table) * BS:
            table += alloc.allocate(1)
        if len(tokens) % BS == 0:
            m = _insert(cache, m, tokens, table)
    return m, table


def _insert(cache: RadixCache, m: PrefixMatch, tokens: list[int], table: list[int]) -> PrefixMatch:
    m2 = cache.insert(tokens, table)
    cache.relock(m, m2)
    return m2


def test_lifecycle_reuses_prefix_and_leaves_no_leak() -> None:
    alloc, cache = make()
    prompt = list(range(10))  # 2 full blocks + 2 tokens
    m1, t1 = run_sequence(alloc, cache, prompt, [100, 101, 102, 103, 104])
    assert cache.cached_blocks == 3  # 15 tokens -> 3 full blocks
    for i, b in enumerate(t1):
        assert alloc.refcount(b) == (2 if i < 3 else 1)  # sequence + tree for cached blocks
    # A second request with the same system prompt hits the two full prompt blocks.
    m = cache.match_prefix(prompt + [7, 7, 7])
    assert m.block_ids == t1[:2] and m.num_tokens == 2 * BS
    cache.lock(m)
    assert all(alloc.refcount(b) == 3 for b in t1[:2])
    t2 = m.block_ids + alloc.allocate(2)
    cache.unlock(m, t2)
    cache.unlock(m1, t1)
    assert alloc.num_free == alloc.num_total - cache.cached_blocks
    assert cache.evictable_blocks == cache.cached_blocks == 3
    assert cache.reset() == 3
    assert alloc.num_free == alloc.num_total
    s = cache.stats()
    assert (s.hit_tokens, s.query_tokens) == (8, 10 + 13)
    assert s.hit_ratio == pytest.approx(8 / 23)


def test_match_never_covers_whole_prompt_and_ignores_partial_blocks() -> None:
    alloc, cache = make()
    tokens = list(range(3 * BS))
    m, table = run_sequence(alloc, cache, tokens, [])
    assert cache.cached_blocks == 3  # exactly three full blocks stored
    assert len(cache.match_prefix(tokens).block_ids) == 2  # cap: last token must be computed
    assert len(cache.match_prefix(tokens + [1]).block_ids) == 3
    assert cache.match_prefix(tokens[:BS]).block_ids == []
    assert cache.match_prefix([]).block_ids == []
    # A partial trailing block is never cached.
    m2 = cache.insert(tokens + [5, 6], table + alloc.allocate(1))
    assert m2.num_tokens == 3 * BS and cache.cached_blocks == 3


def test_duplicate_computation_keeps_tree_block() -> None:
    alloc, cache = make()
    prompt = list(range(2 * BS + 1))
    # Two sequences admitted before either inserted: both compute the prefix.
    ma, mb = cache.match_prefix(prompt), cache.match_prefix(prompt)
    cache.lock(ma), cache.lock(mb)
    ta, tb = alloc.allocate(3), alloc.allocate(3)
    ma = _insert(cache, ma, prompt, ta)
    mb = _insert(cache, mb, prompt, tb)
    assert mb.block_ids == ta[:2]
    assert [alloc.refcount(b) for b in ta] == [2, 2, 1]
    assert [alloc.refcount(b) for b in tb] == [1, 1, 1]
    cache.unlock(mb, tb)
    assert all(alloc.refcount(b) == 0 for b in tb)
    cache.unlock(ma, ta)
    cache.reset()
    assert alloc.num_free == alloc.num_total


def test_lru_order_and_locked_nodes_survive() -> None:
    alloc, cache = make()
    prompts = {name: [first] + list(range(1, 2 * BS)) for first, name in enumerate("abc", 50)}
    held = {}
    for name in "abc":
        held[name] = run_sequence(alloc, cache, prompts[name], [])
        cache.unlock(*held[name])
    # Touch "a" again so "b" becomes the least recently used.
    m = cache.match_prefix(prompts["a"] + [0])
    cache.lock(m)
    cache.unlock(m, m.block_ids)
    assert cache.evict(2) == 2  # both blocks of "b" (leaf first, then its parent)
    assert cache.match_prefix(prompts["b"] + [0]).block_ids == []
    assert len(cache.match_prefix(prompts["a"] + [0]).block_ids) == 2
    # Lock "c"; "a" goes next, "c" never.
    mc = cache.match_prefix(prompts["c"] + [0])
    cache.lock(mc)
    assert cache.evictable_blocks == 2
    assert cache.evict(100) == 2
    assert cache.match_prefix(prompts["c"] + [0]).block_ids == mc.block_ids
    assert cache.evict(100) == 0
    cache.unlock(mc, mc.block_ids)
    assert cache.evict(100) == 2
    assert alloc.num_free == alloc.num_total


def test_recency_counts_insert_and_finish() -> None:
    alloc, cache = make()
    p = {name: [first] * (BS + 1) for first, name in enumerate("xyz", 60)}
    mx, tx = run_sequence(alloc, cache, p["x"], [])  # admitted first, finishes last
    my, ty = run_sequence(alloc, cache, p["y"], [])
    cache.unlock(my, ty)
    cache.unlock(mx, tx)
    # "z" inserts without taking a lock (a final insert right before finishing).
    mz = cache.match_prefix(p["z"])
    cache.lock(mz)
    tz = alloc.allocate(2)
    cache.insert(p["z"], tz)
    cache.unlock(mz, tz)
    assert cache.evict(1) == 1
    assert cache.match_prefix(p["y"]).block_ids == []
    assert cache.match_prefix(p["x"]).block_ids == tx[:1]
    assert cache.evict(1) == 1
    assert cache.match_prefix(p["x"]).block_ids == []
    assert cache.match_prefix(p["z"]).block_ids == tz[:1]


def test_evicting_parent_of_locked_child_is_impossible() -> None:
    alloc, cache = make()
    base = list(range(2 * BS))
    m, t = run_sequence(alloc, cache, base + [9] * BS + [1], [])  # 3 blocks, locked
    m2, t2 = run_sequence(alloc, cache, base + [8] * BS + [1], [])
    cache.unlock(m2, t2)
    assert cache.evict(10) == 1  # only the unshared leaf of the second sequence
    assert cache.cached_blocks == 3
    cache.unlock(m, t)


def test_stale_match_and_bad_input_raise() -> None:
    alloc, cache = make()
    m, t = run_sequence(alloc, cache, list(range(2 * BS + 1)), [])
    cache.unlock(m, t)
    stale = cache.match_prefix(list(range(2 * BS + 1)))
    cache.evict(10)
    with pytest.raises(ValueError, match="stale"):
        cache.lock(stale)
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(stale, [])
    with pytest.raises(ValueError, match="block_ids"):
        cache.insert(list(range(2 * BS)), alloc.allocate(1))
    with pytest.raises(ValueError, match="block_size"):
        RadixCache(alloc, 0, SEED)
    with pytest.raises(ValueError, match="num_blocks"):
        cache.evict(-1)


def test_events_match_tandem_hashing() -> None:
    alloc, cache = make(64)
    rng = random.Random(7)
    tokens = [rng.randrange(1000) for _ in range(5 * BS + 2)]
    m = cache.match_prefix(tokens[: 2 * BS + 1])
    cache.lock(m)
    table = alloc.allocate(6)
    m = _insert(cache, m, tokens[: 2 * BS + 1], table)
    m = _insert(cache, m, tokens, table)
    expected = block_hashes(tokens, BS, SEED)
    first, second = cache.drain_events()
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.block_hashes == expected[:2] and first.parent_hash is None
    assert first.token_ids == tokens[: 2 * BS] and first.block_size == BS
    assert second.block_hashes == expected[2:] and second.parent_hash == expected[1]
    assert second.token_ids == tokens[2 * BS : 5 * BS]
    assert cache.drain_events() == []
    cache.unlock(m, table)
    cache.evict(2)
    (removed,) = cache.drain_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == expected[3:][::-1]
    cache.reset()
    (removed,) = cache.drain_events()
    assert sorted(removed.block_hashes) == sorted(expected[:3])


def test_events_are_not_recorded_for_an_owner_that_never_drains_them() -> None:
    """With `record_events` off the tree changes as with it on, but no event is kept; turning it
    off drops the events not yet drained, and turning it back on records again."""
    rng = random.Random(11)
    tokens = [rng.randrange(1000) for _ in range(4 * BS)]
    trees = []
    for record in (True, False):
        alloc, cache = make(64)
        cache.insert(tokens[:BS], alloc.allocate(1))
        cache.record_events = record
        assert cache.record_events is record
        m = cache.match_prefix(tokens)
        cache.lock(m)
        table = alloc.allocate(4)
        m = _insert(cache, m, tokens, table)
        cache.unlock(m, table)
        assert cache.evict(1) == 1
        trees.append((cache.cached_blocks, sorted(cache.cached_block_ids())))
        assert (cache.drain_events() != []) is record
    assert trees[0] == trees[1]
    cache.record_events = True
    cache.reset()
    (removed,) = cache.drain_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes


def test_extend_leaves_what_insert_and_relock_leave() -> None:
    """A decoding sequence's path grown block by block with `extend` (from its locked match, the
    new tokens only) ends as the whole-path `insert` + `relock` leaves it: the same cached blocks
    and references, locks (what eviction may take) and events; a block another sequence cached
    first is shared, not stored twice."""
    rng = random.Random(3)
    prompt = [rng.randrange(50) for _ in range(2 * BS + 1)]
    decode = [rng.randrange(50) for _ in range(3 * BS + 2)]
    ends = {}
    for way in ("insert", "extend"):
        alloc, cache = make(64)
        other, t_other = run_sequence(alloc, cache, prompt + decode[:BS], [])  # caches 3 blocks first
        m = cache.match_prefix(prompt)
        cache.lock(m)
        table = m.block_ids + alloc.allocate(-(-len(prompt) // BS) - len(m.block_ids))
        tokens = list(prompt)
        for t in [None, *decode]:
            if t is not None:
                tokens.append(t)
            if len(tokens) > len(table) * BS:
                table += alloc.allocate(1)
            if len(tokens) // BS > len(m.block_ids):
                if way == "insert":
                    m = _insert(cache, m, tokens, table)
                else:
                    m = cache.extend(m, tokens[m.num_tokens:], table)
        assert m.block_ids[:3] == t_other[:3] and m.num_tokens == len(tokens) // BS * BS
        cache.unlock(other, t_other)
        events = cache.drain_events()
        state = (sorted(cache.cached_block_ids()), [alloc.refcount(b) for b in range(alloc.num_total)],
                 cache.evictable_blocks, [e.block_hashes for e in events])
        evicted = cache.evict(100)
        ends[way] = (state, evicted, m.block_ids, sorted(cache.cached_block_ids()))
        cache.unlock(m, table)
        cache.reset()
        assert alloc.num_free == alloc.num_total
    assert ends["extend"] == ends["insert"]
    assert ends["insert"][1] == 0  # every cached block is on the decoding sequence's locked path


def test_extend_checks_its_input() -> None:
    alloc, cache = make()
    m, table = run_sequence(alloc, cache, list(range(BS + 1)), [])
    with pytest.raises(ValueError, match="block_ids"):
        cache.extend(m, list(range(2 * BS)), table)  # two more blocks, a table of two
    cache.unlock(m, table)
    with pytest.raises(ValueError, match="not locked"):
        cache.extend(m, list(range(BS)), table + alloc.allocate(1))


def test_disabled_cache_caches_nothing_and_releases_tables() -> None:
    alloc, cache = make(enabled=False)
    m, t = run_sequence(alloc, cache, list(range(3 * BS)), [1, 2, 3, 4])
    assert cache.cached_blocks == 0 and cache.drain_events() == []
    assert cache.match_prefix(list(range(3 * BS))).block_ids == []
    assert cache.evict(5) == 0
    cache.unlock(m, t)
    assert alloc.num_free == alloc.num_total
    assert cache.stats().query_tokens == 3 * BS and cache.stats().hit_tokens == 0


class CacheMachine(RuleBasedStateMachine):
    """Random admissions, decode steps, inserts, finishes, evictions and resets."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(40)
        self.cache = RadixCache(self.alloc, 2, SEED)
        self.seqs: list[dict] = []

    def _allocate(self, n: int) -> list[int] | None:
        if n > self.alloc.num_free:
            self.cache.evict(n - self.alloc.num_free)
        return self.alloc.allocate(n) if n <= self.alloc.num_free else None

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def admit(self, prompt: list[int]) -> None:
        m = self.cache.match_prefix(prompt)
        assert m.num_tokens <= len(prompt) - 1
        self.cache.lock(m)
        extra = self._allocate(-(-len(prompt) // 2) - len(m.block_ids))
        if extra is None:
            self.cache.unlock(m, m.block_ids)
            return
        self.seqs.append({"m": m, "table": m.block_ids + extra, "tokens": list(prompt)})

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 100), token=st.integers(0, 2))
    def decode(self, pick: int, token: int) -> None:
        s = self.seqs[pick % len(self.seqs)]
        if len(s["tokens"]) + 1 > 2 * len(s["table"]):
            extra = self._allocate(1)
            if extra is None:
                return
            s["table"] += extra
        s["tokens"].append(token)

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 100))
    def insert(self, pick: int) -> None:
        s = self.seqs[pick % len(self.seqs)]
        m2 = self.cache.insert(s["tokens"], s["table"])
        self.cache.relock(s["m"], m2)
        s["m"] = m2

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 100))
    def extend(self, pick: int) -> None:
        s = self.seqs[pick % len(self.seqs)]
        s["m"] = self.cache.extend(s["m"], s["tokens"][s["m"].num_tokens :], s["table"])
        assert s["m"].num_tokens == len(s["tokens"]) // 2 * 2

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick: int) -> None:
        s = self.seqs.pop(pick % len(self.seqs))
        self.cache.unlock(s["m"], s["table"])

    @rule(n=st.integers(0, 10))
    def evict(self, n: int) -> None:
        free_before = self.alloc.num_free
        freed = self.cache.evict(n)
        assert freed <= n and self.alloc.num_free == free_before + freed

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        assert self.cache.evictable_blocks == 0

    @invariant()
    def references_match_owners(self) -> None:
        cached = self.cache.cached_block_ids()
        assert len(cached) == len(set(cached)) == self.cache.cached_blocks
        expected = [0] * self.alloc.num_total
        for b in cached:
            expected[b] += 1
        for s in self.seqs:
            for b in s["table"]:
                expected[b] += 1
        assert [self.alloc.refcount(b) for b in range(self.alloc.num_total)] == expected
        used = sum(1 for c in expected if c)
        assert self.alloc.num_free + used == self.alloc.num_total
        locked = {b for s in self.seqs for b in s["m"].block_ids}
        assert locked <= set(cached)
        assert self.cache.evictable_blocks == len(cached) - len(locked)

    def teardown(self) -> None:
        for s in self.seqs:
            self.cache.unlock(s["m"], s["table"])
        self.cache.reset()
        assert self.alloc.num_free == self.alloc.num_total


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

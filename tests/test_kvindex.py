"""Prefix index contract on the embedded memory backend: leading-run matching, clear,
liveness and reaping, validation, and agreement with a brute-force reference model."""
from __future__ import annotations

import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex import MemoryIndex, PrefixIndex, RedisIndex, WorkerInfo, coalesce, make_index
from tandem.hashing import block_hashes, seed_hash

INFO = WorkerInfo("127.0.0.1:5000", "prefill", capacity=1024)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _index(interval: float = 1e6, clock: FakeClock | None = None) -> MemoryIndex:
    return MemoryIndex("test-model", heartbeat_interval_s=interval, clock=clock or FakeClock())


def test_match_counts_consecutive_blocks_from_the_start() -> None:
    seed = seed_hash("m")
    prompt = block_hashes(list(range(16 * 6)), 16, seed)
    ix = _index()
    for w in ("a", "b", "c"):
        ix.heartbeat(w, INFO)
    ix.publish("a", prompt[:4], [])
    ix.publish("b", [prompt[0], prompt[1], prompt[3], prompt[4]], [])  # gap at block 2
    ix.publish("c", prompt[1:], [])  # lacks block 0
    got = ix.match(prompt)
    assert got == {"a": 4, "b": 2}
    assert ix.match([]) == {}
    assert ix.match(prompt[1:3]) == {"a": 2, "b": 1, "c": 2}


def test_removed_and_clear() -> None:
    ix = _index()
    ix.heartbeat("a", INFO)
    ix.heartbeat("b", INFO)
    ix.publish("a", [1, 2, 3], [])
    ix.publish("b", [1, 2], [])
    ix.publish("a", [], [2])
    assert ix.match([1, 2, 3]) == {"a": 1, "b": 2}
    ix.publish("a", [9], [9])  # stored first, then removed
    assert ix.match([9]) == {}
    ix.clear("b")
    assert ix.match([1, 2]) == {"a": 1}
    assert "b" in ix.workers()  # clear keeps the registration
    ix.deregister("a")
    assert ix.match([1]) == {} and "a" not in ix.workers()
    assert ix.num_entries() == 0


def test_liveness_and_reaping_follow_heartbeats() -> None:
    clock = FakeClock()
    ix = _index(interval=1.0, clock=clock)
    ix.publish("a", [5, 6], [])
    assert ix.match([5, 6]) == {}  # never heartbeated: not live
    ix.heartbeat("a", INFO)
    ix.heartbeat("b", INFO)
    ix.publish("b", [5], [])
    assert ix.match([5, 6]) == {"a": 2, "b": 1}
    clock.now += ix.heartbeat_ttl_s * 0.9
    ix.heartbeat("b", INFO)
    clock.now += ix.heartbeat_ttl_s * 0.2  # a's deadline has passed, b's has not
    assert ix.match([5, 6]) == {"b": 1}
    assert set(ix.workers()) == {"b"}
    entries_before = ix.num_entries()
    ix.heartbeat("b", INFO)  # reaps a
    assert ix.num_entries() == entries_before - 2
    ix.heartbeat("a", INFO)  # a comes back with nothing
    assert ix.match([5, 6]) == {"b": 1}


def test_coalesce_keeps_each_hash_last_event() -> None:
    stored, removed = coalesce([(True, [1, 2, 3]), (False, [2, 4]), (True, [4]), (False, [1])])
    assert sorted(stored) == [3, 4]
    assert sorted(removed) == [1, 2]
    assert not set(stored) & set(removed)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda ix: ix.publish("a", [-1], []), "stored"),
        (lambda ix: ix.publish("a", [], [2**64]), "removed"),
        (lambda ix: ix.publish("a", ["x"], []), "stored"),
        (lambda ix: ix.publish("", [1], []), "worker_id"),
        (lambda ix: ix.publish("a b", [1], []), "worker_id"),
        (lambda ix: ix.match([1.5]), "block_hashes"),
        (lambda ix: ix.heartbeat("a", {"address": "x"}), "info"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_field(call, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call(_index())


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"address": "", "role": "prefill"}, "address"),
        ({"address": "h:1", "role": "router"}, "role"),
        ({"address": "h:1", "role": "decode", "capacity": -1}, "capacity"),
        ({"address": "h:1", "role": "decode", "load": float("nan")}, "load"),
    ],
)
def test_worker_info_validation(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WorkerInfo(**kwargs)


def test_make_index_picks_backend_by_url() -> None:
    assert isinstance(make_index(None, "m"), MemoryIndex)
    assert isinstance(make_index("memory://", "m"), MemoryIndex)
    ix = make_index("redis://127.0.0.1:1/0", "m")  # construction does no I/O
    assert isinstance(ix, RedisIndex) and isinstance(ix, PrefixIndex)
    ix.close()
    for url in ("ftp://x", "localhost:6379"):
        with pytest.raises(ValueError, match="index_url"):
            make_index(url, "m")
    with pytest.raises(ValueError, match="namespace"):
        make_index(None, "has space")
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        make_index(None, "m", heartbeat_interval_s=0)


def test_concurrent_publishers_leave_a_consistent_index() -> None:
    ix = _index()
    workers = [f"w{i}" for i in range(4)]
    for w in workers:
        ix.heartbeat(w, INFO)
    chains = {w: block_hashes(list(range(i, i + 16 * 50)), 16, seed_hash("m")) for i, w in enumerate(workers)}

    def run(w: str) -> None:
        rng = random.Random(w)
        for _ in range(200):
            k = rng.randrange(1, 50)
            ix.publish(w, chains[w][:k], chains[w][k:])
        ix.publish(w, chains[w][:10], chains[w][10:])

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in workers:
        assert ix.match(chains[w])[w] == 10
    assert ix.num_entries() == 10 * len(workers)


HASHES = [0, 2**64 - 1, 11, 12, 13, 14, 15, 16]
WORKER_IDS = ["w0", "w1", "w2"]
_hash = st.sampled_from(HASHES)
_worker = st.sampled_from(WORKER_IDS)
_op = st.one_of(
    st.tuples(st.just("publish"), _worker, st.lists(_hash, max_size=6), st.lists(_hash, max_size=3)),
    st.tuples(st.just("clear"), _worker),
    st.tuples(st.just("match"), st.lists(_hash, max_size=8)),
)


def _reference_match(held: dict[str, set[int]], hashes: list[int]) -> dict[str, int]:
    out = {}
    for w, blocks in held.items():
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        if n:
            out[w] = n
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(_op, max_size=30))
def test_memory_index_agrees_with_reference_model(ops: list[tuple]) -> None:
    ix = _index()
    held: dict[str, set[int]] = {w: set() for w in WORKER_IDS}
    for w in WORKER_IDS:
        ix.heartbeat(w, INFO)
    for op in ops:
        if op[0] == "publish":
            _, w, stored, removed = op
            ix.publish(w, stored, removed)
            held[w] |= set(stored)
            held[w] -= set(removed)
        elif op[0] == "clear":
            ix.clear(op[1])
            held[op[1]] = set()
        else:
            assert ix.match(op[1]) == _reference_match(held, op[1])
    for perm in (HASHES, HASHES[::-1]):
        assert ix.match(perm) == _reference_match(held, perm)

"""Pieces of KV-aware routing without processes: the gateway's recent-route memory, the
new-prefix tie-break that spreads prefix groups evenly, and heartbeats reporting a lost
registration (memory index, and the real Redis on 127.0.0.1:6379)."""
from __future__ import annotations

import random
import uuid
from collections import Counter

import pytest

from gateway.routing import CacheAwareRouter, RecentRoutes, RoutingConfig, merge_matches
from kvindex import MemoryIndex, RedisIndex, WorkerInfo

INFO = WorkerInfo("127.0.0.1:1", "prefill", 64)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_recent_routes_match_leading_blocks_until_they_expire() -> None:
    clock = FakeClock()
    recent = RecentRoutes(ttl_s=5.0, clock=clock)
    recent.record("p0", [1, 2, 3, 4])
    recent.record("p1", [1, 2, 9])
    assert recent.match([1, 2, 3, 7]) == {"p0": 3, "p1": 2}
    assert recent.match([5, 1, 2]) == {}  # runs start at the first block
    assert recent.match([]) == {}
    clock.now += 3.0
    recent.record("p1", [1, 2])  # refreshed: outlives p1's first record
    clock.now += 2.5
    assert recent.match([1, 2, 3]) == {"p1": 2}
    clock.now += 3.0
    assert recent.match([1, 2, 3]) == {} and len(recent) == 0
    recent.record("p2", [5])
    assert len(recent) == 1


def test_recent_routes_are_bounded_and_forget_workers() -> None:
    recent = RecentRoutes(ttl_s=60.0, max_prompts=3, clock=FakeClock())
    for i in range(5):
        recent.record(f"p{i}", [100 + i, 200 + i])
    assert len(recent) == 3
    assert recent.match([100, 200]) == {} and recent.match([104, 204]) == {"p4": 2}
    recent.forget("p4")
    assert recent.match([104, 204]) == {}
    assert RecentRoutes(ttl_s=0.0).match([1]) == {}
    with pytest.raises(ValueError, match="recent_route_ttl_s"):
        RecentRoutes(ttl_s=-1.0)
    with pytest.raises(ValueError, match="max_prompts"):
        RecentRoutes(max_prompts=0)
    with pytest.raises(ValueError, match="recent_route_ttl_s"):
        RoutingConfig(recent_route_ttl_s=float("nan"))


def test_merge_keeps_the_longest_run_per_worker() -> None:
    assert merge_matches({"a": 2, "b": 5}, {"a": 4, "c": 1}, {}) == {"a": 4, "b": 5, "c": 1}


def test_router_merges_recent_routes_only_when_cache_aware() -> None:
    router = CacheAwareRouter(block_size=16)
    router.remember("p1", [7, 8, 9])
    assert router.with_recent({"p0": 1}, [7, 8, 9]) == {"p0": 1, "p1": 3}
    assert router.with_recent({"p0": 1}, ()) == {"p0": 1}  # no hashes: the index is unusable
    rr = CacheAwareRouter(RoutingConfig(policy="round_robin"), block_size=16)
    rr.remember("p1", [7, 8, 9])
    assert rr.with_recent({}, [7, 8, 9]) == {}


@pytest.mark.parametrize("seed", range(4))
def test_new_prefixes_spread_evenly_over_idle_workers(seed: int) -> None:
    """One request at a time (loads always back to zero): each new prefix group goes to the
    worker holding the least, its followers to the holder."""
    rng = random.Random(seed)
    workers = ["p0", "p1", "p2", "p3"]
    router = CacheAwareRouter(RoutingConfig(ewma_alpha=1.0), block_size=16)
    groups = [g for g in range(8) for _ in range(6)]
    rng.shuffle(groups)
    holder: dict[int, str] = {}
    counts: Counter = Counter()
    for i, g in enumerate(groups):
        matched = {holder[g]: 10} if g in holder else {}
        d = router.route(workers, 176, matched, request_id=str(i))
        router.release(str(i))
        holder.setdefault(g, d.worker_id)
        assert d.worker_id == holder[g]  # the cache holder keeps its group
        counts[d.worker_id] += 1
    assert Counter(holder.values()) == Counter({w: 2 for w in workers})
    assert max(counts.values()) == min(counts.values())


def test_memory_heartbeat_reports_a_fresh_registration() -> None:
    clock = FakeClock()
    ix = MemoryIndex("units", heartbeat_interval_s=1.0, clock=clock)
    assert ix.heartbeat("a", INFO) is True
    assert ix.heartbeat("a", INFO) is False
    clock.now += ix.heartbeat_ttl_s + 0.1
    assert ix.heartbeat("a", INFO) is True  # lapsed: its entries were reaped
    ix.deregister("a")
    assert ix.heartbeat("a", INFO) is True


def test_redis_heartbeat_reports_lost_registration(redis_url: str) -> None:
    import redis

    ns = f"units-{uuid.uuid4().hex[:8]}"
    ix = RedisIndex(redis_url, ns, heartbeat_interval_s=5.0)
    r = redis.Redis.from_url(redis_url)
    try:
        assert ix.heartbeat("w", INFO) is True
        assert ix.heartbeat("w", INFO) is False
        r.delete(*r.keys(f"tandem:{ns}:*"))  # what a restart without persistence looks like
        assert ix.heartbeat("w", INFO) is True
        assert ix.heartbeat("w", INFO) is False
    finally:
        keys = r.keys(f"tandem:{ns}:*")
        if keys:
            r.delete(*keys)
        ix.close()
    down = RedisIndex("redis://127.0.0.1:1/0", ns, socket_timeout_s=0.2)
    assert down.heartbeat("w", INFO) is False and down.degraded
    down.close()


def test_new_prefix_goes_to_the_smallest_cache_but_no_index_means_load_only() -> None:
    router = CacheAwareRouter(block_size=16)
    router.route(["p0", "p1"], 500, {}, request_id="big")  # p0 has now computed 500 tokens
    router.release("big")
    router.tracker.on_dispatch("p1", "queued", 300)  # p1 is busier, p0 holds more
    assert router.route(["p0", "p1"], 200, {}).worker_id == "p1"  # nobody holds it: smallest cache
    assert router.route(["p0", "p1"], 200, None).worker_id == "p0"  # index degraded: idlest

"""Prefill and decode routing: cache-aware choice, load-balance override, round robin, EWMA
load tracking, decode headroom, and a shared-prefix workload run through a real memory index."""
from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter, OrderedDict, deque
from pathlib import Path

import pytest

from gateway.routing import CacheAwareRouter, LoadTracker, RoutingConfig, RoutingDecision, pick_decode
from kvindex import MemoryIndex, WorkerInfo
from tandem.hashing import block_hashes, seed_hash

W4 = ["p0", "p1", "p2", "p3"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"policy": "random"}, "policy"),
        ({"w_cache": -1.0}, "w_cache"),
        ({"w_load": float("inf")}, "w_load"),
        ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
        ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
        ({"ewma_alpha": 0.0}, "ewma_alpha"),
        ({"ewma_alpha": 1.5}, "ewma_alpha"),
        ({"cached_token_cost": -0.1}, "cached_token_cost"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**kwargs)


def test_route_rejects_bad_input() -> None:
    router = CacheAwareRouter(block_size=16)
    with pytest.raises(ValueError, match="candidates"):
        router.route([], 100)
    with pytest.raises(ValueError, match="prompt_tokens"):
        router.route(W4, 0)
    with pytest.raises(ValueError, match="block_size"):
        CacheAwareRouter(block_size=0)


def test_cache_holder_wins_when_loads_are_even() -> None:
    router = CacheAwareRouter(block_size=16)
    d = router.route(W4, 1100, {"p2": 64, "p1": 10, "elsewhere": 68})
    assert d == RoutingDecision("p2", "cache", 64 * 16)


def test_cached_tokens_leave_the_last_token_to_compute() -> None:
    router = CacheAwareRouter(block_size=16)
    d = router.route(W4, 64, {"p1": 4})  # the whole prompt is cached
    assert d.worker_id == "p1" and d.cached_tokens == 63


def test_moderate_load_is_traded_against_cached_tokens() -> None:
    router = CacheAwareRouter(RoutingConfig(balance_abs_threshold=1e9), block_size=16)
    router.tracker.on_dispatch("p0", "busy", 600)
    assert router.route(W4, 2000, {"p0": 64}).worker_id == "p0"  # 1024 cached beats 600 queued
    router.tracker.on_dispatch("p0", "busier", 1000)
    d = router.route(W4, 2000, {"p0": 64})  # 1024 cached no longer beats 1600 queued
    assert d.worker_id != "p0" and d.reason == "load" and d.cached_tokens == 0


def test_imbalance_beyond_both_thresholds_routes_to_the_idlest() -> None:
    cfg = RoutingConfig(w_cache=100.0, balance_abs_threshold=4000, balance_rel_threshold=2.0)
    router = CacheAwareRouter(cfg, block_size=16)
    for i, w in enumerate(W4):
        router.tracker.on_dispatch(w, f"r{w}", 3000 + 1000 * i)  # p0 idlest, p3 busiest
    # Spread 3000 < 4000: still cache-aware, the heavy cache weight keeps p3.
    assert router.route(W4, 2000, {"p3": 64}).reason == "cache"
    router.tracker.on_dispatch("p3", "more", 2000)  # spread 5000 > 4000 but 8000/3000 > 2.0
    d = router.route(W4, 2000, {"p3": 64})
    assert (d.worker_id, d.reason) == ("p0", "load_balance")
    assert d.cached_tokens == 0


def test_relative_threshold_alone_does_not_trigger_balance() -> None:
    cfg = RoutingConfig(w_cache=100.0, balance_abs_threshold=1000, balance_rel_threshold=3.0)
    router = CacheAwareRouter(cfg, block_size=16)
    router.tracker.on_dispatch("p0", "a", 10_000)
    router.tracker.on_dispatch("p1", "b", 5_000)  # spread 5000 > 1000 but ratio 2 < 3
    assert router.route(["p0", "p1"], 2000, {"p0": 64}).worker_id == "p0"


def test_round_robin_cycles_through_every_candidate() -> None:
    router = CacheAwareRouter(RoutingConfig(policy="round_robin"), block_size=16)
    picks = [router.route(W4, 500, {"p0": 30}).worker_id for _ in range(3 * len(W4))]
    for start in range(0, len(picks), len(W4)):
        assert sorted(picks[start : start + len(W4)]) == sorted(W4)
    assert all(a != b for a, b in zip(picks, picks[1:]))
    assert {router.route(W4, 500).reason for _ in range(2)} == {"round_robin"}


def test_load_policy_and_empty_match_choose_the_idlest() -> None:
    for policy in ("load", "cache_aware"):
        router = CacheAwareRouter(RoutingConfig(policy=policy), block_size=16)
        for w, tokens in zip(W4, (900, 100, 700, 300)):
            router.tracker.on_dispatch(w, f"r{w}", tokens)
        matched = {"p0": 64} if policy == "load" else {}  # {} is what a degraded index answers
        d = router.route(W4, 1000, matched)
        assert (d.worker_id, d.reason) == ("p1", "load")


def test_single_candidate_and_dispatch_accounting() -> None:
    router = CacheAwareRouter(RoutingConfig(cached_token_cost=0.0), block_size=16)
    d = router.route(["p9"], 300, {"p9": 10}, request_id="r1")
    assert d == RoutingDecision("p9", "only_candidate", 160)
    assert router.tracker.outstanding("p9") == 300 - 160
    assert router.release("r1") and not router.release("r1")
    assert router.tracker.outstanding("p9") == 0


def test_cached_tokens_are_charged_at_their_configured_cost() -> None:
    router = CacheAwareRouter(RoutingConfig(cached_token_cost=0.5), block_size=16)
    d = router.route(["p0", "p1"], 1000, {"p0": 40}, request_id="r1")
    assert d.worker_id == "p0" and d.cached_tokens == 640
    assert router.tracker.outstanding("p0") == (1000 - 640) + 320


def test_gateway_side_imports_stay_torch_free() -> None:
    code = "import sys, kvindex, gateway.routing; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_load_tracker_rises_at_once_and_decays_gradually() -> None:
    t = LoadTracker(alpha=0.25)
    t.on_dispatch("a", "r1", 1000)
    assert t.sample(["a"])["a"] == 1000
    t.on_complete("r1")
    assert t.outstanding("a") == 0
    seen = [t.sample(["a"])["a"] for _ in range(30)]
    assert 0 < seen[0] < 1000
    assert all(x > y for x, y in zip(seen, seen[1:]))
    assert seen[-1] < 1.0
    t.on_dispatch("a", "r2", 10)
    t.on_dispatch("b", "r2", 10)  # a retry elsewhere moves the request
    assert (t.outstanding("a"), t.outstanding("b"), t.in_flight("b")) == (0, 10, 1)
    t.forget("b")
    assert t.outstanding("b") == 0 and not t.on_complete("r2")
    with pytest.raises(ValueError, match="tokens"):
        t.on_dispatch("a", "r3", -1)


def test_pick_decode_prefers_headroom_with_a_sticky_bonus() -> None:
    cands = {"d0": (100, 2), "d1": (500, 9), "d2": (450, 1), "d3": (20, 0)}
    assert pick_decode(cands, 50) == "d1"
    assert pick_decode(cands, 50, preferred="d2") == "d2"  # 400 * 1.25 > 450
    assert pick_decode(cands, 50, preferred="d0") == "d1"  # far less headroom: no stickiness
    assert pick_decode(cands, 50, preferred="d3") == "d1"  # no room: never chosen
    assert pick_decode(cands, 480) == "d1"
    assert pick_decode(cands, 501) is None
    assert pick_decode({"x": (300, 5), "y": (300, 1)}, 10) == "y"  # fewer running breaks ties
    with pytest.raises(ValueError, match="needed_blocks"):
        pick_decode(cands, -1)
    with pytest.raises(ValueError, match="free_blocks"):
        pick_decode({"x": (-3, 0)}, 1)
    router = CacheAwareRouter(RoutingConfig(decode_sticky_bonus=0.0), block_size=16)
    assert router.pick_decode(cands, 50, preferred="d2") == "d1"


def _simulate(cfg: RoutingConfig, seed: int) -> tuple[float, Counter]:
    """Shared-prefix workload: 16 groups with 1024-token system prompts (Zipf popularity),
    64-token questions, 3 arrivals per tick onto 4 prefill workers that each compute 350
    tokens per tick and keep an LRU cache of about 5 prompts; finished prefills publish their
    blocks (and evictions) to a real memory index. Returns (hit ratio, requests per worker)."""
    rng = random.Random(seed)
    bs, groups, prefix_len, question_len, cap_blocks = 16, 16, 1024, 64, 5 * (1024 + 64) // 16
    seed_h = seed_hash("sim-model")
    prefixes = [[rng.randrange(32000) for _ in range(prefix_len)] for _ in range(groups)]
    popularity = [1.0 / (g + 1) for g in range(groups)]
    index = MemoryIndex("sim", heartbeat_interval_s=1e6)
    for w in W4:
        index.heartbeat(w, WorkerInfo("127.0.0.1:1", "prefill"))
    router = CacheAwareRouter(cfg, block_size=bs)
    caches: dict[str, OrderedDict[int, None]] = {w: OrderedDict() for w in W4}
    queues: dict[str, deque[list]] = {w: deque() for w in W4}
    counts: Counter = Counter()
    cached = total = rid = 0
    for _tick in range(250):
        for _ in range(3):
            g = rng.choices(range(groups), popularity)[0]
            tokens = prefixes[g] + [rng.randrange(32000) for _ in range(question_len)]
            hashes = block_hashes(tokens, bs, seed_h)
            d = router.route(W4, len(tokens), index.match(hashes), request_id=str(rid))
            counts[d.worker_id] += 1
            cached += d.cached_tokens
            total += len(tokens)
            queues[d.worker_id].append([str(rid), len(tokens) - d.cached_tokens, hashes])
            rid += 1
        for w in W4:  # each worker works its queue down: the load decays
            budget, q = 350, queues[w]
            while q and budget > 0:
                step = min(budget, q[0][1])
                q[0][1] -= step
                budget -= step
                if q[0][1] == 0:
                    done, _, hashes = q.popleft()
                    router.release(done)
                    cache, new = caches[w], []
                    for h in reversed(hashes):  # leaf first, so eviction takes leaves first
                        if h in cache:
                            cache.move_to_end(h)
                        else:
                            cache[h] = None
                            new.append(h)
                    evicted = [cache.popitem(last=False)[0] for _ in range(max(0, len(cache) - cap_blocks))]
                    index.publish(w, new, evicted)
    return cached / total, counts


@pytest.mark.parametrize("seed", [0, 1])
def test_shared_prefix_workload_hits_cache_and_stays_balanced(seed: int) -> None:
    hit, counts = _simulate(RoutingConfig(), seed)
    rr_hit, _ = _simulate(RoutingConfig(policy="round_robin"), seed)
    assert hit >= 0.7
    assert hit >= rr_hit + 0.2
    assert set(counts) == set(W4)
    assert max(counts.values()) <= 2 * min(counts.values())

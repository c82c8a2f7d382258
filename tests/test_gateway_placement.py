"""The gateway's Placer (gateway/placement.py), as pure logic over worker handles in given
states: where the prompt is computed and why, failed workers avoided, and the prefill load
recorded under the request id and released by one idempotent call."""
from __future__ import annotations

import asyncio
import dataclasses

import grpc

from gateway.adapters import WorkerStatsView
from gateway.config import WorkerPoolConfig
from gateway.metrics import GatewayMetrics
from gateway.placement import COLOCATED, LOCAL, LONG_PROMPT, REMOTE, PlacementNeeds, Placer
from gateway.routing import CacheAwareRouter, RoutingConfig
from gateway.workers import WorkerHandle, WorkerRegistry

BLOCK = 16


def _stats(name: str, free: int) -> WorkerStatsView:
    return WorkerStatsView(worker_id=name, role="", free_kv_blocks=free, total_kv_blocks=free, running=0,
                           waiting=0, queued_prefill_tokens=0, prefix_query_tokens=0, prefix_hit_tokens=0,
                           preemptions=0, draining=False)


def _cluster(roles: dict[str, str], *, local_prefill_tokens: int = 0) -> tuple[Placer, dict[str, WorkerHandle]]:
    """Handles in the states given (all up, 100 free blocks); must run inside an event loop."""
    registry = WorkerRegistry(WorkerPoolConfig())
    handles = {}
    for i, (name, role) in enumerate(roles.items()):
        h = WorkerHandle(f"127.0.0.1:{40000 + i}", role, grpc.aio.insecure_channel(f"127.0.0.1:{40000 + i}"), 4)
        h.worker_id, h.stats, h.up = name, _stats(name, 100), True
        registry.handles.append(h)
        handles[name] = h
    router = CacheAwareRouter(RoutingConfig(), block_size=BLOCK)
    placer = Placer(registry=registry, router=router, index=None, hash_seed=0, block_size=BLOCK,
                    local_prefill_tokens=local_prefill_tokens, sticky_bonus=0.25, metrics=GatewayMetrics())
    return placer, handles


def test_disaggregated_placement_routes_after_reserve_and_releases_by_request_id() -> None:
    async def body() -> None:
        placer, w = _cluster({"p0": "prefill", "p1": "prefill", "d0": "decode"})
        needs = PlacementNeeds("req-1", prompt_tokens=40, needed_blocks=4)
        placement = placer.place(needs, w["d0"], 40)
        assert placement.reason == REMOTE and not placement.local and placement.prefill is None
        assert {h.name for h in placement.candidates} == {"p0", "p1"}
        assert placer.router.tracker.outstanding("p0") + placer.router.tracker.outstanding("p1") == 0
        placer.avoid(needs, w["p0"])
        routed = await placer.route_prefill(needs, placement, list(range(40)), resumed=False)
        assert routed.computes_prompt is w["p1"] and routed.decode is w["d0"]
        assert routed.reason not in (COLOCATED, LOCAL, REMOTE)
        assert placer.router.tracker.outstanding("p1") == 40
        placer.release(needs)
        placer.release(needs)  # every exit path may call it again
        assert placer.router.tracker.outstanding("p1") == 0

    asyncio.run(body())


def test_local_and_colocated_placements_compute_the_prompt_on_the_decode_worker() -> None:
    async def body() -> None:
        placer, w = _cluster({"b0": "both", "d0": "decode", "p0": "prefill"}, local_prefill_tokens=8)
        needs = PlacementNeeds("req-2", prompt_tokens=6, needed_blocks=1)
        colocated = placer.place(needs, w["b0"], 6)
        assert colocated.reason == COLOCATED and colocated.computes_prompt is w["b0"]
        local = placer.place(needs, w["d0"], 6)  # 6 uncached tokens <= local_prefill_tokens
        assert local.reason == LOCAL and local.computes_prompt is w["d0"]
        assert placer.place(needs, w["d0"], 9).reason == REMOTE
        w["p0"].up = False  # no prefill worker up: the decode worker prefills itself
        assert placer.place(needs, w["d0"], 9).reason == LOCAL

    asyncio.run(body())


def test_a_prompt_no_prefill_worker_takes_is_prefilled_by_the_decode_worker() -> None:
    """A prefill worker's context (WorkerStats.max_model_len) bounds the prompts routed to it: a
    longer one goes to a prefill worker that takes it, else to the decode worker (LONG_PROMPT);
    a worker that has not said its context takes any."""
    async def body() -> None:
        placer, w = _cluster({"p0": "prefill", "p1": "prefill", "d0": "decode"})
        w["p0"].stats = dataclasses.replace(w["p0"].stats, max_model_len=64)
        w["p1"].stats = dataclasses.replace(w["p1"].stats, max_model_len=128)
        w["d0"].stats = dataclasses.replace(w["d0"].stats, max_model_len=512)
        needs = PlacementNeeds("req-long", prompt_tokens=63, needed_blocks=5)
        assert {h.name for h in placer.place(needs, w["d0"], 63).candidates} == {"p0", "p1"}  # 63 + 1 fit 64
        assert [h.name for h in placer.place(needs, w["d0"], 64).candidates] == ["p1"]
        w["p1"].suspect_since = 1.0  # the only one that takes it: routed there all the same
        assert [h.name for h in placer.place(needs, w["d0"], 100).candidates] == ["p1"]
        before = placer.metrics.routing.labels(LONG_PROMPT)._value.get()
        long = placer.place(needs, w["d0"], 128)
        assert long.reason == LONG_PROMPT and long.local and long.computes_prompt is w["d0"]
        assert placer.metrics.routing.labels(LONG_PROMPT)._value.get() == before + 1
        w["p1"].stats = dataclasses.replace(w["p1"].stats, max_model_len=0)  # not known: takes any
        assert placer.place(needs, w["d0"], 400).reason == REMOTE
        w["p1"].up = False
        assert placer.place(needs, w["d0"], 400).reason == LONG_PROMPT
        w["p0"].up = False  # no prefill worker up at all: the plain local placement
        assert placer.place(needs, w["d0"], 400).reason == LOCAL

    asyncio.run(body())


def test_decode_worker_avoids_a_worker_that_failed_the_request_unless_it_is_the_only_one() -> None:
    async def body() -> None:
        placer, w = _cluster({"d0": "decode", "d1": "decode"})
        w["d0"].stats = _stats("d0", 500)  # the most headroom
        needs = PlacementNeeds("req-3", prompt_tokens=40, needed_blocks=4)
        assert placer.decode_worker(needs, [w["d0"], w["d1"]]) is w["d0"]
        placer.avoid(needs, w["d0"])
        assert placer.decode_worker(needs, [w["d0"], w["d1"]]) is w["d1"]
        assert placer.decode_worker(needs, [w["d0"]]) is w["d0"]

    asyncio.run(body())

"""The request lifecycle and placement as pure logic (no worker processes; the workers are
handles in given states): an Abort or a disconnect before the request's task ran ends it and
gives back its ticket and any slot granted meanwhile; a burst spreads over decode workers by
expected free blocks; the liveness arithmetic (stall timeouts scaled by step time, suspects
trusted again, the call bound)."""
from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import grpc
import pytest

from gateway.adapters import WorkerStatsView
from gateway.config import WorkerPoolConfig
from gateway.dispatch import Dispatcher, Waiter
from gateway.liveness import LivenessConfig
from gateway.metrics import GatewayMetrics
from gateway.modelinfo import load_served_model
from gateway.placement import PlacementNeeds, Placer, expected_free_blocks
from gateway.request import RequestRunner, RequestState
from gateway.routing import CacheAwareRouter, RoutingConfig
from gateway.streaming import OutputAssembler
from gateway.tiers import TicketState, TierQueues
from gateway.validate import AdmittedRequest
from gateway.workers import WorkerHandle, WorkerRegistry
from tandem.types import SamplingParams, Tier


def _stats(name: str, free: int) -> WorkerStatsView:
    return WorkerStatsView(worker_id=name, role="decode", free_kv_blocks=free, total_kv_blocks=free, running=0,
                           waiting=0, queued_prefill_tokens=0, prefix_query_tokens=0, prefix_hit_tokens=0,
                           preemptions=0, draining=False)


def _gateway(n_decode: int = 2, free: int = 160, slots: int = 32):
    registry = WorkerRegistry(WorkerPoolConfig())
    for i in range(n_decode):
        h = WorkerHandle(f"127.0.0.1:{41000 + i}", "decode", grpc.aio.insecure_channel(f"127.0.0.1:{41000 + i}"),
                         slots)
        h.worker_id, h.stats, h.up = f"d{i}", _stats(f"d{i}", free), True
        registry.handles.append(h)
    metrics = GatewayMetrics()
    placer = Placer(registry=registry, router=CacheAwareRouter(RoutingConfig(), block_size=16), index=None,
                    hash_seed=0, block_size=16, local_prefill_tokens=0, sticky_bonus=0.25, metrics=metrics)
    queues: TierQueues[Waiter] = TierQueues({t: 64 for t in Tier}, {t: None for t in Tier})
    dispatcher = Dispatcher(queues, registry, placer, metrics)
    runner = RequestRunner(dispatcher=dispatcher, placer=placer, block_size=16, max_retries=1, metrics=metrics)
    return registry, dispatcher, runner


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]):
    return load_served_model(tiny_models["llama"])


def _state(model, rid: str) -> RequestState:
    params = SamplingParams(max_tokens=8)
    admitted = AdmittedRequest((5, 6, 7), params, Tier.STANDARD, rid, False)
    assembler = OutputAssembler(model.tokenizer, admitted.prompt_ids, params, model.eos_token_ids,
                                model.max_context, False)
    return RequestState(rid, admitted, assembler, 0.0, 1e12, PlacementNeeds(rid, 3, 4))


def test_abort_and_disconnect_before_the_task_runs_free_ticket_and_slot(model) -> None:
    async def body() -> None:
        registry, dispatcher, runner = _gateway()
        dispatcher.start()
        # Abort before the task ran: the stream gets its final chunk, the ticket leaves its queue
        # or gives back the slot granted meanwhile.
        for rid in ("a", "b"):
            st = _state(model, rid)
            st.ticket = dispatcher.enqueue(st.needs, Tier.STANDARD, None)
            if rid == "b":  # the dispatcher grants a slot before the task runs
                for _ in range(3):
                    await asyncio.sleep(0)
                assert st.ticket.item.future.done() and sum(h.inflight for h in registry.handles) == 1
            runner.start(st)
            assert not st.started
            assert runner.abort(st) and not runner.abort(st)  # found once
            last = st.out.get_nowait()
            assert last.finish_reason == "abort" and st.out.empty()
            for _ in range(5):
                await asyncio.sleep(0)
            assert not st.started and st.task.done()
            assert st.ticket.state is not TicketState.QUEUED
        # A disconnect before the task ran (runner.cancel).
        st = _state(model, "c")
        st.ticket = dispatcher.enqueue(st.needs, Tier.STANDARD, None)
        for _ in range(3):
            await asyncio.sleep(0)
        assert st.ticket.item.future.done()  # granted
        runner.start(st)
        runner.cancel(st)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not st.started and st.out.empty()
        # Abort before the request was even queued (its id known, matching the prompt).
        st = _state(model, "d")
        assert runner.abort(st) and st.ended
        assert sum(h.inflight for h in registry.handles) == 0
        assert sum(h.reserved_blocks for h in registry.handles) == 0
        assert len(dispatcher.queues) == 0
        await dispatcher.close()

    asyncio.run(body())


def test_a_burst_spreads_over_decode_workers_between_stats_polls() -> None:
    async def body() -> None:
        registry, dispatcher, _ = _gateway(2, free=160)
        dispatcher.start()
        tickets = [dispatcher.enqueue(PlacementNeeds(f"r{i}", 40, 4), Tier.STANDARD, None) for i in range(32)]
        granted = [await dispatcher.acquire(t) for t in tickets]
        split = sorted(Counter(h.name for h in granted).values())
        assert split == [16, 16]
        d0 = registry.handles[0]
        assert (d0.inflight, d0.reserved_blocks, d0.pending_blocks) == (16, 64, 64)
        assert expected_free_blocks(d0) == 160 - 64
        for h in granted:
            dispatcher.release(h, 4)
        assert all(h.inflight == 0 and h.reserved_blocks == 0 for h in registry.handles)
        # Unequal workers: the one with more room takes more, never all.
        registry2, dispatcher2, _ = _gateway(2, free=160)
        registry2.handles[1].stats = _stats("d1", 96)
        dispatcher2.start()
        tickets = [dispatcher2.enqueue(PlacementNeeds(f"s{i}", 40, 4), Tier.STANDARD, None) for i in range(32)]
        split = Counter([(await dispatcher2.acquire(t)).name for t in tickets])
        assert split["d0"] > split["d1"] > 0
        await dispatcher.close()
        await dispatcher2.close()

    asyncio.run(body())


def test_liveness_timeouts_scale_with_step_time_and_suspects_are_trusted_again() -> None:
    cfg = LivenessConfig(stall_timeout_s=3.0, stall_steps=20.0, prefill_stall_s=30.0, ewma_alpha=0.5)

    class W:
        step_s = 0.0

    w = W()
    assert cfg.stream_timeout(w) == 3.0 and cfg.prefill_timeout(w) == 30.0
    cfg.observe_chunk(w, 0.5)  # a slow batch: 0.5 s a step
    cfg.observe_chunk(w, 0.5)
    assert cfg.stream_timeout(w) == pytest.approx(10.0)  # 20 steps, not the 3 s floor
    cfg.observe_chunk(w, -1.0)  # ignored
    assert w.step_s == pytest.approx(0.5)
    assert not cfg.trusted_again(100.0, 102.0) and cfg.trusted_again(100.0, 103.0)
    assert cfg.call_bound(3072, 128) == 3072 + 128 + 256
    assert LivenessConfig(max_inflight_calls=10).call_bound(3072, 128) == 10
    for bad in ({"stall_timeout_s": 0}, {"ewma_alpha": 1.5}, {"max_inflight_calls": 0}, {"stall_steps": float("nan")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LivenessConfig(**bad)


def test_a_suspect_worker_is_not_routed_to_until_trusted_again() -> None:
    async def body() -> None:
        registry, _, _ = _gateway(1)
        h = registry.handles[0]
        registry.liveness = LivenessConfig(stall_timeout_s=0.05)
        other = WorkerHandle("127.0.0.1:41100", "decode", grpc.aio.insecure_channel("127.0.0.1:41100"), 32)
        other.worker_id, other.stats, other.up = "d9", _stats("d9", 10), True
        registry.handles.append(other)
        placer = Placer(registry=registry, router=CacheAwareRouter(RoutingConfig(), block_size=16), index=None,
                        hash_seed=0, block_size=16, local_prefill_tokens=0, sticky_bonus=0.25,
                        metrics=GatewayMetrics())
        needs = PlacementNeeds("r", 16, 1)
        assert placer.decode_worker(needs, [h, other]) is h  # more room
        registry.suspect(h, "test")
        assert not h.trusted and placer.decode_worker(needs, [h, other]) is other
        assert placer.decode_worker(needs, [h]) is h  # a suspect only when nothing else is free
        registry._on_stats(h, _stats("d0", 160))  # answers at once: still on probation
        assert not h.trusted
        await asyncio.sleep(0.06)
        registry._on_stats(h, _stats("d0", 160))
        assert h.trusted and placer.decode_worker(needs, [h, other]) is h

    asyncio.run(body())

"""The dispatcher: hands queued requests, in tier order, to decode-capable workers that have a
free slot (in-flight below `max_inflight_per_decode`). One task runs the loop; requests wait
for their turn in `acquire` and give the slot back with `release`."""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.metrics import GatewayMetrics
from gateway.routing import CacheAwareRouter, pick_decode
from gateway.tiers import Ticket, TierQueues
from gateway.workers import WorkerHandle, WorkerRegistry
from tandem.types import Tier

logger = logging.getLogger(__name__)

DISPATCH_LOG_SIZE = 4096


@dataclass(frozen=True)
class DispatchEvent:
    """One line of the dispatch log: kind is "enqueue", "dispatch" (`worker` is the decode or
    role-both worker), or "prefill" (`worker` computed the prompt: a prefill worker, or the
    decode worker itself for a local prefill; `reason` is the routing reason); `order` increases."""

    order: int
    kind: str
    request_id: str
    tier: Tier
    effective_tier: Tier | None = None
    worker: str = ""
    reason: str = ""


@dataclass(eq=False)
class Waiter:
    """What a queued request needs to be placed."""

    request_id: str
    prompt_tokens: int
    needed_blocks: int
    matches: Mapping[str, int] = field(default_factory=dict)  # prefix-index match of the prompt
    hashes: tuple[int, ...] = ()  # the prompt's block hashes; empty while the index is unusable
    avoid: set[str] = field(default_factory=set)  # workers that failed this request
    future: asyncio.Future[WorkerHandle] | None = None


class Dispatcher:
    """Strict-priority (with aging) dispatch onto decode-worker slots.

    Order of events for one request: `enqueue` (may raise QueueFull), then `acquire` (waits
    for a slot; cancelling it removes the request from its queue), `release` when the attempt
    ends; for a retry, `acquire(..., retry=True)` puts the same ticket back at its arrival
    position. Placement among workers with a free slot: with role-both workers only, the
    cache-aware router (they prefill too); otherwise the most KV headroom (routing.pick_decode).
    """

    def __init__(self, queues: TierQueues[Waiter], registry: WorkerRegistry, router: CacheAwareRouter,
                 metrics: GatewayMetrics | None = None, sticky_bonus: float = 0.25) -> None:
        self.queues = queues
        self.registry = registry
        self.router = router
        self.metrics = metrics
        self.sticky_bonus = sticky_bonus
        self.log: deque[DispatchEvent] = deque(maxlen=DISPATCH_LOG_SIZE)
        self._order = itertools.count()
        self._capacity = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="dispatcher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def wake(self) -> None:
        """Capacity may have changed (slot released, worker up or down)."""
        self._capacity.set()

    # ---------------------------------------------------------------- request side

    def enqueue(self, waiter: Waiter, tier: Tier, deadline: float | None) -> Ticket[Waiter]:
        """Queue a new request; raises tiers.QueueFull when its tier is full."""
        ticket = self.queues.put(waiter, tier, deadline)
        waiter.future = asyncio.get_running_loop().create_future()
        self.log.append(DispatchEvent(next(self._order), "enqueue", waiter.request_id, ticket.tier))
        return ticket

    async def acquire(self, ticket: Ticket[Waiter], retry: bool = False) -> WorkerHandle:
        """Wait until the dispatcher gives this ticket a worker slot."""
        waiter = ticket.item
        if retry:
            waiter.future = asyncio.get_running_loop().create_future()
            self.queues.requeue(ticket)
        assert waiter.future is not None, "acquire() before enqueue()"
        try:
            return await waiter.future
        except asyncio.CancelledError:
            fut = waiter.future
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # granted just as we were cancelled
            else:
                self.queues.cancel(ticket)
            raise

    def release(self, worker: WorkerHandle) -> None:
        worker.inflight = max(0, worker.inflight - 1)
        self.wake()

    def note_prefill(self, request_id: str, tier: Tier, worker: WorkerHandle, reason: str) -> None:
        """Log which worker computes a request's prompt, and why (tests and benchmarks read it)."""
        self.log.append(DispatchEvent(next(self._order), "prefill", request_id, tier, worker=worker.name,
                                      reason=reason))

    # ---------------------------------------------------------------- the loop

    def _has_slot(self) -> bool:
        return any(h.has_slot for h in self.registry.decode_workers())

    async def _run(self) -> None:
        while True:
            while not self._has_slot():
                self._capacity.clear()
                await self._capacity.wait()
            ticket = await self.queues.get()
            waiter = ticket.item
            if waiter.future is None or waiter.future.done():
                continue  # its caller gave up (cancelled) between the pop and now
            worker = self._pick(waiter)
            if worker is None:  # capacity vanished while we waited for a request
                self.queues.requeue(ticket)
                continue
            worker.inflight += 1
            tier = ticket.effective_tier if ticket.effective_tier is not None else ticket.tier
            self.log.append(DispatchEvent(next(self._order), "dispatch", waiter.request_id, ticket.tier, tier,
                                          worker.name))
            if self.metrics is not None:
                self.metrics.dispatched.labels(ticket.tier.name.lower(), tier.name.lower()).inc()
                if ticket.requeues == 0:
                    self.metrics.queue_wait.labels(ticket.tier.name.lower()).observe(self.queues.waited(ticket))
            waiter.future.set_result(worker)

    def _pick(self, waiter: Waiter) -> WorkerHandle | None:
        free = [h for h in self.registry.decode_workers() if h.has_slot]
        if not free:
            return None
        preferred = [h for h in free if h.name not in waiter.avoid]
        cands = preferred or free
        if len(cands) == 1:
            return cands[0]
        # Requests admitted together were matched before any of them was placed.
        matches = self.router.with_recent(waiter.matches, waiter.hashes)
        if all(h.role == "both" for h in cands):
            # Colocated workers prefill too: prefer the one holding the prompt's prefix.
            decision = self.router.route([h.name for h in cands], waiter.prompt_tokens,
                                         matches if waiter.hashes else None, request_id=waiter.request_id)
            self.router.remember(decision.worker_id, waiter.hashes)
            if self.metrics is not None:
                self.metrics.routing.labels(decision.reason).inc()
            return next(h for h in cands if h.name == decision.worker_id)
        by_name = {h.name: h for h in cands}
        # The decode worker holding the longest prefix (e.g. the previous turn) gets a bonus.
        sticky = max(cands, key=lambda h: matches.get(h.name, 0))
        name = pick_decode({h.name: (h.free_blocks, h.inflight) for h in cands}, waiter.needed_blocks,
                           sticky.name if matches.get(sticky.name) else None,
                           sticky_bonus=self.sticky_bonus)
        if name is None:  # nobody has room by the (slightly stale) stats: least loaded, Reserve decides
            return min(cands, key=lambda h: (h.inflight, -h.free_blocks, h.name))
        return by_name[name]

"""The dispatcher: hands queued requests, in tier order, to decode-capable workers that have a
free slot (in-flight below `max_inflight_per_decode`). One task runs the loop; requests wait
for their turn in `acquire` and give the slot back with `release`. Which of the workers with a
free slot a request gets is the placer's decision (gateway.placement)."""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from dataclasses import dataclass

from gateway.metrics import GatewayMetrics
from gateway.placement import PlacementNeeds, Placer
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
    """A queued request: what placing it needs, and the future its slot is granted through."""

    needs: PlacementNeeds
    future: asyncio.Future[WorkerHandle] | None = None

    @property
    def request_id(self) -> str:
        return self.needs.request_id


class Dispatcher:
    """Strict-priority (with aging) dispatch onto decode-worker slots.

    Order of events for one request: `enqueue` (may raise QueueFull), then `acquire` (waits
    for a slot; cancelling it removes the request from its queue), `release` when the attempt
    ends; for a retry, `acquire(..., retry=True)` puts the same ticket back at its arrival
    position. Among workers with a free slot, `Placer.decode_worker` picks (it reads the
    request's `PlacementNeeds`, which the request flow updates through the placer). A grant
    counts the request's blocks on the worker (`reserved_blocks`, and `pending_blocks` until
    the worker's next Stats answer) until `release(worker, blocks)`. `withdraw(ticket)` is for
    a request that ends without using its grant (cancelled before its task ran).
    """

    def __init__(self, queues: TierQueues[Waiter], registry: WorkerRegistry, placer: Placer,
                 metrics: GatewayMetrics | None = None) -> None:
        self.queues = queues
        self.registry = registry
        self.placer = placer
        self.metrics = metrics
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

    def enqueue(self, needs: PlacementNeeds, tier: Tier, deadline: float | None) -> Ticket[Waiter]:
        """Queue a new request; raises tiers.QueueFull when its tier is full."""
        waiter = Waiter(needs)
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
            worker = await waiter.future
        except asyncio.CancelledError:
            self.withdraw(ticket)
            raise
        waiter.future = None  # the grant is the caller's now: `withdraw` leaves it alone
        return worker

    def withdraw(self, ticket: Ticket[Waiter]) -> None:
        """The ticket's request ended without (or before) taking its slot: take it out of its
        queue, or give back the slot granted meanwhile. Idempotent; safe at any moment, also
        for a request whose task never started."""
        fut = ticket.item.future
        if fut is not None and fut.done() and not fut.cancelled():
            ticket.item.future = None
            self.release(fut.result(), ticket.item.needs.needed_blocks)  # granted, never used
            return
        self.queues.cancel(ticket)
        if fut is not None and not fut.done():
            fut.cancel()

    def release(self, worker: WorkerHandle, blocks: int = 0) -> None:
        """An attempt on `worker` ended: its slot (and the `blocks` counted for it) are free."""
        worker.inflight = max(0, worker.inflight - 1)
        worker.reserved_blocks = max(0, worker.reserved_blocks - blocks)
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
            worker.reserved_blocks += waiter.needs.needed_blocks
            worker.pending_blocks += waiter.needs.needed_blocks
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
        return self.placer.decode_worker(waiter.needs, free)

"""Admission queues: one bounded FIFO per priority tier, strict priority with aging.

Pure asyncio and a clock; no I/O, so the dispatch order is deterministic and unit-testable.
"""
from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tandem.types import Tier

logger = logging.getLogger(__name__)
T = TypeVar("T")


class QueueFull(Exception):
    """The request's tier already holds its capacity of queued requests."""

    def __init__(self, tier: Tier, capacity: int) -> None:
        super().__init__(f"tier: the {tier.name} queue is full ({capacity} requests waiting); retry later")
        self.tier = tier
        self.capacity = capacity


class TicketState(str, enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


@dataclass(eq=False)
class Ticket(Generic[T]):
    """A queued item. `seq` is the arrival order; `state` is queued, dispatched, cancelled or
    expired. `effective_tier` is the tier it was dispatched from (after aging)."""

    item: T
    tier: Tier
    seq: int
    enqueued_at: float
    deadline: float | None = None
    state: TicketState = TicketState.QUEUED
    effective_tier: Tier | None = None
    requeues: int = field(default=0)


class TierQueues(Generic[T]):
    """Three bounded FIFOs with strict priority and aging.

    Order of `pop_nowait` / `get`: the queued ticket with the best (effective tier, seq), where
    the effective tier is the ticket's tier promoted one step for each aging period it waited:
    a BATCH ticket counts as STANDARD after aging_s[BATCH] seconds, and as INTERACTIVE after
    a further aging_s[STANDARD] seconds (None: the tier never ages). Within one effective tier
    the earlier arrival goes first, so a promoted ticket precedes later arrivals of the tier
    it joined. Tickets whose deadline has passed are dropped (state "expired"), never returned.

    `put` raises QueueFull when the ticket's own tier holds `capacities[tier]` tickets.
    `requeue` puts a dispatched ticket back in its arrival position (a retry does not queue
    behind later arrivals) and ignores capacity: the ticket already held a place.
    """

    def __init__(
        self,
        capacities: Mapping[Tier, int],
        aging_s: Mapping[Tier, float | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for tier in Tier:
            cap = capacities.get(tier)
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise ValueError(f"capacities: {tier.name} must be an integer >= 1, got {cap!r}")
            age = aging_s.get(tier)
            if age is not None and (isinstance(age, bool) or not isinstance(age, (int, float)) or age <= 0):
                raise ValueError(f"aging_s: {tier.name} must be None or > 0, got {age!r}")
        self._capacity = {t: int(capacities[t]) for t in Tier}
        self._aging = {t: aging_s.get(t) for t in Tier}
        self._clock = clock
        self._queues: dict[Tier, deque[Ticket[T]]] = {t: deque() for t in Tier}
        self._seq = itertools.count()
        self._nonempty = asyncio.Event()
        self.on_expire: Callable[[Ticket[T]], None] | None = None

    # ---------------------------------------------------------------- queueing

    def put(self, item: T, tier: Tier, deadline: float | None = None) -> Ticket[T]:
        """Queue `item` in `tier`; `deadline` is a clock value after which it is dropped."""
        tier = Tier.parse(tier)
        queue = self._queues[tier]
        if len(queue) >= self._capacity[tier]:
            raise QueueFull(tier, self._capacity[tier])
        ticket: Ticket[T] = Ticket(item, tier, next(self._seq), self._clock(), deadline)
        queue.append(ticket)
        self._nonempty.set()
        return ticket

    def requeue(self, ticket: Ticket[T]) -> None:
        """Put a dispatched ticket back at its arrival position."""
        if ticket.state is TicketState.QUEUED:
            return
        if ticket.state is not TicketState.DISPATCHED:
            raise ValueError(f"ticket: only a dispatched ticket can be requeued, this one is {ticket.state.value}")
        queue = self._queues[ticket.tier]
        pos = 0
        while pos < len(queue) and queue[pos].seq < ticket.seq:
            pos += 1
        queue.insert(pos, ticket)
        ticket.state = TicketState.QUEUED
        ticket.effective_tier = None
        ticket.requeues += 1
        self._nonempty.set()

    def cancel(self, ticket: Ticket[T]) -> bool:
        """Remove a queued ticket; False when it is no longer queued."""
        if ticket.state is not TicketState.QUEUED:
            return False
        self._queues[ticket.tier].remove(ticket)
        ticket.state = TicketState.CANCELLED
        self._update_event()
        return True

    # ---------------------------------------------------------------- dispatching

    def effective_tier(self, ticket: Ticket[T], now: float | None = None) -> Tier:
        """The tier `ticket` competes in at time `now` (its own tier, promoted by aging)."""
        now = self._clock() if now is None else now
        waited = now - ticket.enqueued_at
        tier = ticket.tier
        while tier > Tier.INTERACTIVE:
            age = self._aging[tier]
            if age is None or waited < age:
                break
            waited -= age
            tier = Tier(tier - 1)
        return tier

    def pop_nowait(self) -> Ticket[T] | None:
        """The next ticket to dispatch (state becomes "dispatched"), or None when empty."""
        now = self._clock()
        self._drop_expired(now)
        best: tuple[Tier, int] | None = None
        best_tier: Tier | None = None
        for tier in Tier:
            queue = self._queues[tier]
            if not queue:
                continue
            # Each queue is in arrival order, so its head has waited longest and ranks best.
            key = (self.effective_tier(queue[0], now), queue[0].seq)
            if best is None or key < best:
                best, best_tier = key, tier
        if best is None or best_tier is None:
            self._update_event()
            return None
        ticket = self._queues[best_tier].popleft()
        ticket.state = TicketState.DISPATCHED
        ticket.effective_tier = best[0]
        self._update_event()
        return ticket

    async def get(self) -> Ticket[T]:
        """Wait for and pop the next ticket (see `pop_nowait`)."""
        while True:
            ticket = self.pop_nowait()
            if ticket is not None:
                return ticket
            await self._nonempty.wait()

    # ---------------------------------------------------------------- introspection

    def waited(self, ticket: Ticket[T]) -> float:
        """Seconds since `ticket` was first queued."""
        return max(0.0, self._clock() - ticket.enqueued_at)

    def depth(self, tier: Tier) -> int:
        return len(self._queues[Tier.parse(tier)])

    def capacity(self, tier: Tier) -> int:
        return self._capacity[Tier.parse(tier)]

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def _drop_expired(self, now: float) -> None:
        for queue in self._queues.values():
            expired = [t for t in queue if t.deadline is not None and t.deadline <= now]
            for ticket in expired:
                queue.remove(ticket)
                ticket.state = TicketState.EXPIRED
                if self.on_expire is not None:
                    self.on_expire(ticket)

    def _update_event(self) -> None:
        if any(self._queues.values()):
            self._nonempty.set()
        else:
            self._nonempty.clear()

"""The gateway's tier queues: strict priority, FIFO within a tier, aging, bounded capacity,
cancellation and expiry, on a hand-driven clock (no processes, no sleeps)."""
from __future__ import annotations

import asyncio

import pytest

from gateway.tiers import QueueFull, TierQueues
from tandem.types import Tier

I, S, B = Tier.INTERACTIVE, Tier.STANDARD, Tier.BATCH


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(capacity: int = 8, aging: dict | None = None) -> tuple[TierQueues[str], Clock]:
    clock = Clock()
    ages = aging if aging is not None else {I: None, S: 5.0, B: 30.0}
    return TierQueues({t: capacity for t in Tier}, ages, clock=clock), clock


def drain(q: TierQueues[str]) -> list[str]:
    out = []
    while (t := q.pop_nowait()) is not None:
        out.append(t.item)
    return out


def test_strict_priority_then_arrival_order() -> None:
    q, _ = make()
    for name, tier in [("b1", B), ("s1", S), ("b2", B), ("i1", I), ("s2", S), ("i2", I)]:
        q.put(name, tier)
    assert drain(q) == ["i1", "i2", "s1", "s2", "b1", "b2"]
    assert len(q) == 0


def test_aging_promotes_one_tier_per_period() -> None:
    q, clock = make()
    old_batch = q.put("old-batch", B)
    clock.t += 10
    assert q.effective_tier(old_batch) is B
    clock.t += 22  # old-batch has waited 32 s: past BATCH's 30 s, not STANDARD's further 5 s
    q.put("std", S)
    q.put("inter", I)
    assert q.effective_tier(old_batch) is S
    # INTERACTIVE still first; the promoted BATCH arrived before "std", so it precedes it.
    first = q.pop_nowait()
    assert first is not None and first.item == "inter"
    second = q.pop_nowait()
    assert second is not None and second.item == "old-batch" and second.effective_tier is S
    assert drain(q) == ["std"]


def test_aged_twice_competes_with_interactive_by_arrival() -> None:
    q, clock = make()
    q.put("batch", B)
    clock.t += 1
    q.put("inter", I)
    clock.t += 35  # batch waited 36 s >= 30 + 5: counts as INTERACTIVE and arrived first
    t = q.pop_nowait()
    assert t is not None and t.item == "batch" and t.effective_tier is I
    assert drain(q) == ["inter"]


def test_no_aging_when_disabled() -> None:
    q, clock = make(aging={I: None, S: None, B: None})
    q.put("batch", B)
    clock.t += 1e6
    q.put("std", S)
    assert drain(q) == ["std", "batch"]


def test_full_tier_raises_and_other_tiers_still_accept() -> None:
    q, _ = make(capacity=2)
    q.put("b1", B)
    q.put("b2", B)
    with pytest.raises(QueueFull, match="tier: the BATCH queue is full") as info:
        q.put("b3", B)
    assert info.value.tier is B and info.value.capacity == 2
    q.put("s1", S)  # another tier is unaffected
    assert q.depth(B) == 2 and q.depth(S) == 1
    assert q.pop_nowait().item == "s1"
    assert q.pop_nowait().item == "b1"
    q.put("b3", B)  # popping freed a place
    assert drain(q) == ["b2", "b3"]


def test_cancelled_entries_are_never_dispatched() -> None:
    q, _ = make()
    a = q.put("a", S)
    q.put("b", S)
    c = q.put("c", I)
    assert q.cancel(a) and q.cancel(c)
    assert not q.cancel(a)  # already gone
    assert a.state == "cancelled" and q.depth(S) == 1 and q.depth(I) == 0
    assert drain(q) == ["b"]


def test_expired_entries_are_dropped_and_reported() -> None:
    q, clock = make()
    expired = []
    q.on_expire = expired.append
    q.put("soon", I, deadline=clock.t + 1)
    q.put("later", S, deadline=clock.t + 100)
    q.put("never", B)
    clock.t += 2
    assert drain(q) == ["later", "never"]
    assert [t.item for t in expired] == ["soon"] and expired[0].state == "expired"


def test_requeue_keeps_arrival_position_and_ignores_capacity() -> None:
    q, _ = make(capacity=2)
    first = q.put("first", S)
    q.put("second", S)
    popped = q.pop_nowait()
    assert popped is first
    q.put("third", S)  # the tier is full again
    q.requeue(first)  # a retry goes back ahead of later arrivals, over capacity
    assert q.depth(S) == 3 and first.requeues == 1
    assert drain(q) == ["first", "second", "third"]
    with pytest.raises(ValueError, match="ticket"):
        q.requeue(_cancelled(q))  # a cancelled ticket cannot come back


def _cancelled(q: TierQueues[str]):
    t = q.put("gone", B)
    q.cancel(t)
    return t


def test_get_waits_until_something_is_queued() -> None:
    async def scenario() -> list[str]:
        q, _ = make()
        got: list[str] = []

        async def consumer() -> None:
            for _ in range(3):
                got.append((await q.get()).item)

        task = asyncio.create_task(consumer())
        await asyncio.sleep(0)
        assert got == [] and not task.done()  # nothing queued: get() is waiting
        q.put("b", B)
        q.put("i", I)  # both queued before the consumer runs again: priority decides
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        q.put("s", S)
        await asyncio.wait_for(task, 5)
        return got

    assert asyncio.run(scenario()) == ["i", "b", "s"]


@pytest.mark.parametrize(("caps", "ages", "field"), [
    ({I: 0, S: 1, B: 1}, {}, "capacities"),
    ({I: 1, S: 1}, {}, "capacities"),
    ({I: 1, S: 1, B: 1}, {B: -1.0}, "aging_s"),
])
def test_bad_configuration_names_the_field(caps: dict, ages: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TierQueues(caps, ages)

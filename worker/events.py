"""Fan-out of the prefix cache's BlockStored / BlockRemoved events to KvEvents subscribers.

The engine thread feeds every event it drains from `engine.cache` into one `KvEventHub`. The
hub keeps the set of block hashes the cache holds (the radix cache has no public call that
lists hashes, but since the hub sees every event from the engine's start, its set is exact),
so a new subscriber first gets a `reset` batch with all of them, then deltas in `seq` order.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.radix_cache import BlockStored, KvEvent
from kvindex import coalesce

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvEventBatch:
    """Hashes stored in / removed from the cache. The lists are disjoint (the last event of a
    hash wins), so their order of application does not matter. `reset`: `stored` is the whole
    set held and the subscriber must drop what it knew before."""

    seq: int
    reset: bool
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


Subscriber = Callable[[KvEventBatch], None]


class KvEventHub:
    """Not thread-safe: every method runs on the engine thread. Subscribers are called there
    too, so they must only hand the batch over (to a queue or an event loop) and return."""

    def __init__(self) -> None:
        self._hashes: set[int] = set()
        self._seq = 0
        self._subscribers: dict[int, Subscriber] = {}
        self._next_id = 0

    @property
    def num_hashes(self) -> int:
        return len(self._hashes)

    def pump(self, events: Iterable[KvEvent]) -> KvEventBatch | None:
        """Apply a drained event list; send and return the delta batch (None when empty)."""
        stored, removed = coalesce((isinstance(ev, BlockStored), ev.block_hashes) for ev in events)
        if not stored and not removed:
            return None
        self._hashes.update(stored)
        self._hashes.difference_update(removed)
        self._seq += 1
        batch = KvEventBatch(self._seq, False, stored, removed)
        for sub_id, sub in list(self._subscribers.items()):
            self._call(sub_id, sub, batch)
        return batch

    def subscribe(self, subscriber: Subscriber) -> int:
        """Send the reset batch to `subscriber` and register it for deltas; returns its id."""
        self._next_id += 1
        sub_id = self._next_id
        self._subscribers[sub_id] = subscriber
        self._call(sub_id, subscriber, KvEventBatch(self._seq, True, sorted(self._hashes), []))
        return sub_id

    def unsubscribe(self, sub_id: int) -> None:
        self._subscribers.pop(sub_id, None)

    def _call(self, sub_id: int, sub: Subscriber, batch: KvEventBatch) -> None:
        try:
            sub(batch)
        except Exception:
            logger.exception("kv events subscriber %d failed; dropping it", sub_id)
            self._subscribers.pop(sub_id, None)

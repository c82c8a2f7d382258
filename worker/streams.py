"""Hand-over from the engine thread to the asyncio event loop that serves gRPC.

The engine thread must never wait on the event loop. `AsyncBridge.post` appends to a list and,
for the first item of a burst only, schedules one `call_soon_threadsafe`, so a step that
produces outputs for 200 requests wakes the event loop once, not 200 times.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from tandem.rules import WORKER_MAX_HOLD_S, StreamGrouping

logger = logging.getLogger(__name__)


class AsyncBridge:
    """Thread-safe `post(queue, item)` into asyncio queues owned by `loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Any]] = []
        self._scheduled = False

    def post(self, q: asyncio.Queue, item: Any) -> None:
        self.post_all(q, [item])

    def post_all(self, q: asyncio.Queue, items: list[Any]) -> None:
        """Post `items` in order, at once: a reader of `q` sees all of them or none (the event
        loop puts everything pending in one callback)."""
        with self._lock:
            self._pending.extend((q, item) for item in items)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop is closed: nobody is left to read
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
            self._scheduled = False
        for q, item in items:
            q.put_nowait(item)


class ItemStream:
    """An unbounded asyncio queue fed from the engine thread through an `AsyncBridge`."""

    def __init__(self, bridge: AsyncBridge) -> None:
        self._bridge = bridge
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Any thread."""
        self._bridge.post(self._queue, item)

    def put_all(self, items: list[Any]) -> None:
        """Any thread: `items` in order, reaching a reader together (one `get_batch` sees all)."""
        self._bridge.post_all(self._queue, items)

    async def get_batch(self, timeout: float | None = None) -> list[Any]:
        """Every item available now, waiting (up to `timeout`) for at least one.
        Raises TimeoutError when none came in time."""
        if self._queue.empty():
            first = await asyncio.wait_for(self._queue.get(), timeout) if timeout is not None else await self._queue.get()
            items = [first]
        else:
            items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        return items


def coalescing(put_all: Callable[[list[Any]], None], every: int) -> Callable[[Any], None]:
    """A request's listener (engine thread) that passes its outputs on to `put_all` a group per
    call (ItemStream.put_all, so the reader never sees part of one), so that the event loop
    wakes, and the stream sends a chunk, once a group rather than once a step: as
    `tandem.rules.StreamGrouping` says for `every` (the first output at once, then whenever the
    outputs held carry `every` new tokens, or were held WORKER_MAX_HOLD_S), and at the end (a
    finished output, or an exception) with everything held before it, in order. Nothing is
    reordered or dropped. every <= 1: each output is a group."""
    if every <= 1:
        return lambda item: put_all([item])
    grouping = StreamGrouping(every, max_hold_s=WORKER_MAX_HOLD_S)
    held: list[Any] = []

    def listener(item: Any) -> None:
        end = isinstance(item, BaseException) or item.finished
        held.append(item)
        if grouping.add(0 if isinstance(item, BaseException) else len(item.new_token_ids), end):
            group = held[:]
            held.clear()
            put_all(group)

    return listener

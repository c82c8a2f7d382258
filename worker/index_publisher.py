"""Publishes a worker's prefix-cache events to a shared prefix index (kvindex, e.g. Redis) and
keeps the worker's heartbeat there, from a thread of its own (index I/O never runs on the
engine thread). Used when the worker is started with --redis-url."""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from kvindex import PrefixIndex, WorkerInfo, coalesce
from worker.engine_loop import EngineLoop, LoopStopped
from worker.events import KvEventBatch

logger = logging.getLogger(__name__)


class IndexPublisher:
    """start(): clear this worker's stale entries, subscribe to the engine's KV events, publish
    them in coalesced batches and heartbeat every `index.heartbeat_interval_s`.
    A heartbeat that finds this worker unregistered (its entries were reaped after a lapse, or
    Redis restarted empty) triggers a resync: subscribing again yields a reset batch with every
    hash the cache holds, which is published after a clear.
    close(): unsubscribe, deregister (which clears the entries) and close the index."""

    def __init__(self, index: PrefixIndex, worker_id: str, loop: EngineLoop, info: Callable[[], WorkerInfo]) -> None:
        self.index = index
        self.worker_id = worker_id
        self.loop = loop
        self._info = info
        self._batches: queue.SimpleQueue[KvEventBatch | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._sub_id = 0
        self._thread = threading.Thread(target=self._run, name="index-publisher", daemon=True)

    def start(self) -> None:
        self.index.clear(self.worker_id)
        self.index.heartbeat(self.worker_id, self._info())
        self._sub_id = self.loop.submit(lambda _e: self.loop.events.subscribe(self._batches.put)).result()
        self._thread.start()

    def _run(self) -> None:
        interval = self.index.heartbeat_interval_s
        last_beat = time.monotonic()
        while not self._stop.is_set():
            try:
                first = self._batches.get(timeout=interval)
            except queue.Empty:
                first = None
            batches = [] if first is None else [first]
            while True:
                try:
                    item = self._batches.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    batches.append(item)
            try:
                self._publish(batches)
                if time.monotonic() - last_beat >= interval / 2:
                    if self.index.heartbeat(self.worker_id, self._info()):
                        self._resync()
                    last_beat = time.monotonic()
            except LoopStopped:
                return
            except Exception:  # the index degrades on its own; keep the thread alive
                logger.exception("prefix index publish failed")

    def _resync(self) -> None:
        """Swap the subscription for a new one, whose reset batch republishes the whole cache."""
        logger.info("prefix index: worker %s was not registered; republishing its cache", self.worker_id)
        old = self._sub_id

        def swap(_engine: object) -> int:
            self.loop.events.unsubscribe(old)
            return self.loop.events.subscribe(self._batches.put)

        self._sub_id = self.loop.submit(swap).result(timeout=30)

    def _publish(self, batches: list[KvEventBatch]) -> None:
        if not batches:
            return
        events: list[tuple[bool, list[int]]] = []
        for b in batches:
            if b.reset:
                self.index.clear(self.worker_id)
                events = []
            events += [(True, b.stored), (False, b.removed)]
        stored, removed = coalesce(events)
        if stored or removed:
            self.index.publish(self.worker_id, stored, removed)

    def close(self) -> None:
        self._stop.set()
        self._batches.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        sub_id = self._sub_id  # read after the join: a resync may have replaced it
        try:
            self.loop.submit(lambda _e: self.loop.events.unsubscribe(sub_id)).result(timeout=5)
        except (LoopStopped, TimeoutError):
            pass
        try:
            self.index.deregister(self.worker_id)
            self.index.flush()
        except Exception:
            logger.exception("prefix index deregister failed")
        self.index.close()

"""The gateway's view of its workers: a static list of prefill / decode / role-both addresses,
one channel each, Stats polled every ~100 ms (a worker that fails a poll is down and skipped
until it answers again), and per-worker KvEvents streams feeding the embedded prefix index."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from gateway.adapters import KvEventBatch, WorkerStatsView
from gateway.config import WorkerPoolConfig
from gateway.liveness import LivenessConfig
from gateway.metrics import GatewayMetrics
from gateway.worker_client import KvEventStream, WorkerClient, WorkerCredentials
from tandem.types import ROLES

if TYPE_CHECKING:
    from kvindex.base import PrefixIndex

logger = logging.getLogger(__name__)

_RECONNECT_S = (0.1, 0.2, 0.5, 1.0, 2.0)


@dataclass(eq=False)
class WorkerHandle:
    """One worker. `inflight` counts the requests this gateway has on it as decode worker;
    `worker_id` comes from its Stats (the address until the first answer); `client` makes
    every call to it (gateway.worker_client)."""

    address: str
    role: str
    channel: grpc.aio.Channel
    max_inflight: int
    worker_id: str = ""
    stats: WorkerStatsView | None = None
    up: bool = False
    inflight: int = 0
    last_error: str = ""
    mark: str = ""  # "drained" or "isolated" by the Admin service (gateway/admin.py): never routable
    # Placement and liveness (gateway.dispatch, gateway.liveness): blocks the requests this
    # gateway has on the worker may need, those of them granted since its last Stats answer,
    # its step time as learnt from its streams, and when a stall made it suspect (None: trusted).
    reserved_blocks: int = 0
    pending_blocks: int = 0
    step_s: float = 0.0
    suspect_since: float | None = None
    last_progress: float = 0.0  # when any stream or prefill on it last made progress (monotonic)
    credentials: WorkerCredentials | None = field(default=None, repr=False)  # token and TLS CA for its calls
    client: WorkerClient = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.client = WorkerClient(self)

    @property
    def name(self) -> str:
        return self.worker_id or self.address

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def routable(self) -> bool:
        return self.up and not self.mark and not (self.stats is not None and self.stats.draining)

    @property
    def trusted(self) -> bool:
        """Not suspect (a stall was seen on it and it has not answered Stats for a stall timeout
        since). Placement skips suspects unless every candidate is one."""
        return self.suspect_since is None

    @property
    def has_slot(self) -> bool:
        return self.routable and self.inflight < self.max_inflight

    @property
    def free_blocks(self) -> int:
        return self.stats.free_kv_blocks if self.stats is not None else 0


class WorkerRegistry:
    """Channels, health and prefix-index feeding for every configured worker.

    `index` (a kvindex.PrefixIndex or None) is fed from KvEvents and heartbeats when
    `feed_index` is True (embedded memory index); with a shared Redis index the workers
    publish themselves and the registry only reads. `on_change()` is called whenever a worker
    goes up or down or starts/stops draining (the dispatcher re-checks capacity then).
    """

    def __init__(self, pool: WorkerPoolConfig, *, index: PrefixIndex | None = None, feed_index: bool = False,
                 metrics: GatewayMetrics | None = None, channel_options: list[tuple[str, Any]] | None = None,
                 on_change: Callable[[], None] | None = None, liveness: LivenessConfig | None = None,
                 credentials: WorkerCredentials | None = None) -> None:
        self.pool = pool
        self.liveness = liveness or LivenessConfig()
        self.credentials = credentials or WorkerCredentials()
        self.index = index
        self.feed_index = feed_index and index is not None
        self.metrics = metrics
        self.on_change = on_change or (lambda: None)
        self._options = channel_options or []
        self.handles: list[WorkerHandle] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._last_heartbeat: dict[str, float] = {}
        self._event_calls: dict[str, KvEventStream] = {}  # address -> its KvEvents call in progress
        self._events_synced: set[str] = set()  # addresses whose current stream's reset was applied
        self._closed = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Open channels and start polling; returns at once (workers come up as they answer)."""
        for role in ROLES:
            for addr in getattr(self.pool, role):
                channel = self.credentials.channel(addr, self._options)
                self.handles.append(WorkerHandle(addr, role, channel, self.pool.max_inflight_per_decode,
                                                 credentials=self.credentials))
        for h in self.handles:
            self._tasks.append(asyncio.create_task(self._poll(h), name=f"stats:{h.address}"))
            if self.feed_index:
                self._tasks.append(asyncio.create_task(self._kv_events(h), name=f"kvevents:{h.address}"))

    async def close(self) -> None:
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for h in self.handles:
            await h.channel.close()

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait until a decode-capable worker is up (and, if prefill workers are configured
        without role-both ones, a prefill worker too); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready():
                return True
            await asyncio.sleep(self.pool.stats_interval_s)
        return self.ready()

    def ready(self) -> bool:
        decode_up = any(h.routable for h in self.handles if h.can_decode)
        need_prefill = bool(self.pool.prefill) and not self.pool.both
        prefill_up = any(h.routable for h in self.handles if h.role == "prefill")
        return decode_up and (prefill_up or not need_prefill)

    # ---------------------------------------------------------------- views

    def decode_workers(self) -> list[WorkerHandle]:
        return [h for h in self.handles if h.can_decode]

    def prefill_workers(self) -> list[WorkerHandle]:
        """Workers that prefill for another worker's decode (role "prefill")."""
        return [h for h in self.handles if h.role == "prefill"]

    def by_name(self, name: str) -> WorkerHandle | None:
        for h in self.handles:
            if h.name == name:
                return h
        return None

    def suspect(self, h: WorkerHandle, why: str) -> None:
        """A stream or prefill on `h` stalled: place nothing on it (unless every candidate is
        suspect) until it is trusted again (it answers Stats for a stall timeout after this;
        gateway.liveness.trusted_again)."""
        first = h.suspect_since is None
        h.suspect_since = time.monotonic()
        if first:
            logger.warning("worker %s (%s) is suspect: %s", h.name, h.address, why)
            if self.metrics is not None:
                self.metrics.suspects.labels(h.role).inc()
            self.on_change()

    # ---------------------------------------------------------------- polling

    async def _poll(self, h: WorkerHandle) -> None:
        interval, timeout = self.pool.stats_interval_s, self.pool.stats_timeout_s
        while not self._closed:
            started = time.monotonic()
            try:
                stats = await h.client.stats(timeout)
            except asyncio.CancelledError:
                raise
            except grpc.RpcError as exc:
                self._set_up(h, False, f"Stats: {exc.code().name}")
                self._still_suspect(h)
            except Exception as exc:  # a malformed reply must not kill the poller
                self._set_up(h, False, f"Stats: {exc!r}")
                self._still_suspect(h)
            else:
                self._on_stats(h, stats)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    @staticmethod
    def _still_suspect(h: WorkerHandle) -> None:
        """A suspect worker that fails a poll starts its probation over."""
        if h.suspect_since is not None:
            h.suspect_since = time.monotonic()

    def _on_stats(self, h: WorkerHandle, stats: WorkerStatsView) -> None:
        was_draining = h.stats is not None and h.stats.draining
        if stats.worker_id and h.worker_id and stats.worker_id != h.worker_id:
            logger.info("worker at %s restarted as %s (was %s)", h.address, stats.worker_id, h.worker_id)
            self._forget_index(h)
        h.worker_id = stats.worker_id or h.address
        h.stats = stats
        h.pending_blocks = 0  # the poll's free blocks count what was reserved before it
        if h.suspect_since is not None and self.liveness.trusted_again(h.suspect_since, time.monotonic()):
            logger.info("worker %s answers again: no longer suspect", h.name)
            h.suspect_since = None
            self.on_change()
        if not h.up:
            self._set_up(h, True, "")
        elif was_draining != stats.draining:
            logger.info("worker %s %s draining", h.name, "is" if stats.draining else "stopped")
            self.on_change()
        if self.feed_index:
            self._heartbeat(h, stats)

    def _set_up(self, h: WorkerHandle, up: bool, why: str) -> None:
        if h.up == up:
            return
        h.up, h.last_error = up, why
        if up:
            logger.info("worker %s (%s, %s) is up", h.name, h.address, h.role)
        else:
            logger.warning("worker %s (%s) is down: %s", h.name, h.address, why)
            self._forget_index(h)
        if self.metrics is not None:
            for role in ROLES:
                self.metrics.workers_up.labels(role).set(sum(1 for x in self.handles if x.role == role and x.up))
        self.on_change()

    # ---------------------------------------------------------------- prefix index feeding

    def _heartbeat(self, h: WorkerHandle, stats: WorkerStatsView) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat.get(h.name, -1e9) < self.index.heartbeat_interval_s / 2:
            return
        self._last_heartbeat[h.name] = now
        from kvindex import WorkerInfo

        load = float(stats.queued_prefill_tokens if h.role == "prefill" else stats.running)
        try:
            fresh = self.index.heartbeat(h.name, WorkerInfo(h.address, h.role, stats.total_kv_blocks, load))
        except ValueError as exc:
            logger.warning("prefix index heartbeat for %s refused: %s", h.name, exc)
            return
        if fresh and h.address in self._events_synced:
            # Its entries were dropped (marked down after a failed poll, or reaped after a
            # lapse) while its KvEvents stream, which only sends deltas now, went on: reconnect
            # it, and the new stream's reset batch republishes everything the worker holds.
            logger.info("prefix index: resynchronizing the KV events of %s", h.name)
            self._events_synced.discard(h.address)
            call = self._event_calls.get(h.address)
            if call is not None:
                call.cancel()

    def _forget_index(self, h: WorkerHandle) -> None:
        if self.feed_index and h.worker_id:
            with contextlib.suppress(ValueError):
                self.index.deregister(h.worker_id)
            self._last_heartbeat.pop(h.worker_id, None)

    async def _kv_events(self, h: WorkerHandle) -> None:
        failures = 0
        while not self._closed:
            if not h.up:
                await asyncio.sleep(self.pool.stats_interval_s)
                continue
            call = h.client.kv_events()
            self._events_synced.discard(h.address)
            self._event_calls[h.address] = call
            try:
                async for events in call:
                    failures = 0
                    self._apply_events(h, events)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._closed or task is None or task.cancelling():
                    call.cancel()
                    raise
                continue  # the call was cancelled by _heartbeat to resynchronize: reconnect now
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    logger.info("worker %s serves no KvEvents; routing to it is load-only", h.name)
                    return
                logger.debug("KvEvents stream of %s ended: %s", h.name, exc.code().name)
            except ValueError as exc:
                logger.warning("KvEvents of %s rejected: %s", h.name, exc)
            finally:
                self._event_calls.pop(h.address, None)
            await asyncio.sleep(_RECONNECT_S[min(failures, len(_RECONNECT_S) - 1)])
            failures += 1

    def _apply_events(self, h: WorkerHandle, ev: KvEventBatch) -> None:
        worker_id = ev.worker_id or h.worker_id
        if not worker_id:
            return
        if ev.reset:
            self.index.clear(worker_id)
            self._events_synced.add(h.address)
        if ev.stored or ev.removed:
            self.index.publish(worker_id, ev.stored, ev.removed)

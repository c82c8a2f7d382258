"""Redis backend of the prefix index, shared by every gateway and worker of a deployment.

Keys (`<ns>` is the namespace, normally the model identity, so two models never share entries):
  tandem:<ns>:blk:<hash, 16 hex digits>  hash: field <worker id> = unix time of its last publish
      (publisher's clock, informational). TTL `block_ttl_s`, refreshed by each publish that
      stores the block and by each match that looks it up (hot prefixes stay).
  tandem:<ns>:wblk:<worker id>    set of the hex hashes the worker published, so clear() removes
      exactly its fields. TTL `block_ttl_s`, refreshed by its publishes and heartbeats.
  tandem:<ns>:worker:<worker id>  hash: address, role, capacity, load, updated. TTL
      3 x heartbeat_interval_s, so it disappears after three missed heartbeats.
  tandem:<ns>:workers             sorted set: worker id -> heartbeat deadline in Redis server time
      (from TIME, so host clocks don't matter). match() reads it in its single round trip to
      know who is live; heartbeat() reads it to find lapsed workers.

How the entries of a kill -9'd worker disappear:
  1. for readers, at its deadline: match() ignores fields of workers whose deadline passed;
  2. from Redis, on the next heartbeat() of any worker: it reaps lapsed workers (HDEL of their
     field from each blk key listed in their wblk set, then the set and registration go);
  3. failing that (no heartbeats at all), blk keys and wblk sets expire via their TTL, and
     until they do match() keeps ignoring the fields.

Redis restarted empty (no persistence) or lost the keys: the next heartbeat() of each worker
finds its registration gone and returns True, and the worker republishes everything it holds.

Redis unreachable: no call raises. Writes wait in a bounded buffer (past `max_pending_ops`
hashes the oldest publish is dropped and counted; clears are kept), match() and workers()
answer {}, `degraded` is set, and the next attempt waits an exponential backoff (jittered,
capped), so a dead server isn't hammered. Buffered writes go out with the next publish, clear,
heartbeat or flush once the server answers. The sync redis-py client does the I/O; the async
methods run it in a thread (asyncio.to_thread) so the gateway's event loop never blocks.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from kvindex.backoff import Backoff
from kvindex.base import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    IndexStats,
    PrefixIndex,
    WorkerInfo,
    check_hashes,
    check_name,
    leading_runs,
    register_index,
)

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Op:
    """A buffered write. kind: "pub" (stored/removed hex hashes), "clear" or "deregister"."""

    kind: str
    worker_id: str
    stored: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    at: float = 0.0

    @property
    def size(self) -> int:
        return max(1, len(self.stored) + len(self.removed))


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")
    return float(value)


def _chunks(items: list[str], n: int) -> Iterator[list[str]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


@register_index("redis")
class RedisIndex(PrefixIndex):
    """Prefix index in Redis; see the module docstring for keys, expiry and failure behaviour."""

    blocking_io = True

    def __init__(
        self,
        url: str,
        namespace: str,
        *,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        block_ttl_s: float = 3600.0,
        touch_on_match: bool = True,
        max_pending_ops: int = 100_000,
        batch_max_ops: int = 4096,
        socket_timeout_s: float = 1.0,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        connection_pool: redis.ConnectionPool | None = None,
    ) -> None:
        super().__init__(namespace, heartbeat_interval_s=heartbeat_interval_s)
        self.block_ttl_s = _positive("block_ttl_s", block_ttl_s)
        self.touch_on_match = bool(touch_on_match)
        for name, value in (("max_pending_ops", max_pending_ops), ("batch_max_ops", batch_max_ops)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        self.max_pending_ops = max_pending_ops
        self.batch_max_ops = batch_max_ops
        self._backoff = Backoff(
            _positive("backoff_initial_s", backoff_initial_s), _positive("backoff_max_s", backoff_max_s)
        )
        timeout = _positive("socket_timeout_s", socket_timeout_s)
        if connection_pool is None:
            if not isinstance(url, str) or "://" not in url:
                raise ValueError(f"url: expected redis://host:port[/db], got {url!r}")
            # One immediate retry recovers a pooled connection the server closed; the
            # backoff below, not redis-py, paces attempts against a dead server.
            connection_pool = redis.ConnectionPool.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 1)
            )
        self._pool = connection_pool
        self._r = redis.Redis(connection_pool=connection_pool)
        self._prefix = f"tandem:{self.namespace}:"
        self._workers_key = self._prefix + "workers"

        self._io_lock = threading.Lock()  # one batch on the wire at a time, in order
        self._buf_lock = threading.Lock()  # the pending buffer and its counters
        self._pending: deque[_Op] = deque()
        self._pending_ops = 0
        self._dropped = 0

    @classmethod
    def from_url(cls, url: str, namespace: str, **options: Any) -> RedisIndex:
        return cls(url, namespace, **options)

    def blk_key(self, h: int | str) -> str:
        return f"{self._prefix}blk:{h if isinstance(h, str) else format(h, '016x')}"

    def wblk_key(self, worker_id: str) -> str:
        return f"{self._prefix}wblk:{worker_id}"

    def worker_key(self, worker_id: str) -> str:
        return f"{self._prefix}worker:{worker_id}"

    @property
    def workers_key(self) -> str:
        return self._workers_key

    def publish(self, worker_id: str, stored: Sequence[int], removed: Sequence[int]) -> None:
        check_name("worker_id", worker_id)
        stored_hex = [format(h, "016x") for h in check_hashes("stored", stored)]
        removed_hex = [format(h, "016x") for h in check_hashes("removed", removed)]
        if stored_hex or removed_hex:
            self._enqueue(_Op("pub", worker_id, stored_hex, removed_hex, time.time()))
        self.flush()

    def clear(self, worker_id: str) -> None:
        check_name("worker_id", worker_id)
        self._enqueue(_Op("clear", worker_id))
        self.flush()

    def deregister(self, worker_id: str) -> None:
        check_name("worker_id", worker_id)
        self._enqueue(_Op("deregister", worker_id))
        self.flush()

    def flush(self) -> None:
        with self._io_lock:
            while True:
                with self._buf_lock:
                    batch = self._take_batch()
                if not batch or not self._available():
                    return
                try:
                    if batch[0].kind == "pub":
                        self._send_publish(batch)
                    else:
                        self._send_clear(batch[0].worker_id, deregister=batch[0].kind == "deregister")
                except (RedisError, OSError) as exc:
                    self._failed("write", exc)
                    return
                self._succeeded()
                with self._buf_lock:
                    for op in batch:
                        self._remove_pending(op)

    def heartbeat(self, worker_id: str, info: WorkerInfo) -> bool:
        check_name("worker_id", worker_id)
        if not isinstance(info, WorkerInfo):
            raise ValueError(f"info: must be a WorkerInfo, got {type(info).__name__}")
        self.flush()
        if not self._available():
            return False
        ttl_ms = int(self.heartbeat_ttl_s * 1000)
        try:
            pipe = self._r.pipeline(transaction=False)
            pipe.time()
            pipe.zrange(self._workers_key, 0, -1, withscores=True)
            (sec, usec), members = pipe.execute()
            now = sec + usec / 1e6
            lapsed = [_s(m) for m, deadline in members if deadline <= now]
            if lapsed:
                with self._io_lock:
                    for dead in lapsed:
                        logger.info("prefix index: worker %s missed its heartbeats; reaping its entries", dead)
                        self._send_clear(dead, deregister=False)
                    # By score, so a worker that heartbeated again meanwhile stays registered.
                    self._r.zremrangebyscore(self._workers_key, "-inf", now)
            pipe = self._r.pipeline(transaction=False)
            mapping = {
                "address": info.address,
                "role": info.role,
                "capacity": str(info.capacity),
                "load": repr(float(info.load)),
                "updated": repr(now),
            }
            pipe.hset(self.worker_key(worker_id), mapping=mapping)
            pipe.pexpire(self.worker_key(worker_id), ttl_ms)
            pipe.zadd(self._workers_key, {worker_id: now + self.heartbeat_ttl_s})
            pipe.pexpire(self.wblk_key(worker_id), int(self.block_ttl_s * 1000))
            _, _, added, _ = pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("heartbeat", exc)
            return False
        self._succeeded()
        # ZADD counts new members only: 1 means the registration was gone (first beat, reaped
        # after a lapse, or the server restarted empty).
        return bool(added)

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        hashes = check_hashes("block_hashes", block_hashes)
        if not hashes or not self._available():
            return {}
        keys = [self.blk_key(h) for h in hashes]
        try:
            pipe = self._r.pipeline(transaction=False)
            pipe.time()
            pipe.zrange(self._workers_key, 0, -1, withscores=True)
            for k in keys:
                pipe.hkeys(k)
            if self.touch_on_match:
                ttl_ms = int(self.block_ttl_s * 1000)
                for k in keys:
                    pipe.pexpire(k, ttl_ms)
            res = pipe.execute()
        except (RedisError, OSError) as exc:
            self._failed("match", exc)
            return {}
        self._succeeded()
        sec, usec = res[0]
        now = sec + usec / 1e6
        live = {_s(m) for m, deadline in res[1] if deadline > now}
        holders = [{_s(f) for f in fields} for fields in res[2 : 2 + len(keys)]]
        return leading_runs(holders, live)

    def workers(self) -> dict[str, WorkerInfo]:
        if not self._available():
            return {}
        try:
            pipe = self._r.pipeline(transaction=False)
            pipe.time()
            pipe.zrange(self._workers_key, 0, -1, withscores=True)
            (sec, usec), members = pipe.execute()
            now = sec + usec / 1e6
            live = [_s(m) for m, deadline in members if deadline > now]
            pipe = self._r.pipeline(transaction=False)
            for w in live:
                pipe.hgetall(self.worker_key(w))
            records = pipe.execute() if live else []
        except (RedisError, OSError) as exc:
            self._failed("workers", exc)
            return {}
        self._succeeded()
        out: dict[str, WorkerInfo] = {}
        for w, rec in zip(live, records):
            if not rec:
                continue  # expired between the two reads
            d = {_s(k): _s(v) for k, v in rec.items()}
            try:
                out[w] = WorkerInfo(d["address"], d["role"], int(d["capacity"]), float(d["load"]))
            except (KeyError, ValueError) as exc:
                logger.warning("prefix index: ignoring malformed record of worker %s: %s", w, exc)
        return out

    def stats(self) -> IndexStats:
        with self._buf_lock:
            return IndexStats(
                backend=self.name,
                degraded=self._backoff.degraded,
                pending_ops=self._pending_ops,
                dropped_ops=self._dropped,
                errors=self._backoff.errors,
                reconnects=self._backoff.recoveries,
            )

    @property
    def degraded(self) -> bool:
        return self._backoff.degraded

    def close(self) -> None:
        self.flush()
        self._pool.disconnect()

    def _send_publish(self, batch: list[_Op]) -> None:
        ttl_ms = int(self.block_ttl_s * 1000)
        pipe = self._r.pipeline(transaction=False)
        for op in batch:
            stamp = f"{op.at:.3f}"
            for hx in op.stored:
                key = self.blk_key(hx)
                pipe.hset(key, op.worker_id, stamp)
                pipe.pexpire(key, ttl_ms)
            for hx in op.removed:
                pipe.hdel(self.blk_key(hx), op.worker_id)
            wblk = self.wblk_key(op.worker_id)
            if op.stored:
                pipe.sadd(wblk, *op.stored)
                pipe.pexpire(wblk, ttl_ms)
            if op.removed:
                pipe.srem(wblk, *op.removed)
        pipe.execute()

    def _send_clear(self, worker_id: str, *, deregister: bool) -> None:
        # Read the set, HDEL the fields, then SREM exactly what was read: a retry after a
        # failure midway reads the remainder again, so nothing is orphaned.
        wblk = self.wblk_key(worker_id)
        members = [_s(m) for m in self._r.smembers(wblk)]
        for chunk in _chunks(members, self.batch_max_ops):
            pipe = self._r.pipeline(transaction=False)
            for hx in chunk:
                pipe.hdel(self.blk_key(hx), worker_id)
            pipe.srem(wblk, *chunk)
            pipe.execute()
        if deregister:
            pipe = self._r.pipeline(transaction=False)
            pipe.delete(self.worker_key(worker_id), wblk)
            pipe.zrem(self._workers_key, worker_id)
            pipe.execute()

    def _enqueue(self, op: _Op) -> None:
        with self._buf_lock:
            if op.kind != "pub":
                # A clear supersedes everything of this worker still waiting (keeping a
                # pending deregistration).
                for old in [o for o in self._pending if o.worker_id == op.worker_id]:
                    if old.kind == "deregister":
                        op.kind = "deregister"
                    self._remove_pending(old)
            self._pending.append(op)
            self._pending_ops += op.size
            while self._pending_ops > self.max_pending_ops:
                oldest = next((o for o in self._pending if o.kind == "pub" and o is not op), None)
                if oldest is None:
                    break  # only clears and the newest publish left: keep them
                self._remove_pending(oldest)
                self._dropped += oldest.size

    def _take_batch(self) -> list[_Op]:
        batch: list[_Op] = []
        size = 0
        for op in self._pending:
            if op.kind != "pub":
                return batch or [op]
            if batch and size + op.size > self.batch_max_ops:
                break
            batch.append(op)
            size += op.size
        return batch

    def _remove_pending(self, op: _Op) -> None:
        try:
            self._pending.remove(op)
        except ValueError:
            return  # already superseded by a clear
        self._pending_ops -= op.size

    def _available(self) -> bool:
        return self._backoff.ready()

    def _failed(self, what: str, exc: BaseException) -> None:
        if self._backoff.failed():
            logger.warning("prefix index: Redis unreachable during %s (%s); routing falls back to load", what, exc)
        else:
            logger.debug("prefix index: Redis still unreachable during %s (%s)", what, exc)

    def _succeeded(self) -> None:
        if self._backoff.succeeded():
            logger.info("prefix index: Redis reachable again")

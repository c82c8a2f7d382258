"""Redis prefix index against a real Redis: key layout, expiry of dead workers, one round trip
per lookup, agreement with the memory backend, and serving on when Redis is down."""
from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex import MemoryIndex, RedisIndex, WorkerInfo, make_index
from tandem.hashing import block_hashes, seed_hash

INFO = WorkerInfo("10.0.0.7:7001", "prefill", capacity=4096, load=12.5)


@pytest.fixture(scope="module")
def client(redis_url: str) -> Iterator[redis.Redis]:
    """`redis_url` (tests/conftest.py) is the shared Redis, 127.0.0.1:6379 unless overridden."""
    r = redis.Redis.from_url(redis_url, socket_connect_timeout=1)
    try:
        r.ping()
    except redis.ConnectionError:
        pytest.skip(f"no Redis at {redis_url}")
    yield r
    r.close()


def _delete_namespace(r: redis.Redis, ns: str) -> None:
    keys = list(r.scan_iter(match=f"tandem:{ns}:*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture
def ns(client: redis.Redis) -> Iterator[str]:
    name = "test-" + uuid.uuid4().hex[:12]
    yield name
    _delete_namespace(client, name)


def _wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _hashes(n: int, salt: int = 0) -> list[int]:
    return block_hashes([salt + i for i in range(16 * n)], 16, seed_hash("redis-test-model"))


def test_keys_are_named_and_typed_as_specified(client: redis.Redis, ns: str, redis_url: str) -> None:
    ix = RedisIndex(redis_url, ns, heartbeat_interval_s=2.0, block_ttl_s=600)
    hs = _hashes(3)
    ix.heartbeat("p0", INFO)
    before = time.time()
    ix.publish("p0", hs, [])
    p = f"tandem:{ns}:"
    expected = {p + f"blk:{h:016x}" for h in hs} | {p + "wblk:p0", p + "worker:p0", p + "workers"}
    assert {k.decode() for k in client.scan_iter(match=p + "*")} == expected
    for h in hs:
        key = p + f"blk:{h:016x}"
        assert client.type(key) == b"hash"
        seen = client.hgetall(key)
        assert set(seen) == {b"p0"}
        assert abs(float(seen[b"p0"]) - before) < 60
        assert 0 < client.pttl(key) <= 600_000
    assert client.smembers(p + "wblk:p0") == {f"{h:016x}".encode() for h in hs}
    rec = {k.decode(): v.decode() for k, v in client.hgetall(p + "worker:p0").items()}
    assert (rec["address"], rec["role"], int(rec["capacity"]), float(rec["load"])) == (
        INFO.address, INFO.role, INFO.capacity, INFO.load,
    )
    assert 0 < client.pttl(p + "worker:p0") <= 6_000  # 3 x heartbeat interval
    assert client.zscore(p + "workers", "p0") is not None
    assert ix.workers() == {"p0": INFO}
    assert ix.match(hs) == {"p0": 3}
    ix.close()


def test_clear_removes_exactly_that_workers_fields(client: redis.Redis, ns: str, redis_url: str) -> None:
    ix = RedisIndex(redis_url, ns)
    shared, own = _hashes(2), _hashes(2, salt=999)
    for w in ("a", "b"):
        ix.heartbeat(w, INFO)
    ix.publish("a", shared + own, [])
    ix.publish("b", shared, [])
    ix.clear("a")
    p = f"tandem:{ns}:"
    for h in shared:
        assert client.hkeys(p + f"blk:{h:016x}") == [b"b"]
    for h in own:
        assert not client.exists(p + f"blk:{h:016x}")
    assert not client.exists(p + "wblk:a")
    assert client.exists(p + "worker:a")  # clear keeps the registration
    assert ix.match(shared) == {"b": 2}
    ix.deregister("b")
    assert not client.exists(p + "worker:b") and client.zscore(p + "workers", "b") is None
    assert ix.match(shared) == {}
    ix.close()


def test_worker_key_expires_after_missed_heartbeats(client: redis.Redis, ns: str, redis_url: str) -> None:
    slow = RedisIndex(redis_url, ns, heartbeat_interval_s=20)
    slow.heartbeat("steady", INFO)
    assert 0 < client.pttl(f"tandem:{ns}:worker:steady") <= 60_000  # 3 x interval
    fast = RedisIndex(redis_url, ns, heartbeat_interval_s=0.1)  # TTL 0.3 s
    fast.heartbeat("short-lived", INFO)
    key = f"tandem:{ns}:worker:short-lived"
    assert _wait_for(lambda: not client.exists(key))
    assert set(fast.workers()) == {"steady"}
    fast.close()
    slow.close()


def test_dead_workers_blocks_are_ignored_then_removed(client: redis.Redis, ns: str, redis_url: str) -> None:
    dying = RedisIndex(redis_url, ns, heartbeat_interval_s=0.1)
    steady = RedisIndex(redis_url, ns, heartbeat_interval_s=30)
    hs = _hashes(4)
    dying.heartbeat("dead", INFO)
    steady.heartbeat("live", INFO)
    dying.publish("dead", hs, [])
    steady.publish("live", hs[:2], [])
    p = f"tandem:{ns}:"
    # "dead" stops heartbeating, as after kill -9.
    assert _wait_for(lambda: "dead" not in steady.workers())
    assert steady.match(hs) == {"live": 2}
    for h in hs:
        assert b"dead" in client.hkeys(p + f"blk:{h:016x}")  # still stored, only ignored
    steady.heartbeat("live", INFO)  # any heartbeat reaps lapsed workers
    for h in hs:
        assert b"dead" not in client.hkeys(p + f"blk:{h:016x}")
    assert not client.exists(p + "wblk:dead")
    assert client.zscore(p + "workers", "dead") is None
    assert steady.match(hs) == {"live": 2}
    dying.close()
    steady.close()


def test_block_keys_expire_via_ttl(client: redis.Redis, ns: str, redis_url: str) -> None:
    ix = RedisIndex(redis_url, ns, block_ttl_s=0.2)
    hs = _hashes(2)
    ix.publish("gone", hs, [])
    keys = [f"tandem:{ns}:blk:{h:016x}" for h in hs] + [f"tandem:{ns}:wblk:gone"]
    assert client.exists(*keys) == len(keys)
    assert _wait_for(lambda: client.exists(*keys) == 0)
    ix.close()


class CountingConnection(redis.Connection):
    """A redis-py connection that counts the packets it sends (one per round trip)."""

    sends = 0

    def send_packed_command(self, command, check_health=True):  # type: ignore[no-untyped-def]
        type(self).sends += 1
        return super().send_packed_command(command, check_health)


def test_match_and_publish_take_one_round_trip_each(ns: str, client: redis.Redis, redis_url: str) -> None:
    pool = redis.ConnectionPool.from_url(redis_url, connection_class=CountingConnection)
    ix = RedisIndex(redis_url, ns, connection_pool=pool)
    hs = _hashes(64)
    ix.heartbeat("p0", INFO)  # also opens the connection (handshake not counted below)
    CountingConnection.sends = 0
    ix.publish("p0", hs, [])
    assert CountingConnection.sends == 1
    CountingConnection.sends = 0
    assert ix.match(hs) == {"p0": 64}
    assert CountingConnection.sends == 1
    CountingConnection.sends = 0
    assert ix.match(_hashes(64, salt=7)) == {}
    assert CountingConnection.sends == 1
    ix.close()


def test_amatch_runs_from_an_event_loop(ns: str, client: redis.Redis, redis_url: str) -> None:
    ix = RedisIndex(redis_url, ns)
    hs = _hashes(5)

    async def go() -> dict[str, int]:
        await ix.aheartbeat("p0", INFO)
        await ix.apublish("p0", hs, [])
        return await ix.amatch(hs)

    assert asyncio.run(go()) == ix.match(hs) == {"p0": 5}
    ix.close()


def test_unreachable_redis_never_raises() -> None:
    ix = make_index("redis://127.0.0.1:1/0", "nowhere", max_pending_ops=10, backoff_initial_s=0.01)
    hs = _hashes(4)
    assert ix.match(hs) == {}
    assert ix.degraded
    for i in range(4):
        ix.publish("p0", _hashes(4, salt=i * 100), [])
    ix.heartbeat("p0", INFO)
    ix.clear("p1")
    assert ix.workers() == {}
    assert asyncio.run(ix.amatch(hs)) == {}
    st_ = ix.stats()
    assert st_.degraded and st_.errors >= 1
    assert st_.pending_ops <= 10  # bounded: four publishes of 4 hashes would be 16
    assert st_.dropped_ops >= 4
    ix.close()


class CountingConnects(redis.Connection):
    attempts = 0

    def connect(self):  # type: ignore[no-untyped-def]
        type(self).attempts += 1
        return super().connect()


def test_backoff_keeps_calls_off_a_dead_server() -> None:
    pool = redis.ConnectionPool.from_url("redis://127.0.0.1:1/0", connection_class=CountingConnects)
    ix = RedisIndex("redis://127.0.0.1:1/0", "nowhere", connection_pool=pool, backoff_initial_s=600)
    assert ix.match(_hashes(2)) == {}
    first = CountingConnects.attempts
    assert first >= 1
    for i in range(20):
        assert ix.match(_hashes(2, salt=i)) == {}
        ix.publish("p0", _hashes(1, salt=i), [])
        ix.heartbeat("p0", INFO)
    assert CountingConnects.attempts == first  # inside the backoff window nothing is tried
    assert ix.stats().pending_ops == 20
    ix.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    probe = redis.Redis(port=port, socket_connect_timeout=0.2)

    def up() -> bool:
        try:
            return bool(probe.ping())
        except redis.ConnectionError:
            return False

    if not _wait_for(up):
        proc.kill()
        raise RuntimeError("redis-server did not start")
    probe.close()
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server binary not installed")
def test_recovers_when_redis_comes_back() -> None:
    port = _free_port()
    proc = _start_redis(port)
    ix = RedisIndex(f"redis://127.0.0.1:{port}/0", "recovery", backoff_initial_s=0.05, backoff_max_s=0.2)
    try:
        before, during = _hashes(3), _hashes(3, salt=500)
        ix.heartbeat("p0", INFO)
        ix.publish("p0", before, [])
        assert ix.match(before) == {"p0": 3}
        _stop(proc)
        assert ix.match(before) == {}
        assert ix.degraded
        ix.publish("p0", during, [])  # buffered while down
        assert ix.stats().pending_ops == 3
        proc = _start_redis(port)  # a fresh server: nothing persisted
        assert _wait_for(lambda: ix.match(during) == {} and not ix.degraded)
        ix.heartbeat("p0", INFO)  # sends the buffered publish, then registers again
        assert ix.stats().pending_ops == 0
        assert ix.stats().reconnects >= 1
        assert ix.match(during) == {"p0": 3}
    finally:
        ix.close()
        _stop(proc)


HASHES = [0, 2**64 - 1, 21, 22, 23, 24, 25, 26]
WORKER_IDS = ["w0", "w1", "w2"]
_hash = st.sampled_from(HASHES)
_worker = st.sampled_from(WORKER_IDS)
_op = st.one_of(
    st.tuples(st.just("publish"), _worker, st.lists(_hash, max_size=6), st.lists(_hash, max_size=3)),
    st.tuples(st.just("clear"), _worker),
    st.tuples(st.just("deregister"), _worker),
    st.tuples(st.just("heartbeat"), _worker),
    st.tuples(st.just("match"), st.lists(_hash, max_size=8)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(_op, max_size=25))
def test_redis_and_memory_backends_agree(client: redis.Redis, ops: list[tuple], redis_url: str) -> None:
    ns = "test-" + uuid.uuid4().hex[:12]
    mem = MemoryIndex(ns, heartbeat_interval_s=60)
    red = RedisIndex(redis_url, ns, heartbeat_interval_s=60)
    try:
        for w in WORKER_IDS:
            mem.heartbeat(w, INFO)
            red.heartbeat(w, INFO)
        for op in ops:
            kind, args = op[0], op[1:]
            if kind == "match":
                assert red.match(*args) == mem.match(*args)
            elif kind == "heartbeat":
                mem.heartbeat(args[0], INFO)
                red.heartbeat(args[0], INFO)
            else:
                getattr(mem, kind)(*args)
                getattr(red, kind)(*args)
        for seq in (HASHES, HASHES[::-1], *([h] for h in HASHES)):
            assert red.match(seq) == mem.match(seq)
        assert set(red.workers()) == set(mem.workers())
        assert not red.degraded
    finally:
        red.close()
        _delete_namespace(client, ns)

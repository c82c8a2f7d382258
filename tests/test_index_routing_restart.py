"""Redis stopped and restarted under load: no request fails, routing falls back to load only
while Redis is away, and once it is back (empty: no persistence) the workers republish their
caches and prefix-aware routing resumes. Uses a redis-server of its own on a free port."""
from __future__ import annotations

import random
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, WorkerPoolConfig
from harness import GatewayThread, start_workers, stop_workers, wait_idle, wait_until
from tandem import Client
from tandem.errors import TandemError
from tandem.hashing import block_hashes, seed_hash

WAIT = 60.0
BS = 16
GREEDY = {"temperature": 0.0, "ignore_eos": True}
DEGRADED = "tandem_gateway_prefix_index_degraded"


class RedisServer:
    """A throwaway redis-server (no persistence) on a fixed port, restartable."""

    def __init__(self, work: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.work = work
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.work)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)

        def up() -> bool:
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        wait_until(up, WAIT, what="redis-server to answer")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


def test_redis_restart_mid_run_fails_nothing_and_routing_recovers(tiny_models, redis_server, tmp_path) -> None:
    flags = ["--num-kv-blocks", "256", "--max-running", "16", "--redis-url", redis_server.url,
             "--index-heartbeat", "0.3"]
    workers = start_workers([("prefill", flags), ("prefill", flags), ("decode", flags)], tiny_models["llama"], tmp_path)
    p0, p1, d = workers
    pool = WorkerPoolConfig(prefill=(p0.address, p1.address), decode=(d.address,))
    gw = GatewayThread(GatewayConfig(model_dir=str(tiny_models["llama"]), port=0, workers=pool,
                                     index_url=redis_server.url))
    rng = random.Random(9)
    systems = [[rng.randrange(256) for _ in range(96)] for _ in range(3)]
    phase = {"now": "up"}
    sent: dict[str, str] = {}  # request id -> phase when it was sent
    failures: list[str] = []
    stop = threading.Event()

    def load(n: int) -> None:
        local = random.Random(n)
        with Client(gw.target, timeout=WAIT) as c:
            i = 0
            while not stop.is_set():
                rid = f"load{n}-{i}"
                sent[rid] = phase["now"]
                try:
                    c.generate(local.choice(systems) + [local.randrange(256) for _ in range(8)], max_tokens=2,
                               **GREEDY, request_id=rid)
                except TandemError as exc:
                    failures.append(f"{rid}: {exc}")
                i += 1

    def reasons(tag: str) -> list[str]:
        log = gw.call(lambda: {e.request_id: e.reason for e in gw.gateway.dispatcher.log if e.kind == "prefill"})
        return [reason for rid, reason in log.items() if sent.get(rid) == tag]

    threads = [threading.Thread(target=load, args=(n,), daemon=True) for n in range(2)]
    try:
        assert gw.wait_ready(WAIT)
        seed = seed_hash(gw.gateway.model.identity)
        with Client(gw.target, timeout=WAIT) as c:
            for s in systems:
                c.generate(s + [1, 2, 3], max_tokens=2, **GREEDY)
        hashes = [block_hashes(s, BS, seed) for s in systems]

        def holders(h: list[int]) -> set[str]:
            return {w for w, n in gw.call(lambda: gw.gateway.index.match(h)).items() if n == len(h)}

        # Each system prompt is held by the prefill worker that computed it and by d.
        for h in hashes:
            wait_until(lambda h=h: len(holders(h)) >= 2, WAIT, what="the index to list each system prompt")
        held_before = [holders(h) for h in hashes]
        assert all(d.worker_id in held for held in held_before)
        for t in threads:
            t.start()
        wait_until(lambda: "cache" in reasons("up"), WAIT, what="cache-aware decisions under load")

        redis_server.stop()  # mid-run
        wait_until(lambda: gw.metric(DEGRADED) == 1.0, WAIT, what="the gateway to notice Redis is gone")
        phase["now"] = "down"
        wait_until(lambda: len(reasons("down")) >= 6, WAIT, what="requests served while Redis is down")
        phase["now"] = "restarting"
        assert set(reasons("down")) == {"load"}  # no index: load only, and nothing failed
        assert not failures

        redis_server.start()  # empty: the workers must republish what they hold
        wait_until(lambda: gw.metric(DEGRADED) == 0.0, WAIT, what="the gateway to reach Redis again")
        # Nothing stores these blocks again where they were cached already (prefill workers
        # that first computed a prompt while Redis was away do publish it): only a republish
        # brings the earlier holders back.
        for h, held in zip(hashes, held_before):
            wait_until(lambda h=h, held=held: holders(h) >= held, WAIT,
                       what="the workers to republish their cached prefixes")
        phase["now"] = "recovered"
        wait_until(lambda: reasons("recovered").count("cache") >= 3, WAIT, what="cache-aware routing to resume")
    finally:
        stop.set()
        for t in threads:
            if t.is_alive():
                t.join(WAIT)
        gw.stop()
        try:
            assert not failures, failures
            assert len(sent) > 12
            for w in workers:
                wait_idle(w, WAIT)
        finally:
            stop_workers(workers)

"""The shared Redis prefix index with real workers publishing to it: two gateways reading one
Redis send a prefix to the same prefill worker, the `tandem:{ns}:blk:*` keys name the workers
that hold each block, and a worker's entries go when it stops: at once on a clean exit
(SIGTERM), reaped by a live worker's heartbeat or expired by TTL after kill -9."""
from __future__ import annotations

import random
import uuid
from collections import Counter
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, WorkerPoolConfig
from harness import GatewayThread, WorkerProcess, start_workers, stop_workers, wait_idle, wait_until
from tandem import Client
from tandem.hashing import block_hashes, seed_hash

WAIT = 60.0
BS = 16
TTL_S = 6.0  # entries of a worker that died with nobody left to reap them expire after this
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def namespace(redis_url: str):
    import redis

    ns = f"route-test-{uuid.uuid4().hex[:8]}"
    yield ns
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(f"tandem:{ns}:*"))
    if keys:
        r.delete(*keys)


@pytest.fixture(scope="module")
def cluster(tiny_models: dict[str, Path], redis_url: str, namespace: str, tmp_path_factory) -> list[WorkerProcess]:
    """p0, p1, d: all publishing to Redis, heartbeating every 0.3 s."""
    flags = ["--num-kv-blocks", "256", "--max-running", "16", "--redis-url", redis_url, "--namespace", namespace,
             "--index-heartbeat", "0.3", "--index-block-ttl", str(TTL_S)]
    workers = start_workers([("prefill", flags), ("prefill", flags), ("decode", flags)], tiny_models["llama"],
                            tmp_path_factory.mktemp("redis-routing-workers"))
    yield workers
    stop_workers(workers)


def holders(redis_url: str, namespace: str) -> Counter:
    """worker id -> number of blk keys naming it."""
    import redis

    r = redis.Redis.from_url(redis_url)
    out: Counter = Counter()
    for key in r.scan_iter(f"tandem:{namespace}:blk:*", count=1000):
        out.update(f.decode() for f in r.hkeys(key))
    return out


def test_two_gateways_send_a_prefix_to_the_same_prefill_worker(tiny_models, cluster, redis_url: str,
                                                               namespace: str) -> None:
    p0, p1, d = cluster
    pool = WorkerPoolConfig(prefill=(p0.address, p1.address), decode=(d.address,))
    config = GatewayConfig(model_dir=str(tiny_models["llama"]), port=0, workers=pool, index_url=redis_url,
                           namespace=namespace, index_block_ttl_s=TTL_S)
    gws = [GatewayThread(config), GatewayThread(config)]
    rng = random.Random(3)
    try:
        for gw in gws:
            assert gw.wait_ready(WAIT)
        seed = seed_hash(gws[0].gateway.model.identity)
        for first, then in ((gws[0], gws[1]), (gws[1], gws[0])):
            system = [rng.randrange(256) for _ in range(96)]
            hashes = block_hashes(system, BS, seed)
            with Client(first.target, timeout=WAIT) as c:
                c.generate(system + [rng.randrange(256) for _ in range(8)], max_tokens=2, **GREEDY, request_id="q0")
            holder = first.call(lambda g=first: next(e.worker for e in reversed(g.gateway.dispatcher.log)
                                                      if e.kind == "prefill" and e.request_id == "q0"))
            # The other gateway learns it from Redis only (the workers publish there).
            wait_until(lambda: then.call(lambda: then.gateway.index.match(hashes)).get(holder, 0) == len(hashes),
                       WAIT, what="Redis to list the prefix under its prefill worker")
            with Client(then.target, timeout=WAIT) as c:
                for i in range(3):
                    c.generate(system + [rng.randrange(256) for _ in range(8)], max_tokens=2, **GREEDY,
                               request_id=f"follow-{i}")
            routed = then.call(lambda g=then: {e.request_id: (e.worker, e.reason) for e in g.gateway.dispatcher.log
                                               if e.kind == "prefill" and e.request_id.startswith("follow-")})
            assert set(routed.values()) == {(holder, "cache")}
            then.call(lambda g=then: g.gateway.dispatcher.log.clear())
            first.call(lambda g=first: g.gateway.dispatcher.log.clear())
    finally:
        for gw in gws:
            gw.stop()
    for w in cluster:
        wait_idle(w, WAIT)


def test_blocks_name_their_holders_and_leave_with_them(tiny_models, cluster, redis_url: str, namespace: str) -> None:
    p0, p1, d = cluster
    pool = WorkerPoolConfig(prefill=(p0.address, p1.address), decode=(d.address,))
    gw = GatewayThread(GatewayConfig(model_dir=str(tiny_models["llama"]), port=0, workers=pool, index_url=redis_url,
                                     namespace=namespace, index_block_ttl_s=TTL_S))
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(256) for _ in range(64 + 16 * i)] for i in range(4)}
    try:
        assert gw.wait_ready(WAIT)
        with Client(gw.target, timeout=WAIT) as c:
            for rid, prompt in prompts.items():
                c.generate(prompt, max_tokens=2, **GREEDY, request_id=rid)
        computed_on = gw.call(lambda: {e.request_id: e.worker for e in gw.gateway.dispatcher.log if e.kind == "prefill"})
        seed = seed_hash(gw.gateway.model.identity)
    finally:
        gw.stop()
    import redis

    r = redis.Redis.from_url(redis_url)
    for rid, prompt in prompts.items():
        for h in block_hashes(prompt, BS, seed):
            key = f"tandem:{namespace}:blk:{h:016x}"
            # The prefill worker that computed it, and the decode worker that received its KV.
            wait_until(lambda k=key: {f.decode() for f in r.hkeys(k)} >= {computed_on[rid], d.worker_id}, WAIT,
                       what=f"{key} to name its holders")
    assert set(holders(redis_url, namespace)) <= {p0.worker_id, p1.worker_id, d.worker_id}
    for w in cluster:
        wait_idle(w, WAIT)

    held = holders(redis_url, namespace)
    assert held[p0.worker_id] > 0 and held[p1.worker_id] > 0  # new prompts spread over both
    # Clean exit: the worker clears its entries and registration before it goes.
    clean, crashed = p0, p1
    assert clean.stop() == 0
    assert holders(redis_url, namespace)[clean.worker_id] == 0
    assert not r.exists(f"tandem:{namespace}:worker:{clean.worker_id}", f"tandem:{namespace}:wblk:{clean.worker_id}")
    # kill -9 with a worker left: its next heartbeat reaps the dead one's entries.
    assert holders(redis_url, namespace)[crashed.worker_id] == held[crashed.worker_id]
    crashed.kill()
    wait_until(lambda: holders(redis_url, namespace)[crashed.worker_id] == 0, WAIT,
               what="the live worker's heartbeat to reap the killed worker's entries")
    # kill -9 of the last worker: nobody reaps; its keys expire (TTL_S).
    assert holders(redis_url, namespace)[d.worker_id] > 0
    d.kill()
    wait_until(lambda: not list(r.scan_iter(f"tandem:{namespace}:blk:*")), WAIT,
               what="the last worker's block keys to expire")

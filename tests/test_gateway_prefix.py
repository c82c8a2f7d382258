"""Cache-aware routing through the gateway with real workers: a prompt sharing a cached prefix
goes to the worker that holds it, with the embedded index fed by the workers' KvEvents and
with the shared Redis index the workers publish to themselves."""
from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, WorkerPoolConfig
from harness import GatewayThread, start_workers, stop_workers, wait_idle, wait_until
from tandem import Client
from tandem.hashing import block_hashes, seed_hash

WAIT = 60.0


@pytest.fixture(scope="module")
def namespace() -> str:
    return f"gw-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def pair(tiny_models: dict[str, Path], redis_url: str, namespace: str, tmp_path_factory):
    flags = ["--num-kv-blocks", "96", "--max-running", "16", "--redis-url", redis_url, "--namespace", namespace]
    workers = start_workers([("both", flags), ("both", flags)], tiny_models["llama"],
                            tmp_path_factory.mktemp("gw-prefix-workers"))
    yield workers
    stop_workers(workers)


def check_follows_the_cache(gw: GatewayThread, prefix: str, workers) -> None:
    model = gw.gateway.model
    hashes = block_hashes(model.tokenizer.encode(prefix), 16, seed_hash(model.identity))
    assert len(hashes) >= 4
    placed = lambda: gw.call(lambda: [e.worker for e in gw.gateway.dispatcher.log if e.kind == "dispatch"])  # noqa: E731
    with Client(gw.target, timeout=WAIT) as c:
        c.generate(prefix + "first question?", max_tokens=2, temperature=0.0)
        holder = placed()[-1]
        # The index learns of the cached blocks asynchronously (KvEvents, or the worker's publish).
        wait_until(lambda: gw.call(lambda: gw.gateway.index.match(hashes)).get(holder, 0) >= len(hashes),
                   WAIT, what="the prefix index to list the cached prefix")
        before = gw.metric("tandem_gateway_routing_decisions_total", {"reason": "cache"})
        for i in range(3):
            c.generate(prefix + f"follow-up {i}?", max_tokens=2, temperature=0.0)
            assert placed()[-1] == holder
        assert gw.metric("tandem_gateway_routing_decisions_total", {"reason": "cache"}) == before + 3
    for w in workers:
        wait_idle(w, WAIT)


def test_embedded_index_fed_by_kv_events(tiny_models, pair) -> None:
    pool = WorkerPoolConfig(both=tuple(w.address for w in pair))
    gw = GatewayThread(GatewayConfig(model_dir=str(tiny_models["llama"]), port=0, workers=pool))
    try:
        assert gw.wait_ready(WAIT)
        assert gw.gateway.registry.feed_index  # memory index: the gateway feeds it
        check_follows_the_cache(gw, "An embedded index routes this shared system prompt. " * 2, pair)
    finally:
        gw.stop()


def test_shared_redis_index_published_by_workers(tiny_models, pair, redis_url: str, namespace: str) -> None:
    pool = WorkerPoolConfig(both=tuple(w.address for w in pair))
    gw = GatewayThread(GatewayConfig(model_dir=str(tiny_models["llama"]), port=0, workers=pool,
                                     index_url=redis_url, namespace=namespace))
    try:
        assert gw.wait_ready(WAIT)
        assert not gw.gateway.registry.feed_index  # Redis: the workers publish, the gateway only reads
        check_follows_the_cache(gw, "A shared Redis index routes this other system prompt. " * 2, pair)
    finally:
        gw.stop()

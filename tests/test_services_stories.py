"""stories260K (a real trained model) through gateway + prefill + decode processes: the same greedy
text as the offline engine, unary and streaming alike, and every KV block back afterwards."""
from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import GatewayConfig, WorkerPoolConfig
from harness import GatewayThread, start_workers, stop_workers, wait_idle
from tandem import Client, SamplingParams

WAIT = 60.0

PROMPTS = ["Once upon a time", "The little dog was sad because", "Tom and Lily found a big box. Inside"]


@pytest.fixture(scope="module")
def cluster(stories_dir: Path, tmp_path_factory):
    p, d = start_workers([("prefill", ["--num-kv-blocks", "64"]), ("decode", ["--num-kv-blocks", "96"])],
                         stories_dir, tmp_path_factory.mktemp("stories-workers"))
    gw = GatewayThread(GatewayConfig(model_dir=str(stories_dir), port=0,
                                     workers=WorkerPoolConfig(prefill=(p.address,), decode=(d.address,))))
    assert gw.wait_ready(WAIT)
    yield gw, p, d
    gw.stop()
    stop_workers([p, d])


def test_stories_over_grpc_equals_offline_engine(stories_dir, cluster):
    from engine import LLM

    gw, p, d = cluster
    want = LLM(str(stories_dir), num_kv_blocks=128).generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0))
    with Client(gw.target, timeout=WAIT) as client:
        for prompt, ref in zip(PROMPTS, want):
            unary = client.generate(prompt, max_tokens=40, temperature=0.0)
            chunks = list(client.stream(prompt, max_tokens=40, temperature=0.0))
            streamed_ids = [t for c in chunks for t in c.token_ids]
            assert unary.token_ids == ref.token_ids
            assert unary.text == ref.text
            assert streamed_ids == ref.token_ids
            assert "".join(c.text for c in chunks) == ref.text
            assert unary.finish_reason == ref.finish_reason
    for worker in (p, d):
        stats = wait_idle(worker, WAIT)
        assert stats.free_kv_blocks == stats.total_kv_blocks

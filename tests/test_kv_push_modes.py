"""`--kv-push step`: a prefill worker pushes every layer of a prompt's KV once the forward has
run instead of each layer as it is computed. The rule (prefill.push_mode), its validation, and
real prefill and decode workers (ZMQ on the CPU, tiny random llama) that give the offline
engine's greedy tokens with it: a prompt prefilled in several chunks, prompts sharing a cached
prefix, and a tensor-parallel pair (every rank pushes its shard in the same burst)."""
from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import GatewayConfig, WorkerPoolConfig
from harness import GatewayThread, start_workers, stop_workers, wait_idle
from prefill.push_mode import layers_due
from tandem import Client, SamplingParams
from worker.config import KV_PUSH_MODES, TransferConfig

WAIT = 60.0
GREEDY = {"temperature": 0.0, "ignore_eos": True}
FLAGS = ["--num-kv-blocks", "64", "--max-running", "8"]
SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 2  # several full blocks


def test_the_rule_pushes_each_layer_once() -> None:
    for mode in KV_PUSH_MODES:
        for n in (1, 2, 5):
            pushed = [due for layer in range(n) for due in layers_due(layer, n, mode)]
            assert pushed == list(range(n)), (mode, n)
    assert list(layers_due(2, 5, "layer")) == [2]
    assert list(layers_due(2, 5, "step")) == [] and list(layers_due(4, 5, "step")) == [0, 1, 2, 3, 4]


def test_an_unknown_mode_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="kv_push"):
        layers_due(0, 4, "burst")
    with pytest.raises(ValueError, match="kv_push"):
        TransferConfig(push="burst")


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from engine import LLM

    return LLM(str(model_dir), num_kv_blocks=128, max_running=8)


def _serve_and_compare(model_dir: Path, llm, p, d, prompts: list) -> None:
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0,
                                     workers=WorkerPoolConfig(prefill=(p.address,), decode=(d.address,),
                                                              local_prefill_tokens=0)))
    try:
        assert gw.wait_ready(WAIT)
        with Client(gw.target, timeout=WAIT) as c:
            for prompt in prompts:
                want = llm.generate(prompt, SamplingParams(max_tokens=10, **GREEDY))[0].token_ids
                assert c.generate(prompt, max_tokens=10, **GREEDY).token_ids == want, prompt
    finally:
        gw.stop()
    for w in (p, d):
        wait_idle(w, WAIT)
    assert d.stats().kv_bytes_received == p.stats().kv_bytes_sent > 0


def test_step_push_gives_the_offline_tokens(model_dir: Path, llm, tmp_path: Path) -> None:
    # A 16-token step budget: the long prompt is prefilled in several chunks, and the push in
    # its last chunk's step carries the blocks the earlier steps computed too.
    p, d = start_workers([("prefill", ["--kv-push", "step", "--max-batched-tokens", "16", *FLAGS]),
                          ("decode", FLAGS)], model_dir, tmp_path)
    try:
        _serve_and_compare(model_dir, llm, p, d, [
            [256, *range(40, 100)], "Hi", SYSTEM + "What is a KV cache?", SYSTEM + "What is a radix tree?"])
    finally:
        stop_workers([p, d])


def test_step_push_on_a_tensor_parallel_pair(model_dir: Path, llm, tmp_path: Path) -> None:
    tp = ["--tp", "2", *FLAGS]
    p, d = start_workers([("prefill", ["--kv-push", "step", *tp]), ("decode", tp)], model_dir, tmp_path,
                         timeout=WAIT * 2)
    try:
        _serve_and_compare(model_dir, llm, p, d, [[256, *range(60, 99)], SYSTEM + "And again?"])
    finally:
        stop_workers([p, d])

"""A prefill job whose KV target comes while its step still runs is pushed during that step
(`KvPusher.while_step_runs`), not after it: a step replayed from a prefill graph runs every
layer hook before its first kernel ends, and the gateway's Reserve answer usually comes later.

Real parts on the CPU: the tiny llama's engine driven by a real `EngineLoop` thread, the ZMQ
transport to a real receiver writing into a second cache. On a CPU the samples are in as soon
as the step is queued, so the test keeps the step "running" (its `ready` probe says no) until
the target has come and been pushed, and checks that the push happened inside the step."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, Tier
from kvtransfer.sinks import TensorKVSink
from kvtransfer.zmq_transport import ZmqReceiver, ZmqSender
from prefill.adapters import KvTarget, PrefillInput
from prefill.kv_push import KvPusher, PrefillJob
from worker.engine_loop import EngineLoop
from worker.transfer import transfer_id

WAIT_S = 30.0


@pytest.fixture(scope="module")
def llm(tiny_models: dict[str, Path]):
    model = LLM(str(tiny_models["llama"]), num_kv_blocks=64, max_running=4)
    yield model
    model.close()


def _pushing_rig(engine, name: str, push: str = "layer"):
    """(dest_k, dest_v, receiver, sender, loop, pusher): a real ZMQ receiver writing into zeroed
    copies of `engine`'s cache layers, a sender, and a KvPusher on an EngineLoop thread named
    `name` (not started) whose layer hook is the pusher's."""
    layers = engine.kv_cache.layers
    dest_k = [torch.zeros_like(k) for k, _ in layers]
    dest_v = [torch.zeros_like(v) for _, v in layers]
    receiver = ZmqReceiver(TensorKVSink(dest_k, dest_v))
    sender = ZmqSender()
    loop = EngineLoop(engine, name=name)
    pusher = KvPusher(loop, sender, push=push)
    loop.on_layer = pusher.on_layer
    return dest_k, dest_v, receiver, sender, loop, pusher


@pytest.mark.parametrize("push", ["layer", "step"])
def test_a_target_that_comes_mid_step_is_pushed_before_the_step_ends(llm, push: str) -> None:
    engine = llm.engine
    layers = engine.kv_cache.layers
    dest_k, dest_v, receiver, sender, loop, pusher = _pushing_rig(engine, "engine-midstep", push)

    in_step = threading.Event()  # the step is queued: the test sends the target now
    pushed = threading.Event()  # the test saw every layer handed to the sender: the step may end
    seen: dict[str, int] = {}

    def while_running(plan, ready) -> None:
        in_step.set()
        pusher.while_step_runs(plan, lambda: ready() and pushed.is_set())
        seen["layers_sent_in_step"] = job.layers_sent
        seen["src"] = list(job.request.block_table[:3])

    loop.while_running = while_running
    prompt = list(range(40, 40 + 37))  # three blocks, the last one partial
    rid = f"midstep-{push}"
    job = PrefillJob(PrefillInput(rid, prompt, SamplingParams(max_tokens=4, temperature=0.0), Tier.STANDARD,
                                  None, None, 4), engine.model_config.num_layers)
    loop.start()
    try:
        loop.submit(lambda e: pusher.start(e, job)).result(WAIT_S)
        assert in_step.wait(WAIT_S)
        assert job.layers_sent == 0 and not job.done.done()  # every hook ran without a target
        dst = [7, 11, 3]
        reservation = 5
        receiver.expect(transfer_id(rid, reservation), dst, job.num_layers, WAIT_S)
        job.target = KvTarget("d", receiver.address, reservation, 0, dst, (receiver.address,))
        pusher.target_set()
        end = time.monotonic() + WAIT_S
        while job.layers_sent < job.num_layers:
            assert not job.done.done() and time.monotonic() < end
            time.sleep(0.01)
        pushed.set()
        done = job.done.result(WAIT_S)
        assert done.send.result(WAIT_S).ok
        results = receiver.poll_completed(timeout_s=WAIT_S)
        assert [r.ok for r in results] == [True], results
    finally:
        loop.stop()
        sender.close()
        receiver.close()
    assert seen["layers_sent_in_step"] == job.num_layers  # pushed inside the step, not after it
    assert not pusher.awaiting and not pusher.jobs
    # The receiver wrote the prompt's KV (3 blocks) into the named blocks of every layer, and
    # nothing else (its cache started at zeros).
    src = seen["src"]
    for layer, (k, v) in enumerate(layers):
        assert torch.equal(dest_k[layer][dst], k[src]) and torch.equal(dest_v[layer][dst], v[src])
        assert k[src].abs().sum() > 0
        others = [b for b in range(dest_k[layer].shape[0]) if b not in dst]
        assert dest_k[layer][others].abs().sum() == 0 and dest_v[layer][others].abs().sum() == 0
    want = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids
    assert done.output.new_token_ids == want


def test_a_target_after_the_step_still_finds_the_kv_of_a_request_its_first_token_ended(llm) -> None:
    """max_tokens 1: the prefill's one token ends the request (LENGTH). Its blocks must stay
    held until the KV is pushed, also when the target comes only after the step (the job
    waits in `awaiting`); they are freed once the push is committed."""
    engine = llm.engine
    layers = engine.kv_cache.layers
    dest_k, dest_v, receiver, sender, loop, pusher = _pushing_rig(engine, "engine-late-target")
    prompt = list(range(90, 90 + 21))  # two blocks, the last one partial
    rid = "late-target-one-token"
    job = PrefillJob(PrefillInput(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0), Tier.STANDARD,
                                  None, None, 1), engine.model_config.num_layers)
    loop.start()
    try:
        loop.submit(lambda e: pusher.start(e, job)).result(WAIT_S)
        end = time.monotonic() + WAIT_S
        while rid not in loop.submit(lambda e: set(pusher.awaiting)).result(WAIT_S):
            assert not job.done.done() and time.monotonic() < end, "the job never waited for its target"
            time.sleep(0.01)
        assert job.output.finish_reason.value == "length"
        src = list(job.request.block_table)
        assert len(src) == 2  # still held: the push below reads them
        dst = [5, 9]
        receiver.expect(transfer_id(rid, 1), dst, job.num_layers, WAIT_S)
        job.target = KvTarget("d", receiver.address, 1, 0, dst, (receiver.address,))
        loop.submit(lambda e: pusher.target_arrived(e, job)).result(WAIT_S)
        done = job.done.result(WAIT_S)
        assert done.send.result(WAIT_S).ok
        assert [r.ok for r in receiver.poll_completed(timeout_s=WAIT_S)] == [True]
        held = loop.submit(lambda e: e.knows(rid)).result(WAIT_S)
    finally:
        loop.stop()
        sender.close()
        receiver.close()
    assert not held  # released after the commit
    assert engine.num_free_blocks_after_reset() == engine.num_total_blocks
    for layer, (k, v) in enumerate(layers):
        assert torch.equal(dest_k[layer][dst], k[src]) and torch.equal(dest_v[layer][dst], v[src])
        assert k[src].abs().sum() > 0
    want = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids
    assert done.output.new_token_ids == want

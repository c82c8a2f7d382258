"""The stall bound counts silence from the call's start or the worker's last progress, the later,
and a slow worker that keeps stepping is never silent for long.

A worker that is new, or was idle for longer than the bound, has not been silent on a call it
only just received: its first slow prefill must not be taken for a stall (it used to be, at the
gateway's first drain poll, a quarter second in, so a long prompt after a quiet spell failed on
every worker it was retried on). And a worker asked for chunks of many tokens sends what it
holds at least every WORKER_MAX_HOLD_S (its 7 tokens after the first here take 3.5 s, over the
bound). Real prefill and decode workers (a tiny test model) slowed with the
TANDEM_FAULT_STEP_DELAY hook, a gateway with short bounds.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, WorkerPoolConfig
from gateway.liveness import LivenessConfig
from gateway.request import DRAIN_POLL_S
from harness import GatewayThread, start_workers, stop_workers, wait_idle
from tandem import Client, SamplingParams

WAIT = 60.0
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPT = "Once upon a time"
MAX_TOKENS = 8  # generate() asks the worker for chunks of 16: only WORKER_MAX_HOLD_S keeps them coming
STEP_DELAY_S = 2 * DRAIN_POLL_S  # every step outlasts the gateway's poll of a waiting call
BOUND_S = 2 * STEP_DELAY_S + 0.5  # and stays inside the stall bounds


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


def test_slow_first_calls_on_new_and_idle_workers_are_not_stalls(model_dir: Path, tmp_path: Path) -> None:
    from engine import LLM

    want = LLM(str(model_dir), num_kv_blocks=64, max_running=4).generate(
        [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))[0].token_ids
    slow = {"TANDEM_FAULT_STEP_DELAY": str(STEP_DELAY_S)}
    flags = ["--num-kv-blocks", "64", "--max-running", "4"]
    p, d = start_workers([("prefill", flags, slow), ("decode", flags, slow)], model_dir, tmp_path)
    gw = GatewayThread(GatewayConfig(
        model_dir=str(model_dir), port=0, max_retries=0,
        liveness=LivenessConfig(stall_timeout_s=BOUND_S, prefill_stall_s=BOUND_S, stall_steps=1.0),
        workers=WorkerPoolConfig(prefill=(p.address,), decode=(d.address,), local_prefill_tokens=0)))
    try:
        assert gw.wait_ready(WAIT)
        with Client(gw.target, timeout=WAIT) as c:
            # New workers: nothing has progressed on them yet.
            assert c.generate(PROMPT, max_tokens=MAX_TOKENS, **GREEDY).token_ids == want
            time.sleep(BOUND_S + 0.5)  # idle for longer than every bound
            assert c.generate(PROMPT, max_tokens=MAX_TOKENS, **GREEDY).token_ids == want
        for stage in ("reserve", "prefill", "stream"):
            assert gw.metric("tandem_gateway_stalls_total", {"stage": stage}) == 0, stage
        for w in (p, d):
            wait_idle(w, WAIT)
    finally:
        gw.stop()
        stop_workers([p, d])

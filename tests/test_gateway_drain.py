"""A drained worker (the Admin service's Drain, as the infra agent calls it) hands its running
streams to another decode worker, each resumed exactly once with the fault-free greedy tokens;
it gets no new request, and every worker's blocks come back. With no other decode worker to
take them, a drained worker's streams finish where they are.

The decode workers are slowed (worker/faults.py's step delay) until the drain has been answered,
so every stream is still running when the drain lands however fast the host decodes; then they
heal so the rest runs at full speed."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, WorkerPoolConfig
from harness import GatewayThread, start_workers, stop_workers, wait_idle, wait_until
from tandem import Client, SamplingParams, wire
from tandem._proto.tandem.v1 import admin_pb2
from worker.faults import ENV_STEP_DELAY

WAIT = 60.0  # bound on waits for server-side events; never a timing assertion
GREEDY = {"temperature": 0.0, "ignore_eos": True}
MAX_TOKENS = 160
SLOW_STEP_S = 0.05  # 160 tokens take >= 8 s until healed: the drain always finds them running
PROMPTS = [f"Story {i}: once upon a time in a land of paged caches" for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def want(model_dir: Path) -> list[list[int]]:
    from engine import LLM

    llm = LLM(str(model_dir), num_kv_blocks=256, max_running=64)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))]


def run_streams(target: str, started: threading.Barrier, out: list[list[int] | BaseException]) -> list[threading.Thread]:
    def one(i: int) -> None:
        try:
            with Client(target, timeout=WAIT) as c:
                tokens: list[int] = []
                for n, chunk in enumerate(c.stream(PROMPTS[i], max_tokens=MAX_TOKENS, **GREEDY)):
                    tokens += chunk.token_ids
                    if n == 2:
                        started.wait(WAIT)  # every stream is running before the drain
                out[i] = tokens
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    return threads


def slowed(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A step-delay file set to a slow step, and the env that points decode workers at it."""
    delay = tmp_path / "step-delay"
    delay.write_text(str(SLOW_STEP_S))
    return delay, {ENV_STEP_DELAY: f"@{delay}"}


def drain(gw: GatewayThread, worker_id: str) -> None:
    import grpc

    with grpc.insecure_channel(gw.target) as ch:
        wire.AdminStub(ch).Drain(admin_pb2.WorkerMarkRequest(worker=worker_id, reason="test"), timeout=WAIT)


def test_a_drained_workers_streams_move_to_another_exactly_once(model_dir: Path, want, tmp_path) -> None:
    blocks = ["--num-kv-blocks", "128", "--max-running", "16"]
    delay, slow = slowed(tmp_path)
    p, d0, d1 = start_workers([("prefill", blocks), ("decode", blocks, slow), ("decode", blocks, slow)],
                              model_dir, tmp_path)
    pool = WorkerPoolConfig(prefill=(p.address,), decode=(d0.address, d1.address))
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0, workers=pool))
    try:
        assert gw.wait_ready(WAIT)
        out: list[list[int] | BaseException] = [[] for _ in PROMPTS]
        started = threading.Barrier(len(PROMPTS) + 1)
        threads = run_streams(gw.target, started, out)
        started.wait(WAIT)
        placed = gw.call(lambda: [e.worker for e in gw.gateway.dispatcher.log if e.kind == "dispatch"])
        assert d0.worker_id in placed and d1.worker_id in placed  # the burst spread over both
        moved_before = gw.metric("tandem_gateway_retries_total", {"stage": "stream"})
        drain(gw, d0.worker_id)
        delay.write_text("")  # healed
        for t in threads:
            t.join(WAIT)
        assert out == want  # every stream resumed with no gap and no duplicate
        assert gw.metric("tandem_gateway_retries_total", {"stage": "stream"}) > moved_before
        dispatched = gw.call(lambda: len(gw.gateway.dispatcher.log))
        with Client(gw.target, timeout=WAIT) as c:  # new work goes to the worker left
            assert c.generate("After the drain", max_tokens=4, **GREEDY).usage.completion_tokens == 4
        after = gw.call(lambda: [e.worker for e in list(gw.gateway.dispatcher.log)[dispatched:] if e.kind == "dispatch"])
        assert after and d0.worker_id not in after
        wait_until(lambda: gw.call(lambda: not gw.gateway.service.running), WAIT, what="the gateway to hold nothing")
    finally:
        gw.stop()
        for w in (p, d0, d1):
            wait_idle(w, WAIT)
        stop_workers([p, d0, d1])


def test_the_last_decode_worker_drained_finishes_its_streams(model_dir: Path, want, tmp_path) -> None:
    blocks = ["--num-kv-blocks", "128", "--max-running", "16"]
    delay, slow = slowed(tmp_path)
    p, d = start_workers([("prefill", blocks), ("decode", blocks, slow)], model_dir, tmp_path)
    pool = WorkerPoolConfig(prefill=(p.address,), decode=(d.address,))
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0, workers=pool))
    try:
        assert gw.wait_ready(WAIT)
        out: list[list[int] | BaseException] = [[] for _ in PROMPTS]
        started = threading.Barrier(len(PROMPTS) + 1)
        threads = run_streams(gw.target, started, out)
        started.wait(WAIT)
        drain(gw, d.worker_id)
        delay.write_text("")  # healed
        for t in threads:
            t.join(WAIT)
        assert out == want
        assert gw.metric("tandem_gateway_retries_total", {"stage": "stream"}) == 0  # nothing moved
    finally:
        gw.stop()
        for w in (p, d):
            wait_idle(w, WAIT)
        stop_workers([p, d])

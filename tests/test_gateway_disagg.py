"""The gateway over disaggregated workers (real prefill and decode processes, KV pushed over
zmq): greedy output equals the offline engine's, prefix reuse, cancellation freeing blocks on
both sides, a corrupt KV transfer retried with unchanged output, and a decode worker killed
mid-stream with the stream resumed elsewhere, each token delivered exactly once. The decode
workers run with the overlapped engine step."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from engine.engine import OVERLAP_ENV
from gateway.config import GatewayConfig, WorkerPoolConfig
from harness import GatewayThread, WorkerProcess, start_workers, stop_workers, wait_idle, wait_until
from kvtransfer.zmq_transport import CORRUPT_ENV
from tandem import Client, SamplingParams
from worker.faults import ENV_STEP_DELAY

WAIT = 60.0  # bound on waits for server-side events; never a timing assertion
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from engine import LLM

    return LLM(str(model_dir), num_kv_blocks=256, max_running=64)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory) -> dict[str, WorkerProcess]:
    """p, d: the main pair; p_bad: a prefill worker whose first KV push is corrupted;
    d_victim: a decode worker with the most free blocks (picked first), killed by one test; its
    steps take 20 ms more, so that its stream cannot end before the kill."""
    blocks = ["--num-kv-blocks", "96", "--max-running", "32"]
    overlap = {OVERLAP_ENV: "1"}  # the decode workers overlap scheduling with steps, as on a GPU
    p, d, p_bad, d_victim = start_workers(
        [("prefill", blocks), ("decode", blocks, overlap), ("prefill", blocks, {CORRUPT_ENV: "1"}),
         ("decode", ["--num-kv-blocks", "160", "--max-running", "32"], {**overlap, ENV_STEP_DELAY: "0.02"})],
        model_dir, tmp_path_factory.mktemp("gw-disagg-workers"))
    workers = {"p": p, "d": d, "p_bad": p_bad, "d_victim": d_victim}
    yield workers
    stop_workers(list(workers.values()))


def gateway_for(model_dir: Path, prefill: list[WorkerProcess], decode: list[WorkerProcess]) -> GatewayThread:
    pool = WorkerPoolConfig(prefill=tuple(w.address for w in prefill), decode=tuple(w.address for w in decode))
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0, workers=pool))
    assert gw.wait_ready(WAIT)
    return gw


@pytest.fixture(scope="module")
def gateway(model_dir: Path, cluster: dict[str, WorkerProcess]):
    gw = gateway_for(model_dir, [cluster["p"]], [cluster["d"]])
    yield gw
    gw.stop()


def reference(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params))[0]


def test_disaggregated_greedy_equals_offline_engine(gateway: GatewayThread, llm, cluster) -> None:
    system = "You are a helpful assistant. Answer briefly and precisely. " * 2  # several full blocks
    prompts = ["Hi", system + "What is a KV cache?", system + "What is a radix tree?", [256, 1, 2, 3, 4, 5]]
    with Client(gateway.target, timeout=WAIT) as c:
        for prompt in prompts:
            want = reference(llm, prompt, max_tokens=12, **GREEDY)
            got = c.generate(prompt, max_tokens=12, **GREEDY)
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        # The second prompt with the shared system prefix reused cached blocks.
        assert c.generate(system + "Again?", max_tokens=2, **GREEDY).usage.cached_tokens >= 16
        many = [f"Question {i}: why is the sky {'blue' if i % 2 else 'grey'}?" for i in range(8)]
        want = llm.generate(many, SamplingParams(max_tokens=6, **GREEDY))
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: c.generate(p, max_tokens=6, **GREEDY), many))
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        # A first token that already ends the request (max_tokens 1) releases D's reservation.
        one = c.generate("x", max_tokens=1, **GREEDY)
        assert one.token_ids == reference(llm, "x", max_tokens=1, **GREEDY).token_ids
    assert gateway.metric("tandem_gateway_routing_decisions_total", {"reason": "only_candidate"}) >= len(prompts)
    for name in ("p", "d"):
        wait_idle(cluster[name], WAIT)


def test_cancel_frees_blocks_on_prefill_and_decode(gateway: GatewayThread, cluster) -> None:
    with Client(gateway.target, timeout=WAIT) as c:
        stream = c.stream("A long answer, please: " * 4, max_tokens=400, ignore_eos=True, **GREEDY)
        next(stream)
        assert next(stream).token_ids
        stream.cancel()
    for name in ("p", "d"):
        stats = wait_idle(cluster[name], WAIT)
        assert stats.free_kv_blocks == stats.total_kv_blocks


def test_corrupt_kv_transfer_is_retried_with_unchanged_output(model_dir: Path, llm, cluster) -> None:
    gw = gateway_for(model_dir, [cluster["p_bad"]], [cluster["d"]])
    try:
        prompt = "Checksums catch flipped bytes in transit. " * 2
        want = reference(llm, prompt, max_tokens=10, **GREEDY)
        with Client(gw.target, timeout=WAIT) as c:
            got = c.generate(prompt, max_tokens=10, **GREEDY)
        assert (got.token_ids, got.text) == (want.token_ids, want.text)
        assert gw.metric("tandem_gateway_retries_total", {"stage": "decode"}) == 1  # the corrupt push
    finally:
        gw.stop()
    for name in ("p_bad", "d"):
        wait_idle(cluster[name], WAIT)


def test_decode_worker_killed_mid_stream_resumes_exactly_once(model_dir: Path, llm, cluster) -> None:
    gw = gateway_for(model_dir, [cluster["p"]], [cluster["d_victim"], cluster["d"]])
    try:
        prompt = "Tell me a long story about disaggregated serving."
        want = reference(llm, prompt, max_tokens=160, ignore_eos=True, **GREEDY)
        with Client(gw.target, timeout=WAIT) as c:
            stream = c.stream(prompt, max_tokens=160, ignore_eos=True, **GREEDY)
            chunks = [next(stream), next(stream), next(stream)]
            placed = gw.call(lambda: [e.worker for e in gw.gateway.dispatcher.log if e.kind == "dispatch"])
            assert placed == [cluster["d_victim"].worker_id]  # most headroom: picked first
            cluster["d_victim"].kill()
            chunks += list(stream)
        tokens = sum((ch.token_ids for ch in chunks), [])
        assert tokens == want.token_ids  # no gap, no duplicate
        assert "".join(ch.text for ch in chunks) == want.text
        assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 160
        placed = gw.call(lambda: [e.worker for e in gw.gateway.dispatcher.log if e.kind == "dispatch"])
        assert placed == [cluster["d_victim"].worker_id, cluster["d"].worker_id]
        wait_until(lambda: gw.call(lambda: not any(h.up for h in gw.gateway.registry.handles
                                                   if h.address == cluster["d_victim"].address)),
                   WAIT, what="the dead worker to be marked down")
    finally:
        gw.stop()
    for name in ("p", "d"):
        wait_idle(cluster[name], WAIT)


def test_a_refused_reservation_aborts_the_prefill_sent_with_it(model_dir: Path, llm, cluster, tmp_path) -> None:
    """The gateway sends a prompt's Prefill with its Reserve (the target follows). When the
    decode worker has no room, the prefill is aborted (P frees its blocks), the attempts after
    that wait for a reservation before they prefill, and the request completes once room frees
    up, with the offline engine's tokens."""
    # The small worker's steps: 10 ms, so the stream's reader keeps up with the first request,
    # then 100 ms once it holds its blocks, so they stay held until the second's Reserve came.
    slow = tmp_path / "step-delay"
    slow.write_text("0.01")
    [small] = start_workers([("decode", ["--num-kv-blocks", "16", "--max-running", "4"],
                              {OVERLAP_ENV: "1", ENV_STEP_DELAY: f"@{slow}"})], model_dir, tmp_path)
    gw = gateway_for(model_dir, [cluster["p"]], [small])
    p = cluster["p"].worker_id
    try:
        first = list(range(100, 116))  # 16 tokens; with 200 more it holds 14 of the 16 blocks
        second = list(range(150, 230))  # 80 tokens: 6 blocks
        want = reference(llm, second, max_tokens=4, **GREEDY)
        with Client(gw.target, timeout=WAIT) as c, ThreadPoolExecutor(1) as pool:
            stream = c.stream(first, max_tokens=200, ignore_eos=True, **GREEDY)
            got_first = []
            # 166 tokens in 11 blocks: 5 free, too few for the second; the 50 tokens still to come
            # keep it so while the second's Reserve arrives: 5 s at 0.1 s a step (at full speed a
            # loaded machine streamed them before the Reserve came).
            while len(got_first) < 150:
                got_first += next(stream).token_ids
            slow.write_text("0.1")
            late = pool.submit(c.generate, second, max_tokens=4, **GREEDY)
            wait_until(lambda: gw.metric("tandem_gateway_prefill_requests_total", {"worker": p}) >= 2, WAIT,
                       what="the second request's prefill to be sent with its Reserve")
            got_first += [t for ch in stream for t in ch.token_ids]
            got = late.result(WAIT)
        assert len(got_first) == 200
        assert got.token_ids == want.token_ids
        # The first request's prefill, the second's sent with its refused Reserve, and its last.
        assert gw.metric("tandem_gateway_prefill_requests_total", {"worker": p}) == 3
    finally:
        gw.stop()
        stop_workers([small])
    wait_idle(cluster["p"], WAIT)


def test_the_prefill_can_wait_for_the_reservation(model_dir: Path, llm, cluster) -> None:
    """`--reserve-before-prefill`: the Prefill goes out with its target once D has reserved."""
    pool = WorkerPoolConfig(prefill=(cluster["p"].address,), decode=(cluster["d"].address,),
                            prefill_target_follows=False)
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0, workers=pool))
    try:
        assert gw.wait_ready(WAIT)
        prompts = ["Hello there", "One more prompt that spans more than a single block of sixteen tokens."]
        with Client(gw.target, timeout=WAIT) as c:
            for prompt in prompts:
                want = reference(llm, prompt, max_tokens=8, **GREEDY)
                assert c.generate(prompt, max_tokens=8, **GREEDY).token_ids == want.token_ids
    finally:
        gw.stop()
    for name in ("p", "d"):
        wait_idle(cluster[name], WAIT)

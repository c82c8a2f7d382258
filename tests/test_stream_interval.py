"""GenerateRequest.stream_interval: the same tokens in fewer messages. The grouping rules on
each side (the worker's engine-thread listener, the gateway's client stream), the arithmetic
the gateway's stall bound gets from it, and end to end through a gateway and a disaggregated
prefill + decode pair: greedy output equal to the offline engine's at every interval, the
first token at once, `Client.generate` answered with one token chunk, bad values refused."""
from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from engine.outputs import FinishReason, StepOutput
from gateway.config import GatewayConfig, WorkerPoolConfig
from gateway.liveness import MAX_WORKER_CHUNK_TOKENS, LivenessConfig, worker_stream_interval
from gateway.request import RequestFailed
from gateway.streaming import grouped, merge_chunks
from harness import GatewayThread, start_workers, stop_workers, wait_idle
from tandem import Client, SamplingParams, wire
from tandem.wire import Chunk, TokenLogprob, Usage
from tandem.rules import WORKER_MAX_HOLD_S, StreamGrouping
from worker.streams import coalescing

WAIT = 60.0
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = ["Once upon a time", "The cache was paged", "A tiny model said"]
MAX_TOKENS = 37


def outputs(n: int, end: bool = True) -> list[StepOutput]:
    outs = [StepOutput("r", [i], [None], False) for i in range(n)]
    if end:
        outs[-1] = StepOutput("r", [n - 1], [None], True, FinishReason.LENGTH, "")
    return outs


# ---------------------------------------------------------------- the worker's listener

@pytest.mark.parametrize("every", [1, 2, 4, 16])
def test_the_worker_listener_hands_over_in_groups_in_order(every):
    got: list[list[StepOutput]] = []  # what reaches the stream, a group per put_all
    listen = coalescing(lambda group: got.append(list(group)), every)
    for out in outputs(11):
        listen(out)
    assert [o for g in got for o in g] == outputs(11)  # nothing lost, nothing reordered
    assert [len(g) for g in got] == ([1] * 11 if every == 1 else
                                     [1, *[every] * ((10 - 1) // every), 10 - every * ((10 - 1) // every)])


def test_a_group_reaches_the_stream_whole_while_the_loop_drains():
    """The engine thread hands a group over while the event loop is draining earlier ones: a
    reader's get_batch holds whole groups only (a group split across two reads would go out as
    two chunks, one of them ending mid-interval), and every item arrives once, in order."""
    from worker.streams import AsyncBridge, ItemStream

    groups, size = 2000, 5

    async def run() -> list[list[int]]:
        stream = ItemStream(AsyncBridge(asyncio.get_running_loop()))

        def engine_thread() -> None:
            for g in range(groups):
                stream.put_all([g * size + i for i in range(size)])

        feeder = threading.Thread(target=engine_thread)
        feeder.start()
        reads, seen = [], 0
        while seen < groups * size:
            batch = await asyncio.wait_for(stream.get_batch(), WAIT)
            reads.append(batch)
            seen += len(batch)
            await asyncio.sleep(0)  # let the bridge's callbacks interleave with the reads
        feeder.join()
        return reads

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the two threads take turns between any two posts
    try:
        reads = asyncio.run(run())
    finally:
        sys.setswitchinterval(switch)
    assert [x for r in reads for x in r] == list(range(groups * size))
    assert all(len(r) % size == 0 and r[0] % size == 0 for r in reads), [len(r) for r in reads if len(r) % size]


def test_held_tokens_go_out_after_the_hold_bound():
    """A slow stream (one token a second, say) is not held for its whole interval: what is held
    goes out once it was held `max_hold_s`, so the gateway hears from a stepping worker at least
    that often (its stall bound measures silence, not slowness)."""
    now = [0.0]
    g = StreamGrouping(16, max_hold_s=0.5, clock=lambda: now[0])
    assert g.add(1)  # the first token at once
    now[0] = 0.2
    assert not g.add(1)
    now[0] = 0.45
    assert not g.add(1)
    now[0] = 0.5
    assert g.add(1)  # held since the last send at 0.0 for 0.5 s
    now[0] = 0.7
    assert not g.add(1)
    now[0] = 1.0
    assert g.add(1)
    t = [0.0]
    idle = StreamGrouping(16, max_hold_s=0.5, clock=lambda: t[0])
    assert idle.add(1)
    t[0] = 9.0
    assert not idle.add(0)  # nothing held: nothing due, however long ago the last send
    fast = StreamGrouping(4, max_hold_s=0.5, clock=lambda: 0.0)
    assert [fast.add(1) for _ in range(9)] == [True, False, False, False, True, False, False, False, True]
    assert WORKER_MAX_HOLD_S > 0 and StreamGrouping(16).max_hold_s is None  # the client's grouping has none


def test_the_worker_listener_flushes_before_an_error():
    seen: list = []
    listen = coalescing(seen.extend, 8)
    first, second, third = outputs(3, end=False)
    listen(first)
    listen(second)
    listen(third)
    assert seen == [first]  # two held
    boom = RuntimeError("engine failed")
    listen(boom)
    assert seen == [first, second, third, boom]


# ---------------------------------------------------------------- the gateway's client stream

def chunks(n: int) -> list[Chunk]:
    out = [Chunk(token_ids=[i], text=chr(97 + i), logprobs=[TokenLogprob(i, -0.5)]) for i in range(n)]
    out[-1] = Chunk(token_ids=[n - 1], text=chr(97 + n - 1), logprobs=[TokenLogprob(n - 1, -0.5)],
                    finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=n))
    return out


async def _collect(items: list, interval: int) -> list:
    async def source():
        for item in items:
            yield item
    return [x async for x in grouped(source(), interval)]


@pytest.mark.parametrize("interval, sizes", [(1, [1] * 7), (3, [1, 3, 3]), (0, [7]), (100, [1, 6])])
def test_the_gateway_groups_the_client_stream(interval, sizes):
    got = asyncio.run(_collect(chunks(7), interval))
    assert [len(c.token_ids) for c in got] == sizes
    whole = merge_chunks(got)
    assert whole.token_ids == list(range(7)) and whole.text == "abcdefg"
    assert [lp.token_id for lp in whole.logprobs] == list(range(7))
    assert got[-1].finish_reason == "length" and got[-1].usage.completion_tokens == 7


def test_held_chunks_go_before_a_failure():
    failed = RequestFailed(grpc.StatusCode.UNAVAILABLE, "no worker")
    got = asyncio.run(_collect([*chunks(5)[:4], failed], 0))
    assert [len(c.token_ids) for c in got[:-1]] == [4] and got[-1] is failed


def test_worker_interval_and_the_stall_bound():
    assert worker_stream_interval(1) == 1
    assert worker_stream_interval(0) == MAX_WORKER_CHUNK_TOKENS
    assert worker_stream_interval(4) == 4 and worker_stream_interval(10_000) == MAX_WORKER_CHUNK_TOKENS
    live = LivenessConfig(stall_timeout_s=1.0, stall_steps=20)
    slow = SimpleNamespace(step_s=0.2)  # 0.2 s a token: a chunk of 16 comes every 3.2 s
    assert live.stream_timeout(slow) == pytest.approx(4.0)
    assert live.stream_timeout(slow, 16) == pytest.approx(7.0)  # never shorter than a chunk's wait
    assert live.stream_timeout(SimpleNamespace(step_s=0.001), 16) == 1.0


def test_bad_stream_interval_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="stream_interval"):
        wire.generate_request_to_proto("hi", SamplingParams(), stream_interval=-1)
    with pytest.raises(ValueError, match="stream_interval"):
        wire.generate_request_to_proto("hi", SamplingParams(), stream_interval=True)


# ---------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def want(model_dir: Path) -> list[list[int]]:
    from engine import LLM

    llm = LLM(str(model_dir), num_kv_blocks=128, max_running=16)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))]


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory):
    blocks = ["--num-kv-blocks", "96", "--max-running", "16"]
    p, d = start_workers([("prefill", blocks), ("decode", blocks)], model_dir, tmp_path_factory.mktemp("si"))
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0,
                                     workers=WorkerPoolConfig(prefill=(p.address,), decode=(d.address,))))
    try:
        assert gw.wait_ready(WAIT)
        yield gw, (p, d)
    finally:
        gw.stop()
        stop_workers([p, d])


@pytest.mark.parametrize("interval", [None, 1, 4, 0])
def test_every_interval_gives_the_offline_tokens(cluster, want, interval):
    gw, workers = cluster
    results: dict[int, list[list[int]]] = {}

    def one(i: int) -> None:
        with Client(gw.target, timeout=WAIT) as c:
            results[i] = [ch.token_ids for ch in c.stream(PROMPTS[i], max_tokens=MAX_TOKENS, stream_interval=interval,
                                                            **GREEDY)]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    for i, tokens in enumerate(want):
        got = [c for c in results[i] if c]  # the admission chunk carries no token
        assert [t for c in got for t in c] == tokens
        if interval == 0:
            assert len(got) == 1
        elif interval == 4:
            assert len(got[0]) == 1  # the first token at once
            assert all(len(c) >= 4 for c in got[1:-1]), [len(c) for c in got]  # then >= 4 a chunk
            assert len(got) <= 1 + -(-(len(tokens) - 1) // 4)
    for w in workers:
        wait_idle(w, WAIT)


def test_generate_asks_for_one_chunk(cluster, want):
    gw, _ = cluster
    stub = wire.TandemStub(grpc.insecure_channel(gw.target))
    msgs = list(stub.Generate(wire.generate_request_to_proto(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, **GREEDY),
                                                             stream_interval=0), timeout=WAIT))
    assert len(msgs) == 2 and msgs[0].request_id and not msgs[0].token_ids  # admission, then everything
    assert list(msgs[1].token_ids) == want[0] and msgs[1].usage.completion_tokens == MAX_TOKENS
    with Client(gw.target, timeout=WAIT) as c:
        assert c.generate(PROMPTS[0], max_tokens=MAX_TOKENS, **GREEDY).token_ids == want[0]
        with pytest.raises(ValueError, match="stream_interval"):
            c.stream(PROMPTS[0], max_tokens=4, stream_interval=-2)


def test_the_gateway_default_applies_to_streams_that_do_not_ask(cluster, want, model_dir):
    _, (p, d) = cluster
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0, stream_interval=5,
                                     workers=WorkerPoolConfig(prefill=(p.address,), decode=(d.address,))))
    try:
        assert gw.wait_ready(WAIT)
        with Client(gw.target, timeout=WAIT) as c:
            unset = [ch.token_ids for ch in c.stream(PROMPTS[1], max_tokens=MAX_TOKENS, **GREEDY) if ch.token_ids]
            every = [ch.token_ids for ch in c.stream(PROMPTS[1], max_tokens=MAX_TOKENS, stream_interval=1, **GREEDY)
                     if ch.token_ids]
        assert [t for c in unset for t in c] == [t for c in every for t in c] == want[1]
        assert len(unset[0]) == 1 and all(len(c) >= 5 for c in unset[1:-1]) and len(unset) <= 1 + -(-(MAX_TOKENS - 1) // 5)
        assert len(every) > len(unset)  # asking for 1 overrides the default
    finally:
        gw.stop()
    with pytest.raises(ValueError, match="stream_interval"):
        GatewayConfig(model_dir=str(model_dir), stream_interval=-1)

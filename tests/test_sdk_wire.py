"""The SDK (tandem.client) against a real in-process gRPC server implementing tandem.v1.Tandem.

The server here is a small echo service defined in this file: it tests how the SDK carries
requests, chunks, errors and cancellation over the wire, not the gateway.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from tandem import wire
from tandem.client import AsyncClient, Client, Completion
from tandem.errors import TandemError
from tandem.types import SamplingParams, Tier

WAIT = 20.0  # generous bound for waiting on server-side events; never a timing assertion
MODEL = wire.ModelInfo("echo", "echo@1", 1 << 17, 2048, 16, (0,), "float32", 1, 2)


@dataclass
class Record:
    request: wire.GenerateInput
    wake: threading.Event = field(default_factory=threading.Event)
    aborted: bool = False
    cancelled: threading.Event = field(default_factory=threading.Event)
    finished: bool = False


class EchoTandem(wire.TandemServicer):
    """Echoes the prompt's characters (or token ids) back, one token per chunk.

    Text prompts with a special form steer it: "hang" (one chunk, then wait for abort or
    cancel), "fail:<CODE>" (fail before output), "failmid" (fail after two chunks),
    "nofinish" (end without a final chunk), "barrier:<x>" (meet two other requests first).
    """

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}
        self.lock = threading.Lock()
        self.active = 0
        self.max_active = 0
        self.barrier = threading.Barrier(3, timeout=WAIT)
        self._ids = itertools.count()

    def reset_load(self) -> None:
        with self.lock:
            self.max_active = 0
            self.barrier = threading.Barrier(3, timeout=WAIT)

    def Generate(self, request, context):
        inp = wire.generate_request_from_proto(request)
        rid = inp.request_id or f"srv-{next(self._ids)}"
        rec = self.records[rid] = Record(inp)

        def on_end() -> None:  # runs when the RPC ends, however it ends
            if not (rec.finished or rec.aborted):  # ended before the last chunk: the client went away
                rec.cancelled.set()
            rec.wake.set()

        context.add_callback(on_end)
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            yield from self._generate(rid, rec, context)
            rec.finished = True
        finally:
            with self.lock:
                self.active -= 1

    def _generate(self, rid: str, rec: Record, context):
        prompt, params = rec.request.prompt, rec.request.params
        if prompt == "hang":
            yield wire.chunk_to_proto(wire.Chunk(token_ids=[104], text="h", request_id=rid))
            rec.wake.wait(WAIT)
            if rec.aborted:
                yield wire.chunk_to_proto(wire.Chunk(finish_reason="abort", stop_reason="aborted by client",
                                                     usage=wire.Usage(4, 1, 0)))
            return
        if isinstance(prompt, str) and prompt.startswith("fail:"):
            context.abort(grpc.StatusCode[prompt[5:]], f"echo failure {prompt[5:]}")
        if prompt == "failmid":
            yield wire.chunk_to_proto(wire.Chunk(token_ids=[1], text="a", request_id=rid))
            yield wire.chunk_to_proto(wire.Chunk(token_ids=[2], text="b"))
            context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker died")
        if prompt == "nofinish":
            yield wire.chunk_to_proto(wire.Chunk(token_ids=[1], text="a", request_id=rid))
            return
        if isinstance(prompt, str) and prompt.startswith("barrier:"):
            self.barrier.wait()
        tokens = list(prompt) if isinstance(prompt, tuple) else [ord(c) for c in prompt]
        yield from self._echo(rid, tokens, params, rec.request.stream_text)

    def _echo(self, rid: str, tokens: list[int], params: SamplingParams, stream_text: bool):
        out: list[int] = []
        finish = wire.Chunk(finish_reason="length")
        for tok in tokens[: params.max_tokens]:
            out.append(tok)
            lps = []
            if params.logprobs is not None:
                lps = [wire.TokenLogprob(tok, -0.5, tuple((tok + i, -1.0 - i) for i in range(params.logprobs)))]
            chunk = wire.Chunk(token_ids=[tok], text=chr(tok) if stream_text else "", logprobs=lps,
                               request_id=rid if len(out) == 1 else "")
            if tok in params.stop_token_ids:
                chunk.finish_reason, chunk.stop_reason, chunk.matched_stop = "stop", "stop_token_id", tok
            elif any("".join(map(chr, out)).endswith(s) for s in params.stop):
                match = next(s for s in params.stop if "".join(map(chr, out)).endswith(s))
                chunk.finish_reason, chunk.stop_reason, chunk.matched_stop = "stop", "stop_string", match
            elif len(out) == len(tokens):
                chunk.finish_reason, chunk.stop_reason = "stop", "eos"
            if chunk.finish_reason:  # finish rides on the last token's chunk
                chunk.usage = wire.Usage(len(tokens), len(out), len(tokens) // 2)
                yield wire.chunk_to_proto(chunk)
                return
            yield wire.chunk_to_proto(chunk)
        finish.usage = wire.Usage(len(tokens), len(out), len(tokens) // 2)
        yield wire.chunk_to_proto(finish)  # finish in a chunk of its own

    def Abort(self, request, context):
        rec = self.records.get(request.request_id)
        if rec is None or rec.finished or rec.wake.is_set():
            return wire.pb.AbortResponse(found=False)
        rec.aborted = True
        rec.wake.set()
        return wire.pb.AbortResponse(found=True)

    def GetModelInfo(self, request, context):
        return wire.model_info_to_proto(MODEL)


@pytest.fixture(scope="module")
def echo():
    servicer = EchoTandem()
    server = grpc.server(ThreadPoolExecutor(max_workers=32))
    wire.add_tandem_servicer(servicer, server)
    wire.add_health_and_reflection(server, [wire.TANDEM_SERVICE])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture
def client(echo):
    with Client(echo[1], timeout=60) as c:
        yield c


# ------------------------------------------------------------------ sync client

def test_generate_carries_params_tier_and_request_id(echo, client) -> None:
    servicer, _ = echo
    done = client.generate("hello", max_tokens=3, temperature=0.0, seed=7, tier=Tier.INTERACTIVE,
                           request_id="gen-1")
    assert isinstance(done, Completion)
    assert (done.text, done.token_ids, done.finish_reason) == ("hel", [ord(c) for c in "hel"], "length")
    assert done.usage == wire.Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)
    assert done.request_id == "gen-1" and done.logprobs is None
    got = servicer.records["gen-1"].request
    assert got.params == SamplingParams(max_tokens=3, temperature=0.0, seed=7)
    assert got.tier is Tier.INTERACTIVE and got.prompt == "hello"


def test_keywords_override_params(echo, client) -> None:
    servicer, _ = echo
    base = SamplingParams(max_tokens=50, top_p=0.5, top_k=3, stop=("zz",), ignore_eos=True)
    client.generate("abc", params=base, top_p=0.9, stop=["q"], request_id="ovr-1")
    assert servicer.records["ovr-1"].request.params == base.replace(top_p=0.9, stop=("q",))
    client.generate("abc", params=base, request_id="ovr-2")
    assert servicer.records["ovr-2"].request.params == base


def test_token_prompt_stop_reasons_and_logprobs(echo, client) -> None:
    servicer, _ = echo
    done = client.generate([7, 8, 9], request_id="tok-1")
    assert done.token_ids == [7, 8, 9] and done.finish_reason == "stop" and done.stop_reason == "eos"
    assert servicer.records["tok-1"].request.prompt == (7, 8, 9)
    assert servicer.records["tok-1"].request.tier is Tier.STANDARD

    done = client.generate([7, 8, 9], stop_token_ids=[8])
    assert done.token_ids == [7, 8] and done.stop_reason == "stop_token_id" and done.matched_stop == 8

    done = client.generate("one, two", stop=[", "])
    assert done.text == "one, " and done.stop_reason == "stop_string" and done.matched_stop == ", "

    done = client.generate("xyz", logprobs=2)
    assert [lp.token_id for lp in done.logprobs] == done.token_ids
    assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in done.logprobs)


def test_stream_yields_deltas_then_a_final_chunk(client) -> None:
    stream = client.stream("abcd", max_tokens=10, request_id="st-1")
    chunks = list(stream)
    assert "".join(c.text for c in chunks) == "abcd"
    assert [t for c in chunks for t in c.token_ids] == [ord(c) for c in "abcd"]
    assert chunks[0].request_id == "st-1" and stream.request_id == "st-1"
    assert all(not c.finished for c in chunks[:-1]) and chunks[-1].finish_reason == "stop"
    assert chunks[-1].usage == wire.Usage(4, 4, 2)


def test_bad_keywords_raise_value_error_before_sending(echo, client) -> None:
    servicer, _ = echo
    before = len(servicer.records)
    cases = [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
             ({"max_tokens": 0}, "max_tokens"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
             ({"seed": -3}, "seed"), ({"logprobs": 1000}, "logprobs"), ({"tier": "urgent"}, "tier"),
             ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"params": {"temperature": 1}}, "params")]
    for kw, name in cases:
        with pytest.raises(ValueError, match=name):
            client.generate("hi", **kw)
        with pytest.raises(ValueError, match=name):
            client.stream("hi", **kw)
    for prompt in ("", [], [1, -2], [1, 2**32], b"bytes"):
        with pytest.raises(ValueError, match="prompt"):
            client.generate(prompt)
    with pytest.raises(TypeError, match="temprature"):
        client.generate("hi", temprature=0.5)
    with pytest.raises(ValueError, match="timeout"):
        Client("127.0.0.1:1", timeout=-1)
    with pytest.raises(ValueError, match="concurrency"):
        client.submit_batch(["a"], concurrency=0)
    with pytest.raises(ValueError, match="temperature"):
        client.submit_batch(["a", "b"], params=SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt"):
        client.submit_batch(["a", ""])
    assert len(servicer.records) == before


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "OUT_OF_RANGE"])
def test_status_codes_become_tandem_errors(client, code: str) -> None:
    with pytest.raises(TandemError) as info:
        client.generate(f"fail:{code}")
    assert info.value.code == grpc.StatusCode[code]
    assert info.value.details == f"echo failure {code}"
    with pytest.raises(TandemError) as info:
        list(client.stream(f"fail:{code}"))
    assert info.value.code == grpc.StatusCode[code]


def test_failure_mid_stream_and_missing_final_chunk(client) -> None:
    stream = client.stream("failmid")
    got = [next(stream), next(stream)]
    assert "".join(c.text for c in got) == "ab"
    with pytest.raises(TandemError) as info:
        next(stream)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "died" in info.value.details
    with pytest.raises(TandemError) as info:
        client.generate("nofinish")
    assert info.value.code == grpc.StatusCode.INTERNAL


def test_deadline_and_unreachable_server(client) -> None:
    with pytest.raises(TandemError) as info:
        client.generate("hang", timeout=0.5)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with Client("127.0.0.1:1", timeout=10) as dead:
        with pytest.raises(TandemError) as info:
            dead.model_info()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_closing_a_stream_cancels_the_rpc(echo, client) -> None:
    servicer, _ = echo
    stream = client.stream("hang", request_id="cancel-1")
    assert next(stream).text == "h"
    stream.close()
    assert servicer.records["cancel-1"].cancelled.wait(WAIT)
    assert list(stream) == []

    with client.stream("hang", request_id="cancel-2") as stream:
        for _chunk in stream:
            break
    assert servicer.records["cancel-2"].cancelled.wait(WAIT)


def test_abort_ends_the_stream_with_abort(echo, client) -> None:
    stream = client.stream("hang", request_id="abort-1")
    assert next(stream).request_id == "abort-1"
    assert client.abort("abort-1") is True
    rest = list(stream)
    assert rest[-1].finish_reason == "abort" and rest[-1].usage.completion_tokens == 1
    assert client.abort("abort-1") is False
    assert client.abort("never-seen") is False
    with pytest.raises(ValueError, match="request_id"):
        client.abort("")


def test_submit_batch_bounds_concurrency_and_keeps_order(echo, client) -> None:
    servicer, _ = echo
    servicer.reset_load()
    prompts = [f"barrier:{i}" for i in range(9)]
    done = client.submit_batch(prompts, concurrency=3, max_tokens=64)
    assert [c.text for c in done] == prompts  # echo, in input order
    assert servicer.max_active <= 3
    batch_tiers = {r.request.tier for r in servicer.records.values() if str(r.request.prompt).startswith("barrier:")}
    assert batch_tiers == {Tier.BATCH}
    assert client.submit_batch([]) == []


def test_submit_batch_errors(client) -> None:
    mixed = client.submit_batch(["ok", "fail:INTERNAL", [65, 66]], return_exceptions=True, concurrency=2)
    assert isinstance(mixed[0], Completion) and mixed[0].text == "ok"
    assert isinstance(mixed[1], TandemError) and mixed[1].code == grpc.StatusCode.INTERNAL
    assert isinstance(mixed[2], Completion) and mixed[2].text == "AB"
    with pytest.raises(TandemError) as info:
        client.submit_batch(["ok", "fail:PERMISSION_DENIED"])
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(ValueError, match="request_id"):
        client.submit_batch(["a"], request_id="same-for-all")


def test_model_info(client) -> None:
    assert client.model_info() == MODEL


# ------------------------------------------------------------------ async client

def test_async_client_round_trips(echo) -> None:
    servicer, target = echo

    async def main() -> None:
        async with AsyncClient(target, timeout=60) as c:
            done = await c.generate("hello", max_tokens=4, top_k=5, tier="batch", request_id="a-gen")
            assert (done.text, done.finish_reason) == ("hell", "length")
            assert servicer.records["a-gen"].request.params == SamplingParams(max_tokens=4, top_k=5)
            assert servicer.records["a-gen"].request.tier is Tier.BATCH

            chunks = [ch async for ch in c.stream([72, 73], logprobs=0)]
            assert [t for ch in chunks for t in ch.token_ids] == [72, 73]
            assert chunks[-1].stop_reason == "eos" and len(chunks[0].logprobs) == 1

            assert await c.model_info() == MODEL
            with pytest.raises(ValueError, match="top_p"):
                c.stream("x", top_p=2.0)
            with pytest.raises(TandemError) as info:
                await c.generate("fail:RESOURCE_EXHAUSTED")
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED

            servicer.reset_load()
            prompts = [f"barrier:a{i}" for i in range(6)]
            batch = await c.submit_batch(prompts, concurrency=3)
            assert [b.text for b in batch] == prompts and servicer.max_active <= 3
            mixed = await c.submit_batch(["x", "fail:ABORTED"], return_exceptions=True)
            assert mixed[0].text == "x" and mixed[1].code == grpc.StatusCode.ABORTED

    asyncio.run(main())


def test_async_cancellation_reaches_the_server(echo) -> None:
    servicer, target = echo

    async def main() -> None:
        async with AsyncClient(target, timeout=60) as c:
            async with c.stream("hang", request_id="a-cancel-1") as stream:
                async for chunk in stream:
                    assert chunk.text == "h"
                    break
            assert await asyncio.to_thread(servicer.records["a-cancel-1"].cancelled.wait, WAIT)

            first = asyncio.Event()

            async def consume() -> None:
                async for _chunk in c.stream("hang", request_id="a-cancel-2"):
                    first.set()

            task = asyncio.ensure_future(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await asyncio.to_thread(servicer.records["a-cancel-2"].cancelled.wait, WAIT)

            stream = c.stream("hang", request_id="a-abort")
            assert (await stream.__anext__()).request_id == "a-abort"
            assert await c.abort("a-abort") is True
            rest = [ch async for ch in stream]
            assert rest[-1].finish_reason == "abort"

    asyncio.run(main())

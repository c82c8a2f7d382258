"""The gateway end to end with a real role-both worker process and the SDK: greedy output
equals the offline engine's, concurrency, validation, cancel / abort / deadline freeing every
KV block, tier priority and a full tier; plus the `tandem gateway` process (metrics,
health, SIGTERM drain)."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from entrypoints.cluster import command
from gateway.config import GatewayConfig, TierConfig, WorkerPoolConfig
from harness import GatewayThread, start_workers, wait_idle, wait_until
from tandem import Client, SamplingParams, Tier, TandemError, wire
from worker.faults import ENV_STEP_DELAY

WAIT = 60.0  # bound on waits for server-side events; never a timing assertion
LONG = 450  # tokens of a request meant to still be running when the test acts on it
# The worker's steps take 5 ms more (worker/faults.py), so LONG tokens take over 2 s on any
# machine: a fast one decodes this tiny model's 450 tokens in ~0.5 s, near the 0.3 and 0.5 s
# deadlines the tests set and the round trips they make before acting on such a request.
STEP_DELAY_S = "0.005"


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from engine import LLM

    return LLM(str(model_dir), num_kv_blocks=256, max_running=64)


@pytest.fixture(scope="module")
def worker(model_dir: Path, tmp_path_factory):
    (w,) = start_workers([("both", ["--num-kv-blocks", "160", "--max-running", "64"], {ENV_STEP_DELAY: STEP_DELAY_S})],
                         model_dir, tmp_path_factory.mktemp("gw-e2e-workers"))
    yield w
    w.stop()


@pytest.fixture(scope="module")
def gateway(model_dir: Path, worker):
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0, workers=WorkerPoolConfig(both=(worker.address,))))
    assert gw.wait_ready(WAIT)
    yield gw
    gw.stop()


@pytest.fixture()
def client(gateway: GatewayThread):
    with Client(gateway.target, timeout=WAIT) as c:
        yield c


def reference(llm, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params))[0]


def test_greedy_output_equals_offline_engine(client: Client, llm, worker) -> None:
    prompts = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 3, [256, 72, 105, 33, 10]]
    for prompt in prompts:
        want = reference(llm, prompt, max_tokens=16, temperature=0.0)
        got = client.generate(prompt, max_tokens=16, temperature=0.0)
        streamed = list(client.stream(prompt, max_tokens=16, temperature=0.0))
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason
        assert sum((c.token_ids for c in streamed), []) == want.token_ids
        assert "".join(c.text for c in streamed) == want.text
        assert streamed[0].request_id and streamed[-1].usage.completion_tokens == len(want.token_ids)
        assert got.usage.prompt_tokens == want.prompt_tokens
    # A stop string taken from the reference output is cut exactly where the engine cuts it.
    plain = reference(llm, "Once upon a time", max_tokens=24, temperature=0.0)
    stop = next(plain.text[i:i + 2] for i in range(3, len(plain.text) - 2) if "\ufffd" not in plain.text[i:i + 2])
    want = reference(llm, "Once upon a time", max_tokens=24, temperature=0.0, stop=[stop])
    got = client.generate("Once upon a time", max_tokens=24, temperature=0.0, stop=[stop])
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert got.stop_reason == "stop_string" and got.matched_stop == stop and stop not in got.text
    wait_idle(worker, WAIT)  # the stop cut here aborted the worker's copy


def test_logprobs_come_through(client: Client, llm) -> None:
    want = reference(llm, "abc", max_tokens=4, temperature=0.0, logprobs=2)
    got = client.generate("abc", max_tokens=4, temperature=0.0, logprobs=2)
    assert [lp.token_id for lp in got.logprobs] == want.token_ids
    for mine, ref in zip(got.logprobs, want.logprobs):
        assert mine.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t for t, _ in mine.top] == [t for t, _ in ref.top]


def test_32_concurrent_streams(client: Client, llm) -> None:
    prompts = [f"Request number {i}: tell me about {'xyz'[i % 3] * (i % 7 + 1)}" for i in range(32)]
    want = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))

    def one(prompt: str) -> tuple[list[int], str]:
        chunks = list(client.stream(prompt, max_tokens=8, temperature=0.0))
        return sum((c.token_ids for c in chunks), []), "".join(c.text for c in chunks)

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, prompts))
    assert [g[0] for g in got] == [w.token_ids for w in want]
    assert [g[1] for g in got] == [w.text for w in want]


def _raw(**fields) -> wire.pb.GenerateRequest:
    params = fields.pop("params", {})
    return wire.pb.GenerateRequest(params=wire.pb.SamplingParams(**params), **fields)


BAD_REQUESTS = [
    (_raw(), "prompt"),
    (_raw(text=""), "prompt"),
    (_raw(token_ids=wire.pb.TokenIds(ids=[5, 300])), "prompt"),
    (_raw(token_ids=wire.pb.TokenIds(ids=[7] * 512)), "prompt"),
    (_raw(text="hi", params={"max_tokens": 0}), "max_tokens"),
    (_raw(token_ids=wire.pb.TokenIds(ids=[7] * 500), params={"max_tokens": 20}), "max_tokens"),
    (_raw(text="hi", tier=9), "tier"),
    (_raw(text="hi", params={"temperature": -1.0}), "temperature"),
    (_raw(text="hi", params={"top_p": 0.0}), "top_p"),
    (_raw(text="hi", params={"top_p": 1.5}), "top_p"),
    (_raw(text="hi", params={"top_k": -2}), "top_k"),
    (_raw(text="hi", params={"stop_token_ids": [999]}), "stop_token_ids"),
    (_raw(text="hi", params={"stop": [""]}), "stop"),
    (_raw(text="hi", params={"logprobs": 50}), "logprobs"),
    (_raw(text="hi", params={"max_tokens": 4, "min_tokens": 9}), "min_tokens"),
    (_raw(text="hi", params={"repetition_penalty": 0.0}), "repetition_penalty"),
    (_raw(text="hi", request_id="no spaces allowed"), "request_id"),
    (_raw(text="hi", request_id="x" * 200), "request_id"),
]


def test_every_invalid_field_is_rejected_before_any_worker(gateway: GatewayThread, worker, client: Client) -> None:
    before = worker.stats()
    with grpc.insecure_channel(gateway.target) as channel:
        stub = wire.TandemStub(channel)
        for request, field in BAD_REQUESTS:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, timeout=WAIT))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, info.value.details())
            assert info.value.details().startswith(f"{field}: "), (field, info.value.details())
        with pytest.raises(grpc.RpcError) as info:  # beyond the 16 MiB message limit
            list(stub.Generate(_raw(text="a" * (17 << 20)), timeout=WAIT))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    after = worker.stats()
    assert after.prefix_query_tokens == before.prefix_query_tokens  # nothing reached the worker
    assert client.generate("still serving", max_tokens=3, temperature=0.0).finish_reason == "length"


def test_cancel_mid_stream_frees_every_block(client: Client, gateway: GatewayThread, worker) -> None:
    stream = client.stream("cancel me", max_tokens=LONG, ignore_eos=True, temperature=0.0)
    first = next(stream)
    got = next(stream).token_ids
    assert first.request_id and got
    with pytest.raises(TandemError) as info:  # a request id still running cannot be reused
        client.generate("dup", request_id=first.request_id, max_tokens=2)
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    stream.cancel()
    wait_until(lambda: gateway.call(lambda: not gateway.gateway.service.running), WAIT, what="gateway to forget it")
    stats = wait_idle(worker, WAIT)
    assert stats.free_kv_blocks == stats.total_kv_blocks


def test_abort_by_request_id_ends_the_stream(client: Client, worker) -> None:
    with client.stream("abort me", max_tokens=LONG, ignore_eos=True, temperature=0.0) as stream:
        rid = next(stream).request_id
        assert client.abort(rid)
        chunks = list(stream)
    assert chunks[-1].finish_reason == "abort" and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in chunks) < LONG
    assert not client.abort(rid)  # no longer running
    wait_idle(worker, WAIT)


def test_deadline_expiry_frees_every_block(client: Client, worker) -> None:
    with pytest.raises(TandemError) as info:
        client.generate("too slow", max_tokens=LONG, ignore_eos=True, temperature=0.0, timeout=0.3)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(worker, WAIT)


def test_priority_full_tier_and_tier_default_deadline(model_dir: Path, worker) -> None:
    tiers = {Tier.INTERACTIVE: TierConfig(8), Tier.STANDARD: TierConfig(8, 5.0, default_deadline_s=0.5),
             Tier.BATCH: TierConfig(3, 30.0)}
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0, tiers=tiers,
                                     workers=WorkerPoolConfig(both=(worker.address,), max_inflight_per_decode=1)))
    try:
        assert gw.wait_ready(WAIT)
        log = lambda: gw.call(lambda: list(gw.gateway.dispatcher.log))  # noqa: E731
        depth = lambda t: gw.call(lambda: gw.gateway.dispatcher.queues.depth(t))  # noqa: E731
        results: dict[str, object] = {}
        with Client(gw.target, timeout=WAIT) as c:
            def run(name: str, tier: Tier, n: int) -> None:
                try:
                    results[name] = c.generate(name, tier=tier, request_id=name, max_tokens=n, ignore_eos=True,
                                               temperature=0.0)
                except TandemError as exc:
                    results[name] = exc

            threads = [threading.Thread(target=run, args=("b0", Tier.BATCH, LONG))]
            threads[0].start()
            wait_until(lambda: any(e.kind == "dispatch" for e in log()), WAIT, what="b0 dispatched")
            for name in ("b1", "b2", "b3"):
                threads.append(threading.Thread(target=run, args=(name, Tier.BATCH, 4)))
                threads[-1].start()
            wait_until(lambda: depth(Tier.BATCH) == 3, WAIT, what="BATCH queue full")
            with pytest.raises(TandemError) as full:
                c.generate("b4", tier=Tier.BATCH, max_tokens=2)
            assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "BATCH" in full.value.details
            threads.append(threading.Thread(target=run, args=("i0", Tier.INTERACTIVE, 4)))
            threads[-1].start()
            wait_until(lambda: depth(Tier.INTERACTIVE) == 1, WAIT, what="i0 queued")
            assert c.abort("b0")  # frees the only slot
            for t in threads:
                t.join(WAIT)
            events = log()
            enq_i0 = next(e.order for e in events if e.kind == "enqueue" and e.request_id == "i0")
            after = [e.request_id for e in events if e.kind == "dispatch" and e.order > enq_i0]
            batch_order = [e.request_id for e in events if e.kind == "enqueue" and e.request_id in ("b1", "b2", "b3")]
            assert after == ["i0", *batch_order]  # strict priority over older BATCH requests, then FIFO
            assert results["b0"].finish_reason == "abort"
            assert all(results[n].finish_reason == "length" for n in ("b1", "b2", "b3", "i0"))
            assert gw.metric("tandem_gateway_dispatched_total", {"tier": "interactive", "effective_tier": "interactive"}) == 1
            # STANDARD's default deadline (0.5 s here) applies to a call without a gRPC deadline.
            with pytest.raises(TandemError) as late:
                Client(gw.target).generate("slow", tier=Tier.STANDARD, max_tokens=LONG, ignore_eos=True)
            assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_idle(worker, WAIT)
    finally:
        gw.stop()


def test_gateway_process_metrics_health_and_sigterm_drain(model_dir: Path, worker, tmp_path: Path) -> None:
    out = tmp_path / "gateway.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(command("gateway", ["--model", str(model_dir), "--port", "0", "--worker", worker.address,
                                                    "--metrics-port", "0", "--log-level", "WARNING"]),
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        line = wait_until(lambda: re.search(r"listening on [\d.]+:(\d+) \(metrics on port (\d+)\)", out.read_text()),
                          WAIT, what="gateway to listen")
        target, metrics_port = f"127.0.0.1:{line.group(1)}", int(line.group(2))
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(target) as channel:
            # NOT_SERVING from listening until the gateway has heard its worker is up; then SERVING.
            stub = health_pb2_grpc.HealthStub(channel)
            wait_until(lambda: stub.Check(health_pb2.HealthCheckRequest(service=wire.TANDEM_SERVICE)).status
                       == health_pb2.HealthCheckResponse.SERVING, WAIT, what="gateway health SERVING")
        with Client(target, timeout=WAIT) as c:
            info = c.model_info()
            assert (info.vocab_size, info.max_context, info.num_decode_workers) == (258, 512, 1)
            assert c.generate("warm", max_tokens=2, ignore_eos=True).finish_reason == "length"
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT).read().decode()
            model = f'model="{info.model}"'
            assert f'tandem_gateway_requests_total{{{model},status="length"}} 1.0' in scraped
            assert f'tandem_gateway_queue_depth{{{model},tier="interactive"}} 0.0' in scraped
            stream = c.stream("drain", max_tokens=120, ignore_eos=True, temperature=0.0)
            next(stream)
            proc.send_signal(signal.SIGTERM)  # running streams finish; then the process exits
            chunks = list(stream)
        assert chunks[-1].finish_reason == "length" and sum(len(ch.token_ids) for ch in chunks) == 120
        assert proc.wait(WAIT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert "Traceback" not in text, text


def test_metrics_count_requests_tokens_and_queues(gateway: GatewayThread, client: Client) -> None:
    before = gateway.metric("tandem_gateway_generation_tokens_total")
    client.generate("count me", max_tokens=5, ignore_eos=True)
    assert gateway.metric("tandem_gateway_generation_tokens_total") == before + 5
    assert gateway.metric("tandem_gateway_requests_total", {"status": "length"}) >= 1
    assert gateway.metric("tandem_gateway_queue_depth", {"tier": "batch"}) == 0
    body = gateway.call(lambda: __import__("prometheus_client").generate_latest(gateway.gateway.metrics.registry))
    for name in ("tandem_gateway_time_to_first_token_seconds_bucket", "tandem_gateway_e2e_seconds_count",
                 "tandem_gateway_inter_token_seconds_count", "tandem_gateway_errors_total"):
        assert name.encode() in body, name
    assert json.dumps(gateway.call(gateway.gateway.service.stats))


def test_stats_report_the_engines_max_running(worker) -> None:
    """Stats carries the sequences the worker's engine runs at once (the launcher's banner and the
    gateway's in-flight cap read it): here the --max-running the worker was given."""
    assert worker.stats().max_running == 64

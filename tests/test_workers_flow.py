"""Prefill, decode and role-both workers as real processes (`tandem prefill`, `tandem decode`,
`tandem worker --role both`, started by `entrypoints.cluster`), driven over gRPC on loopback with KV pushed over
real ZMQ, exactly as SERVICES_FLOW.md has the gateway do it.

Leak invariant: once every request has ended, Stats.free_kv_blocks == total_kv_blocks on
every worker. free_kv_blocks counts blocks a new request can get without preempting anyone:
the free list plus blocks only the prefix cache holds (unlocked, evictable on demand). A block
still referenced by a request, a reservation or a pending send is never counted.
"""
from __future__ import annotations

import itertools
import random
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from entrypoints.cluster import Cluster, worker_process
from tandem import wire
from tandem._proto.tandem.v1 import tandem_pb2 as pb
from tandem._proto.tandem.v1 import worker_pb2 as w
from tandem.hashing import block_hashes, seed_hash
from tandem.types import SamplingParams

WAIT_S = 60.0  # bound on any wait; no test measures time
BLOCKS = 64
BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
_rng = random.Random(1234)


def fresh_prompt(n: int) -> list[int]:
    """Random byte tokens: prompts of different tests never share a prefix by accident."""
    return [_rng.randrange(0, 256) for _ in range(n)]


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen
    log: Path
    info: dict
    channel: grpc.Channel | None = None

    @property
    def stub(self):
        if self.info["role"] == "prefill":
            return wire.PrefillWorkerStub(self.channel)
        return wire.DecodeWorkerStub(self.channel)

    def stats(self) -> w.WorkerStats:
        return self.stub.Stats(w.StatsRequest(), timeout=WAIT_S)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from engine.demo import make_random_model

    return make_random_model(tmp_path_factory.mktemp("workers") / "m", "llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """decode (d), prefill (p), a prefill whose first KV frame is corrupted (pc), role both (b)."""
    tmp = tmp_path_factory.mktemp("procs")
    flags = ["--num-kv-blocks", str(BLOCKS), "--metrics-port", "0"]
    specs = {
        "d": ("decode", ["--kv-timeout", "20"], None),
        "p": ("prefill", ["--reflection"], None),  # reflection is off unless asked for
        "pc": ("prefill", [], {"TANDEM_KV_CORRUPT_ONCE": "1"}),
        "b": ("both", [], None),
    }
    procs = {name: worker_process(name, role, model_dir, tmp, [*flags, *extra], env, log_level="INFO")
             for name, (role, extra, env) in specs.items()}
    cluster = Cluster(procs.values())
    workers: dict[str, Worker] = {}
    try:
        cluster.start(120)
        for name, proc in procs.items():
            workers[name] = Worker(name, proc.proc, proc.log_path, proc.info,
                                   grpc.insecure_channel(proc.info["address"]))
        yield workers
    finally:
        for proc in procs.values():
            proc.terminate()
        for name, proc in procs.items():
            if proc.proc is None:
                continue
            try:
                proc.proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                print(f"--- {name} did not stop:\n{proc.log_tail(1_000_000)}")
        for wk in workers.values():
            wk.channel.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    from engine import LLM

    llm = LLM(str(model_dir), num_kv_blocks=BLOCKS)
    return lambda prompts, params=GREEDY: [o.token_ids for o in llm.generate(prompts, params)]


def reserve(d: Worker, rid: str, prompt: list[int], params=GREEDY, timeout_ms: int = 20000) -> w.ReserveResponse:
    r = d.stub.Reserve(w.ReserveRequest(request_id=rid, token_ids=prompt, max_tokens=params.max_tokens,
                                        timeout_ms=timeout_ms), timeout=WAIT_S)
    assert r.ok, r.reason
    return r


def prefill(p: Worker, rid: str, prompt: list[int], r: w.ReserveResponse, params=GREEDY) -> w.PrefillResponse:
    target = w.KvTarget(worker_id="d", kv_address=r.kv_address, reservation_id=r.reservation_id,
                        num_cached_blocks=r.num_cached_blocks, dst_block_ids=r.dst_block_ids)
    return p.stub.Prefill(w.PrefillRequest(request_id=rid, token_ids=prompt, params=wire.params_to_proto(params),
                                           target=target, timeout_ms=20000), timeout=WAIT_S)


def decode_call(d: Worker, rid: str, r: w.ReserveResponse, first: int, params=GREEDY, timeout_ms: int = 20000,
                stream_interval: int = 0):
    return d.stub.Decode(w.DecodeRequest(request_id=rid, reservation_id=r.reservation_id, first_token_id=first,
                                         params=wire.params_to_proto(params), timeout_ms=timeout_ms,
                                         stream_interval=stream_interval), timeout=WAIT_S)


def disaggregated(d: Worker, p: Worker, rid: str, prompt: list[int], params=GREEDY) -> tuple[list[int], list[w.DecodeChunk]]:
    """Reserve on D, Prefill on P into D's blocks, Decode on D: every token, the first included."""
    r = reserve(d, rid, prompt, params)
    pr = prefill(p, rid, prompt, r, params)
    assert pr.prompt_tokens == len(prompt) and pr.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    chunks = list(decode_call(d, rid, r, pr.first_token_id, params))
    return [pr.first_token_id] + [t for c in chunks for t in c.token_ids], chunks


def local(b: Worker, rid: str, prompt: list[int], params=GREEDY, timeout_ms: int = 20000, stream_interval: int = 0):
    return b.stub.PrefillAndDecode(w.GenerateOnWorkerRequest(request_id=rid, token_ids=prompt,
                                                             params=wire.params_to_proto(params),
                                                             timeout_ms=timeout_ms, stream_interval=stream_interval),
                                   timeout=WAIT_S)


def wait_until(cond, what: str):
    deadline = time.monotonic() + WAIT_S
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def assert_no_leaks(*workers: Worker) -> None:
    for wk in workers:
        def clean() -> bool:
            s = wk.stats()
            return s.free_kv_blocks == s.total_kv_blocks == BLOCKS and s.running == 0 and s.waiting == 0
        wait_until(clean, f"{wk.name} to free every KV block")


# ------------------------------------------------------------------------------------------

def test_disaggregated_flow_matches_offline_greedy(cluster, reference):
    d, p = cluster["d"], cluster["p"]
    prompts = [fresh_prompt(n) for n in (5, 16, 33, 70, 47)]  # short, exact blocks, partial blocks
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i], chunks = disaggregated(d, p, f"flow-{i}", prompts[i])
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert [results.get(i) for i in range(len(prompts))] == reference(prompts)
    assert_no_leaks(d, p)


@pytest.mark.parametrize("interval", [1, 5, 64])
def test_stream_interval_groups_the_tokens_after_the_first(cluster, reference, interval):
    """A worker asked for `interval` tokens a chunk sends the first output at once, then a chunk
    once that many tokens are held, and the rest with the end: the same tokens, fewer messages."""
    d, p, b = cluster["d"], cluster["p"], cluster["b"]
    params = GREEDY.replace(max_tokens=23)
    prompt = fresh_prompt(21)
    want = reference([prompt], params)[0]
    on_b = list(local(b, f"si-local-{interval}", prompt, params, stream_interval=interval))
    r = reserve(d, f"si-disagg-{interval}", prompt, params)
    pr = prefill(p, f"si-disagg-{interval}", prompt, r, params)
    on_d = list(decode_call(d, f"si-disagg-{interval}", r, pr.first_token_id, params, stream_interval=interval))
    for chunks, tokens in ((on_b, want), (on_d, want[1:])):
        assert [t for c in chunks for t in c.token_ids] == tokens
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        # Chunks end only where a group ends (after the first token, then every `interval`);
        # a stream that fell behind may carry two groups in one chunk, never a split group.
        ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))[:-1]
        assert all((n - 1) % interval == 0 for n in ends), [len(c.token_ids) for c in chunks]
        assert len(chunks) <= 1 + -(-(len(tokens) - 1) // interval)
    assert_no_leaks(d, p, b)


def test_decode_prefix_reuse_sends_only_missing_blocks(cluster, reference):
    d, p = cluster["d"], cluster["p"]
    a = fresh_prompt(48)  # 3 full blocks
    b = a[:32] + fresh_prompt(21)  # shares 2 blocks with a; 4 prompt blocks
    sent0, recv0 = p.stats().kv_bytes_sent, d.stats().kv_bytes_received
    r_a = reserve(d, "reuse-a", a)
    assert r_a.num_cached_blocks == 0 and len(r_a.dst_block_ids) == 3
    pr_a = prefill(p, "reuse-a", a, r_a)
    tokens_a = [pr_a.first_token_id] + [t for c in decode_call(d, "reuse-a", r_a, pr_a.first_token_id) for t in c.token_ids]
    sent1, recv1 = p.stats().kv_bytes_sent, d.stats().kv_bytes_received

    r_b = reserve(d, "reuse-b", b)
    assert r_b.num_cached_blocks == 2 and len(r_b.dst_block_ids) == 2
    pr_b = prefill(p, "reuse-b", b, r_b)
    assert pr_b.cached_tokens == 32  # P's own radix cache had the shared prefix too
    tokens_b = [pr_b.first_token_id] + [t for c in decode_call(d, "reuse-b", r_b, pr_b.first_token_id) for t in c.token_ids]
    sent2, recv2 = p.stats().kv_bytes_sent, d.stats().kv_bytes_received

    assert [tokens_a, tokens_b] == reference([a, b])
    bytes_a, bytes_b = sent1 - sent0, sent2 - sent1
    assert bytes_a > 0 and bytes_b * 3 == bytes_a * 2  # 2 blocks instead of 3
    assert (recv1 - recv0, recv2 - recv1) == (bytes_a, bytes_b)
    assert_no_leaks(d, p)


def test_prefill_and_decode_matches_offline_and_reports_cached_tokens(cluster, reference):
    b = cluster["b"]
    prompt = fresh_prompt(40)
    want = reference([prompt])[0]
    first = list(local(b, "local-1", prompt))
    again = list(local(b, "local-2", prompt))
    for chunks in (first, again):
        assert [t for c in chunks for t in c.token_ids] == want
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert first[0].cached_tokens == 0 and again[0].cached_tokens == 32  # two full blocks reused
    refused = b.stub.Reserve(w.ReserveRequest(request_id="x", token_ids=prompt, max_tokens=4), timeout=WAIT_S)
    assert not refused.ok and "role both" in refused.reason
    assert_no_leaks(b)


def test_release_abort_and_full_cache_free_every_block(cluster):
    d, p, b = cluster["d"], cluster["p"], cluster["b"]
    # Fill D with reservations: 240-token prompts need ceil(241 / 16) = 16 blocks each.
    params = GREEDY.replace(max_tokens=16)
    held = [reserve(d, f"fill-{i}", fresh_prompt(240), params) for i in range(BLOCKS // 16)]
    extra = d.stub.Reserve(w.ReserveRequest(request_id="fill-x", token_ids=fresh_prompt(240), max_tokens=16), timeout=WAIT_S)
    assert not extra.ok and extra.reason == "no free KV blocks" and extra.free_blocks == 0
    for i, r in enumerate(held):
        assert d.stub.Release(w.ReleaseRequest(request_id=f"fill-{i}", reservation_id=r.reservation_id)).found
    assert not d.stub.Release(w.ReleaseRequest(request_id="fill-0", reservation_id=held[0].reservation_id)).found
    assert_no_leaks(d)

    # Aborted after the KV arrived, before Decode: Decode then fails, blocks are back.
    prompt = fresh_prompt(30)
    r = reserve(d, "ab-1", prompt)
    pr = prefill(p, "ab-1", prompt, r)
    assert d.stub.Abort(pb.AbortRequest(request_id="ab-1")).found
    with pytest.raises(grpc.RpcError) as err:
        list(decode_call(d, "ab-1", r, pr.first_token_id))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "aborted" in err.value.details()

    # Aborted mid-stream: the stream ends with finish_reason ABORT.
    long = GREEDY.replace(max_tokens=400)
    r = reserve(d, "ab-2", prompt, long)
    pr = prefill(p, "ab-2", prompt, r, long)
    stream = decode_call(d, "ab-2", r, pr.first_token_id, long)
    assert next(stream).token_ids
    assert d.stub.Abort(pb.AbortRequest(request_id="ab-2")).found
    assert list(stream)[-1].finish_reason == pb.FINISH_REASON_ABORT

    # Client cancels a PrefillAndDecode stream: the worker aborts the request.
    stream = local(b, "ab-3", prompt, long)
    assert next(stream).token_ids
    stream.cancel()
    assert not p.stub.Abort(pb.AbortRequest(request_id="never-seen")).found
    assert_no_leaks(d, p, b)


def test_logprobs_and_a_first_token_that_ends_the_request(cluster, reference):
    d, p = cluster["d"], cluster["p"]
    prompt = fresh_prompt(20)
    one = GREEDY.replace(max_tokens=1, logprobs=2)
    r = reserve(d, "one", prompt, one)
    pr = prefill(p, "one", prompt, r, one)
    assert pr.finish_reason == pb.FINISH_REASON_LENGTH and [pr.first_token_id] == reference([prompt], one)[0]
    assert pr.first_logprob.token_id == pr.first_token_id and len(pr.first_logprob.top) == 2
    assert pr.first_logprob.top[0].logprob >= pr.first_logprob.top[1].logprob
    assert d.stub.Release(w.ReleaseRequest(request_id="one", reservation_id=r.reservation_id)).found  # as the gateway does

    some = GREEDY.replace(max_tokens=6, logprobs=1)
    tokens, chunks = disaggregated(d, p, "lp", prompt, some)
    assert tokens == reference([prompt], some)[0]
    lps = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in lps] == tokens[1:] and all(len(lp.top) == 1 for lp in lps)
    assert_no_leaks(d, p)


def test_corrupt_kv_frame_fails_decode_and_frees_blocks(cluster, reference):
    d, pc = cluster["d"], cluster["pc"]
    prompt = fresh_prompt(37)
    r = reserve(d, "bad", prompt)
    pr = prefill(pc, "bad", prompt, r)  # P cannot know: it handed intact-looking frames to ZMQ
    with pytest.raises(grpc.RpcError) as err:
        list(decode_call(d, "bad", r, pr.first_token_id))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "checksum" in err.value.details()
    assert_no_leaks(d)
    # What the gateway does next: reserve again (new reservation id) and re-prefill.
    tokens, _ = disaggregated(d, pc, "bad", prompt)
    assert tokens == reference([prompt])[0]
    assert_no_leaks(d, pc)


def test_timeouts_free_blocks(cluster):
    d, b = cluster["d"], cluster["b"]
    prompt = fresh_prompt(50)
    # A reservation nobody prefills expires.
    r = reserve(d, "exp-1", prompt, timeout_ms=300)
    assert_no_leaks(d)
    with pytest.raises(grpc.RpcError) as err:
        list(decode_call(d, "exp-1", r, 1))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "expired" in err.value.details()
    # Decode's own timeout_ms covers the wait for the KV commit.
    r = reserve(d, "exp-2", prompt)
    with pytest.raises(grpc.RpcError) as err:
        list(decode_call(d, "exp-2", r, 1, timeout_ms=200))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "timeout_ms" in err.value.details()
    assert_no_leaks(d)
    # A request that cannot finish 480 tokens within 50 ms is cut at its deadline.
    with pytest.raises(grpc.RpcError) as err:
        list(local(b, "exp-3", prompt[:10], GREEDY.replace(max_tokens=480), timeout_ms=50))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_no_leaks(b)


def test_bad_requests_are_invalid_argument(cluster):
    d, p, b = cluster["d"], cluster["p"], cluster["b"]
    with pytest.raises(grpc.RpcError) as err:
        d.stub.Reserve(w.ReserveRequest(request_id="bad-1", token_ids=[1, 999], max_tokens=4), timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in err.value.details()
    bad_target = w.KvTarget(kv_address="tcp://127.0.0.1:1", dst_block_ids=[1, 2, 3])
    with pytest.raises(grpc.RpcError) as err:
        p.stub.Prefill(w.PrefillRequest(request_id="bad-2", token_ids=fresh_prompt(20), target=bad_target), timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dst_block_ids" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(local(b, "bad-3", [5, 6], SamplingParams(temperature=-1.0)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
    r = reserve(d, "dup", [7, 8, 9])
    with pytest.raises(grpc.RpcError) as err:
        reserve(d, "dup", [7, 8, 9])
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert d.stub.Release(w.ReleaseRequest(request_id="dup", reservation_id=r.reservation_id)).found
    assert_no_leaks(d, p, b)


def prefill_follows(p: Worker, rid: str, prompt: list[int], params=GREEDY, timeout_ms: int = 20000) -> grpc.Future:
    """Start a Prefill whose target follows (the gateway's default): the call's future."""
    return p.stub.Prefill.future(w.PrefillRequest(request_id=rid, token_ids=prompt, params=wire.params_to_proto(params),
                                                  target_follows=True, timeout_ms=timeout_ms), timeout=WAIT_S)


def send_target(p: Worker, rid: str, r: w.ReserveResponse, dst_block_ids=None) -> w.PrefillTargetResponse:
    target = w.KvTarget(worker_id="d", kv_address=r.kv_address, reservation_id=r.reservation_id,
                        num_cached_blocks=r.num_cached_blocks,
                        dst_block_ids=r.dst_block_ids if dst_block_ids is None else dst_block_ids)
    return p.stub.PrefillTarget(w.PrefillTargetRequest(request_id=rid, target=target), timeout=WAIT_S)


def computed_and_waiting(p: Worker) -> bool:
    """P runs nothing but holds a prompt's blocks: a prefill computed, waiting for its target."""
    s = p.stats()
    return s.running == 0 and s.waiting == 0 and s.free_kv_blocks < s.total_kv_blocks


def rpc_error(fut: grpc.Future) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        fut.result(timeout=WAIT_S)
    return err.value


def test_a_target_that_follows_the_prefill_gives_the_same_tokens(cluster, reference):
    """The target sent with the Reserve's answer while P computes, or only once P has computed
    the prompt (it then holds the KV and pushes when the target comes): the same tokens."""
    d, p = cluster["d"], cluster["p"]
    prompts = [fresh_prompt(n) for n in (5, 33, 70)]
    want = reference(prompts)
    for late in (False, True):
        for i, prompt in enumerate(prompts):
            rid = f"follows-{late}-{i}"
            fut = prefill_follows(p, rid, prompt)
            if late:
                wait_until(lambda: computed_and_waiting(p), "P to compute the prompt and wait for its target")
                assert not fut.done()
            r = reserve(d, rid, prompt)
            send_target(p, rid, r)
            pr = fut.result(timeout=WAIT_S)
            assert pr.prompt_tokens == len(prompt)
            chunks = list(decode_call(d, rid, r, pr.first_token_id))
            assert [pr.first_token_id] + [t for c in chunks for t in c.token_ids] == want[i], (late, i)
    with pytest.raises(grpc.RpcError) as err:  # the prefill is over: nothing waits for a target
        send_target(p, rid, r)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "request_id" in err.value.details()
    # A target that overtakes its Prefill on the way waits for it.
    prompt = fresh_prompt(21)
    r = reserve(d, "follows-early", prompt)
    target = threading.Thread(target=send_target, args=(p, "follows-early", r))
    target.start()
    time.sleep(0.2)  # ordering only: the target is sent first (no assertion on time)
    pr = prefill_follows(p, "follows-early", prompt).result(timeout=WAIT_S)
    target.join(WAIT_S)
    chunks = list(decode_call(d, "follows-early", r, pr.first_token_id))
    assert [pr.first_token_id] + [t for c in chunks for t in c.token_ids] == reference([prompt])[0]
    assert_no_leaks(d, p)


def test_a_prefill_waiting_for_its_target_ends_cleanly(cluster):
    """Aborted, cancelled, past its deadline or given a bad target while it holds the computed
    prompt: the Prefill call fails with its reason and P frees every block."""
    d, p = cluster["d"], cluster["p"]
    fut = prefill_follows(p, "tf-abort", fresh_prompt(40))
    wait_until(lambda: computed_and_waiting(p), "P to wait for the target")
    assert p.stub.Abort(pb.AbortRequest(request_id="tf-abort"), timeout=WAIT_S).found
    assert rpc_error(fut).code() == grpc.StatusCode.ABORTED
    assert_no_leaks(p)

    fut = prefill_follows(p, "tf-cancel", fresh_prompt(40))
    wait_until(lambda: computed_and_waiting(p), "P to wait for the target")
    fut.cancel()
    assert_no_leaks(p)

    err = rpc_error(prefill_follows(p, "tf-deadline", fresh_prompt(40), timeout_ms=300))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_no_leaks(p)

    prompt = fresh_prompt(40)
    fut = prefill_follows(p, "tf-bad", prompt)
    r = reserve(d, "tf-bad", prompt)
    with pytest.raises(grpc.RpcError) as err:
        send_target(p, "tf-bad", r, dst_block_ids=[1])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "target.dst_block_ids" in err.value.details()
    failed = rpc_error(fut)
    assert failed.code() == grpc.StatusCode.ABORTED and "refused" in failed.details()
    assert d.stub.Release(w.ReleaseRequest(request_id="tf-bad", reservation_id=r.reservation_id)).found

    with pytest.raises(grpc.RpcError) as err:  # a target with target_follows: one or the other
        p.stub.Prefill(w.PrefillRequest(request_id="tf-both", token_ids=prompt, target_follows=True,
                                        target=w.KvTarget(kv_address=r.kv_address)), timeout=WAIT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "target" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        send_target(p, "tf-never-sent", r)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert_no_leaks(d, p)


def test_kv_events_stream_starts_with_every_cached_block(cluster):
    b = cluster["b"]
    seed = seed_hash(b.info["model_identity"])
    x, y = fresh_prompt(48), fresh_prompt(33)
    list(local(b, "ev-x", x, GREEDY.replace(max_tokens=1)))
    events = b.stub.KvEvents(w.KvEventsRequest(), timeout=WAIT_S)
    reset = next(events)
    assert reset.reset and reset.worker_id == b.info["worker_id"]
    assert set(block_hashes(x, BS, seed)) <= set(reset.stored)
    list(local(b, "ev-y", y, GREEDY.replace(max_tokens=1)))
    want, seen, last_seq = set(block_hashes(y, BS, seed)), set(), reset.seq
    for batch in events:
        assert not batch.reset and batch.seq > last_seq
        last_seq = batch.seq
        seen |= set(batch.stored)
        if want <= seen:
            break
    events.cancel()


def test_health_reflection_and_metrics(cluster, model_dir):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    d, p = cluster["d"], cluster["p"]
    for wk, service in ((d, wire.DECODE_SERVICE), (p, wire.PREFILL_SERVICE)):
        health = health_pb2_grpc.HealthStub(wk.channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(wk.channel)
        ask = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        if wk is d:  # started without --reflection
            with pytest.raises(grpc.RpcError) as err:
                next(refl.ServerReflectionInfo(ask))
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            continue
        reply = next(refl.ServerReflectionInfo(ask))
        assert service in {s.name for s in reply.list_services_response.service}
    text = urllib.request.urlopen(f"http://127.0.0.1:{d.info['metrics_port']}/metrics", timeout=WAIT_S).read().decode()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if ln.startswith("tandem_")}
    labels = f'model="{model_dir.name}",role="decode",worker="{d.info["worker_id"]}"'
    assert lines[f"tandem_kv_blocks_total{{{labels}}}"] == BLOCKS
    received = [v for k, v in lines.items() if k.startswith("tandem_kv_transfer_bytes_total") and "received" in k]
    assert received and received[0] == d.stats().kv_bytes_received > 0
    assert any(k.startswith("tandem_engine_step_seconds_count") and v > 0 for k, v in lines.items())


def test_sigterm_drains_in_flight_work_then_exits_zero(cluster, reference):
    """Runs last: it stops the decode worker."""
    d, p = cluster["d"], cluster["p"]
    prompt = fresh_prompt(26)
    r = reserve(d, "drain", prompt)
    d.proc.send_signal(signal.SIGTERM)
    health = health_pb2_grpc.HealthStub(d.channel)
    wait_until(lambda: health.Check(health_pb2.HealthCheckRequest(service=wire.DECODE_SERVICE)).status
               == health_pb2.HealthCheckResponse.NOT_SERVING, "NOT_SERVING")
    assert d.stats().draining
    refused = d.stub.Reserve(w.ReserveRequest(request_id="late", token_ids=prompt, max_tokens=4), timeout=WAIT_S)
    assert not refused.ok and refused.reason == "draining"
    pr = prefill(p, "drain", prompt, r)  # the reservation made before SIGTERM still completes
    tokens = [pr.first_token_id] + [t for c in decode_call(d, "drain", r, pr.first_token_id) for t in c.token_ids]
    assert tokens == reference([prompt])[0]
    assert d.proc.wait(WAIT_S) == 0
    assert "draining" in d.log.read_text()

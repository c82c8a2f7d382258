"""The `tandem bench` load generator: datasets, statistics, and the driver against a real
in-process grpc.aio server implementing tandem.v1.Tandem.

The server here is a small scripted service defined in this file (a few tokens per request,
usage with a prefix-match cached count, scripted failures): it tests the load generator,
not the gateway.
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import threading
from collections import Counter
from dataclasses import dataclass, field

import grpc
import pytest

from loadgen import datasets as ds
from loadgen.command import main
from loadgen.report import SLO, RequestResult, format_run, format_sweep, percentile, summarize, write_plots
from loadgen.run import LoadRun, RequestOptions
from loadgen.schedule import LoadSpec, poisson_offsets
from tandem import wire
from tandem._proto.tandem.v1 import tandem_pb2 as pb
from tandem.client import AsyncClient

WAIT = 20.0  # upper bound on waiting for server-side events; never a timing assertion
TEXT = ds.Vocab("text")
TOKENS = ds.Vocab("tokens", low=0, high=500, exclude=frozenset({2}))
MODEL = wire.ModelInfo("scripted", "scripted@1", 500, 4096, 16, (2,), "float32", 1, 1)


# ------------------------------------------------------------------ the scripted server

@dataclass
class Served:
    index: int                      # arrival order at the server
    request_id: str
    prompt: str | tuple[int, ...]
    max_tokens: int
    answer: str | tuple[int, ...] = ""
    cached: int = 0
    outcome: str = "OK"             # OK, a status code name, FINISH_ERROR, or CANCELLED
    start_seq: int = 0
    end_seq: int = 0


@dataclass
class Script:
    """Behaviour knobs. fail: arrival index % 6 -> what that request does ("RESOURCE_EXHAUSTED"
    before output, "UNAVAILABLE_MID" after one chunk, "FINISH_ERROR" as a final chunk).
    hold: the first `hold` requests wait until `hold` are active at once. hang: never finish."""

    fail: dict[int, str] = field(default_factory=dict)
    hold: int = 0
    hang: bool = False


class ScriptedTandem(wire.TandemServicer):
    def __init__(self, script: Script) -> None:
        self.script = script
        self.served: list[Served] = []
        self.active = self.max_active = self.seq = 0
        self.full = asyncio.Event()

    def _next_seq(self) -> int:
        self.seq += 1
        return self.seq

    async def Generate(self, request, context):
        inp = wire.generate_request_from_proto(request)
        rec = Served(len(self.served), inp.request_id, inp.prompt, inp.params.max_tokens, start_seq=self._next_seq())
        self.served.append(rec)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await self._serve(rec, context)
        except asyncio.CancelledError:
            rec.outcome = "CANCELLED"
            raise
        finally:
            self.active -= 1
            rec.end_seq = self._next_seq()

    async def _serve(self, rec: Served, context) -> None:
        if rec.index < self.script.hold:
            if self.active >= self.script.hold:
                self.full.set()
            await asyncio.wait_for(self.full.wait(), WAIT)
        if self.script.hang:
            await asyncio.sleep(3600)
        action = self.script.fail.get(rec.index % 6)
        if action == "RESOURCE_EXHAUSTED":
            rec.outcome = action
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "tier queue full")
        # Cached tokens: the longest prefix shared with an earlier prompt (a prefix cache's view).
        rec.cached = max((_common_prefix(rec.prompt, s.prompt) for s in self.served[:rec.index]), default=0)
        text = isinstance(rec.prompt, str)
        pieces: list = []
        for i in range(rec.max_tokens):
            tok = 100 + (len(rec.prompt) + i) % 300
            piece = f" w{tok}" if text else (tok,)
            pieces.append(piece)
            last = i == rec.max_tokens - 1
            finish = wire.pb.FINISH_REASON_LENGTH if last else wire.pb.FINISH_REASON_UNSPECIFIED
            msg = wire.pb.GenerateChunk(request_id=rec.request_id, token_ids=[tok], text=piece if text else "",
                                        finish_reason=finish)
            if last:
                msg.usage.CopyFrom(wire.pb.Usage(prompt_tokens=len(rec.prompt), completion_tokens=rec.max_tokens,
                                                 cached_tokens=rec.cached))
            await context.write(msg)
            if i == 0 and action == "UNAVAILABLE_MID":
                rec.outcome = "UNAVAILABLE"
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker died")
            if i == 0 and action == "FINISH_ERROR":
                rec.outcome = action
                await context.write(wire.pb.GenerateChunk(finish_reason=wire.pb.FINISH_REASON_ERROR,
                                                          stop_reason="engine failure"))
                return
            await asyncio.sleep(0.001)
        rec.answer = "".join(pieces) if text else tuple(t for p in pieces for t in p)

    async def GetModelInfo(self, request, context):
        return wire.model_info_to_proto(MODEL)

    async def Abort(self, request, context):
        # The load generator ends a request by cancelling its stream, never by Abort.
        return pb.AbortResponse(found=False)


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ServerThread:
    """The scripted server on its own event loop in a thread, so drivers (and main(), which
    calls asyncio.run) run in the test's thread against a real socket."""

    def __init__(self, script: Script | None = None) -> None:
        self.script = script or Script()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        self.servicer, self.server, port = self._call(self._start())
        self.target = f"127.0.0.1:{port}"
        return self

    async def _start(self):
        servicer = ScriptedTandem(self.script)
        server = grpc.aio.server()
        wire.add_tandem_servicer(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return servicer, server, port

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT)

    def __exit__(self, *exc: object) -> None:
        self._call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)
        self.loop.close()


def drive(target: str, convs, spec: LoadSpec, **kw):
    async def go():
        async with AsyncClient(target, timeout=WAIT) as client:
            return await LoadRun(client, convs, spec, RequestOptions(**kw), id_prefix="t").run()
    return asyncio.run(go())


# ------------------------------------------------------------------ datasets

def test_random_dataset_lengths_formats_and_determinism() -> None:
    convs = ds.random_dataset(200, (5, 40), (3, 9), TEXT, seed=1)
    assert len(convs) == 200 and all(len(c.turns) == 1 for c in convs)
    for c in convs:
        t = c.turns[0]
        assert len(t.text.split()) == t.input_len and 5 <= t.input_len <= 40 and 3 <= t.output_len <= 9
    assert {c.turns[0].input_len for c in convs} >= {5, 40}  # the inclusive ends are reachable
    assert convs == ds.random_dataset(200, (5, 40), (3, 9), TEXT, seed=1)
    assert convs != ds.random_dataset(200, (5, 40), (3, 9), TEXT, seed=2)
    toks = ds.random_dataset(50, (64, 64), (4, 4), TOKENS, seed=3)
    for c in toks:
        ids = c.turns[0].text
        assert len(ids) == 64 and all(0 <= i < 500 and i != 2 for i in ids)
    with pytest.raises(ValueError, match="input_len"):
        ds.random_dataset(3, (9, 4), (1, 1), TEXT, seed=0)
    with pytest.raises(ValueError, match="vocab_size"):
        ds.Vocab("tokens", low=0, high=1, exclude=frozenset({0}))


@pytest.mark.parametrize("vocab", [TEXT, TOKENS], ids=["text", "tokens"])
def test_shared_prefix_groups_share_exactly_their_system_prompt(vocab) -> None:
    g, p, sys_len, q_len = 5, 7, 40, 6
    convs = ds.shared_prefix_dataset(g, p, sys_len, q_len, 11, vocab, seed=4)
    assert len(convs) == g * p and Counter(c.group for c in convs) == {i: p for i in range(g)}

    def units(prompt):
        return prompt.split(" ") if isinstance(prompt, str) else list(prompt)

    by_group: dict[int, list] = {}
    for c in convs:
        by_group.setdefault(c.group, []).append(units(c.turns[0].text))
        assert c.turns[0].output_len == 11 and c.turns[0].input_len == sys_len + q_len
    heads = []
    for prompts in by_group.values():
        head = prompts[0][:sys_len - 1]  # the last system word touches "\n" + question in text form
        assert all(pr[:sys_len - 1] == head for pr in prompts)
        heads.append(tuple(head))
    assert len(set(heads)) == g  # groups do not share their system prompts
    plain = ds.shared_prefix_dataset(g, p, sys_len, q_len, 11, vocab, seed=4, shuffle=False)
    assert [c.group for c in plain] == sorted(c.group for c in plain)
    assert sorted(c.turns[0].text for c in plain) == sorted(c.turns[0].text for c in convs)
    assert [c.group for c in convs] != [c.group for c in plain]  # shuffled across groups


def test_multi_turn_and_sharegpt_like_shapes() -> None:
    convs = ds.multi_turn_dataset(6, 4, 12, 5, TEXT, seed=5, system_prompt_len=30)
    assert len(convs) == 6 and ds.num_turns(convs) == 24
    for c in convs:
        first, *rest = c.turns
        assert len(first.text.split()) == 42 and first.input_len == 42
        assert all(t.text.startswith("\n") and len(t.text.split()) == 12 for t in rest)
    assert ds.concat("a", " b") == "a b" and ds.concat((1,), (2, 3)) == (1, 2, 3)
    with pytest.raises(ValueError, match="prompt"):
        ds.concat("a", (1,))

    sg = ds.sharegpt_like_dataset(1500, TOKENS, seed=6, input_clip=(4, 1500), output_clip=(2, 600))
    ins = [c.turns[0].input_len for c in sg]
    outs = [c.turns[0].output_len for c in sg]
    assert min(ins) >= 4 and max(ins) <= 1500 and min(outs) >= 2 and max(outs) <= 600
    assert all(len(c.turns[0].text) == c.turns[0].input_len for c in sg)
    assert 150 < statistics.median(ins) < 300  # log-normal around the 220-token median
    assert percentile(ins, 99) > 4 * statistics.median(ins)  # long tail
    assert sg == ds.sharegpt_like_dataset(1500, TOKENS, seed=6, input_clip=(4, 1500), output_clip=(2, 600))


# ------------------------------------------------------------------ statistics

def _synthetic(n: int, seed: int) -> list[RequestResult]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ttft = rng.uniform(0.01, 0.5)
        gaps = [rng.uniform(0.005, 0.08) for _ in range(rng.randint(0, 20))]
        failed = rng.random() < 0.1
        out.append(RequestResult(i, 0, f"r{i}", start_s=i * 0.1, e2e_s=ttft + sum(gaps), ttft_s=ttft, itl_s=gaps,
                                 prompt_tokens=rng.randint(10, 100), completion_tokens=len(gaps) + 1,
                                 cached_tokens=rng.randint(0, 10),
                                 status=rng.choice(["UNAVAILABLE", "FINISH_ERROR"]) if failed else "OK"))
    return out


def test_percentiles_and_summary_match_a_direct_recomputation() -> None:
    xs = [random.Random(7).expovariate(1.0) for _ in range(1)] + [random.Random(8).random() for _ in range(300)]
    cuts = statistics.quantiles(xs, n=100, method="inclusive")  # same linear-interpolation definition
    for q in (1, 25, 50, 90, 95, 99):
        assert percentile(xs, q) == pytest.approx(cuts[q - 1])
    assert percentile(xs, 0) == min(xs) and percentile(xs, 100) == max(xs) and percentile([3.0], 50) == 3.0

    results = _synthetic(400, seed=9)
    wall = 37.5
    s = summarize(results, wall, cancelled=2, skipped=3, max_in_flight=8)
    done = [r for r in results if r.status == "OK"]
    assert s["requests"] == {"measured": 400, "completed": len(done), "failed": 400 - len(done),
                             "cancelled_at_deadline": 2, "skipped": 3}
    assert s["request_throughput"] == pytest.approx(len(done) / wall)
    assert s["output_token_throughput"] == pytest.approx(sum(r.completion_tokens for r in done) / wall)
    assert s["input_token_throughput"] == pytest.approx(sum(r.prompt_tokens for r in done) / wall)
    assert s["cache_hit_rate"] == pytest.approx(sum(r.cached_tokens for r in done) / sum(r.prompt_tokens for r in done))
    assert s["failures"] == dict(Counter(r.status for r in results if r.status != "OK"))
    ttft_ms = [r.ttft_s * 1000 for r in done]
    tpot_ms = [1000 * sum(r.itl_s) / len(r.itl_s) for r in done if r.itl_s]
    itl_ms = [g * 1000 for r in done for g in r.itl_s]
    for key, ref in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms), ("itl_ms", itl_ms)):
        cuts = statistics.quantiles(ref, n=100, method="inclusive")
        assert s[key]["count"] == len(ref) and s[key]["mean"] == pytest.approx(statistics.fmean(ref))
        for q in (50, 90, 95, 99):
            assert s[key][f"p{q}"] == pytest.approx(cuts[q - 1])
    assert s["goodput"] is None


def test_goodput_counts_requests_meeting_both_slos() -> None:
    results = _synthetic(500, seed=10)
    slo = SLO(ttft_ms=250.0, tpot_ms=40.0)
    good = 0
    for r in results:
        if r.status != "OK" or r.ttft_s * 1000 > 250.0:
            continue
        if r.completion_tokens >= 2 and (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) * 1000 > 40.0:
            continue
        good += 1
    g = summarize(results, 10.0, slo)["goodput"]
    assert 0 < good < len(results) and g["good"] == good
    assert g["fraction"] == pytest.approx(good / len(results)) and g["rate"] == pytest.approx(good / 10.0)
    ttft_only = summarize(results, 10.0, SLO(ttft_ms=250.0))["goodput"]["good"]
    assert ttft_only == sum(r.status == "OK" and r.ttft_s * 1000 <= 250.0 for r in results) >= good


def test_tables_and_plots(tmp_path) -> None:
    results = [_synthetic(120, seed=s) for s in (20, 21)]
    runs = [{"label": f"concurrency={c}", "summary": summarize(r, 5.0, SLO(ttft_ms=300.0))}
            for c, r in zip((1, 8), results)]
    block = format_run("random concurrency=1", runs[0]["summary"])
    failures = runs[0]["summary"]["failures"]
    assert all(f"{k}={v}" in block for k, v in failures.items()) and "Goodput (TTFT<=300ms)" in block
    sweep = format_sweep(runs).splitlines()
    assert len(sweep) == 3 and sweep[1].split()[0] == "concurrency=1"
    written = write_plots(runs, results, tmp_path / "plots")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert written == [] and not (tmp_path / "plots").exists()
    else:
        assert {p.name for p in written} == {"latency_cdf.png", "sweep.png"}
        assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_poisson_offsets_have_exponential_gaps() -> None:
    rate, n = 8.0, 20000
    offsets = poisson_offsets(rate, n, random.Random(11))
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)  # CV of an exponential
    assert sum(g < 1 / rate for g in gaps) / len(gaps) == pytest.approx(1 - math.exp(-1), abs=0.015)
    assert offsets == poisson_offsets(rate, n, random.Random(11))
    assert poisson_offsets(math.inf, 5, random.Random(0)) == [0.0] * 5


# ------------------------------------------------------------------ the driver on a real server

def test_poisson_run_sends_every_request_on_schedule_with_usage() -> None:
    convs = ds.shared_prefix_dataset(3, 6, 30, 4, 4, TEXT, seed=12)
    spec = LoadSpec(request_rate=300.0, max_concurrency=64, seed=13)
    with ServerThread() as srv:
        out = drive(srv.target, convs, spec)
        served = {s.request_id: s for s in srv.servicer.served}
    assert len(out.results) == len(served) == 18 and all(r.ok for r in out.results)
    assert out.arrivals_s == poisson_offsets(300.0, 18, random.Random(13))
    by_conv = {r.conversation: r for r in out.results}
    starts = [by_conv[i].start_s for i in range(18)]
    assert starts == sorted(starts) and all(s >= a for s, a in zip(starts, out.arrivals_s))  # never early
    for r in out.results:
        s = served[r.request_id]
        assert (r.prompt_tokens, r.cached_tokens, r.completion_tokens) == (len(s.prompt), s.cached, 4)
        assert len(r.itl_s) == 3 and r.ttft_s <= r.e2e_s
    summary = summarize(out.results, out.wall_s)
    recomputed = sum(s.cached for s in served.values()) / sum(len(s.prompt) for s in served.values())
    assert summary["cache_hit_rate"] == pytest.approx(recomputed) and recomputed > 0


def test_multi_turn_prompts_grow_by_answers_and_turns_run_in_order() -> None:
    convs = ds.multi_turn_dataset(4, 3, 5, 3, TOKENS, seed=14)
    with ServerThread() as srv:
        out = drive(srv.target, convs, LoadSpec(concurrency=4))
        served = {s.request_id: s for s in srv.servicer.served}
    assert len(served) == 12 and all(r.ok for r in out.results)
    for conv in convs:
        recs = [served[f"t-c{conv.id}-t{k}"] for k in range(3)]
        assert recs[0].prompt == conv.turns[0].text
        for k in (1, 2):
            assert recs[k].prompt == recs[k - 1].prompt + recs[k - 1].answer + conv.turns[k].text
            assert recs[k].start_seq > recs[k - 1].end_seq  # the next turn waited for the answer
    later_turns = [r for r in out.results if r.turn > 0]
    assert all(r.cached_tokens > 0 for r in later_turns)  # each turn extends an earlier prompt


@pytest.mark.parametrize("spec", [LoadSpec(concurrency=3), LoadSpec(request_rate=math.inf, max_concurrency=3)],
                         ids=["concurrency", "rate-capped"])
def test_concurrency_never_exceeds_the_cap(spec) -> None:
    convs = ds.random_dataset(20, (4, 8), (3, 3), TEXT, seed=15)
    with ServerThread(Script(hold=3)) as srv:  # the first 3 wait for each other: the cap is reached
        out = drive(srv.target, convs, spec)
        max_active, n = srv.servicer.max_active, len(srv.servicer.served)
    assert n == 20 and len(out.results) == 20 and all(r.ok for r in out.results)
    assert max_active == out.max_in_flight == 3


def test_failures_are_counted_by_status_and_end_a_conversation() -> None:
    fail = {1: "RESOURCE_EXHAUSTED", 3: "UNAVAILABLE_MID", 4: "FINISH_ERROR"}
    convs = ds.random_dataset(30, (4, 8), (3, 3), TEXT, seed=16)
    with ServerThread(Script(fail=fail)) as srv:
        out = drive(srv.target, convs, LoadSpec(concurrency=1))
        expected = Counter(s.outcome for s in srv.servicer.served if s.outcome != "OK")
    s = summarize(out.results, out.wall_s)
    assert expected == {"RESOURCE_EXHAUSTED": 5, "UNAVAILABLE": 5, "FINISH_ERROR": 5}
    assert s["failures"] == dict(expected) and s["requests"]["completed"] == 15
    assert {r.status for r in out.results if not r.ok} == set(expected)

    turns = ds.multi_turn_dataset(1, 4, 3, 2, TEXT, seed=17)  # arrival 1 fails: turns 2 and 3 are skipped
    with ServerThread(Script(fail={1: "RESOURCE_EXHAUSTED"})) as srv:
        out = drive(srv.target, turns, LoadSpec(concurrency=1))
        sent = len(srv.servicer.served)
    assert sent == out.sent == 2 and out.skipped == 2 and [r.ok for r in out.results] == [True, False]


def test_duration_limit_cancels_requests_in_flight_and_num_requests_caps() -> None:
    convs = ds.random_dataset(10, (4, 4), (3, 3), TEXT, seed=18)
    with ServerThread(Script(hang=True)) as srv:
        out = drive(srv.target, convs, LoadSpec(concurrency=4, duration_s=0.3))

        async def cancelled() -> int:
            for _ in range(int(WAIT / 0.01)):
                if sum(s.outcome == "CANCELLED" for s in srv.servicer.served) == 4:
                    break
                await asyncio.sleep(0.01)
            return sum(s.outcome == "CANCELLED" for s in srv.servicer.served)
        seen = srv._call(cancelled())
    assert out.results == [] and out.cancelled == out.sent == 4 and out.skipped == 6 and seen == 4

    with ServerThread() as srv:
        capped = drive(srv.target, ds.multi_turn_dataset(5, 3, 3, 2, TEXT, seed=19),
                       LoadSpec(request_rate=math.inf, num_requests=7))
        assert len(srv.servicer.served) == 7
    assert capped.sent == 7 and len(capped.results) == 7


# ------------------------------------------------------------------ the command line

def test_main_sweeps_writes_json_and_reports(tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    with ServerThread() as srv:
        rc = main(["--target", srv.target, "--dataset", "shared-prefix", "--groups", "2", "--prompts-per-group", "3",
                   "--system-prompt-len", "20", "--question-len", "3", "--output-len", "3", "--concurrency", "1,2",
                   "--prompt-format", "tokens", "--warmup", "2", "--slo-ttft-ms", "10000", "--slo-tpot-ms", "10000",
                   "--out", str(out), "--per-request", "--no-progress", "--tier", "batch"])
        served = list(srv.servicer.served)
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [r["label"] for r in doc["runs"]] == ["concurrency=1", "concurrency=2"]
    assert len(served) == 2 + 6 + 6 and sum(s.request_id.startswith("warmup-") for s in served) == 2
    for run in doc["runs"]:
        s, reqs = run["summary"], run["requests"]
        assert s["requests"]["completed"] == len(reqs) == 6 and s["goodput"]["good"] == 6
        assert s["ttft_ms"]["p50"] == pytest.approx(percentile([r["ttft_s"] * 1000 for r in reqs], 50))
        assert all(len(tuple(x.prompt)) == 23 and max(x.prompt) < MODEL.vocab_size and 2 not in x.prompt
                   for x in served)
    assert doc["runs"][0]["seed"] != doc["runs"][1]["seed"]
    printed = capsys.readouterr().out
    assert "concurrency=2" in printed and "TTFT" in printed and "Goodput" in printed


@pytest.mark.parametrize("argv, flag", [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "2", "--request-rate", "1"], "--request-rate"),
    (["--request-rate", "1,-2"], "--request-rate"),
    (["--input-len", "9:4"], "--input-len"),
    (["--tier", "urgent"], "--tier"),
    (["--duration", "0"], "--duration"),
    (["--concurrency", "4", "--max-concurrency", "2"], "--max-concurrency"),
    (["--dataset", "multi-turn", "--output-len", "2:5"], "--output-len"),
    (["--token-range", "0:10"], "--token-range"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, flag, capsys) -> None:
    assert main(argv) == 2
    assert flag in capsys.readouterr().err

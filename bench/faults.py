"""Fault injection on a real cluster (CPU, loopback): every fault RELIABILITY.md lists, each a
function that starts what it needs, injects the fault, and returns a `FaultResult` (requests,
failures, tokens lost, leaked KV blocks). The CI tests (tests/test_reliability.py) call the
same functions with small counts; this script runs the full counts and prints the table:

    PYTHONPATH=$PWD python bench/faults.py                       # every scenario, full counts
    PYTHONPATH=$PWD python bench/faults.py --only lifecycle burst --scale 0.2
    PYTHONPATH=$PWD python bench/faults.py --model /path/to/stories260K-hf

Model: `--model DIR` (a Hugging Face directory, e.g. stories260K converted by
engine.convert.llama2c), default the random-weight demo llama (engine.demo). Greedy decoding
throughout, so "tokens lost" compares every stream with the fault-free run of the same prompt.

Definitions: a failure is a call that ends any other way than its scenario allows (a hang past
its bound counts too); tokens lost are tokens of a stream that should have completed and did
not arrive, or differ from the fault-free run; leaked blocks are KV blocks not free on a live
worker once the gateway reports nothing in flight.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the harness (torch-free) that the tests use

import grpc  # noqa: E402

from gateway.config import GatewayConfig, TierConfig, WorkerPoolConfig  # noqa: E402
from gateway.liveness import LivenessConfig  # noqa: E402
from harness import GatewayThread, WorkerProcess, start_workers, stop_workers  # noqa: E402
from tandem import wire  # noqa: E402
from tandem.types import Tier  # noqa: E402

logger = logging.getLogger(__name__)
pb = wire.pb

WAIT = 60.0  # bound on any one call or wait; a call past it is a failure (a hang)
PROMPTS = [f"Fault {i}: the quick brown fox jumps over the lazy dog, then {'abc'[i % 3] * (i % 5 + 1)}."
           for i in range(8)]


@dataclass
class FaultResult:
    """One row of RELIABILITY.md's table."""

    scenario: str
    fault: str
    requests: int = 0
    failures: int = 0
    tokens_lost: int = 0
    leaked_blocks: int = 0
    outcomes: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> str:
        out = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        return (f"| {self.scenario} | {self.fault} | {self.requests} | {self.failures} | {self.tokens_lost} | "
                f"{self.leaked_blocks} | {out}{'; ' if self.notes and out else ''}{'; '.join(self.notes)} |")


# ---------------------------------------------------------------- cluster

def demo_model(work: Path) -> Path:
    """The random-weight demo llama (what the CI tests use)."""
    from engine.demo import make_random_model

    return make_random_model(work / "demo-llama", "llama", seed=0)


@dataclass
class Rig:
    """Workers of one scenario and the gateway in front of a chosen subset."""

    model: Path
    work: Path
    workers: dict[str, WorkerProcess]

    def __post_init__(self) -> None:
        _ERRORS.records.clear()  # logged in this process before the rig: no scenario's (other tests')

    def gateway(self, prefill: Sequence[str], decode: Sequence[str], *, tiers: dict | None = None,
                liveness: LivenessConfig | None = None, max_inflight_per_decode: int = 32,
                index_url: str | None = None) -> GatewayThread:
        pool = WorkerPoolConfig(prefill=tuple(self.workers[n].address for n in prefill),
                                decode=tuple(self.workers[n].address for n in decode),
                                max_inflight_per_decode=max_inflight_per_decode)
        kw: dict[str, Any] = {"liveness": liveness or LivenessConfig(), "index_url": index_url}
        if tiers is not None:
            kw["tiers"] = tiers
        gw = GatewayThread(GatewayConfig(model_dir=str(self.model), port=0, workers=pool, **kw))
        # Ready is one decode (and one prefill) worker up; a scenario's streams are placed over
        # every listed worker, so wait for each that is alive (a fault aimed at a worker that
        # was not up yet finds no stream on it).
        alive = {self.workers[n].address for n in (*prefill, *decode) if self.workers[n].alive()}
        if gw.wait_ready(WAIT):
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline:
                if alive <= gw.call(lambda: {h.address for h in gw.gateway.registry.handles if h.up}):
                    return gw
                time.sleep(0.05)
        gw.stop()
        raise RuntimeError(f"gateway: not every worker became ready: {sorted(alive)}")

    def stop(self) -> None:
        for w in self.workers.values():
            if w.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGCONT)
        stop_workers(list(self.workers.values()))


def start_rig(model: Path, work: Path, specs: dict[str, tuple[str, list[str]] | tuple[str, list[str], dict]]) -> Rig:
    names = list(specs)
    procs = start_workers([specs[n] for n in names], model, work)
    return Rig(model, work, dict(zip(names, procs)))


def worker_flags(blocks: int = 160, running: int = 32) -> list[str]:
    return ["--num-kv-blocks", str(blocks), "--max-running", str(running)]


@contextlib.contextmanager
def rig(model: Path, work: Path, specs: dict) -> Iterator[Rig]:
    r = start_rig(model, work, specs)
    try:
        yield r
    finally:
        r.stop()


# ---------------------------------------------------------------- invariants

def gateway_in_flight(gw: GatewayThread) -> dict[str, int]:
    """What the gateway still holds: running requests, Generate calls, decode slots, blocks
    counted on workers, queued tickets. All 0 when idle."""
    def read() -> dict[str, int]:
        g = gw.gateway
        return {"running": len(g.service.running), "calls": g.service.calls,
                "slots": sum(h.inflight for h in g.registry.decode_workers()),
                "reserved_blocks": sum(h.reserved_blocks for h in g.registry.decode_workers()),
                "queued": len(g.dispatcher.queues)}
    return gw.call(read)


_LOG_SEEN: dict[str, int] = {}  # log file -> characters already checked


class _Errors(logging.Handler):
    """ERROR records logged in this process (the gateway runs here), drained by `settle`."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "PollerCompletionQueue" in message and record.exc_info and "closed" in str(record.exc_info[1]):
            # gRPC's process-wide poller calling into the closed loop of an earlier scenario's
            # gateway: several gateways in one process is this harness's doing, not a fault.
            return
        if "Task was destroyed but it is pending" in message and "grpc/_cython/_cygrpc/aio/call" in message:
            # gRPC's own per-call status task, left on the closed loop of an earlier scenario's
            # gateway and collected whenever the garbage collector runs (the same harness effect;
            # a gateway that leaked a call of a live request shows in `gateway_in_flight`).
            return
        self.records.append(f"{record.name}: {message[:200]}")
        if record.exc_info:
            import traceback

            logger.warning("ERROR logged in the gateway process: %s\n%s", message,
                           "".join(traceback.format_exception(*record.exc_info)))


_ERRORS = _Errors()
logging.getLogger().addHandler(_ERRORS)


def settle(gw: GatewayThread, workers: Sequence[WorkerProcess], result: FaultResult, timeout: float = WAIT) -> None:
    """Wait for the gateway to hold nothing and every live worker to free every block; what is
    still held after `timeout` is recorded as a failure / leaked blocks, and so is an ERROR or
    a traceback a worker logged since the last check."""
    deadline = time.monotonic() + timeout
    held = gateway_in_flight(gw)
    while any(held.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
        held = gateway_in_flight(gw)
    if any(held.values()):
        result.failures += 1
        result.notes.append(f"gateway still holds {held}")
    if _ERRORS.records:
        result.failures += 1
        result.notes.append(f"the gateway process logged {len(_ERRORS.records)} ERRORs, e.g. {_ERRORS.records[0]!r}")
        _ERRORS.records.clear()
    for w in workers:
        full = w.log_tail(1 << 24)
        log, _LOG_SEEN[str(w.log_path)] = full[_LOG_SEEN.get(str(w.log_path), 0):], len(full)
        if "Traceback" in log or " ERROR " in log:
            result.failures += 1
            result.notes.append(f"{w.name} logged an ERROR: {log[log.find('ERROR') - 200:][:400]!r}")
        if not w.alive():
            continue
        leaked = 0
        while time.monotonic() < deadline:
            s = w.stats()
            leaked = s.total_kv_blocks - s.free_kv_blocks
            if leaked == 0 and s.running == 0 and s.waiting == 0:
                break
            time.sleep(0.05)
        result.leaked_blocks += leaked
    result.extra["gateway_in_flight"] = held


# ---------------------------------------------------------------- one call

_CLIENT_LOOP: asyncio.AbstractEventLoop | None = None


def run_client(coro: Any) -> Any:
    """Run a client coroutine on this process's one client event loop (grpc.aio keeps state
    per loop: a fresh loop per scenario would leave callbacks aimed at closed ones)."""
    global _CLIENT_LOOP
    if _CLIENT_LOOP is None or _CLIENT_LOOP.is_closed():
        _CLIENT_LOOP = asyncio.new_event_loop()
    return _CLIENT_LOOP.run_until_complete(coro)


def request(prompt: str, max_tokens: int, rid: str = "", tier: Tier = Tier.STANDARD) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, request_id=rid, tier=wire.tier_to_proto(tier),
                              params=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


@dataclass
class CallOutcome:
    code: str  # "OK" or a status code name; "HANG" past WAIT
    tokens: list[int]
    finish_reason: str = ""
    details: str = ""
    ended_at: float = 0.0


async def consume(call: Any, on_chunk: Any = None) -> CallOutcome:
    tokens: list[int] = []
    finish = ""
    try:
        async for chunk in call:
            tokens += list(chunk.token_ids)
            if chunk.finish_reason:
                finish = wire.finish_reason_from_proto(chunk.finish_reason) or ""
            if on_chunk is not None:
                await on_chunk(len(tokens))
        return CallOutcome("OK", tokens, finish, ended_at=time.monotonic())
    except asyncio.CancelledError:
        return CallOutcome("DISCONNECTED", tokens, ended_at=time.monotonic())
    except grpc.aio.AioRpcError as exc:
        return CallOutcome(exc.code().name, tokens, details=exc.details() or "", ended_at=time.monotonic())


async def reference_tokens(target: str, prompts: Sequence[str], max_tokens: int) -> dict[str, list[int]]:
    """The fault-free greedy output of each prompt."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = wire.TandemStub(ch)
        outs = await asyncio.gather(*(consume(stub.Generate(request(p, max_tokens), timeout=WAIT)) for p in prompts))
    for p, o in zip(prompts, outs):
        if o.code != "OK":
            raise RuntimeError(f"fault-free reference of {p!r} failed: {o.code} {o.details}")
    return {p: o.tokens for p, o in zip(prompts, outs)}


# ---------------------------------------------------------------- scenario: request lifecycle

LONG = 200  # tokens of a stream a deadline should cut
LIFECYCLE_ACTIONS = ("complete", "abort_now", "abort_after", "disconnect_now", "disconnect_after", "deadline")


async def _lifecycle_calls(gw: GatewayThread, n: int, seed: int, max_tokens: int, ref: dict[str, list[int]],
                           kill: WorkerProcess | None, result: FaultResult) -> None:
    rng = random.Random(seed)
    late: list[str] = []
    async with grpc.aio.insecure_channel(gw.target) as ch:
        stub = wire.TandemStub(ch)

        async def one(i: int) -> None:
            await asyncio.sleep(rng.random() * 2.0)  # arrivals spread over ~2 s
            action = LIFECYCLE_ACTIONS[i % len(LIFECYCLE_ACTIONS)]
            prompt = rng.choice(list(ref))
            rid = f"life-{seed}-{i}"
            after = rng.randint(0, 6)
            timeout = rng.uniform(0.05, 1.0) if action == "deadline" else WAIT
            length = max_tokens if action != "deadline" else LONG  # a deadline should hit a running stream
            call = stub.Generate(request(prompt, length, rid), timeout=timeout)
            acted: list[float] = []

            async def abort() -> None:
                acted.append(time.monotonic())
                found = (await stub.Abort(pb.AbortRequest(request_id=rid), timeout=WAIT)).found
                if not found:
                    acted.clear()  # it had ended (or not yet arrived): it runs to its end

            async def on_chunk(got: int) -> None:
                if got >= after and not acted:
                    if action == "abort_after":
                        await abort()
                    elif action == "disconnect_after":
                        acted.append(time.monotonic())
                        call.cancel()

            background = None
            if action == "abort_now":  # races the Generate call itself
                background = asyncio.ensure_future(abort())
            elif action == "disconnect_now":
                await asyncio.sleep(rng.random() * 0.01)
                call.cancel()
            try:
                out = await asyncio.wait_for(consume(call, on_chunk), WAIT)
            except TimeoutError:
                call.cancel()
                out = CallOutcome("HANG", [])
            if background is not None:
                await background
            kind = out.finish_reason or out.code
            result.outcomes[kind] += 1
            want = ref[prompt][:length]
            if out.code == "HANG":
                result.failures += 1
            elif action == "complete" and out.code not in ("OK",):
                result.failures += 1
                result.notes.append(f"{rid}: {out.code} {out.details}")
            elif out.code not in ("OK", "DISCONNECTED", "DEADLINE_EXCEEDED"):
                result.failures += 1
                result.notes.append(f"{rid} ({action}): {out.code} {out.details}")
            elif out.code == "DEADLINE_EXCEEDED" and action != "deadline":
                result.failures += 1
            elif out.code == "DISCONNECTED" and not action.startswith("disconnect"):
                result.failures += 1
            if out.tokens != want[:len(out.tokens)]:
                result.tokens_lost += len(want)  # a wrong token: the whole stream counts as lost
            elif out.code == "OK" and out.finish_reason == "length" and len(out.tokens) != len(want):
                result.tokens_lost += abs(len(want) - len(out.tokens))
            if acted and action.startswith("abort") and out.code == "OK" and out.ended_at - acted[0] > 1.0:
                late.append(f"{rid}: ended {out.ended_at - acted[0]:.2f} s after its abort")

        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
        if kill is not None:
            await asyncio.sleep(rng.uniform(0.5, 1.5))
            kill.kill()
            result.notes.append(f"killed {kill.name} (SIGKILL) mid-run")
        await asyncio.gather(*tasks)
    result.failures += len(late)
    result.notes += late[:5]
    result.extra["late_aborts"] = len(late)


def lifecycle(r: Rig, n: int, seed: int = 0, *, kill: str | None = None, decode: Sequence[str] = ("d0", "d1"),
              max_tokens: int = 24) -> FaultResult:
    """`n` requests through a (P, D, D) cluster, each ended one of LIFECYCLE_ACTIONS' ways at a
    random moment (an abort racing the submit, a disconnect before the first chunk, after k
    chunks, a deadline of 50 ms-1 s), optionally with one decode worker SIGKILLed mid-run; then
    the gateway must hold nothing, every live worker must free every block, and serve again."""
    fault = "random abort / disconnect / deadline" + (f" + kill -9 {kill}" if kill else "")
    result = FaultResult("lifecycle" + ("+kill" if kill else ""), fault, requests=n)
    gw = r.gateway(["p0"], list(decode))
    try:
        ref = run_client(reference_tokens(gw.target, PROMPTS, LONG))
        run_client(_lifecycle_calls(gw, n, seed, max_tokens, ref, r.workers[kill] if kill else None, result))
        settle(gw, [r.workers[x] for x in ("p0", *decode)], result)
        after = run_client(reference_tokens(gw.target, PROMPTS[:2], LONG))
        if after != {p: ref[p] for p in PROMPTS[:2]}:
            result.failures += 1
            result.notes.append("the gateway did not serve normally afterwards")
        settle(gw, [r.workers[x] for x in ("p0", *decode)], result)
    finally:
        gw.stop()
    return result


# ---------------------------------------------------------------- scenario: burst

BURST_TIERS = {Tier.INTERACTIVE: TierConfig(capacity=512), Tier.STANDARD: TierConfig(capacity=16, aging_s=5.0),
               Tier.BATCH: TierConfig(capacity=16, aging_s=30.0)}


async def _burst_calls(target: str, n: int, interactive_every: int, channels: int) -> list[tuple[Tier, CallOutcome]]:
    chans = [grpc.aio.insecure_channel(target) for _ in range(channels)]
    try:
        stubs = [wire.TandemStub(c) for c in chans]
        tiers = [Tier.INTERACTIVE if i % interactive_every == 0 else (Tier.STANDARD if i % 2 else Tier.BATCH)
                 for i in range(n)]
        calls = [stubs[i % channels].Generate(request(PROMPTS[i % len(PROMPTS)], 4, tier=t), timeout=WAIT * 3)
                 for i, t in enumerate(tiers)]
        outs = await asyncio.gather(*(consume(c) for c in calls))
        return list(zip(tiers, outs))
    finally:
        for c in chans:
            await c.close()


def burst(r: Rig, n: int, *, interactive_every: int = 20, channels: int = 4, library_defaults: bool = False) -> FaultResult:
    """`n` Generate calls at once at a gateway whose tiers hold far fewer (INTERACTIVE 512,
    STANDARD 16, BATCH 16; 2 decode workers x 4 slots): every call must end OK or
    RESOURCE_EXHAUSTED naming its tier (none CANCELLED by the RPC library), every INTERACTIVE
    call OK, and the calls the gateway held at once stay within its bound.
    `library_defaults`: serve with gRPC's default pending-call limits (shows the failure mode)."""
    result = FaultResult("burst" + ("(gRPC defaults)" if library_defaults else ""),
                         f"{n} calls at once, 1 in {interactive_every} INTERACTIVE", requests=n)
    import gateway.server as server_mod

    saved = server_mod.overload_options
    if library_defaults:
        server_mod.overload_options = lambda max_calls: []
    try:
        gw = r.gateway(["p0"], ["d0", "d1"], tiers=BURST_TIERS, max_inflight_per_decode=4)
    finally:
        server_mod.overload_options = saved
    try:
        async def run() -> list[tuple[Tier, CallOutcome]]:
            return await _burst_calls(gw.target, n, interactive_every, channels)

        outs = run_client(run())
        bound = gw.call(lambda: gw.gateway.service.max_calls)
        peak = [gw.call(lambda: gw.gateway.service.calls_peak)]
        for tier, out in outs:
            result.outcomes[f"{tier.name}:{out.code}"] += 1
            if out.code == "OK":
                if len(out.tokens) != 4:
                    result.tokens_lost += 4 - len(out.tokens)
            elif out.code == "RESOURCE_EXHAUSTED" and tier.name in out.details and tier != Tier.INTERACTIVE:
                pass
            else:
                result.failures += 1
                if len(result.notes) < 3:
                    result.notes.append(f"{tier.name}: {out.code} {out.details[:80]}")
        result.extra.update(peak_calls=peak[0], bound=bound)
        result.notes.append(f"peak calls held {peak[0]} (bound {bound})")
        settle(gw, [r.workers[x] for x in ("p0", "d0", "d1")], result)
    finally:
        gw.stop()
    return result


# ---------------------------------------------------------------- scenario: frozen worker (SIGSTOP)

async def _streams_with_fault(target: str, prompts: Sequence[str], max_tokens: int, min_tokens_before: int,
                              inject: Any, gaps: list[float] | None = None, *,
                              any_stream: bool = False) -> list[CallOutcome]:
    """Start one stream per prompt; once every stream (`any_stream`: one) has `min_tokens_before`
    tokens, call `inject()` (in a thread); return every stream's outcome. `gaps[i]`: the longest
    wait for a chunk of stream i after the injection."""
    gaps = gaps if gaps is not None else [0.0] * len(prompts)
    counts = [0] * len(prompts)
    ready = asyncio.Event()
    injected: list[float] = []
    last = [0.0] * len(prompts)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = wire.TandemStub(ch)

        def watcher(i: int) -> Any:
            async def on_chunk(got: int) -> None:
                now = time.monotonic()
                if injected and last[i]:
                    gaps[i] = max(gaps[i], now - max(last[i], injected[0]))
                counts[i], last[i] = got, now
                if (any if any_stream else all)(c >= min_tokens_before for c in counts):
                    ready.set()
            return on_chunk

        tasks = [asyncio.ensure_future(consume(stub.Generate(request(p, max_tokens), timeout=WAIT * 2), watcher(i)))
                 for i, p in enumerate(prompts)]
        await asyncio.wait_for(ready.wait(), WAIT)
        injected.append(time.monotonic())
        await asyncio.to_thread(inject)
        return list(await asyncio.gather(*tasks))


def frozen_worker(r: Rig, n_streams: int = 32, *, role: str = "decode", max_tokens: int = 400,
                  stall_timeout_s: float = 2.0, slots: int = 32) -> FaultResult:
    """`n_streams` streams on two decode workers (the split is checked: no worse than 20/12 for
    32); SIGSTOP the busier decode worker (role "decode") or the only prefill worker of two
    (role "prefill", while new requests prefill) mid-stream; every stream must finish with the
    fault-free tokens while the worker is still frozen (so it was migrated), then SIGCONT and
    every block must come back."""
    prefill = ["p0", "p1"]  # role prefill: p0 is frozen; role decode: prompts start close together
    result = FaultResult(f"sigstop-{role}", f"SIGSTOP a {role} worker with streams on it", requests=n_streams)
    gw = r.gateway(prefill, ["d0", "d1"], liveness=LivenessConfig(stall_timeout_s=stall_timeout_s,
                                                                   prefill_stall_s=max(stall_timeout_s, 5.0)),
                   max_inflight_per_decode=slots)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} Stream {i}." for i in range(n_streams)]
    stopped: list[WorkerProcess] = []
    try:
        ref = run_client(reference_tokens(gw.target, prompts, max_tokens))
        mark = gw.call(lambda: len(gw.gateway.dispatcher.log))

        def freeze() -> None:
            log = gw.call(lambda: list(gw.gateway.dispatcher.log)[mark:])
            first: dict[str, str] = {}  # a request retried before the freeze counts where it first went
            for e in log:
                if e.kind == "dispatch":
                    first.setdefault(e.request_id, e.worker)
            placed = Counter(first.values())
            result.extra["split"] = sorted(placed.values(), reverse=True)
            if role == "decode":
                name = max(("d0", "d1"), key=lambda x: placed.get(r.workers[x].worker_id, 0))
            else:
                name = "p0"
            victim = r.workers[name]
            running = victim.stats().running
            os.kill(victim.pid, signal.SIGSTOP)
            result.extra["running_at_freeze"] = running
            stopped.append(victim)
            result.extra["frozen_at"] = time.monotonic()
            if role == "decode":
                result.notes.append(f"SIGSTOP {name} with {running} of its {placed.get(victim.worker_id, 0)} streams "
                                    f"running")
            else:
                result.notes.append(f"SIGSTOP {name} (one of 2 prefill workers), then the requests")

        min_before = 2 if role == "decode" else 0
        if role == "prefill":
            outs = run_client(_prefill_stall(gw.target, prompts, max_tokens, freeze))
        else:
            gaps = [0.0] * len(prompts)
            outs = run_client(_streams_with_fault(gw.target, prompts, max_tokens, min_before, freeze, gaps))
            result.extra["max_gap_s"] = max(gaps)
            result.notes.append(f"longest wait for a chunk after the freeze {max(gaps):.1f} s "
                                f"(stall timeout {stall_timeout_s:.1f} s)")
        result.extra["finished_frozen"] = all(v.alive() for v in stopped)
        for p, out in zip(prompts, outs):
            result.outcomes[out.code] += 1
            if out.code != "OK":
                result.failures += 1
                result.tokens_lost += len(ref[p]) - len(out.tokens)
                if len(result.notes) < 4:
                    result.notes.append(f"{out.code}: {out.details[:100]}")
            elif out.tokens != ref[p]:
                result.tokens_lost += sum(1 for a, b in zip(out.tokens, ref[p]) if a != b) + abs(len(ref[p]) - len(out.tokens))
        result.extra["stalls"] = gw.metric("tandem_gateway_stalls_total", {"stage": "stream"}) + \
            gw.metric("tandem_gateway_stalls_total", {"stage": "prefill"}) + \
            gw.metric("tandem_gateway_stalls_total", {"stage": "reserve"})
        result.notes.append(f"{int(result.extra['stalls'])} attempts migrated on stall")
        for v in stopped:
            os.kill(v.pid, signal.SIGCONT)
        stopped.clear()
        settle(gw, [r.workers[x] for x in (*prefill, "d0", "d1")], result)
    finally:
        for v in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(v.pid, signal.SIGCONT)
        gw.stop()
    if result.extra.get("split") and role == "decode":
        result.notes.insert(0, f"burst split {'/'.join(map(str, result.extra['split']))}")
    return result


async def _prefill_stall(target: str, prompts: Sequence[str], max_tokens: int, freeze: Any) -> list[CallOutcome]:
    """Freeze the prefill worker first, then send the requests: their prefills stall on it."""
    await asyncio.to_thread(freeze)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = wire.TandemStub(ch)
        return list(await asyncio.gather(*(consume(stub.Generate(request(p, max_tokens), timeout=WAIT * 2))
                                           for p in prompts)))


# ---------------------------------------------------------------- scenario: kill -9

def killed_worker(r: Rig, role: str, n_streams: int = 16, max_tokens: int = 400,
                  result: FaultResult | None = None) -> FaultResult:
    """SIGKILL a decode worker mid-stream (streams resume elsewhere, exactly once) or the prefill
    worker of two (its prefills retry on the other)."""
    result = result or FaultResult(f"kill-{role}", f"kill -9 a {role} worker mid-stream", requests=n_streams)
    prefill = ["p0", "p1"] if role == "prefill" else ["p0"]
    decode = ["d0", "dv"] if role == "decode" else ["d0", "d1"]
    gw = r.gateway(prefill, decode)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} Kill {i}." for i in range(n_streams)]
    try:
        ref = run_client(reference_tokens(gw.target, prompts, max_tokens))
        victim = r.workers["dv" if role == "decode" else "p1"]

        if role == "decode":
            outs = run_client(_streams_with_fault(gw.target, prompts, max_tokens, 2, victim.kill))
        else:
            async def run() -> list[CallOutcome]:
                async with grpc.aio.insecure_channel(gw.target) as ch:
                    stub = wire.TandemStub(ch)

                    async def later(i: int, p: str) -> CallOutcome:
                        await asyncio.sleep(i * 1.0 / len(prompts))  # arrivals over 1 s: prefills keep coming
                        return await consume(stub.Generate(request(p, max_tokens), timeout=WAIT * 2))

                    tasks = [asyncio.ensure_future(later(i, p)) for i, p in enumerate(prompts)]
                    await asyncio.sleep(0.5)
                    await asyncio.to_thread(victim.kill)
                    return list(await asyncio.gather(*tasks))
            outs = run_client(run())
        score(result, prompts, outs, ref)
        result.notes.append(f"retries {retries(gw)}")
        settle(gw, [r.workers[x] for x in (*prefill, *decode)], result)
    finally:
        gw.stop()
    return result


def score(result: FaultResult, prompts: Sequence[str], outs: Sequence[CallOutcome], ref: dict[str, list[int]]) -> None:
    """Count each stream's outcome, its failure if it did not end OK, and its tokens that differ
    from (or are missing against) the fault-free run."""
    for p, out in zip(prompts, outs):
        result.outcomes[out.code] += 1
        if out.code != "OK" or out.tokens != ref[p]:
            result.failures += out.code != "OK"
            result.tokens_lost += sum(1 for a, b in zip(out.tokens, ref[p]) if a != b) + abs(len(ref[p]) - len(out.tokens))


def retries(gw: GatewayThread) -> int:
    return int(sum(gw.metric("tandem_gateway_retries_total", {"stage": s})
                   for s in ("reserve", "prefill", "decode", "stream")))


# ---------------------------------------------------------------- scenario: the device lost

def device_loss_env(arm: Path) -> dict[str, str]:
    """A worker's environment for TANDEM_FAULT_DEVICE_LOST: its device is lost once `arm` exists."""
    from worker.faults import ENV_DEVICE_LOST

    return {ENV_DEVICE_LOST: f"@{arm}"}


def lost_device(r: Rig, arm: Path, n_streams: int = 16, max_tokens: int = 400) -> FaultResult:
    """A decode worker's device lost mid-stream (worker/device_fault.py; the worker "dl", started
    with device_loss_env(arm)): the worker leaves with DEVICE_LOST_EXIT at its next step instead
    of failing every request it holds, and its streams resume on the other decode worker, token
    for token, as after a kill -9.

    The fault is armed once the first stream has two tokens and the victim runs a stream, not
    once every stream has them: a slow worker beside it (a loaded CI machine) can delay the last
    stream's tokens until the victim's have all ended, and a victim with nothing to run never
    takes the step that would find its device lost."""
    from worker.device_fault import DEVICE_LOST_EXIT
    from worker.faults import ENV_DEVICE_LOST

    result = FaultResult("device-lost-decode", "a decode worker's device lost mid-stream (a sticky CUDA error)",
                         requests=n_streams)
    victim = r.workers["dl"]
    gw = r.gateway(["p0"], ["d0", "dl"])
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} Lost {i}." for i in range(n_streams)]
    try:
        ref = run_client(reference_tokens(gw.target, prompts, max_tokens))
        def arm_while_it_runs() -> None:
            deadline = time.monotonic() + WAIT
            while (running := victim.stats().running) == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            result.extra["victim_running_at_arm"] = running
            arm.touch()

        outs = run_client(_streams_with_fault(gw.target, prompts, max_tokens, 2, arm_while_it_runs, any_stream=True))
        score(result, prompts, outs, ref)
        code = victim.wait(WAIT)  # killed (and so counted a failure) if it has not left by then
        result.extra["exit_code"] = code
        if code != DEVICE_LOST_EXIT:
            result.failures += 1
        log = victim.log_tail(1 << 20)
        result.extra["logged_why"] = "the device is lost" in log and ENV_DEVICE_LOST in log
        result.notes.append(f"the worker ran {result.extra.get('victim_running_at_arm')} streams when its device "
                            f"was lost and exited with code {code}; retries {retries(gw)}")
        settle(gw, [r.workers[x] for x in ("p0", "d0")], result)  # the victim's log holds its CRITICAL line
    finally:
        gw.stop()
    return result


def killed_weight_loader(model: Path, work: Path, n_streams: int = 16, max_tokens: int = 400) -> FaultResult:
    """Workers sharing one copy of the weights (--shared-weights-dir, engine/shared_weights.py):
    SIGKILL the decode worker that loaded them mid-stream. The prefill and the other decode
    worker map its copy; their streams and the ones that resume on them must keep the fault-free
    tokens (the copy outlives its loader)."""
    from engine.engine import OVERLAP_ENV

    overlap = {OVERLAP_ENV: "1"}
    shared = ["--shared-weights-dir", str(work / "weights"), "--log-level", "INFO"]  # INFO: who loaded, who mapped
    loader = start_workers([("decode", worker_flags(640, 64) + shared, overlap)], model, work / "loader")[0]
    mapped = start_workers([("prefill", worker_flags() + shared), ("decode", worker_flags(640, 64) + shared, overlap)],
                           model, work / "mapped")
    r = Rig(model, work, {"dv": loader, "p0": mapped[0], "d0": mapped[1]})
    try:
        logs = [(w.log_path.read_text() if w.log_path else "") for w in (loader, *mapped)]
        if "loaded here" not in logs[0] or not all("mapped from" in text for text in logs[1:]):
            raise RuntimeError("kill_weight_loader: the first decode worker did not load the weights the others map")
        result = FaultResult("kill-weight-loader", "kill -9 the decode worker whose weights the others map, "
                             "mid-stream", requests=n_streams)
        return killed_worker(r, "decode", n_streams, max_tokens, result)
    finally:
        r.stop()


# ---------------------------------------------------------------- scenario: corrupt KV frames

def corrupt_frames(r: Rig, n: int = 8, max_tokens: int = 16) -> FaultResult:
    """A prefill worker whose first KV push is corrupted in transit (TANDEM_KV_CORRUPT_ONCE):
    the checksum catches it, the attempt is retried, the output is unchanged."""
    result = FaultResult("corrupt-kv", "a corrupted KV frame (checksum mismatch)", requests=n)
    gw_ref = r.gateway(["p0"], ["d0"])
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} Corrupt {i}." for i in range(n)]
    try:
        ref = run_client(reference_tokens(gw_ref.target, prompts, max_tokens))
    finally:
        gw_ref.stop()
    gw = r.gateway(["p_bad"], ["d0"])
    try:
        async def run() -> list[CallOutcome]:
            async with grpc.aio.insecure_channel(gw.target) as ch:
                stub = wire.TandemStub(ch)
                return [await consume(stub.Generate(request(p, max_tokens), timeout=WAIT)) for p in prompts]
        for p, out in zip(prompts, run_client(run())):
            result.outcomes[out.code] += 1
            result.failures += out.code != "OK"
            if out.tokens != ref[p]:
                result.tokens_lost += len(ref[p])
        result.notes.append(f"retries {int(gw.metric('tandem_gateway_retries_total', {'stage': 'decode'}))}")
        settle(gw, [r.workers[x] for x in ("p_bad", "d0")], result)
    finally:
        gw.stop()
    return result


# ---------------------------------------------------------------- scenario: malformed protobuf

def malformed_messages(target: str, n: int, seed: int = 0) -> tuple[int, Counter]:
    """Send `n` malformed Generate / Abort messages (bad UTF-8 in each string field, truncated
    at random byte offsets); returns (failures, codes). Bad UTF-8 must answer INVALID_ARGUMENT;
    a truncation may happen to end on a field boundary (then the shorter message is checked as
    any request: OK or INVALID_ARGUMENT), never UNKNOWN or INTERNAL."""
    rng = random.Random(seed)
    good = pb.GenerateRequest(text="hello world", request_id="malformed-ok",
                              params=pb.SamplingParams(max_tokens=2, stop=["zz"])).SerializeToString()
    failures = 0
    codes: Counter = Counter()
    with grpc.insecure_channel(target) as ch:
        gen = ch.unary_stream("/tandem.v1.Tandem/Generate", request_serializer=lambda b: b,
                              response_deserializer=pb.GenerateChunk.FromString)
        abort = ch.unary_unary("/tandem.v1.Tandem/Abort", request_serializer=lambda b: b,
                               response_deserializer=pb.AbortResponse.FromString)
        for i in range(n):
            kind = i % 4
            if kind == 0:
                body, must = good.replace(b"hello", b"h\xffllo"), True
            elif kind == 1:
                body, must = good.replace(b"zz", b"\xc3\x28"), True
            elif kind == 2:
                body, must = good[: rng.randrange(1, len(good))], False
            else:
                body, must = pb.AbortRequest(request_id="abcdef").SerializeToString().replace(b"bcd", b"\xed\xa0\x80"), True
            try:
                if kind == 3:
                    abort(body, timeout=WAIT)
                else:
                    list(gen(body, timeout=WAIT))
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name
            codes[code] += 1
            if code != "INVALID_ARGUMENT" and (must or code != "OK"):
                failures += 1
    return failures, codes


def malformed(r: Rig, n: int) -> FaultResult:
    result = FaultResult("malformed", "bad UTF-8 in string fields, truncated messages", requests=n)
    gw = r.gateway(["p0"], ["d0"])
    try:
        result.failures, result.outcomes = malformed_messages(gw.target, n)
        settle(gw, [r.workers[x] for x in ("p0", "d0")], result)
    finally:
        gw.stop()
    return result


# ---------------------------------------------------------------- scenario: Redis down

def redis_down(model: Path, work: Path, n: int = 120, max_tokens: int = 16) -> FaultResult:
    """The shared prefix index (a redis-server of its own) killed while requests arrive, and
    restarted empty later: routing turns load-only meanwhile, no request fails."""
    import shutil
    import socket
    import subprocess

    result = FaultResult("redis-down", "the prefix index's Redis killed mid-run, restarted empty", requests=n)
    if shutil.which("redis-server") is None:
        result.notes.append("skipped: no redis-server")
        return result
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"

    def start_redis() -> subprocess.Popen:
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(work)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    return proc
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer")

    redis_proc = start_redis()
    flags = [*worker_flags(), "--redis-url", url, "--index-heartbeat", "0.3"]
    try:
        with rig(model, work / "redis", {"p0": ("prefill", flags), "p1": ("prefill", flags),
                                        "d0": ("decode", flags)}) as r:
            gw = r.gateway(["p0", "p1"], ["d0"], index_url=url)
            try:
                ref = run_client(reference_tokens(gw.target, PROMPTS, max_tokens))
                degraded = []

                async def run() -> list[tuple[str, CallOutcome]]:
                    nonlocal redis_proc
                    async with grpc.aio.insecure_channel(gw.target) as ch:
                        stub = wire.TandemStub(ch)

                        async def one(i: int) -> tuple[str, CallOutcome]:
                            await asyncio.sleep(3.0 * i / n)
                            p = PROMPTS[i % len(PROMPTS)]
                            return p, await consume(stub.Generate(request(p, max_tokens), timeout=WAIT))

                        tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
                        await asyncio.sleep(1.0)
                        redis_proc.kill()
                        redis_proc.wait(30)
                        await asyncio.sleep(1.0)
                        degraded.append(await asyncio.to_thread(gw.metric, "tandem_gateway_prefix_index_degraded"))
                        redis_proc = await asyncio.to_thread(start_redis)
                        return list(await asyncio.gather(*tasks))

                for p, out in run_client(run()):
                    result.outcomes[out.code] += 1
                    result.failures += out.code != "OK"
                    if out.tokens != ref[p]:
                        result.tokens_lost += len(ref[p])
                result.notes.append(f"index degraded while Redis was down: {bool(degraded and degraded[0])}")
                settle(gw, list(r.workers.values()), result)
            finally:
                gw.stop()
    finally:
        redis_proc.kill()
        redis_proc.wait(30)
    return result


# ---------------------------------------------------------------- main

SCENARIOS = ("lifecycle", "lifecycle_kill", "burst", "sigstop_decode", "sigstop_prefill", "kill_decode",
             "kill_prefill", "corrupt", "malformed", "redis_down", "kill_weight_loader", "device_lost")


def run_all(model: Path, work: Path, only: Sequence[str], scale: float, seed: int, with_defaults: bool) -> list[FaultResult]:
    def n(full: int) -> int:
        return max(4, int(full * scale))

    from engine.engine import OVERLAP_ENV
    from kvtransfer.zmq_transport import CORRUPT_ENV

    overlap = {OVERLAP_ENV: "1"}
    specs = {"p0": ("prefill", worker_flags()), "p1": ("prefill", worker_flags()),
             "p_bad": ("prefill", worker_flags(), {CORRUPT_ENV: "1"}),
             "d0": ("decode", worker_flags(640, 64), overlap), "d1": ("decode", worker_flags(640, 64), overlap),
             "dv": ("decode", worker_flags(640, 64), overlap)}
    if "device_lost" in only:
        specs["dl"] = ("decode", worker_flags(640, 64), {**overlap, **device_loss_env(work / "lose-dl")})
    results: list[FaultResult] = []
    if "redis_down" in only:
        results.append(redis_down(model, work, n(120)))
    if "kill_weight_loader" in only:
        results.append(killed_weight_loader(model, work / "shared", n(16)))
    with rig(model, work, specs) as r:
        for name in only:
            logger.info("scenario %s", name)
            if name == "lifecycle":
                results.append(lifecycle(r, n(500), seed))
            elif name == "burst":
                if with_defaults:
                    results.append(burst(r, n(3000), library_defaults=True))
                results.append(burst(r, n(3000)))
            elif name == "sigstop_decode":
                # 32 streams on the frozen worker; the other has room for all 64
                results.append(frozen_worker(r, 64, role="decode", slots=64))
            elif name == "sigstop_prefill":
                results.append(frozen_worker(r, n(16), role="prefill"))
            elif name == "corrupt":
                results.append(corrupt_frames(r, n(8)))
            elif name == "malformed":
                results.append(malformed(r, n(900)))
            elif name == "kill_prefill":
                results.append(killed_worker(r, "prefill", n(16)))
            elif name == "device_lost":
                results.append(lost_device(r, work / "lose-dl", n(16)))
        # The kills go last: the victims stay dead.
        if "kill_decode" in only:
            results.append(killed_worker(r, "decode", n(16)))
        if "lifecycle_kill" in only:
            r.workers["dv"] = start_workers([specs["dv"]], model, work / "dv2")[0] if not r.workers["dv"].alive() \
                else r.workers["dv"]
            results.append(lifecycle(r, n(500), seed + 1, kill="dv", decode=("d0", "dv")))
    return results


def table(results: Sequence[FaultResult]) -> str:
    head = ("| scenario | fault | requests | failures | tokens lost | leaked blocks | outcomes / notes |\n"
            "|---|---|---|---|---|---|---|")
    return "\n".join([head, *(r.row() for r in results)])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="Hugging Face model directory; default: the demo llama")
    ap.add_argument("--only", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the request counts (0.1 for a quick run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--with-grpc-defaults", action="store_true",
                    help="also run the burst against gRPC's default pending-call limits (the failure mode)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logger.setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="tandem-faults-") as tmp:
        work = Path(tmp)
        model = Path(args.model) if args.model else demo_model(work)
        results = run_all(model, work, args.only, args.scale, args.seed, args.with_grpc_defaults)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([{**vars(r), "outcomes": dict(r.outcomes)} for r in results],
                                              indent=2, default=str))
    return 0 if all(r.failures == 0 and r.tokens_lost == 0 and r.leaked_blocks == 0 for r in results
                    if not r.scenario.endswith("(gRPC defaults)")) else 1


if __name__ == "__main__":
    sys.exit(main())

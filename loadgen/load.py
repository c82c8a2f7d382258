"""`tandem bench`: offer load to a running Tandem gateway (or any OpenAI-compatible server) and
report latency and throughput.

    tandem bench --target 127.0.0.1:50051 --dataset shared-prefix --groups 8 --prompts-per-group 16 \\
        --request-rate 1,2,4 --max-concurrency 64 --slo-ttft-ms 500 --slo-tpot-ms 50 --out bench.json
    tandem bench --backend openai --target http://127.0.0.1:8000/v1 --baseline bench.json --tolerance 10

`LoadRun` is the driver (fixed concurrency, or Poisson arrivals under a concurrency cap); the
datasets live in loadgen.datasets and the statistics in loadgen.report.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import json
import logging
import math
import random
import secrets
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadgen import datasets as ds
from loadgen.report import SLO, Progress, RequestResult, format_run, format_sweep, summarize, write_plots
from loadgen.backends import BACKENDS, BackendError, GrpcBackend, OpenAIBackend, ServerInfo, make_backend
from loadgen.baseline import DEFAULT_TOLERANCE_PCT, compare, load_results
from loadgen.baseline import report as baseline_report
from tandem.security import load_api_key
from tandem.types import MAX_SEED, Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSpec:
    """How load is offered. Exactly one of `concurrency` (that many requests kept in flight)
    or `request_rate` (Poisson arrivals of conversations per second; inf = all at once, at
    most `max_concurrency` in flight when set). `num_requests` caps the requests sent and
    `duration_s` is a hard limit: at it, requests in flight are cancelled."""

    concurrency: int | None = None
    request_rate: float | None = None
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("concurrency / request_rate: set exactly one of them")
        if self.concurrency is not None and (isinstance(self.concurrency, bool) or self.concurrency < 1):
            raise ValueError(f"concurrency: must be an integer >= 1, got {self.concurrency!r}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 (or inf), got {self.request_rate!r}")
        for name in ("max_concurrency", "num_requests"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s: must be > 0, got {self.duration_s!r}")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency={self.concurrency}"
        cap = f" max={self.max_concurrency}" if self.max_concurrency else ""
        return f"rate={self.request_rate:g}/s{cap}"


@dataclass(frozen=True)
class RequestOptions:
    """Per-request settings: max_tokens comes from each turn's output_len. A per-request
    sampling seed (derived from `seed`) is sent only when temperature > 0."""

    tier: Tier = Tier.STANDARD
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float | None = None
    seed: int = 0


@dataclass
class RunOutcome:
    """Results in completion order; `arrivals_s` are the scheduled Poisson offsets used."""

    results: list[RequestResult]
    wall_s: float
    sent: int
    cancelled: int
    skipped: int
    max_in_flight: int
    arrivals_s: list[float] = field(default_factory=list)


def poisson_offsets(rate: float, n: int, rng: random.Random) -> list[float]:
    """n arrival times (seconds from the start) of a Poisson process of `rate` per second:
    the first at 0, then i.i.d. exponential gaps of mean 1/rate; all 0 when rate is inf."""
    if not rate > 0:
        raise ValueError(f"request_rate: must be > 0, got {rate!r}")
    offsets, t = [], 0.0
    for i in range(n):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


class LoadRun:
    """Runs `conversations` against `backend` once, as `spec` says, and returns a RunOutcome.
    `backend` is a loadgen.backends backend, or a tandem AsyncClient (driven over gRPC).

    A conversation's turns go one after another (turn k+1 is sent after turn k ended, with
    prompt = turn k's prompt + its answer + the new text); a failed turn ends its
    conversation. Every loop is bounded by the dataset and stops by itself."""

    def __init__(self, backend: GrpcBackend | OpenAIBackend | Any, conversations: Sequence[ds.Conversation], spec: LoadSpec,
                 options: RequestOptions = RequestOptions(), *, progress: Progress | None = None,
                 id_prefix: str | None = None) -> None:
        if not isinstance(backend, (GrpcBackend, OpenAIBackend)):
            backend = GrpcBackend(client=backend)
        self.backend, self.spec, self.options, self.progress = backend, spec, options, progress
        self.conversations = _truncate(conversations, spec.num_requests)
        self.id_prefix = id_prefix or f"bench-{secrets.token_hex(4)}"
        self.results: list[RequestResult] = []
        self.sent = self.cancelled = self.in_flight = self.max_in_flight = self.failed = 0
        self.t0 = 0.0

    async def run(self) -> RunOutcome:
        self.t0 = time.perf_counter()
        arrivals: list[float] = []
        main = asyncio.ensure_future(self._drive(arrivals))
        try:
            done, _ = await asyncio.wait({main}, timeout=self.spec.duration_s)
            if done:
                main.result()  # re-raise a fault of the driver itself
            else:  # the --duration limit: cancel what is in flight and let it unwind
                main.cancel()
                await asyncio.wait({main})
        finally:
            if not main.done():  # run() itself was cancelled
                main.cancel()
        wall = max(time.perf_counter() - self.t0, 1e-9)
        if self.progress:
            self.progress.update(len(self.results), self.failed, final=True)
        return RunOutcome(self.results, wall, self.sent, self.cancelled, ds.num_turns(self.conversations) - self.sent,
                          self.max_in_flight, arrivals)

    async def _drive(self, arrivals: list[float]) -> None:
        async with asyncio.TaskGroup() as tg:
            if self.spec.concurrency is not None:
                it = iter(self.conversations)
                for _ in range(min(self.spec.concurrency, len(self.conversations))):
                    tg.create_task(self._worker(it))
                return
            gate = asyncio.Semaphore(self.spec.max_concurrency) if self.spec.max_concurrency else None
            arrivals.extend(poisson_offsets(self.spec.request_rate or math.inf, len(self.conversations),
                                            random.Random(self.spec.seed)))
            for conv, offset in zip(self.conversations, arrivals):
                while (delay := self.t0 + offset - time.perf_counter()) > 0:  # never early
                    await asyncio.sleep(delay)
                if self._budget_spent():
                    break
                tg.create_task(self._conversation(conv, gate))

    async def _worker(self, it: Any) -> None:
        for conv in it:  # one iterator shared by the workers: each conversation runs once
            await self._conversation(conv, None)

    def _budget_spent(self) -> bool:
        return self.spec.num_requests is not None and self.sent >= self.spec.num_requests

    async def _conversation(self, conv: ds.Conversation, gate: asyncio.Semaphore | None) -> None:
        history: str | tuple[int, ...] | None = None
        for k, turn in enumerate(conv.turns):
            async with gate if gate is not None else contextlib.nullcontext():
                if self._budget_spent():
                    return
                self.sent += 1
                prompt = turn.text if history is None else ds.concat(history, turn.text)
                result, answer = await self._request(conv, k, prompt, turn.output_len)
            self.results.append(result)
            self.failed += not result.ok
            if self.progress:
                self.progress.update(len(self.results), self.failed)
            if not result.ok:
                return
            history = ds.concat(prompt, answer)

    async def _request(self, conv: ds.Conversation, k: int, prompt: str | tuple[int, ...],
                       output_len: int) -> tuple[RequestResult, str | tuple[int, ...]]:
        opts = self.options
        seed = (opts.seed * 1_000_003 + conv.id * 1009 + k) % MAX_SEED if opts.temperature > 0 else None
        sent_at = time.perf_counter()
        res = RequestResult(conv.id, k, f"{self.id_prefix}-c{conv.id}-t{k}", sent_at - self.t0, 0.0)
        texts: list[str] = []
        ids: list[int] = []
        final = None
        last = sent_at
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            async with self.backend.stream(prompt, max_tokens=output_len, temperature=opts.temperature,
                                           ignore_eos=opts.ignore_eos, seed=seed, tier=opts.tier,
                                           request_id=res.request_id, timeout=opts.timeout_s) as stream:
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.token_ids or chunk.text:
                        if res.ttft_s is None:
                            res.ttft_s = now - sent_at
                        else:
                            res.itl_s.append(now - last)
                        last = now
                    texts.append(chunk.text)
                    ids.extend(chunk.token_ids)
                    if chunk.finish_reason is not None and final is None:
                        final = chunk
        except BackendError as exc:
            res.status, res.detail = exc.status, exc.detail
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except Exception as exc:  # a client-side fault must not end the whole run
            logger.warning("request %s failed in the client: %r", res.request_id, exc)
            res.status, res.detail = "CLIENT_ERROR", f"{type(exc).__name__}: {exc}"
        finally:
            self.in_flight -= 1
        res.e2e_s = time.perf_counter() - sent_at
        if res.ok:
            if final is None:
                res.status, res.detail = "NO_FINAL_CHUNK", "the stream ended without finish_reason"
            elif final.finish_reason in ("error", "abort"):
                res.status, res.detail = f"FINISH_{final.finish_reason.upper()}", final.stop_reason
            usage = final.usage if final is not None else None
            res.completion_tokens = usage.completion_tokens if usage else len(ids)
            res.prompt_tokens = usage.prompt_tokens if usage else 0
            res.cached_tokens = usage.cached_tokens if usage else 0
        return res, ("".join(texts) if isinstance(prompt, str) else tuple(ids))


def _truncate(convs: Sequence[ds.Conversation], num_requests: int | None) -> list[ds.Conversation]:
    """The shortest prefix of `convs` holding at least num_requests turns."""
    if num_requests is None:
        return list(convs)
    out, turns = [], 0
    for conv in convs:
        if turns >= num_requests:
            break
        out.append(conv)
        turns += len(conv.turns)
    return out


# ---------------------------------------------------------------- command line

_KINDS: dict[str, tuple[Any, Any, str]] = {
    "pos_int": (int, lambda v: v >= 1, "an integer >= 1"),
    "nonneg_int": (int, lambda v: v >= 0, "an integer >= 0"),
    "rate": (float, lambda v: v > 0, "a number > 0 or inf"),
    "pos_float": (float, lambda v: 0 < v < math.inf, "a finite number > 0"),
    "nonneg_float": (float, lambda v: 0 <= v < math.inf, "a finite number >= 0"),
}


def _flag_type(kind: str):
    """An argparse type; argparse prefixes its error with the flag ('argument --x: must be ...')."""
    convert, ok, what = _KINDS[kind]

    def parse(text: str) -> Any:
        try:
            value = convert(text.strip())
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


def _list_of(kind: str):
    one = _flag_type(kind)

    def parse(text: str) -> list[Any]:
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"must be a comma-separated list, got {text!r}")
        return [one(t) for t in items]
    return parse


def _range(lowest: int):
    """An argparse type for 'N' or 'MIN:MAX' (inclusive) with lowest <= MIN <= MAX."""
    def parse(text: str) -> tuple[int, int]:
        parts = text.split(":")
        try:
            lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (lowest - 1, 0)
        except ValueError:
            lo, hi = lowest - 1, 0
        if lo < lowest or hi < lo:
            raise argparse.ArgumentTypeError(f"must be N or MIN:MAX with {lowest} <= MIN <= MAX, got {text!r}")
        return lo, hi
    return parse


def _tier(text: str) -> Tier:
    try:
        return Tier.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be interactive, standard or batch, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench", description="Load benchmark against a running Tandem gateway "
                                "or any OpenAI-compatible server.")
    p.add_argument("--target", default="127.0.0.1:50051",
                   help="grpc: gateway HOST:PORT; openai: base URL (http://HOST:PORT/v1) or HOST:PORT")
    p.add_argument("--backend", choices=BACKENDS, default="grpc",
                   help="grpc: Tandem's gRPC API; openai: streaming /v1/completions of any OpenAI-compatible server")
    p.add_argument("--model", default=None, help="openai: the model to request (default: the first /v1/models lists)")
    p.add_argument("--api-key", default=None,
                   help="the server's API key (a bearer token); @FILE reads it (default: $TANDEM_API_KEY)")
    p.add_argument("--tls-ca", default=None, help="grpc: PEM CA that signed the gateway's certificate (uses TLS)")
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", choices=ds.DATASETS, default="random")
    d.add_argument("--num-requests", type=_flag_type("pos_int"), default=None,
                   help="requests for random/sharegpt-like (default 100); a cap on requests sent otherwise")
    d.add_argument("--input-len", type=_range(1), default=None,
                   help="N or MIN:MAX; random: prompt length (default 512), sharegpt-like: clip range (4:2048)")
    d.add_argument("--output-len", type=_range(1), default=None,
                   help="N or MIN:MAX max_tokens; random: default 128, sharegpt-like: clip 4:1024, others: N (128)")
    d.add_argument("--groups", type=_flag_type("pos_int"), default=8, help="shared-prefix: prompt groups")
    d.add_argument("--prompts-per-group", type=_flag_type("pos_int"), default=16, help="shared-prefix")
    d.add_argument("--system-prompt-len", type=_flag_type("nonneg_int"), default=None,
                   help="shared-prefix: shared system prompt length (default 1024); multi-turn: optional (0)")
    d.add_argument("--question-len", type=_flag_type("pos_int"), default=128, help="shared-prefix, multi-turn")
    d.add_argument("--conversations", type=_flag_type("pos_int"), default=16, help="multi-turn")
    d.add_argument("--turns", type=_flag_type("pos_int"), default=4, help="multi-turn: turns per conversation")
    d.add_argument("--prompt-format", choices=ds.PROMPT_FORMATS, default="text",
                   help="text: random words (~1 token each for BPE); tokens: random token ids (exact lengths)")
    d.add_argument("--token-range", type=_range(0), default=None,
                   help="tokens format: ids drawn from MIN:MAX (default 0 .. the server's vocab_size-1, minus EOS)")
    d.add_argument("--seed", type=_flag_type("nonneg_int"), default=0,
                   help="dataset and arrival seed; sweep point i uses seed+i so earlier points' cache doesn't help")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=_list_of("pos_int"), default=None,
                      help="fixed concurrency, or a comma list to sweep (1,8,32)")
    load.add_argument("--request-rate", type=_list_of("rate"), default=None,
                      help="Poisson arrivals per second (inf = all at once), or a comma list to sweep; default inf")
    load.add_argument("--max-concurrency", type=_flag_type("pos_int"), default=None,
                      help="with --request-rate: cap on requests in flight")
    load.add_argument("--duration", type=_flag_type("pos_float"), default=None,
                      help="hard limit per run in seconds; requests in flight then are cancelled")
    load.add_argument("--warmup", type=_flag_type("nonneg_int"), default=1,
                      help="requests sent (from a separate dataset) before measuring; not reported")
    req = p.add_argument_group("requests")
    req.add_argument("--tier", type=_tier, default=Tier.STANDARD, help="interactive, standard or batch")
    req.add_argument("--temperature", type=_flag_type("nonneg_float"), default=0.0)
    req.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                     help="let EOS end requests early (default: ignore it, so output lengths are exact)")
    req.add_argument("--timeout", type=_flag_type("pos_float"), default=None, help="per-request deadline, seconds")
    out = p.add_argument_group("report")
    out.add_argument("--slo-ttft-ms", type=_flag_type("pos_float"), default=None, help="goodput: TTFT target")
    out.add_argument("--slo-tpot-ms", type=_flag_type("pos_float"), default=None, help="goodput: TPOT target")
    out.add_argument("--out", default=None, help="write the results as JSON to this file")
    out.add_argument("--per-request", action="store_true", help="include every request's timings in --out")
    out.add_argument("--plot-dir", default=None, help="write PNG plots here (needs matplotlib)")
    out.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar on stderr")
    out.add_argument("--baseline", default=None, metavar="FILE",
                     help="compare with a saved --out file; exit 3 naming each metric that regressed")
    out.add_argument("--tolerance", type=_flag_type("nonneg_float"), default=DEFAULT_TOLERANCE_PCT, metavar="PCT",
                     help="--baseline: allowed regression per metric, percent (default %(default)g)")
    out.add_argument("--compare-only", default=None, metavar="RESULTS",
                     help="with --baseline: compare this saved --out file instead of running load")
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[LoadSpec]:
    """Cross-flag checks (p.error exits 2 naming the flags); returns one LoadSpec per run."""
    if a.concurrency is not None and a.request_rate is not None:
        p.error("--concurrency and --request-rate: choose one")
    if a.max_concurrency is not None and a.concurrency is not None:
        p.error("--max-concurrency: only with --request-rate (--concurrency already fixes it)")
    if a.dataset in ("shared-prefix", "multi-turn") and a.output_len and a.output_len[0] != a.output_len[1]:
        p.error(f"--output-len: {a.dataset} takes a single length, got a range")
    if a.dataset == "shared-prefix" and a.system_prompt_len == 0:
        p.error("--system-prompt-len: shared-prefix needs a system prompt of length >= 1")
    if a.input_len is not None and a.dataset in ("shared-prefix", "multi-turn"):
        p.error(f"--input-len: not used by {a.dataset} (see --system-prompt-len and --question-len)")
    if a.token_range is not None and a.prompt_format != "tokens":
        p.error("--token-range: only with --prompt-format tokens")
    if a.compare_only is not None and a.baseline is None:
        p.error("--compare-only: needs --baseline")
    if a.backend == "openai" and a.prompt_format == "tokens":
        if a.token_range is None:
            p.error("--token-range: --backend openai with --prompt-format tokens needs it (the server's "
                    "vocabulary size is not known over HTTP)")
        if a.dataset == "multi-turn":
            p.error("--prompt-format: --backend openai streams text, so multi-turn needs --prompt-format text")
    if a.model is not None and a.backend != "openai":
        p.error("--model: only with --backend openai")
    if a.concurrency is not None:
        return [LoadSpec(concurrency=c, num_requests=a.num_requests, duration_s=a.duration, seed=a.seed + i)
                for i, c in enumerate(a.concurrency)]
    return [LoadSpec(request_rate=r, max_concurrency=a.max_concurrency, num_requests=a.num_requests,
                     duration_s=a.duration, seed=a.seed + i) for i, r in enumerate(a.request_rate or [math.inf])]


def build_dataset(a: argparse.Namespace, vocab: ds.Vocab, seed: int) -> list[ds.Conversation]:
    """The conversations the flags in `a` describe, drawn with `seed`."""
    out_n = a.output_len[0] if a.output_len else 128
    if a.dataset == "random":
        return ds.random_dataset(a.num_requests or 100, a.input_len or (512, 512), a.output_len or (128, 128),
                                 vocab, seed)
    if a.dataset == "sharegpt-like":
        return ds.sharegpt_like_dataset(a.num_requests or 100, vocab, seed, input_clip=a.input_len or (4, 2048),
                                        output_clip=a.output_len or (4, 1024))
    if a.dataset == "shared-prefix":
        return ds.shared_prefix_dataset(a.groups, a.prompts_per_group, a.system_prompt_len or 1024,
                                        a.question_len, out_n, vocab, seed)
    return ds.multi_turn_dataset(a.conversations, a.turns, a.question_len, out_n, vocab, seed,
                                 system_prompt_len=a.system_prompt_len or 0)


async def _vocab(info: ServerInfo, a: argparse.Namespace) -> ds.Vocab:
    if a.prompt_format == "text":
        return ds.Vocab("text")
    if a.token_range:
        lo, hi = a.token_range
    elif info.vocab_size is not None:
        lo, hi = 0, info.vocab_size - 1
    else:
        raise ValueError("--token-range: the server's vocabulary size is unknown; give the range")
    return ds.Vocab("tokens", low=lo, high=hi + 1, exclude=frozenset(info.eos_token_ids))


async def _bench(a: argparse.Namespace, specs: list[LoadSpec], argv: Sequence[str]) -> int:
    options = RequestOptions(tier=a.tier, temperature=a.temperature, ignore_eos=a.ignore_eos,
                             timeout_s=a.timeout, seed=a.seed)
    slo = SLO(a.slo_ttft_ms, a.slo_tpot_ms)
    runs: list[dict[str, Any]] = []
    per_run_results: list[list[RequestResult]] = []
    try:
        backend = make_backend(a.backend, a.target, a.model, load_api_key(a.api_key), a.tls_ca)
    except ValueError as exc:  # an unreadable --api-key @FILE
        print(f"tandem bench: {exc}", file=sys.stderr)
        return 2
    except BackendError as exc:
        print(f"tandem bench: {exc.detail}", file=sys.stderr)
        return 2
    async with backend:
        try:
            info = await backend.info(a.timeout or 30.0)
            vocab = await _vocab(info, a)
        except (BackendError, ValueError) as exc:
            print(f"tandem bench: cannot reach {a.target} ({a.backend}): {exc}", file=sys.stderr)
            return 1
        if a.warmup:
            warm = [ds.Conversation(c.id, c.turns[:1]) for c in build_dataset(a, vocab, a.seed + 1_000_003)]
            spec = LoadSpec(concurrency=min(a.warmup, 16), num_requests=a.warmup, duration_s=a.duration)
            outcome = await LoadRun(backend, warm, spec, options, id_prefix=f"warmup-{secrets.token_hex(4)}").run()
            if outcome.results and not any(r.ok for r in outcome.results):
                first = outcome.results[0]
                print(f"tandem bench: every warmup request failed ({first.status}: {first.detail})", file=sys.stderr)
                return 1
        for spec in specs:
            convs = build_dataset(a, vocab, spec.seed)
            progress = Progress(spec.label, min(ds.num_turns(convs), spec.num_requests or math.inf),
                                enabled=a.progress)
            outcome = await LoadRun(backend, convs, spec, options, progress=progress).run()
            summary = summarize(outcome.results, outcome.wall_s, slo, cancelled=outcome.cancelled,
                                skipped=outcome.skipped, max_in_flight=outcome.max_in_flight)
            run = {"label": spec.label, "concurrency": spec.concurrency, "request_rate": spec.request_rate,
                   "max_concurrency": spec.max_concurrency, "seed": spec.seed, "summary": summary}
            if a.per_request:
                run["requests"] = [r.to_dict() for r in sorted(outcome.results, key=lambda r: r.start_s)]
            runs.append(run)
            per_run_results.append(outcome.results)
            print(format_run(f"{a.dataset} {spec.label}", summary), flush=True)
    if len(runs) > 1:
        print(format_sweep(runs))
    if a.out:
        config = {k: (v.name.lower() if isinstance(v, Tier) else v) for k, v in vars(a).items()}
        record = {"tool": "tandem bench", **run_record(info.model, a.backend, argv), "config": config, "runs": runs}
        with open(a.out, "w") as f:
            json.dump(_jsonable(record), f, indent=1, allow_nan=False)
            f.write("\n")
    if a.plot_dir:
        for path in write_plots(runs, per_run_results, a.plot_dir, title=f"{info.model} ({a.backend}, {a.dataset})"):
            print(f"plot: {path}")
    if not any(r.ok for rs in per_run_results for r in rs):
        return 1
    return _check_baseline(a, runs)


def run_record(model: str, backend: str, argv: Sequence[str]) -> dict[str, Any]:
    """What a results file records about the run: when (UTC, ISO 8601), the model, the backend,
    Tandem's version and the command line."""
    try:
        version = importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "model": model,
            "backend": backend, "version": version, "command": shlex.join(["tandem", "bench", *argv])}


def _check_baseline(a: argparse.Namespace, runs: Sequence[dict[str, Any]]) -> int:
    """0 without --baseline or when every metric is within --tolerance; 3 naming the regressions;
    2 when a file cannot be read."""
    if a.baseline is None:
        return 0
    try:
        base = load_results(a.baseline)
        comparisons = compare(runs, base["runs"], a.tolerance)
    except ValueError as exc:
        print(f"tandem bench: --baseline: {exc}", file=sys.stderr)
        return 2
    text, ok = baseline_report(comparisons, a.tolerance, a.baseline)
    print(text, flush=True)
    return 0 if ok else 3


def _jsonable(obj: Any) -> Any:
    """Strict JSON: non-finite floats (an inf request rate) become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tandem bench ARGS`: 0 on success, 1 when nothing completed, 2 on bad flags
    (or an unreadable --baseline), 3 when --baseline found a regression."""
    p_argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    try:
        a = p.parse_args(argv)
        specs = _check_args(p, a)
    except SystemExit as exc:  # argparse exits 2 on bad flags (naming them) and 0 on --help
        return int(exc.code or 0)
    if a.compare_only is not None:
        try:
            runs = load_results(a.compare_only)["runs"]
        except ValueError as exc:
            print(f"tandem bench: --compare-only: {exc}", file=sys.stderr)
            return 2
        return _check_baseline(a, runs)
    try:
        return asyncio.run(_bench(a, specs, p_argv))
    except KeyboardInterrupt:
        print("tandem bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""The `tandem bench` command line: the parser, each flag's type (a bad value exits 2 naming the
flag), and the cross-flag checks that turn the parsed flags into one `LoadSpec` per run.

Parsing only: nothing here reaches a server or builds a dataset (loadgen.command does).
"""
from __future__ import annotations

import argparse
import logging
import math
from typing import Any

from loadgen import datasets as ds
from loadgen.backends import BACKENDS
from loadgen.baseline import DEFAULT_TOLERANCE_PCT
from loadgen.schedule import LoadSpec
from tandem.types import Tier

logger = logging.getLogger(__name__)


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
    """Every `tandem bench` flag with its type, default and help; dataset defaults are applied
    by loadgen.command.build_dataset (None here means "the dataset's default")."""
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


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[LoadSpec]:
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

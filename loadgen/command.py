"""`tandem bench`: offer load to a running Tandem gateway (or any OpenAI-compatible server) and
report latency and throughput.

    tandem bench --target 127.0.0.1:50051 --dataset shared-prefix --groups 8 --prompts-per-group 16 \\
        --request-rate 1,2,4 --max-concurrency 64 --slo-ttft-ms 500 --slo-tpot-ms 50 --out bench.json
    tandem bench --backend openai --target http://127.0.0.1:8000/v1 --baseline bench.json --tolerance 10

`main` ties the parts together: the flags (loadgen.flags) give one LoadSpec per run; the
flags' dataset (built here, per run seed) goes through a warmup and then each run
(loadgen.run.LoadRun); loadgen.report prints the summaries, loadgen.results writes --out, and
loadgen.baseline decides the exit code under --baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import secrets
import sys
from collections.abc import Sequence
from typing import Any

from loadgen import datasets as ds
from loadgen.backends import BackendError, ServerInfo, make_backend
from loadgen.baseline import compare
from loadgen.baseline import report as baseline_report
from loadgen.flags import build_parser, check_args
from loadgen.report import SLO, Progress, RequestResult, format_run, format_sweep, summarize, write_plots
from loadgen.results import load_results, run_entry, write_results
from loadgen.run import LoadRun, RequestOptions
from loadgen.schedule import LoadSpec
from tandem.security import load_api_key

logger = logging.getLogger(__name__)


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
    """Text prompts, or token ids from --token-range (else the server's whole vocabulary), never EOS."""
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
    """The warmup, then one LoadRun per spec on one backend; the exit code main() documents."""
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
            runs.append(run_entry(spec, summary, outcome.results if a.per_request else None))
            per_run_results.append(outcome.results)
            print(format_run(f"{a.dataset} {spec.label}", summary), flush=True)
    if len(runs) > 1:
        print(format_sweep(runs))
    if a.out:
        write_results(a.out, runs, model=info.model, backend=a.backend, argv=argv, config=vars(a))
    if a.plot_dir:
        for path in write_plots(runs, per_run_results, a.plot_dir, title=f"{info.model} ({a.backend}, {a.dataset})"):
            print(f"plot: {path}")
    if not any(r.ok for rs in per_run_results for r in rs):
        return 1
    return _check_baseline(a, runs)


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of `tandem bench ARGS`: 0 on success, 1 when nothing completed, 2 on bad flags
    (or an unreadable --baseline), 3 when --baseline found a regression."""
    p_argv = list(sys.argv[1:] if argv is None else argv)
    p = build_parser()
    try:
        a = p.parse_args(argv)
        specs = check_args(p, a)
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

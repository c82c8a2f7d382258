"""Prefix-aware vs round-robin vs load-only prefill routing on a real cluster, in one run.

    python bench/prefix_routing_bench.py [--model stories|demo|DIR] [--groups 8] [--prompts-per-group 12]
        [--system-prompt-len 384] [--question-len 32] [--output-len 16] [--concurrency 8]

For each policy: start 4 prefill + 1 decode worker processes (cold caches) and a gateway
process (`tandem gateway --routing POLICY`), send the same generated shared-prefix workload
(loadgen.datasets: groups x prompts sharing a system prompt, short questions) through the SDK
(loadgen.run.LoadRun at fixed concurrency), then read: the prefill workers' prefix-cache hit
ratio (their Stats), throughput and TTFT P50/P99 (loadgen.report), and prompts computed per
prefill worker (the gateway's tandem_gateway_prefill_requests_total). Prints JSON and writes
bench/results/prefix_routing.json (or --out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from entrypoints.cluster import Cluster, ClusterProcess, free_port, worker_process  # noqa: E402
from loadgen import datasets as ds  # noqa: E402
from loadgen.report import summarize  # noqa: E402
from loadgen.run import LoadRun, RequestOptions  # noqa: E402
from loadgen.schedule import LoadSpec  # noqa: E402

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "load")
STORIES = REPO.parent / "shared" / "models" / "stories260K"
WAIT_S = 300.0


def resolve_model(name: str, work: Path) -> tuple[str, Path]:
    """("label", model directory) for stories (converted llama2.c stories260K), demo, or a path."""
    if name == "stories":
        from engine.convert.llama2c import convert_llama2c

        if not (STORIES / "stories260K.bin").is_file():
            raise SystemExit(f"--model stories: {STORIES}/stories260K.bin not found; use --model demo")
        return "stories260K", convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", work / "stories")
    if name == "demo":
        from engine.demo import demo_model_dir

        return "demo-llama (random, 4 layers, hidden 256)", demo_model_dir()
    path = Path(name)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {name}: no config.json there")
    return path.name, path


def gateway_process(model: Path, policy: str, prefill: list[str], decode: list[str],
                    log: Path) -> tuple[ClusterProcess, int]:
    """A gateway process on a free port, and its metrics port."""
    port, metrics_port = free_port(), free_port()
    argv = ["--model", str(model), "--port", str(port), "--metrics-port", str(metrics_port), "--routing", policy,
            "--log-level", "WARNING"]
    for a in prefill:
        argv += ["--prefill", a]
    for a in decode:
        argv += ["--decode", a]
    return ClusterProcess(f"gateway-{policy}", "gateway", argv, port, log_path=log), metrics_port


def prefill_counts(metrics_port: int) -> dict[str, int]:
    """Prompts computed per worker, from the gateway's Prometheus endpoint."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tandem_gateway_prefill_requests_total":
                out[s.labels["worker"]] = int(s.value)
    return out


async def drive(address: str, metrics_port: int, convs: list[ds.Conversation], warm: list[ds.Conversation],
                concurrency: int, prefill: list[Any]) -> dict[str, Any]:
    """Warm up, then run `convs`; what the measured part did (warm-up excluded)."""
    from tandem.client import AsyncClient

    async with AsyncClient(address) as client:
        spec = LoadSpec(concurrency=min(4, concurrency), num_requests=len(warm))
        await LoadRun(client, warm, spec, RequestOptions(), id_prefix="warmup").run()
        before, counts_before = [w.stats() for w in prefill], prefill_counts(metrics_port)
        outcome = await LoadRun(client, convs, LoadSpec(concurrency=concurrency), RequestOptions(),
                                id_prefix="measured").run()
        after, counts_after = [w.stats() for w in prefill], prefill_counts(metrics_port)
    hit = sum(a.prefix_hit_tokens - b.prefix_hit_tokens for a, b in zip(after, before))
    query = sum(a.prefix_query_tokens - b.prefix_query_tokens for a, b in zip(after, before))
    counts = {w.worker_id: counts_after.get(w.worker_id, 0) - counts_before.get(w.worker_id, 0) for w in prefill}
    summary = summarize(outcome.results, outcome.wall_s, max_in_flight=outcome.max_in_flight)
    return {"prefill_hit_ratio": hit / query if query else None, "summary": summary,
            "prefill_tokens_computed": query - hit, "counts": counts}


def run_policy(policy: str, model: Path, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from tandem.client import Client

    flags = ["--num-kv-blocks", str(a.num_kv_blocks), "--max-running", str(a.max_running)]
    workers = work / f"workers-{policy}"
    workers.mkdir(parents=True, exist_ok=True)
    prefill = [worker_process(f"prefill{i}", "prefill", model, workers, [*flags, "--worker-id", f"prefill-{i}"])
               for i in range(a.prefill_workers)]
    decode = [worker_process(f"decode{a.prefill_workers}", "decode", model, workers,
                             [*flags, "--worker-id", "decode-0"])]
    cluster = Cluster([*prefill, *decode])
    cluster.start(timeout=WAIT_S)
    try:
        gw, metrics_port = gateway_process(model, policy, [w.address for w in prefill], [w.address for w in decode],
                                           work / f"gateway-{policy}.log")
        address = cluster.add(gw, timeout=WAIT_S).address
        with Client(address) as c:
            info = c.model_info(timeout=30)
        vocab = ds.Vocab("tokens", low=0, high=info.vocab_size, exclude=frozenset(info.eos_token_ids))
        convs = ds.shared_prefix_dataset(a.groups, a.prompts_per_group, a.system_prompt_len, a.question_len,
                                         a.output_len, vocab, a.seed)
        warm = ds.random_dataset(4, (a.question_len, a.question_len), (2, 2), vocab, a.seed + 1)
        result = asyncio.run(drive(address, metrics_port, convs, warm, a.concurrency, prefill))
        counts, s = result["counts"], result["summary"]
        per_worker = sorted(counts.values())
        return {
            "prefill_hit_ratio": round(result["prefill_hit_ratio"], 4),
            "usage_cache_hit_rate": round(s["cache_hit_rate"], 4) if s["cache_hit_rate"] is not None else None,
            "prefill_tokens_computed": result["prefill_tokens_computed"],
            "request_throughput": round(s["request_throughput"], 3),
            "output_token_throughput": round(s["output_token_throughput"], 2),
            "ttft_ms": {"p50": _r(s["ttft_ms"]["p50"]), "p99": _r(s["ttft_ms"]["p99"])},
            "e2e_ms": {"p50": _r(s["e2e_ms"]["p50"]), "p99": _r(s["e2e_ms"]["p99"])},
            "requests_per_prefill_worker": counts,
            "busiest_over_idlest": round(per_worker[-1] / per_worker[0], 2) if per_worker[0] else None,
            "completed": s["requests"]["completed"],
            "failed": s["requests"]["failed"],
            "duration_s": round(s["duration_s"], 2),
        }
    finally:
        cluster.stop(30)


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="stories", help="stories (default), demo, or a model directory")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--prefill-workers", type=int, default=4)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=12)
    p.add_argument("--system-prompt-len", type=int, default=384)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "prefix_routing.json"))
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    policies = [x for x in a.policies.split(",") if x]
    for x in policies:
        if x not in POLICIES:
            p.error(f"--policies: unknown policy {x!r}; known: {', '.join(POLICIES)}")
    results: dict[str, Any] = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "workload": {"dataset": "shared-prefix (token ids)", "groups": a.groups,
                     "prompts_per_group": a.prompts_per_group, "system_prompt_len": a.system_prompt_len,
                     "question_len": a.question_len, "output_len": a.output_len, "concurrency": a.concurrency,
                     "seed": a.seed},
        "cluster": {"prefill_workers": a.prefill_workers, "decode_workers": 1, "device": "cpu",
                    "num_kv_blocks": a.num_kv_blocks, "gateway": "separate process, embedded prefix index"},
        "policies": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        label, model = resolve_model(a.model, work)
        results["model"] = label
        for policy in policies:
            print(f"running {policy} ...", file=sys.stderr, flush=True)
            results["policies"][policy] = run_policy(policy, model, a, work)
            print(json.dumps({policy: results["policies"][policy]}), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

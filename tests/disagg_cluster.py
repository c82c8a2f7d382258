"""A prefill and a decode worker process behind a gateway (bench/multi_gpu_bench.Cluster, CPU),
driven with a few greedy prompts: what the transport tests use to check a transport end to end."""
from __future__ import annotations

from pathlib import Path

WAIT_S = 30.0


def greedy_through_cluster(tmp_path: Path, kv_transport: str) -> tuple[list[list[int]], list[list[int]], str]:
    """(tokens through the cluster, tokens of the offline engine, the decode worker's log) for
    the same prompts on a tiny random llama, KV moved by `kv_transport`."""
    from bench.multi_gpu_bench import Cluster, build_parser
    from engine import LLM
    from engine.demo import make_random_model
    from tandem import Client
    from tandem.types import SamplingParams

    model = make_random_model(tmp_path / "m", "llama", seed=5)
    args = build_parser().parse_args(["goodput", "--device", "cpu", "--max-model-len", "256"])
    args.kv_transport = kv_transport  # the workers take any registered transport by name
    prompts = [[256, *range(40, 40 + n)] for n in (3, 20, 37)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(str(model), device="cpu", num_kv_blocks=32).generate(prompts, params)]
    cluster = Cluster("disagg", args, str(model), "auto", tmp_path)
    try:
        cluster.wait_healthy(120.0)
        with Client(cluster.target, timeout=WAIT_S) as client:
            got = [client.generate(p, params=params).token_ids for p in prompts]
    finally:
        cluster.stop()
    return got, expected, next(tmp_path.glob("decode-*.log")).read_text()

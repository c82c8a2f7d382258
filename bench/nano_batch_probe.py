"""Does a full decode batch gain from two halves on two streams (engine/nano_batch.py)? One graph
each, replayed on the same inputs (Llama-3.1-8B shape, dummy weights, every sequence at `--ctx`
tokens on distinct blocks of random K/V):

- plain: the model's forward (what the decode graphs capture today);
- halves: the two halves one after the other on one stream (what splitting alone costs: each
  GEMM at half the rows, every weight read twice);
- overlapped: the halves on two streams, one half's attention beside the other's GEMMs;
- overlapped_carveoutN (--carveout N): overlapped, with cuBLAS told to leave N SMs free for
  the attention beside it;
- overlapped_greenN (--green N): overlapped, the attention stream in a CUDA green context of N
  SMs, so that the GEMMs have the others to themselves (eager too; a graph keeps the context
  where the driver captures it).

`eager_ms` times plain and overlapped without a graph too: a graph replays every node at its
launch stream's priority, so only eager steps see the GEMM stream's higher priority.

Prints and writes a JSON row per configuration: ms a replay of each graph, plain's ms over
each other variant's (`plain_over_<variant>`, > 1: faster than plain), the fastest overlapped
variant, and how far the overlapped step's hidden states and greedy tokens are from the plain
step's (the GEMMs' accumulation order differs at half the rows). A variant that fails is
recorded under `errors` and the others are still measured.

    python3 bench/nano_batch_probe.py --out $OUT/nano_batch.json                   # the three configurations below
    python3 bench/nano_batch_probe.py --config fp8:fp8:512:1536 --config bf16:auto:384:1536
    python3 bench/nano_batch_probe.py --config fp8:fp8:512:1536 --green 99 --green 110 --carveout 22

A configuration is WEIGHTS:KV:BATCH:CTX (weights bf16 or fp8, KV auto or fp8). Needs a CUDA
device; one H200 runs the defaults in about a minute and a half.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The offline rows' decode steps: FP8 weights + KV at 512 rows, bf16 weights + FP8 KV at 512, bf16 at 384.
DEFAULT_CONFIGS = ("fp8:fp8:512:1536", "bf16:fp8:512:1536", "bf16:auto:384:1536")
DEFAULT_CARVEOUTS = (33, 66)  # a quarter and a half of an H200's 132 SMs
# SMs of the green contexts the attention keeps to: none unless asked (--green 99: three quarters),
# since a green context a driver mishandles may break the process's CUDA context for what follows.
DEFAULT_GREENS: tuple[int, ...] = ()


def carved(sms: int, forward):
    """`forward` with cuBLAS(Lt)'s GEMMs told to leave `sms` SMs free (torch's experimental
    carveout, read as each GEMM is launched: a graph keeps what its capture chose)."""
    def run():
        before = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(sms)
        try:
            return forward()
        finally:
            torch._C._set_sm_carveout_experimental(before)

    return run


def green_streams(dev: torch.device, sms: int):
    """engine.nano_batch.Streams whose attention stream belongs to a CUDA green context of `sms`
    SMs (torch.cuda.green_contexts): the attention then keeps to those SMs and the GEMMs have the
    rest to themselves. Raises where torch or the driver has no green contexts."""
    from torch.cuda.green_contexts import GreenContext

    from engine.nano_batch import Streams

    streams = Streams(dev)
    green = GreenContext.create(num_sms=sms, device_id=dev.index if dev.index is not None else 0)
    streams.attn, streams.green = green.Stream(), green  # the context lives as long as its stream is used
    return streams


def parse_config(text: str) -> tuple[str, str, int, int]:
    """WEIGHTS:KV:BATCH:CTX -> (weights, kv, batch, ctx); ArgumentTypeError naming what is wrong."""
    parts = text.split(":")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(f"--config: expected WEIGHTS:KV:BATCH:CTX, got {text!r}")
    weights, kv, batch, ctx = parts
    if weights not in ("bf16", "fp8"):
        raise argparse.ArgumentTypeError(f"--config: weights must be bf16 or fp8, got {weights!r}")
    if kv not in ("auto", "fp8"):
        raise argparse.ArgumentTypeError(f"--config: KV must be auto or fp8, got {kv!r}")
    try:
        b, c = int(batch), int(ctx)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--config: BATCH and CTX must be integers, got {text!r}") from None
    if b < 2 or c < 1:
        raise argparse.ArgumentTypeError(f"--config: BATCH must be >= 2 and CTX >= 1, got {text!r}")
    return weights, kv, b, c


def probe(model_dir: Path, weights: str, kv: str, batch: int, ctx: int, carveouts: tuple[int, ...] = (),
          greens: tuple[int, ...] = ()) -> dict:
    from engine import LLM
    from engine.attention import AttentionMetadata
    from engine.cuda_graphs import capture_graph, time_each
    from engine.nano_batch import Streams, overlapped_forward

    block_size = 16
    per_seq = -(-ctx // block_size)
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_running=batch, max_model_len=ctx + 64,
              num_kv_blocks=batch * per_seq + 8, kv_cache_dtype=kv, quantization="fp8" if weights == "fp8" else None,
              cuda_graphs=False, warm_up=False, enable_prefix_cache=False, block_size=block_size)
    runner = llm.engine.runner
    model, layers = runner.model, runner.kv_cache.layers
    dev = layers[0][0].device
    for k, v in layers:  # random contexts (values of the size real K/V have)
        for t in (k, v):
            if t.dtype == torch.float8_e4m3fn:
                t.copy_(torch.randn(t.shape, device=dev, dtype=torch.bfloat16))
            else:
                t.normal_()
    blocks = torch.randperm(batch * per_seq, device=dev).to(torch.int32).view(batch, per_seq)
    last = ctx - 1
    meta = AttentionMetadata(
        slot_mapping=(blocks[:, last // block_size].long() * block_size + last % block_size),
        block_tables=blocks, query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=dev), is_decode=True,
        k_scale=runner.kv_cache.k_scale, v_scale=runner.kv_cache.v_scale)
    ids = torch.randint(0, model.config.vocab_size, (batch,), device=dev)
    pos = torch.full((batch,), last, dtype=torch.int64, device=dev)
    runs, outs, errors = {}, {}, {}
    with torch.inference_mode():
        streams = Streams(dev)
        overlapped = lambda streams=streams: overlapped_forward(model, ids, pos, layers, meta, streams)  # noqa: E731
        variants = {
            "plain": lambda: model(ids, pos, layers, meta),
            "halves": lambda: overlapped_forward(model, ids, pos, layers, meta, Streams(dev, parallel=False)),
            "overlapped": overlapped,
        }
        eager = {"plain": variants["plain"], "overlapped": overlapped}
        if dev.type == "cuda":
            for sms in carveouts:
                variants[f"overlapped_carveout{sms}"] = carved(sms, overlapped)
            for sms in greens:  # last: a capture that fails here leaves the others measured
                try:
                    eager[f"overlapped_green{sms}"] = partial(overlapped, green_streams(dev, sms))
                    variants[f"overlapped_green{sms}"] = eager[f"overlapped_green{sms}"]
                except Exception as exc:  # a torch or driver without green contexts
                    errors[f"overlapped_green{sms}"] = f"{type(exc).__name__}: {exc}"[:300]
            pool = None
            for name, forward in variants.items():
                try:
                    graph, outs[name] = capture_graph(forward, pool)
                except Exception as exc:  # record and go on: the other variants still say something
                    errors[name] = f"{type(exc).__name__}: {exc}"[:300]
                    continue
                pool = pool or graph.pool()
                runs[name] = graph.replay
            torch.cuda.synchronize()
            ms = time_each(runs)
            # Eager, where the GEMM stream's priority holds (a graph replays at its launch stream's).
            eager_runs = {}
            for name, forward in eager.items():
                try:
                    forward()
                    torch.cuda.synchronize()
                    eager_runs[name] = forward
                except Exception as exc:
                    errors[name + "_eager"] = f"{type(exc).__name__}: {exc}"[:300]
            eager_ms = time_each(eager_runs)
            for run in runs.values():  # the outputs of one replay each, on the same cache
                run()
            torch.cuda.synchronize()
        else:  # a tiny model on a CPU (the tests): eager, timed once each, for the row's shape
            ms, eager_ms = {}, {}
            for name, forward in variants.items():
                t = time.perf_counter()
                outs[name] = forward()
                ms[name] = (time.perf_counter() - t) * 1e3
        row = {"weights": weights, "kv": kv, "batch": batch, "ctx": ctx, "ms": {k: round(v, 3) for k, v in ms.items()},
               "eager_ms": {k: round(v, 3) for k, v in eager_ms.items()}}
        for name in ms:
            if name != "plain" and "plain" in ms:
                row[f"plain_over_{name}"] = round(ms["plain"] / ms[name], 3)
        timed = [k for k in ms if k.startswith("overlapped")]
        row["best_overlapped"] = min(timed, key=ms.__getitem__) if timed else None
        if "plain" in outs and "overlapped" in outs:
            plain, over = outs["plain"].float(), outs["overlapped"].float()
            row["hidden_rel_diff"] = float(f"{((over - plain).norm() / plain.norm()).item():.2e}")
            same = model.logits(outs["overlapped"]).argmax(-1) == model.logits(outs["plain"]).argmax(-1)
            row["greedy_same"] = round(same.float().mean().item(), 4)
        if errors:
            row["errors"] = errors
    del llm, runner, runs, outs
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", type=parse_config, default=None,
                   help="WEIGHTS:KV:BATCH:CTX, repeatable (default: %s)" % ", ".join(DEFAULT_CONFIGS))
    p.add_argument("--out", default=None, help="write the rows here as JSON")
    p.add_argument("--green", type=int, action="append", default=None, metavar="SMS",
                   help="also time overlapped steps whose attention keeps to a green context of SMS SMs "
                        "(repeatable; default: none; run it after the others, in a call of its own)")
    p.add_argument("--carveout", type=int, action="append", default=None, metavar="SMS",
                   help="also time the overlapped step with cuBLAS told to leave SMS SMs free (its GEMMs run on "
                        "the rest; repeatable; default: %s)" % ", ".join(map(str, DEFAULT_CARVEOUTS)))
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a Hugging Face model directory instead of the Llama-3.1-8B shape (dummy weights either "
                        "way); without a CUDA device a tiny one runs eagerly, as the tests do")
    a = p.parse_args(argv)
    if a.model is not None and not (Path(a.model) / "config.json").is_file():
        p.error(f"--model: no config.json in {a.model}")
    if not torch.cuda.is_available() and a.model is None:
        print("nano_batch_probe: needs a CUDA device (or --model, a tiny model to run on the CPU)", file=sys.stderr)
        return 2
    from bench.h200_bench import LLAMA31_8B, write_model

    configs = a.config or [parse_config(c) for c in DEFAULT_CONFIGS]
    a.carveout = DEFAULT_CARVEOUTS if a.carveout is None else a.carveout
    if any(not 0 < c < 128 for c in a.carveout):
        p.error(f"--carveout: SMs to leave free must be in [1, 127], got {a.carveout}")
    a.green = DEFAULT_GREENS if a.green is None else a.green
    if any(c < 1 for c in a.green):
        p.error(f"--green: a green context needs at least 1 SM, got {a.green}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="nano-batch-") as tmp:
        model_dir = Path(a.model) if a.model else write_model(Path(tmp) / "llama31-8b", LLAMA31_8B)
        for weights, kv, batch, ctx in configs:
            t = time.time()
            try:
                row = probe(model_dir, weights, kv, batch, ctx, tuple(a.carveout), tuple(a.green))
            except Exception as exc:  # record and go on: one configuration's failure must not hide the others
                row = {"weights": weights, "kv": kv, "batch": batch, "ctx": ctx,
                       "error": f"{type(exc).__name__}: {exc}"[:500]}
            row["wall_s"] = round(time.time() - t, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(["python3", "bench/nano_batch_probe.py", *(sys.argv[1:] if argv is None else argv)])
        Path(a.out).write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

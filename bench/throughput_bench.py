"""The throughput issue's table in one command: every row measured on one GPU and written to
`bench/results/h200_throughput.json` (Llama-3.1-8B shape, dummy weights).

Two device calls, each under 9 minutes on one H200 (the device's limit is 10 per command):

    # A: ceilings, batch-1 decode (ours and the gpt-fast peer), offline bf16 / FP8 KV / FP8 weights + KV
    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 bench/throughput_bench.py --only A --out $OUT/h200_throughput.json
    # B: `tandem up` disaggregated and colocated vs offline (same 512 prompts), online 2 req/s, max rate
    # in the SLO; the services need pyzmq, redis and grpcio-health/-reflection: carry .whl, as for
    # h200_bench's services section
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site python3 bench/throughput_bench.py --only B \
        --merge bench/results/h200_throughput.json --out $OUT/h200_throughput.json --log-dir $OUT/logs

(copy call A's file to bench/results/h200_throughput.json before call B; `--merge` keeps its
sections and the summary is recomputed over both.) `--dry-run` prints the sections, their
groups and budgets and exits; `--only` / `--skip` take section names or the groups A, B and S.

Sections by group (their budgets and expected seconds: --dry-run):
- A: ceilings (device copy GB/s, bf16 and FP8 matmul TFLOP/s), decode_b1 (bench/h200_bench.py's
  batch-1 decode against the weight-read floor), offline_bf16, offline_fp8kv, offline_fp8 (FP8
  weights + FP8 KV; each 1000 x 1024/1024 through h200_bench's `offline`, max_running derived as
  `LLM(...)` derives it), gptfast (bench/gptfast_peer.py: the same prompt and step counts as
  decode_b1, on the same dummy weights).
- B: services (`tandem up`, its defaults: P + D on one GPU; 512 x 1024/1024 through the SDK, as
  bench/up_bench.py runs it), online (`tandem bench` Poisson 2 req/s, 1024/256, on that cluster),
  max_rate (Poisson rates upwards until TTFT P99 > 500 ms or TPOT P99 > 25 ms or a request fails,
  then bisection), colocated and online_colocated (the same on `tandem up --colocated`),
  offline_subset (the offline engine with its defaults on the same 512 prompts, bench/up_bench.py).
- S (batch 1 and small batches, BENCHMARKS.md §28's changes each against the default in one run):
  gpu_parity (h200_bench's), decode_b1, decode_b1_attn_prefetch (decode attention's first tile
  before the PDL wait), gemv_sweep and gemv_sweep_fp8 (fused GEMV tilings vs cuBLAS(Lt) at the
  four weights on cold weights, 1 and 2 rows; the fused sections take their fastest, the FP8
  sections the FP8 sweep's), decode_b1_fused_qkv_o and decode_b1_fused_qkv_o_down (those
  projections as fused GEMVs with the sweep's fastest tilings), decode_b4 (4 sequences: the
  online TPOT's batch) and its attn_prefetch and fused_qkv_o variants. `small_batch` in the JSON (and lines printed
  before the table) holds each variant's ms and its ratio to its batch's default.
- Not in a group: env (versions, device; needs no GPU), max_rate_colocated.

Each GPU section runs in its own child process (a fresh CUDA context; killed with its process
group at its budget); cluster sections run here, reusing one running `tandem up` across
consecutive sections of the same mode. A failing section is recorded ({"error", "trace"}) and the
others run; the JSON is rewritten after every section; a table of the summary keys against the
issue's goals is printed last. Exit 0 when every section ran without error, else 1; 2 on bad flags.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

logger = logging.getLogger(__name__)

# Each GPU's ceilings as this bench's `ceilings` section measured them (H200: §37's run; H100: §43's),
# used only by a run that has none measured on its own GPU: its fractions are then marked "assumed".
KNOWN_CEILINGS = {
    "H200": {"copy_GBps": 4240.8, "matmul_bf16_TFLOPs": 763.5, "matmul_fp8_TFLOPs": 1343.0},
    "H100": {"copy_GBps": 3024.7, "matmul_bf16_TFLOPs": 792.6, "matmul_fp8_TFLOPs": 1439.6},
}
B1_PROMPT = list(range(100, 228))  # decode_b1's prompt (bench/h200_bench.py)
B1_WARMUP, B1_STEPS = 5, 200


def log(*a: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


@dataclass(frozen=True)
class Section:
    """One measured part. `where`: "child" (GPU work in a child process), "cluster" (against a
    `tandem up` this process runs) or "local" (here, no GPU). `fn(ctx)` returns a JSON-able dict."""

    name: str
    group: str  # "A", "B" or "" (only when named)
    budget_s: float
    expect_s: float  # on one H200 (BENCHMARKS §7, §8; the gpt-fast compile is a guess)
    where: str
    fn: Callable[["Context"], dict]
    what: str


@dataclass
class Context:
    args: argparse.Namespace
    model_dir: Path
    work: Path
    ceilings: dict
    deadline: float  # time.time() by which the section must end
    clusters: "Clusters | None" = None
    earlier: dict = dataclasses.field(default_factory=dict)  # the results so far (a later section may read one)

    def left(self) -> float:
        return self.deadline - time.time()

    @property
    def vocab_size(self) -> int:
        from bench.up_bench import vocab_size

        return vocab_size(self.model_dir)


# ---------------------------------------------------------------- GPU sections (child processes)

def _need_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("this section needs a CUDA device")


def this_gpu_name() -> str | None:
    """The name of the GPU the sections will run on (device 0 as CUDA_VISIBLE_DEVICES maps it), from
    nvidia-smi so that this parent never opens a CUDA context; None without one."""
    from entrypoints.placement import physical_gpus
    from entrypoints.nvidia_smi import name

    return name(physical_gpus((0,)))


def run_ceilings_for(measured: Any, gpu: str | None) -> dict:
    """The ceilings a section's fractions are read against: those `ceilings` measured (in this run
    or the merged file) when they were measured on this GPU (or its name is unknown), else
    KNOWN_CEILINGS for its kind, marked "assumed" with the reason (an H100 run that merged an
    H200 file, say, would otherwise read its fractions against the H200's copy speed)."""
    from tandem_kernels.gpu_family import family_of

    has_copy = isinstance(measured, dict) and "copy_GBps" in measured
    if has_copy and (gpu is None or measured.get("device") == gpu):
        return measured
    kind = family_of(gpu, KNOWN_CEILINGS) or "H200"
    why = f"ceilings measured on {measured.get('device')}" if has_copy else "no ceilings measured"
    return {**KNOWN_CEILINGS[kind], "device": gpu,
            "assumed": f"{why} for this GPU ({gpu or 'unknown'}): {kind}'s from an earlier run"}


def run_ceilings(ctx: Context) -> dict:
    _need_cuda()
    import torch

    from bench.h200_bench import ceilings, median_ms

    res = ceilings()
    try:  # FP8 (e4m3) matmul through cuBLASLt, the FP8 rows' ceiling
        m = 8192
        x = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
        y = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device="cuda")
        ms = median_ms(lambda: torch._scaled_mm(x, y, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        res["matmul_fp8_TFLOPs"] = round(2 * m**3 / ms / 1e9, 1)
    except Exception as exc:  # an older torch or GPU without FP8: the bf16 ceilings still stand
        res["matmul_fp8_error"] = f"{type(exc).__name__}: {exc}"[:300]
    res["device"] = torch.cuda.get_device_name()
    return res


def run_decode_b1(ctx: Context) -> dict:
    _need_cuda()
    from bench.h200_bench import LLAMA31_8B, decode_b1

    return decode_b1(ctx.model_dir, LLAMA31_8B, ctx.ceilings)


def run_decode_b1_no_pdl(ctx: Context) -> dict:
    """decode_b1 without programmatic dependent launch: this child's kernels see TANDEM_PDL=0."""
    from tandem_kernels.triton_common import PDL_ENV

    os.environ[PDL_ENV] = "0"
    return run_decode_b1(ctx)


def run_decode_b1_unfused(ctx: Context) -> dict:
    """decode_b1 with fused_decode_gemv off: every projection through cuBLAS (the default before §32)."""
    _need_cuda()
    from bench.h200_bench import LLAMA31_8B, decode_b1

    return decode_b1(ctx.model_dir, LLAMA31_8B, ctx.ceilings, fused=False)


def run_decode_b1_fp8(ctx: Context) -> dict:
    """decode_b1 with FP8 weights (--quantization fp8): on a measured GPU all four projections
    as fused GEMVs over the e4m3 weights, activations unquantized (engine/model.py
    fused_decode_projections); the floor is read at the FP8 weights' bytes."""
    _need_cuda()
    from bench.h200_bench import LLAMA31_8B, decode_b1

    return decode_b1(ctx.model_dir, LLAMA31_8B, ctx.ceilings, quantization="fp8")


def run_decode_b1_fp8_unfused(ctx: Context) -> dict:
    """decode_b1_fp8 with fused_decode_gemv off: cuBLASLt's FP8 GEMM, activations quantized per token."""
    _need_cuda()
    from bench.h200_bench import LLAMA31_8B, decode_b1

    return decode_b1(ctx.model_dir, LLAMA31_8B, ctx.ceilings, fused=False, quantization="fp8")


def run_decode_b1_fused_gemv(ctx: Context) -> dict:
    """decode_b1 with EngineConfig.fused_decode_gemv True: the projections TANDEM_FUSED_GEMV names
    (else all four) as Triton GEMVs (tandem_kernels.gemv), the others cuBLAS."""
    _need_cuda()
    from bench.h200_bench import LLAMA31_8B, decode_b1

    return decode_b1(ctx.model_dir, LLAMA31_8B, ctx.ceilings, fused=True)


# ---- group S: batch-1 and small-batch decode, each change of BENCHMARKS.md §28 against the default
# in one run (the fused GEMVs with the sweep's fastest tiling of each weight).

SMALL_BATCH_TUNING = {"prefetch": True, "resident": 3}  # decode attention's first tile before the PDL wait
# The tilings the gemv_sweep sections time at each weight, at 1 and 2 rows (GemvTiling fields):
# §39's H100 winners and their neighbours (one row a 2-D product, per-lane sums, the rows against
# the whole tile, 1-3 pipelined stages), and §33's H200 tile before them. A GPU's table entries
# (tandem_kernels/gemv_tilings.py) come from these sections' `best_tilings` where the step agrees.
_FLAT = {"late_reduce": True, "flat_row": True, "wide_rows": True}
GEMV_AB_TILINGS = ({"block_n": 4, "block_k": 512, "late_reduce": True},
                   *({"block_n": bn, "block_k": bk, **_FLAT, "stages": st}
                     for bn, bk in ((2, 1024), (4, 512), (4, 1024), (8, 512)) for st in (1, 2, 3)),
                   *({"block_n": bn, "block_k": bk, **_FLAT, "stages": 3, "fma_chain": True}  # 1 row: as without
                     for bn, bk in ((4, 512), (4, 1024), (8, 512))))
GEMV_AB_ROWS = (1, 2)
# gemv_sweep_b4's tilings at four rows (the online TPOT's batch): §39's several-row tiles, each
# also with fma_chain, and for qkv and gate_up (the projections with a norm in front) all again
# with separate_norm.
GEMV_B4_TILINGS = tuple({"block_n": bn, "block_k": bk, **_FLAT, "stages": 3, "fma_chain": chain}
                        for bn, bk in ((4, 1024), (8, 512), (16, 512), (16, 1024)) for chain in (False, True))
GEMV_B4_NORMED = ("qkv", "gate_up")
GEMV_AB_WEIGHTS = ("qkv", "o_proj", "gate_up", "down")
ALL_FUSED = ",".join(GEMV_AB_WEIGHTS)  # TANDEM_FUSED_GEMV's value for the *_fused_all sections


def run_gpu_parity(ctx: Context) -> dict:
    """bench/h200_bench.py's gpu_parity: greedy tokens against transformers, and the fused GEMVs
    and prefill graphs against the plain engine, on random tiny llama / qwen3 / glm4 models."""
    _need_cuda()
    from bench.h200_bench import gpu_parity

    (ctx.work / "parity").mkdir(parents=True, exist_ok=True)
    return gpu_parity(ctx.work / "parity", ["llama", "qwen3", "glm4"])


def run_gemv_sweep(ctx: Context, fp8: bool = False) -> dict:
    """kernel_bench's --gemv-sweep over GEMV_AB_TILINGS at GEMV_AB_WEIGHTS and GEMV_AB_ROWS (`fp8`:
    e4m3 weights against cuBLASLt's FP8 GEMM), with `best_tilings`: each weight's fastest tiling
    at 1 row, as TANDEM_GEMV_TILING takes it (and at each row count, best_tilings_by_rows)."""
    _need_cuda()
    from bench.kernel_bench import gemv_sweep
    from tandem_kernels.gemv import GemvTiling

    res = gemv_sweep(rows_list=GEMV_AB_ROWS, weights=GEMV_AB_WEIGHTS, fp8=fp8,
                     tilings=[GemvTiling(**t) for t in GEMV_AB_TILINGS])
    rows = next(v for k, v in res.items() if k.startswith("rows"))
    return {**res, **best_tilings(rows)}


def run_gemv_sweep_b4(ctx: Context, fp8: bool = False) -> dict:
    """kernel_bench's --gemv-sweep at 4 rows: GEMV_B4_TILINGS at every weight, and again with
    separate_norm at GEMV_B4_NORMED; `best_tilings_by_rows` {"4": ...} as the decode_b4 sections
    take it."""
    _need_cuda()
    from bench.kernel_bench import gemv_sweep
    from tandem_kernels.gemv import GemvTiling

    plain = gemv_sweep(rows_list=(4,), weights=GEMV_AB_WEIGHTS, fp8=fp8,
                       tilings=[GemvTiling(**t) for t in GEMV_B4_TILINGS])
    normed = gemv_sweep(rows_list=(4,), weights=GEMV_B4_NORMED, fp8=fp8,
                        tilings=[GemvTiling(**t, separate_norm=True) for t in GEMV_B4_TILINGS])
    key = next(k for k in plain if k.startswith("rows"))
    rows = plain[key] + [r for r in normed[key] if r[2] is not None]  # cuBLAS's rows once
    return {**plain, key: rows, **best_tilings(rows)}


def best_tilings(rows: list[list]) -> dict:
    """From gemv_sweep's rows [weight, rows, tiling (GemvTiling fields, None: unfused), us, GB/s,
    err]: `best_tilings` {weight: GemvTiling fields} (the fastest timed tiling at 1 row),
    `gemv_us_at_1_row` {weight: {"cublas": us, "fused": us}}, and the same two at every row
    count as `best_tilings_by_rows` and `gemv_us_by_rows` {str(rows): ...}."""
    best: dict[int, dict[str, tuple[float, dict]]] = {}
    us: dict[int, dict[str, dict]] = {}
    for weight, m, tiling, t, *_ in rows:
        if not isinstance(t, (int, float)):
            continue
        if tiling is None:  # the unfused row: cuBLAS and the separate norm / SiLU kernels
            us.setdefault(m, {}).setdefault(weight, {})["cublas"] = t
        elif weight not in best.setdefault(m, {}) or t < best[m][weight][0]:
            best[m][weight] = (t, dict(tiling))
    for m, by_weight in best.items():
        for weight, (t, _) in by_weight.items():
            us.setdefault(m, {}).setdefault(weight, {})["fused"] = t
    fields = {m: {w: f for w, (_, f) in by_weight.items()} for m, by_weight in best.items()}
    return {"best_tilings": fields.get(1, {}), "gemv_us_at_1_row": us.get(1, {}),
            "best_tilings_by_rows": {str(m): f for m, f in sorted(fields.items())},
            "gemv_us_by_rows": {str(m): u for m, u in sorted(us.items())}}


def _small_batch_sections(batch: int, what: str) -> list[Section]:
    """decode_b<batch>, with all four projections fused, and both with FP8 weights (group S)."""
    name = f"decode_b{batch}"
    return [
        Section(name, "S", 75, 35, "child", _decode(batch), what),
        Section(f"{name}_fused_all", "S", 75, 35, "child", _decode(batch, fused=ALL_FUSED),
                f"{name}, all four projections as fused GEMVs"),
        Section(f"{name}_fp8", "S", 90, 45, "child", _decode(batch, quantization="fp8"),
                f"{name} with FP8 weights (fused where gemv_tilings.FP8_DEVICE_ROWS or TANDEM_FUSED_GEMV_ROWS "
                f"reach {batch} rows, else cuBLASLt's FP8 GEMM)"),
        Section(f"{name}_fp8_fused_all", "S", 90, 45, "child", _decode(batch, fused=ALL_FUSED, quantization="fp8"),
                f"{name}_fp8, all four projections as fused GEMVs over the e4m3 weights"),
    ]


def _decode(batch: int, tuning: dict | None = None, fused: str = "", prompt_len: int = 128,
            quantization: str | None = None) -> Callable[[Context], dict]:
    """A section: h200_bench's decode_b1 at `batch` sequences of `prompt_len`-token prompts
    (`quantization`: the weights', as decode_b1 takes it); `tuning`: TANDEM_DECODE_TUNING's
    fields in this child; `fused`: the projections TANDEM_FUSED_GEMV names, as fused GEMVs at
    `batch` rows with the earlier gemv_sweep's (gemv_sweep_fp8's for FP8 weights) best tilings at
    `batch` rows (else at one row; TANDEM_GEMV_TILING) where this run measured them (else the
    GPU's, tandem_kernels/gemv_tilings.py)."""
    def section(ctx: Context) -> dict:
        _need_cuda()
        from bench.h200_bench import LLAMA31_8B, decode_b1
        from engine.model import FUSED_GEMV_ENV, FUSED_GEMV_ROWS_ENV
        from tandem_kernels.decode_attention import TUNING_ENV
        from tandem_kernels.gemv import TILING_ENV

        extra: dict[str, Any] = {}
        if tuning:
            os.environ[TUNING_ENV] = json.dumps(tuning)
            extra["decode_tuning"] = tuning
        if fused:
            os.environ[FUSED_GEMV_ENV] = fused
            os.environ[FUSED_GEMV_ROWS_ENV] = str(batch)
            extra["fused_gemv_projections"] = fused
            sweep = "gemv_sweep_fp8" if quantization == "fp8" else "gemv_sweep"
            tilings = (_get(ctx.earlier, sweep, "best_tilings_by_rows") or {}).get(str(batch)) \
                or (_get(ctx.earlier, f"{sweep}_b{batch}", "best_tilings_by_rows") or {}).get(str(batch)) \
                or _get(ctx.earlier, sweep, "best_tilings")
            if tilings:
                os.environ[TILING_ENV] = json.dumps(tilings)
                extra["gemv_tilings"] = tilings
        return {**decode_b1(ctx.model_dir, LLAMA31_8B, ctx.ceilings, fused=True if fused else None, batch=batch,
                            prompt_len=prompt_len, quantization=quantization), **extra}

    return section


CUBLAS_WORKSPACE = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # torch's own on Hopper: 32 MiB


def _with_env(run: Callable[[Context], dict], env: Callable[[], dict[str, str]]) -> Callable[[Context], dict]:
    """`run` with `env()`'s variables set in this child before it builds its engine (engine
    modules read them there; `env` is called in the child, so its imports stay out of the
    parent). For a cluster section, run the whole bench with them set: the workers inherit them."""
    def section(ctx: Context) -> dict:
        os.environ.update(env())
        return run(ctx)

    return section


def _cublas_workspace(run: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """`run` with torch's cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8), where an engine's
    process has none by default (engine/cublas.py): cuBLAS may then choose its split-K kernels
    again (BENCHMARKS.md §17, §24-25: batch-1 decode 1.3-1.4% slower with them)."""
    return _with_env(run, lambda: CUBLAS_WORKSPACE)


def _engine_env(run: Callable[[Context], dict], module: str, name: str, value: str) -> Callable[[Context], dict]:
    """`run` with the variable that `module`.`name` names set to `value` (the module is imported in
    the child, as `_with_env` calls it, so no engine import reaches the parent)."""
    return _with_env(run, lambda: {getattr(importlib.import_module(module), name): value})


def _fused_rotary(run: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """`run` with TANDEM_FUSED_ROTARY=1: decode-only steps rotate and store their K/V inside the
    decode attention kernel (engine/attention.py)."""
    return _engine_env(run, "engine.attention", "FUSED_ROTARY_ENV", "1")


def _nano_batch(run: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """`run` with TANDEM_NANO_BATCH=auto: a decode graph of at least engine.nano_batch.MIN_ROWS
    rows runs two halves on two streams, one half's attention beside the other's GEMMs, where that
    replays faster than the plain step at a full context (engine/nano_batch.py,
    engine/cuda_graphs.py; the engine's log names the buckets)."""
    return _engine_env(run, "engine.nano_batch", "NANO_BATCH_ENV", "auto")


def _cached_kv(run: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """`run` with TANDEM_EXTEND_NEW_KV=0: prefill attention reads every key and value from the
    cache, the new tokens' too (the behaviour before BENCHMARKS.md §30-31; engine/attention.py)."""
    return _engine_env(run, "engine.attention", "EXTEND_NEW_KV_ENV", "0")


def _offline(ctx: Context, kv: str, quantization: str | None, max_running: int | None = None,
             kv_layout: str = "nhd") -> dict:
    """The offline workload; `max_running` (else --max-running, else derived) caps the batch;
    `kv_layout` is the KV cache's (EngineConfig.kv_cache_layout)."""
    _need_cuda()
    from bench.h200_bench import offline

    a = ctx.args
    return offline(ctx.model_dir, a.offline_prompts, a.input_len, a.output_len, kv=kv,
                   max_running=max_running or a.max_running, quantization=quantization, kv_layout=kv_layout)


def run_offline_fp8_deferred_scales(ctx: Context) -> dict:
    """offline_fp8 with the FP8 scales deferred to the kernels that read the products: this
    child's model is built with TANDEM_FP8_DEFERRED_SCALES=1."""
    return _engine_env(lambda c: _offline(c, "fp8", "fp8"), "engine.quant.fp8", "DEFERRED_SCALES_ENV", "1")(ctx)


def run_offline_bf16_untimed_buckets(ctx: Context) -> dict:
    """offline_bf16 with every decode graph up to the batch cap kept, untimed, as before timed
    buckets (engine/cuda_graphs.py): this child sees TANDEM_TIMED_BUCKETS=0."""
    return _engine_env(lambda c: _offline(c, "auto", None), "engine.cuda_graphs", "TIMED_BUCKETS_ENV", "0")(ctx)


def _offline_2d_tile(ctx: Context, quantization: str | None) -> dict:
    """An FP8-KV offline section with FP8_TUNING (the 2-D tile kernel) at every batch, as before
    the warp-split kernel took the full batches (BENCHMARKS.md §23): this child's
    TANDEM_DECODE_TUNING holds all of FP8_TUNING's fields."""
    import dataclasses

    from tandem_kernels.decode_attention import FP8_TUNING, TUNING_ENV

    os.environ[TUNING_ENV] = json.dumps(dataclasses.asdict(FP8_TUNING))
    return _offline(ctx, "fp8", quantization)


def run_gptfast(ctx: Context) -> dict:
    _need_cuda()
    from bench.gptfast_peer import measure

    return measure(ctx.model_dir, B1_PROMPT, B1_WARMUP, B1_STEPS, load_format="dummy")


def run_offline_subset(ctx: Context) -> dict:
    _need_cuda()
    from bench.up_bench import make_prompts, offline

    a = ctx.args
    return offline(ctx.model_dir, make_prompts(a.services_prompts, a.input_len, ctx.vocab_size), a.output_len)


# ---------------------------------------------------------------- cluster sections (here)

class Clusters:
    """At most one `tandem up` at a time (bench/up_bench.py's start_up / stop), kept running for
    the next section of the same mode; a mode that failed to start is not retried."""

    MODES = {"disagg": [], "colocated": ["--colocated"],
             "disagg_small_prefill": ["--prefill-memory-ratio", "0.25", "--max-model-len", "8192"],
             "disagg_whole_prefill_context": ["--prefill-max-model-len", "131072"],
             "disagg_hold_reserving": ["--gpu-turn-hold", "reserving"],
             "disagg_own_weights": ["--no-share-weights"], "disagg_gil_100us": [],
             "disagg_fp8": ["--quantization", "fp8"], "colocated_fp8": ["--colocated", "--quantization", "fp8"],
             "disagg_fp8_one_row": ["--quantization", "fp8"],
             "disagg_no_mps": ["--no-mps"], "disagg_fp8_no_mps": ["--quantization", "fp8", "--no-mps"],
             "disagg_mps_no_turn": ["--mps", "--no-gpu-turn"],
             "disagg_mps_layer_push": ["--mps", "--kv-push", "layer"],
             "disagg_fp8_mps_no_turn": ["--quantization", "fp8", "--mps", "--no-gpu-turn"]}
    ENV = {"disagg_gil_100us": {"TANDEM_GIL_SWITCH_US": "100"},  # a mode's environment (entrypoints/worker.py)
           "disagg_fp8_one_row": {"TANDEM_FUSED_GEMV_ROWS": "1"}}

    def __init__(self, model_dir: Path, log_root: Path, up_args: list[str] = ()) -> None:
        self.model_dir, self.log_root, self.up_args = model_dir, log_root, list(up_args)
        self.mode: str | None = None
        self.proc: subprocess.Popen | None = None
        self.target = ""
        self.info: dict = {}
        self.failed: dict[str, str] = {}

    def get(self, mode: str, timeout_s: float) -> tuple[str, dict]:
        """(gRPC target, {"banner", "startup_s", "reused"}) of a running cluster of `mode`."""
        from bench import up_bench
        from entrypoints.cluster import free_port

        if mode in self.failed:
            raise RuntimeError(f"tandem up ({mode}) failed to start earlier in this run: {self.failed[mode]}")
        if self.mode == mode and self.proc is not None and self.proc.poll() is None:
            return self.target, {**self.info, "reused": True}
        self.close()
        port = free_port()
        up_bench.UP_TIMEOUT_S = max(30.0, timeout_s)  # start_up reads it for its deadline
        try:
            proc, banner, up_s = up_bench.start_up(self.model_dir, port, self.log_root / f"logs-{mode}",
                                                   [*self.MODES[mode], *self.up_args], self.ENV.get(mode))
        except Exception as exc:
            self.failed[mode] = repr(exc)[:2000]
            raise
        self.mode, self.proc, self.target = mode, proc, f"127.0.0.1:{port}"
        self.info = {"banner": banner, "startup_s": round(up_s, 1)}
        return self.target, {**self.info, "reused": False}

    def log_tails(self, mode: str) -> dict[str, str]:
        logs = sorted((self.log_root / f"logs-{mode}").glob("*.log"))
        return {f.name: f.read_text(errors="replace")[-3000:] for f in logs}

    def close(self) -> int | None:
        from bench.up_bench import stop

        code = None
        if self.proc is not None:
            code = stop(self.proc)
            log(f"tandem up ({self.mode}) stopped, exit code {code}")
        self.mode, self.proc = None, None
        return code


def run_services(ctx: Context, mode: str = "disagg") -> dict:
    """The same prompts as offline_subset through the SDK, all submitted at once (bench/up_bench.py)."""
    from bench.up_bench import make_prompts
    from tandem import AsyncClient

    a = ctx.args
    prompts = make_prompts(a.services_prompts, a.input_len, ctx.vocab_size)
    target, info = ctx.clusters.get(mode, ctx.left())

    async def run() -> tuple[int, int, float]:
        async with AsyncClient(target, timeout=3600) as client:
            await client.generate(prompts[0], max_tokens=4, temperature=0.0, ignore_eos=True)
            t = time.perf_counter()
            outs = await asyncio.gather(*(client.generate(x, max_tokens=a.output_len, temperature=0.0,
                                                          ignore_eos=True) for x in prompts))
            return len(outs), sum(len(o.token_ids) for o in outs), time.perf_counter() - t

    async def bounded() -> tuple[int, int, float]:
        return await asyncio.wait_for(run(), timeout=max(1.0, ctx.left()))

    done, n_out, dt = asyncio.run(bounded())
    return {**info, "mode": mode, "completed": done, "prompts": len(prompts), "input_len": a.input_len,
            "output_len": a.output_len, "output_tokens": n_out, "seconds": round(dt, 2),
            "output_tok_s": round(n_out / dt, 1)}


def bench_point(ctx: Context, target: str, rate: float, num_requests: int, seed: int, out: Path) -> dict:
    """One `tandem bench` run: Poisson `rate`, random token prompts of input_len, online_output_len
    new tokens, the SLO of --slo-*; its summary. Its duration is capped by the section's time left."""
    a = ctx.args
    duration = max(5.0, min(a.point_max_s, ctx.left() - 15))
    cmd = [sys.executable, "-m", "entrypoints", "bench", "--target", target, "--dataset", "random",
           "--prompt-format", "tokens", "--num-requests", str(num_requests), "--input-len", str(a.input_len),
           "--output-len", str(a.online_output_len), "--request-rate", f"{rate:g}",
           "--slo-ttft-ms", f"{a.slo_ttft_ms:g}", "--slo-tpot-ms", f"{a.slo_tpot_ms:g}", "--seed", str(seed),
           "--warmup", "2", "--duration", f"{duration:g}", "--out", str(out), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=duration + 60)
    if not out.is_file():
        raise RuntimeError(f"tandem bench exited {proc.returncode} without results: {proc.stderr[-2000:]}")
    return json.loads(out.read_text())["runs"][0]["summary"]


def _point_row(rate: float, s: dict) -> dict:
    req = s["requests"]
    return {"rate": rate, "requests": req["measured"], "failed": req["failed"],
            "cancelled": req["cancelled_at_deadline"], "skipped": req["skipped"],
            "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "output_tok_s": round(s["output_token_throughput"], 1),
            "slo_attainment": (s.get("goodput") or {}).get("fraction")}


def within_slo(row: dict, ttft_ms: float, tpot_ms: float) -> bool:
    """Every request sent and completed, TTFT P99 and TPOT P99 within the targets."""
    if row["failed"] or row["cancelled"] or row["skipped"] or not row["requests"]:
        return False
    return (row["ttft_p99_ms"] is not None and row["ttft_p99_ms"] <= ttft_ms
            and (row["tpot_p99_ms"] is None or row["tpot_p99_ms"] <= tpot_ms))


def run_online(ctx: Context, mode: str = "disagg") -> dict:
    a = ctx.args
    target, info = ctx.clusters.get(mode, ctx.left())
    from bench import step_gaps

    ports = step_gaps.metrics_ports(info["banner"])
    before = step_gaps.scrape_all(ports)
    s = bench_point(ctx, target, a.online_rate, a.online_requests, seed=1, out=ctx.work / f"online-{mode}.json")
    stages = step_gaps.stage_means(before, step_gaps.scrape_all(ports))
    return {**info, "mode": mode, "rate": a.online_rate, "input_len": a.input_len, "output_len": a.online_output_len,
            **_point_row(a.online_rate, s), "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"], "itl_ms": s["itl_ms"],
            "stage_means_ms": stages}


def point_requests(rate: float, seconds: float, least: int) -> int:
    return max(least, round(rate * seconds))


def search_max_rate(measure: Callable[[float], dict], rates: list[float], refine: int, ttft_ms: float,
                    tpot_ms: float, fits: Callable[[float], bool]) -> dict:
    """Rates upwards until one misses the SLO, then `refine` bisections between the last rate
    within it (0 if none) and the first miss. `measure(rate)` -> a _point_row; `fits(rate)`: whether
    a point at `rate` still fits the time left (the search stops, recorded, when not)."""
    points: list[dict] = []
    best, first_miss, stopped = 0.0, None, None

    def one(rate: float) -> bool | None:
        if not fits(rate):
            return None
        row = measure(rate)
        row["within_slo"] = within_slo(row, ttft_ms, tpot_ms)
        points.append(row)
        log(f"rate {rate:g}/s: TTFT P99 {row['ttft_p99_ms']} ms, TPOT P99 {row['tpot_p99_ms']} ms, "
            f"failed {row['failed']}, within SLO: {row['within_slo']}")
        return row["within_slo"]

    for rate in rates:
        ok = one(rate)
        if ok is None:
            stopped = f"time budget reached before rate {rate:g}"
            break
        if not ok:
            first_miss = rate
            break
        best = rate
    for _ in range(refine if first_miss is not None and stopped is None else 0):
        mid = round((best + first_miss) / 2, 2)
        ok = one(mid)
        if ok is None:
            stopped = f"time budget reached before rate {mid:g}"
            break
        best, first_miss = (mid, first_miss) if ok else (best, mid)
    return {"max_rate_within_slo": best, "first_rate_missing_slo": first_miss, "stopped": stopped,
            "slo": {"ttft_p99_ms": ttft_ms, "tpot_p99_ms": tpot_ms}, "points": points}


def run_max_rate(ctx: Context, mode: str = "disagg") -> dict:
    a = ctx.args
    target, info = ctx.clusters.get(mode, ctx.left())
    from bench import step_gaps

    ports = step_gaps.metrics_ports(info["banner"])
    n = [0]

    def measure(rate: float) -> dict:
        n[0] += 1
        before = step_gaps.scrape_all(ports)
        s = bench_point(ctx, target, rate, point_requests(rate, a.point_s, a.point_min_requests),
                        seed=100 + n[0], out=ctx.work / f"rate-{mode}-{n[0]}.json")
        return {**_point_row(rate, s), "stage_means_ms": step_gaps.stage_means(before, step_gaps.scrape_all(ports))}

    def fits(rate: float) -> bool:  # the arrivals, the last requests' tail and the client's start-up
        return ctx.left() > point_requests(rate, a.point_s, a.point_min_requests) / rate + 10

    res = search_max_rate(measure, a.rates, a.rate_refine, a.slo_ttft_ms, a.slo_tpot_ms, fits)
    return {**info, "mode": mode, "input_len": a.input_len, "output_len": a.online_output_len, **res}


def run_env(ctx: Context) -> dict:
    import platform

    res: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        res["torch"] = torch.__version__
        res["cuda_available"] = torch.cuda.is_available()  # no CUDA context is made here
    except ImportError:
        res["torch"] = None
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    res["commit"] = git.stdout.strip() or None
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,clocks.max.sm,power.limit",
                          "--format=csv,noheader"], capture_output=True, text=True) if _has("nvidia-smi") else None
    res["gpus"] = smi.stdout.strip().splitlines() if smi and smi.returncode == 0 else []
    return res


def _has(cmd: str) -> bool:
    import shutil

    return shutil.which(cmd) is not None


SECTIONS: dict[str, Section] = {s.name: s for s in [
    Section("ceilings", "A", 45, 15, "child", run_ceilings, "device copy GB/s, bf16 and FP8 matmul TFLOP/s"),
    Section("decode_b1", "A", 75, 35, "child", run_decode_b1, "ours, batch 1, ms/token vs the weight-read floor"),
    # The offline runs' budgets leave room for an 80 GB H100 (~0.7 of an H200's speed here; offline_bf16 ran
    # past 150 s on one, BENCHMARKS §35).
    Section("offline_bf16", "A", 220, 120, "child", lambda c: _offline(c, "auto", None), "offline, bf16 weights + KV"),
    Section("offline_fp8kv", "A", 200, 110, "child", lambda c: _offline(c, "fp8", None), "bf16 weights, FP8 KV"),
    Section("offline_fp8", "A", 180, 100, "child", lambda c: _offline(c, "fp8", "fp8"), "FP8 weights + FP8 KV"),
    Section("gptfast", "A", 200, 130, "child", run_gptfast, "gpt-fast-style peer, batch 1 (compiles first)"),
    Section("services", "B", 130, 90, "cluster", run_services, "`tandem up` (P + D on one GPU), 512 prompts"),
    Section("online", "B", 75, 45, "cluster", run_online, "`tandem up`, Poisson 2 req/s, 1024/256"),
    Section("max_rate", "B", 170, 125, "cluster", run_max_rate, "`tandem up`, highest rate within the SLO"),
    Section("colocated", "B", 110, 80, "cluster", lambda c: run_services(c, "colocated"), "`tandem up --colocated`"),
    Section("online_colocated", "B", 75, 45, "cluster", lambda c: run_online(c, "colocated"), "--colocated, 2 req/s"),
    Section("online_hold_reserving", "", 75, 45, "cluster", lambda c: run_online(c, "disagg_hold_reserving"),
            "online with --gpu-turn-hold reserving: the held launch's cost on TPOT against `online` (always)"),
    Section("online_gil_100us", "", 75, 45, "cluster", lambda c: run_online(c, "disagg_gil_100us"),
            "online with the workers' GIL switch interval at 0.1 ms (TANDEM_GIL_SWITCH_US; 0.5 ms by default): "
            "whether the held launch waits for the GIL"),
    Section("services_own_weights", "", 130, 90, "cluster", lambda c: run_services(c, "disagg_own_weights"),
            "`tandem up --no-share-weights`: a copy of the weights each, the decode worker's K/V smaller by one"),
    Section("online_own_weights", "", 75, 45, "cluster", lambda c: run_online(c, "disagg_own_weights"),
            "online with --no-share-weights (TTFT / TPOT against `online`)"),
    Section("online_fp8", "", 75, 45, "cluster", lambda c: run_online(c, "disagg_fp8"),
            "online with FP8 weights (`tandem up --quantization fp8`; TTFT / TPOT against `online`)"),
    Section("max_rate_fp8", "", 170, 125, "cluster", lambda c: run_max_rate(c, "disagg_fp8"),
            "max_rate with FP8 weights"),
    Section("online_colocated_fp8", "", 75, 45, "cluster", lambda c: run_online(c, "colocated_fp8"),
            "online_colocated with FP8 weights"),
    Section("online_fp8_one_row", "", 75, 45, "cluster", lambda c: run_online(c, "disagg_fp8_one_row"),
            "online_fp8 with fused GEMVs at one row only (TANDEM_FUSED_GEMV_ROWS=1): steps of 2+ sequences "
            "through cuBLASLt's FP8 GEMM, against online_fp8's fused ones"),
    Section("online_no_mps", "", 75, 45, "cluster", lambda c: run_online(c, "disagg_no_mps"),
            "online with `tandem up --no-mps`: turns at every batch, where `online` runs under MPS on a GPU with "
            "its tools (turns only while the decode batch is small; BENCHMARKS.md §46-47)"),
    Section("services_no_mps", "", 130, 90, "cluster", lambda c: run_services(c, "disagg_no_mps"),
            "services with `tandem up --no-mps`"),
    Section("max_rate_no_mps", "", 170, 125, "cluster", lambda c: run_max_rate(c, "disagg_no_mps"),
            "max_rate with `tandem up --no-mps`"),
    Section("online_fp8_no_mps", "", 75, 45, "cluster", lambda c: run_online(c, "disagg_fp8_no_mps"),
            "online_fp8 with `tandem up --no-mps`"),
    Section("max_rate_fp8_no_mps", "", 170, 125, "cluster", lambda c: run_max_rate(c, "disagg_fp8_no_mps"),
            "max_rate_fp8 with `tandem up --no-mps` (BENCHMARKS.md §46: 24 req/s on an H100, 26 under MPS)"),
    Section("online_mps_no_turn", "", 75, 45, "cluster", lambda c: run_online(c, "disagg_mps_no_turn"),
            "online with --mps --no-gpu-turn: side by side at every batch (BENCHMARKS.md §45: TTFT P50 +4-5 ms)"),
    Section("online_fp8_mps_no_turn", "", 75, 45, "cluster", lambda c: run_online(c, "disagg_fp8_mps_no_turn"),
            "online_fp8 with --mps --no-gpu-turn"),
    Section("max_rate_fp8_mps_no_turn", "", 170, 125, "cluster", lambda c: run_max_rate(c, "disagg_fp8_mps_no_turn"),
            "max_rate_fp8 with --mps --no-gpu-turn"),
    Section("online_mps_layer_push", "", 75, 45, "cluster", lambda c: run_online(c, "disagg_mps_layer_push"),
            "online under --mps with --kv-push layer: each layer's KV sent as it is computed (BENCHMARKS.md §46: "
            "the same TTFT as `auto`'s push after the forward)"),
    Section("offline_subset", "B", 110, 75, "child", run_offline_subset, "offline engine, defaults, same 512 prompts"),
    Section("env", "", 30, 1, "local", run_env, "versions, commit, GPUs (no GPU needed)"),
    Section("max_rate_colocated", "", 150, 125, "cluster", lambda c: run_max_rate(c, "colocated"), "colocated"),
    Section("services_small_prefill", "", 130, 90, "cluster", lambda c: run_services(c, "disagg_small_prefill"),
            "`tandem up --prefill-memory-ratio 0.25 --max-model-len 8192`: decode gets 72% of the GPU, prefill 18% "
            "(too little KV for one 131,072-token request, hence the shorter limit)"),
    Section("services_whole_prefill_context", "", 130, 90, "cluster",
            lambda c: run_services(c, "disagg_whole_prefill_context"),
            "`tandem up --prefill-max-model-len 131072`: the prefill worker holds one request of the model's whole "
            "context, as before the default capped it at 32,768 (BENCHMARKS.md §48)"),
    # Experiments beside the table's rows (BENCHMARKS.md §15-17), each against its row in the same run:
    # Group S (BENCHMARKS.md §28): batch 1 and 4 with each small-batch change against decode_b1 / decode_b4.
    Section("gpu_parity", "S", 120, 50, "child", run_gpu_parity,
            "greedy tokens vs transformers; fused GEMVs and prefill graphs vs the plain engine"),
    Section("decode_b1_attn_prefetch", "S", 75, 35, "child", _decode(1, SMALL_BATCH_TUNING),
            "decode_b1, decode attention's first K/V tile before the PDL wait (TANDEM_DECODE_TUNING)"),
    Section("gemv_sweep", "S", 240, 70, "child", run_gemv_sweep,
            "fused GEMV tilings vs cuBLAS at the four weights (cold), 1 and 2 rows; the fastest of each"),
    Section("gemv_sweep_fp8", "S", 240, 70, "child", lambda c: run_gemv_sweep(c, fp8=True),
            "gemv_sweep over e4m3 weights against cuBLASLt's FP8 GEMM (the FP8 sections' tilings)"),
    Section("gemv_sweep_b4", "S", 150, 40, "child", run_gemv_sweep_b4,
            "fused GEMV tilings vs cuBLAS at 4 rows, qkv and gate_up also with separate_norm (decode_b4_*'s tilings)"),
    Section("gemv_sweep_fp8_b4", "S", 150, 40, "child", lambda c: run_gemv_sweep_b4(c, fp8=True),
            "gemv_sweep_b4 over e4m3 weights against cuBLASLt's FP8 GEMM"),
    Section("decode_b1_unfused", "S", 75, 35, "child", run_decode_b1_unfused,
            "decode_b1 with fused_decode_gemv off (every projection through cuBLAS)"),
    Section("decode_b1_fp8", "S", 90, 45, "child", run_decode_b1_fp8,
            "decode_b1 with FP8 weights: fused GEMVs over the e4m3 weights (W8A16), vs their floor"),
    Section("decode_b1_fp8_unfused", "S", 90, 45, "child", run_decode_b1_fp8_unfused,
            "decode_b1_fp8 through cuBLASLt's FP8 GEMM (activations quantized per token)"),
    Section("decode_b1_fp8_fused_all", "S", 90, 45, "child", _decode(1, fused=ALL_FUSED, quantization="fp8"),
            "decode_b1_fp8, all four projections as fused GEMVs at gemv_sweep_fp8's tilings (on any GPU)"),
    Section("decode_b1_fused_qkv_o", "S", 75, 35, "child", _decode(1, fused="qkv,o_proj"),
            "decode_b1, qkv (norm folded in) and o_proj as fused GEMVs, gemv_sweep's tilings"),
    Section("decode_b1_fused_qkv_o_down", "S", 75, 35, "child", _decode(1, fused="qkv,o_proj,down"),
            "decode_b1, qkv, o_proj and down as fused GEMVs"),
    Section("decode_b1_fused_o_down", "S", 75, 35, "child", _decode(1, fused="o_proj,down"),
            "decode_b1, o_proj and down as fused GEMVs"),
    Section("decode_b1_fused_all", "S", 75, 35, "child", _decode(1, fused=ALL_FUSED),
            "decode_b1, all four projections as fused GEMVs (norms and SiLU inside)"),
    *_small_batch_sections(2, "2 sequences, ms a step"),
    *_small_batch_sections(4, "4 sequences (the online TPOT's batch), ms a step"),
    Section("decode_b4_attn_prefetch", "S", 75, 35, "child", _decode(4, SMALL_BATCH_TUNING),
            "decode_b4 with decode attention's first tile before the wait"),
    Section("decode_b4_fused_qkv_o", "S", 75, 35, "child", _decode(4, fused="qkv,o_proj"),
            "decode_b4, qkv and o_proj as fused GEMVs"),
    Section("decode_b4_ctx1024", "", 75, 35, "child", _decode(4, prompt_len=1024),
            "4 sequences of 1,024-token prompts: the online TPOT's step (its attention reads ~4% of the weights' bytes, at a third of copy speed)"),
    Section("decode_b1_no_pdl", "", 75, 35, "child", run_decode_b1_no_pdl,
            "decode_b1 with TANDEM_PDL=0 (no programmatic dependent launch)"),
    Section("decode_b1_cublas_workspace", "", 75, 35, "child", _cublas_workspace(run_decode_b1),
            "decode_b1 with CUBLAS_WORKSPACE_CONFIG=:4096:8 (torch's workspace: split-K GEMMs allowed)"),
    Section("decode_b1_fused_gemv", "", 75, 35, "child", run_decode_b1_fused_gemv,
            "decode_b1 with fused_decode_gemv (TANDEM_FUSED_GEMV: which projections; TANDEM_GEMV_TILING)"),
    Section("decode_b1_fused_rotary", "", 75, 35, "child", _fused_rotary(run_decode_b1),
            "decode_b1 with TANDEM_FUSED_ROTARY=1 (rotary + the step's K/V store inside decode attention)"),
    Section("offline_fp8_nano_batch", "", 125, 100, "child", _nano_batch(lambda c: _offline(c, "fp8", "fp8")),
            "offline_fp8 with TANDEM_NANO_BATCH=auto (full decode batches as two overlapped halves where faster)"),
    Section("offline_fp8kv_nano_batch", "", 140, 110, "child", _nano_batch(lambda c: _offline(c, "fp8", None)),
            "offline_fp8kv with TANDEM_NANO_BATCH=auto"),
    Section("offline_bf16_nano_batch", "", 150, 120, "child", _nano_batch(lambda c: _offline(c, "auto", None)),
            "offline_bf16 with TANDEM_NANO_BATCH=auto"),
    Section("offline_bf16_fused_rotary", "", 150, 120, "child", _fused_rotary(lambda c: _offline(c, "auto", None)),
            "offline_bf16 with TANDEM_FUSED_ROTARY=1"),
    Section("offline_fp8_fused_rotary", "", 125, 100, "child", _fused_rotary(lambda c: _offline(c, "fp8", "fp8")),
            "offline_fp8 with TANDEM_FUSED_ROTARY=1"),
    Section("offline_fp8_cached_kv", "", 125, 100, "child", _cached_kv(lambda c: _offline(c, "fp8", "fp8")),
            "offline_fp8 with TANDEM_EXTEND_NEW_KV=0 (prefill attention reads the new tokens from the cache)"),
    Section("offline_fp8kv_cached_kv", "", 140, 110, "child", _cached_kv(lambda c: _offline(c, "fp8", None)),
            "offline_fp8kv with TANDEM_EXTEND_NEW_KV=0"),
    Section("offline_bf16_cached_kv", "", 150, 120, "child", _cached_kv(lambda c: _offline(c, "auto", None)),
            "offline_bf16 with TANDEM_EXTEND_NEW_KV=0"),
    Section("offline_fp8_deferred_scales", "", 125, 100, "child", run_offline_fp8_deferred_scales,
            "offline_fp8 with TANDEM_FP8_DEFERRED_SCALES=1 (unit-scale GEMMs, scales applied by the readers)"),
    Section("offline_bf16_untimed_buckets", "", 150, 120, "child", run_offline_bf16_untimed_buckets,
            "offline_bf16 with TANDEM_TIMED_BUCKETS=0 (every decode graph up to max_running, none timed)"),
    Section("offline_fp8kv_hnd", "", 140, 110, "child", lambda c: _offline(c, "fp8", None, kv_layout="hnd"),
            "offline_fp8kv on a head-major KV cache (kv_cache_layout hnd: each head's slots of a block together)"),
    Section("offline_fp8_hnd", "", 125, 100, "child", lambda c: _offline(c, "fp8", "fp8", kv_layout="hnd"),
            "offline_fp8 on a head-major KV cache (kv_cache_layout hnd)"),
    Section("offline_fp8kv_2d_tile", "", 140, 110, "child", lambda c: _offline_2d_tile(c, None),
            "offline_fp8kv with FP8_TUNING at every batch (no warp-split kernel; TANDEM_DECODE_TUNING)"),
    Section("offline_fp8_2d_tile", "", 125, 100, "child", lambda c: _offline_2d_tile(c, "fp8"),
            "offline_fp8 with FP8_TUNING at every batch (no warp-split kernel; TANDEM_DECODE_TUNING)"),
]}
GROUPS = {g: [n for n, s in SECTIONS.items() if s.group == g] for g in ("A", "B", "S")}
GROUPS["S"].insert(1, "decode_b1")  # S compares its variants with A's batch-1 row, in the same run

# key -> (comparison, goal) from the "Done when"
GOALS: dict[str, tuple[str, float]] = {
    "offline_bf16_out_tok_s": (">=", 11_000), "offline_fp8kv_out_tok_s": ("", 0), "fp8kv_over_bf16": (">=", 1.35),
    "offline_fp8_out_tok_s": (">=", 18_000), "decode_b1_ms_per_token": ("", 0),
    "decode_b1_roofline_fraction": (">=", 0.85), "gptfast_b1_ms_per_token": ("", 0),
    "b1_speed_over_gptfast": (">=", 1.1), "services_vs_offline": (">=", 0.90), "colocated_vs_offline": (">=", 0.95),
    "online_ttft_p50_ms": ("<=", 35), "online_tpot_p50_ms": ("<=", 4.5), "online_colocated_ttft_p50_ms": ("", 0),
    "online_colocated_tpot_p50_ms": ("", 0), "max_rate_within_slo": (">=", 20), "copy_GBps": ("", 0),
    "matmul_bf16_TFLOPs": ("", 0), "matmul_fp8_TFLOPs": ("", 0),
}


def _get(sections: dict, name: str, key: str) -> Any:
    value = sections.get(name)
    return value.get(key) if isinstance(value, dict) and "error" not in value else None


def _ratio(num: Any, den: Any, digits: int = 3) -> float | None:
    return round(num / den, digits) if isinstance(num, (int, float)) and isinstance(den, (int, float)) and den else None


# The table's ratios: key -> (numerator, denominator), each (section, field). A ratio is quoted
# from one run (both sections measured by the same command, on the same machine): each run
# records the ratios it measured, and the summary takes the latest run's.
RATIOS = {
    "fp8kv_over_bf16": (("offline_fp8kv", "output_tok_s"), ("offline_bf16", "output_tok_s")),
    "b1_speed_over_gptfast": (("gptfast", "gptfast_b1_ms_per_token"), ("decode_b1", "decode_b1_ms_per_token")),
    "services_vs_offline": (("services", "output_tok_s"), ("offline_subset", "output_tok_s")),
    "colocated_vs_offline": (("colocated", "output_tok_s"), ("offline_subset", "output_tok_s")),
    "services_small_prefill_vs_offline": (("services_small_prefill", "output_tok_s"), ("offline_subset", "output_tok_s")),
    "services_own_weights_vs_offline": (("services_own_weights", "output_tok_s"), ("offline_subset", "output_tok_s")),
    "services_no_mps_vs_offline": (("services_no_mps", "output_tok_s"), ("offline_subset", "output_tok_s")),
    "services_whole_prefill_context_vs_offline": (("services_whole_prefill_context", "output_tok_s"),
                                                  ("offline_subset", "output_tok_s")),
}


def run_ratios(sections: dict, names: list[str]) -> dict:
    """The ratios whose two sections are both among `names` (one run's) and succeeded."""
    ratios = {}
    for key, ((num, num_key), (den, den_key)) in RATIOS.items():
        if num in names and den in names:
            value = _ratio(_get(sections, num, num_key), _get(sections, den, den_key))
            if value is not None:
                ratios[key] = value
    return ratios


def summarize(sections: dict, runs: list[dict] | None = None) -> dict:
    """The issue's keys from the sections' results (None where a section is missing or failed).

    With `runs` (the file's run records), each ratio is the one the latest run that measured both
    its sections recorded (`run_ratios`), or None when no run did; without `runs`, or for a
    record from before runs kept their ratios, the quotient of what the sections hold."""
    g = lambda name, key: _get(sections, name, key)  # noqa: E731
    summary = {
        "offline_bf16_out_tok_s": g("offline_bf16", "output_tok_s"),
        "offline_fp8kv_out_tok_s": g("offline_fp8kv", "output_tok_s"), "fp8kv_over_bf16": None,
        "offline_fp8_out_tok_s": g("offline_fp8", "output_tok_s"),
        "decode_b1_ms_per_token": g("decode_b1", "decode_b1_ms_per_token"),
        "weight_read_floor_ms": g("decode_b1", "weight_read_floor_ms"),
        "decode_b1_roofline_fraction": g("decode_b1", "decode_b1_roofline_fraction"),
        "gptfast_b1_ms_per_token": g("gptfast", "gptfast_b1_ms_per_token"), "b1_speed_over_gptfast": None,
        "services_out_tok_s": g("services", "output_tok_s"), "colocated_out_tok_s": g("colocated", "output_tok_s"),
        "offline_subset_out_tok_s": g("offline_subset", "output_tok_s"),
        "services_vs_offline": None, "colocated_vs_offline": None, "services_small_prefill_vs_offline": None,
        "services_own_weights_vs_offline": None, "services_no_mps_vs_offline": None,
        "services_whole_prefill_context_vs_offline": None,
        "online_ttft_p50_ms": _round(g("online", "ttft_p50_ms")),
        "online_tpot_p50_ms": _round(g("online", "tpot_p50_ms")),
        "online_colocated_ttft_p50_ms": _round(g("online_colocated", "ttft_p50_ms")),
        "online_colocated_tpot_p50_ms": _round(g("online_colocated", "tpot_p50_ms")),
        "max_rate_within_slo": g("max_rate", "max_rate_within_slo"),
        "copy_GBps": g("ceilings", "copy_GBps"), "matmul_bf16_TFLOPs": g("ceilings", "matmul_bf16_TFLOPs"),
        "matmul_fp8_TFLOPs": g("ceilings", "matmul_fp8_TFLOPs"),
    }
    for key, ((num, num_key), (den, den_key)) in RATIOS.items():
        quotient = _ratio(g(num, num_key), g(den, den_key))
        if runs is None:
            summary[key] = quotient
            continue
        touched = [run for run in runs if {num, den} & set(run.get("sections", ()))]
        both = [run for run in touched if {num, den} <= set(run.get("sections", ()))]
        if both and isinstance(both[-1].get("ratios"), dict):
            summary[key] = both[-1]["ratios"].get(key)
        elif both and touched[-1] is both[-1]:  # an older record, and no later run measured either
            summary[key] = quotient
    return summary


def small_batch(sections: dict) -> dict:
    """Group S's decode rows: {section: {"ms", "vs_default"}}, ms a step (a token at batch 1) and
    the default's ms over it (> 1: the variant is faster), against decode_b1 / decode_b4 as
    the same file holds them."""
    out = {}
    for name in GROUPS["S"]:
        if not name.startswith("decode_b"):
            continue
        batch = name.split("_")[1]  # "b1", "b4"
        key = f"decode_{batch}_ms_per_{'token' if batch == 'b1' else 'step'}"
        ms = _get(sections, name, key)
        if ms is not None:
            out[name] = {"ms": ms, "vs_default": _ratio(_get(sections, f"decode_{batch}", key), ms)}
    return out


def _round(x: Any) -> Any:
    return round(x, 2) if isinstance(x, float) else x


def format_table(summary: dict) -> str:
    rows = [("key", "measured", "goal", "met")]
    for key, value in summary.items():
        op, goal = GOALS.get(key, ("", 0))
        met = "" if not op or value is None else ("yes" if (value >= goal if op == ">=" else value <= goal) else "NO")
        rows.append((key, "-" if value is None else f"{value:g}" if isinstance(value, (int, float)) else str(value),
                     f"{op} {goal:g}" if op else "", met))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


# ---------------------------------------------------------------- running sections

def run_child(section: Section, ctx: Context, timeout_s: float) -> dict:
    """`section` in a child process (this file with --child); killed with its process group at
    timeout_s. Its stdout and stderr pass through to ours."""
    spec = ctx.work / f"child-{section.name}.json"
    out = ctx.work / f"child-{section.name}.out.json"
    out.unlink(missing_ok=True)
    spec.write_text(json.dumps({"section": section.name, "args": vars(ctx.args), "model_dir": str(ctx.model_dir),
                                "work": str(ctx.work), "ceilings": ctx.ceilings, "deadline": time.time() + timeout_s,
                                "out": str(out), "earlier": ctx.earlier}, default=str))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec)], cwd=REPO, env=env,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"error": f"timed out: the section's budget of {timeout_s:.0f} s ran out (killed)"}
    if out.is_file():
        return json.loads(out.read_text())
    return {"error": f"the child process exited {rc} without a result"}


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    args = argparse.Namespace(**spec["args"])
    ctx = Context(args, Path(spec["model_dir"]), Path(spec["work"]), spec["ceilings"], spec["deadline"],
                  earlier=spec.get("earlier", {}))
    try:
        res = SECTIONS[spec["section"]].fn(ctx)
    except Exception as exc:
        res = {"error": f"{type(exc).__name__}: {exc}"[:2000], "trace": traceback.format_exc()[-3000:]}
    Path(spec["out"]).write_text(json.dumps(res, indent=1, default=str))
    return 0


def run_section(section: Section, ctx: Context) -> dict:
    if section.where == "child":
        return run_child(section, ctx, max(1.0, ctx.left()))
    try:
        return section.fn(ctx)
    except Exception as exc:  # record and go on: one broken section must not hide the others
        res = {"error": f"{type(exc).__name__}: {exc}"[:2000], "trace": traceback.format_exc()[-3000:]}
        if section.where == "cluster" and ctx.clusters is not None:
            mode = ctx.clusters.mode or ("colocated" if "colocated" in section.name else "disagg")
            res["log_tails"] = ctx.clusters.log_tails(mode)
            ctx.clusters.close()  # a cluster in an unknown state is not reused
        return res


# ---------------------------------------------------------------- command line

def _names(text: str, flag: str) -> list[str]:
    out: list[str] = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item in GROUPS:
            out += GROUPS[item]
        elif item in SECTIONS:
            out.append(item)
        else:
            raise argparse.ArgumentTypeError(f"{flag}: unknown section or group {item!r} "
                                             f"(groups: A, B, S; sections: {', '.join(SECTIONS)})")
    return out


def _budgets(text: str) -> dict[str, float]:
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, value = item.partition("=")
        if name not in SECTIONS:
            raise argparse.ArgumentTypeError(f"--budget: unknown section {name!r}")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds < math.inf:
            raise argparse.ArgumentTypeError(f"--budget: {name} needs a number of seconds > 0, got {value!r}")
        out[name] = seconds
    return out


def _rates(text: str) -> list[float]:
    try:
        rates = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        rates = []
    if not rates or any(not 0 < r < math.inf for r in rates) or rates != sorted(set(rates)):
        raise argparse.ArgumentTypeError(f"--rates: an increasing comma list of rates > 0, got {text!r}")
    return rates


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not value > 0:
            raise argparse.ArgumentTypeError(f"must be a {kind.__name__} > 0, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(REPO / "bench/results/h200_throughput.json"), help="where the JSON goes")
    p.add_argument("--merge", default=None, metavar="FILE", help="start from this results file (an earlier group)")
    p.add_argument("--only", default="", help="comma list of sections or groups (A, B, S) to run; default: all")
    p.add_argument("--skip", default="", help="comma list of sections or groups to leave out")
    p.add_argument("--budget", default="", help="per-section time budgets, NAME=SECONDS,... (see --dry-run)")
    p.add_argument("--deadline-s", type=_positive(float), default=560.0,
                   help="the whole run's limit: no section starts or runs past it (default %(default)g)")
    p.add_argument("--dry-run", action="store_true", help="print the sections, groups and budgets; run nothing")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="a Hugging Face model directory to run instead of the Llama-3.1-8B shape (dummy weights "
                        "either way); a tiny one runs the cluster sections on a CPU, as the tests do")
    p.add_argument("--up-args", default="", help="more `tandem up` flags for every cluster section, space-separated")
    p.add_argument("--log-dir", default=None, help="keep the clusters' logs here (default: a temporary directory)")
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=_positive(int), default=1024)
    w.add_argument("--output-len", type=_positive(int), default=1024, help="offline and services output length")
    w.add_argument("--offline-prompts", type=_positive(int), default=1000)
    w.add_argument("--max-running", type=_positive(int), default=None, help="offline: default derived, as LLM's")
    w.add_argument("--services-prompts", type=_positive(int), default=512)
    o = p.add_argument_group("online (tandem bench against tandem up)")
    o.add_argument("--online-output-len", type=_positive(int), default=256)
    o.add_argument("--online-rate", type=_positive(float), default=2.0)
    o.add_argument("--online-requests", type=_positive(int), default=80)
    o.add_argument("--rates", type=_rates, default=[8.0, 12.0, 16.0, 20.0, 24.0], help="max_rate's rates, increasing")
    o.add_argument("--rate-refine", type=int, default=1, help="bisections after the first rate missing the SLO")
    o.add_argument("--point-s", type=_positive(float), default=12.0, help="seconds of arrivals per rate")
    o.add_argument("--point-min-requests", type=_positive(int), default=100)
    o.add_argument("--point-max-s", type=_positive(float), default=60.0, help="hard limit of one rate's run")
    o.add_argument("--slo-ttft-ms", type=_positive(float), default=500.0, help="TTFT P99 target")
    o.add_argument("--slo-tpot-ms", type=_positive(float), default=25.0, help="TPOT P99 target")
    return p


def plan(a: argparse.Namespace, p: argparse.ArgumentParser) -> list[tuple[Section, float]]:
    try:
        only = _names(a.only, "--only") or list(SECTIONS)
        skip = set(_names(a.skip, "--skip"))
        budgets = _budgets(a.budget)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if a.rate_refine < 0:
        p.error(f"--rate-refine: must be >= 0, got {a.rate_refine}")
    if a.model is not None and not (Path(a.model) / "config.json").is_file():
        p.error(f"--model: no config.json in {a.model}")
    if a.merge is not None and not Path(a.merge).is_file():
        p.error(f"--merge: no such file {a.merge}")
    chosen = [SECTIONS[n] for n in SECTIONS if n in only and n not in skip]  # the table's order
    if not chosen:
        p.error("--only/--skip: no section left to run")
    return [(s, budgets.get(s.name, s.budget_s)) for s in chosen]


def print_plan(steps: list[tuple[Section, float]], deadline_s: float) -> None:
    print(f"{'section':<28} {'group':<5} {'budget_s':>8} {'expect_s':>8}  {'runs in':<8} what")
    for s, b in steps:
        print(f"{s.name:<28} {s.group or '-':<5} {b:>8g} {s.expect_s:>8g}  {s.where:<8} {s.what}")
    print(f"expected {sum(s.expect_s for s, _ in steps):g} s in all (budgets sum to {sum(b for _, b in steps):g}); "
          f"no section starts or runs past --deadline-s {deadline_s:g}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 2 and argv[0] == "--child":
        return child_main(argv[1])
    p = build_parser()
    try:
        a = p.parse_args(argv)
        steps = plan(a, p)
    except SystemExit as exc:
        return int(exc.code or 0)
    if a.dry_run:
        print_plan(steps, a.deadline_s)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    t0 = time.time()
    result: dict[str, Any] = json.loads(Path(a.merge).read_text()) if a.merge else {}
    sections: dict = result.setdefault("sections", {})
    run_record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join(["python3", "bench/throughput_bench.py", *argv]),
                  "sections": [s.name for s, _ in steps], "section_seconds": {}}
    result.setdefault("runs", []).append(run_record)
    result["model"] = f"{a.model}, dummy weights" if a.model else "Llama-3.1-8B shape, dummy weights"
    result["goals"] = {k: f"{op} {g:g}" for k, (op, g) in GOALS.items() if op}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = False

    def write() -> None:
        run_record["ratios"] = run_ratios(sections, list(run_record["section_seconds"]))  # what this run measured
        result.update(summarize(sections, result["runs"]))
        result["small_batch"] = small_batch(sections)
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    gpu = this_gpu_name()
    with tempfile.TemporaryDirectory(prefix="throughput-bench-") as tmp:
        work = Path(tmp)
        from bench.h200_bench import LLAMA31_8B, write_model

        model_dir = Path(a.model) if a.model else write_model(work / "llama31-8b", LLAMA31_8B)
        clusters = Clusters(model_dir, Path(a.log_dir) if a.log_dir else work, a.up_args.split())
        try:
            for section, budget in steps:
                left = t0 + a.deadline_s - time.time()
                if left < 20:
                    sections[section.name] = {"error": f"not run: --deadline-s {a.deadline_s:g} reached"}
                    failed = True
                    write()
                    continue
                if section.where != "cluster" and clusters.proc is not None:
                    clusters.close()  # GPU sections get the whole device
                ceil = run_ceilings_for(sections.get("ceilings"), gpu)
                ctx = Context(a, model_dir, work, ceil, time.time() + min(budget, left), clusters, sections)
                log(f"== {section.name} (budget {min(budget, left):.0f} s)")
                t = time.time()
                res = run_section(section, ctx)
                res["wall_s"] = round(time.time() - t, 1)
                if "assumed" in ceil and section.name != "ceilings":
                    res["ceilings_assumed"] = ceil["assumed"]  # its fractions are read against KNOWN_CEILINGS
                sections[section.name] = res
                failed |= "error" in res
                run_record["section_seconds"][section.name] = res["wall_s"]
                log(section.name, json.dumps({k: v for k, v in res.items() if k not in ("trace", "log_tails")},
                                             default=str)[:600])
                write()
        finally:
            clusters.close()
    run_record["total_s"] = round(time.time() - t0, 1)
    write()
    log(f"wrote {out}")
    for name, row in result["small_batch"].items():  # group S's rows, before the table
        print(f"{name:<28} {row['ms']:>8.3f} ms  default/this {row['vs_default']}", flush=True)
    for weight, us in (_get(sections, "gemv_sweep", "gemv_us_at_1_row") or {}).items():
        tiling = (_get(sections, "gemv_sweep", "best_tilings") or {}).get(weight)
        print(f"gemv {weight:<23} cuBLAS {us.get('cublas')} us, fused {us.get('fused')} us ({tiling})", flush=True)
    print(format_table(summarize(sections, result["runs"])), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""bench/throughput_bench.py's GPU sections, each run in a child process of its own (a fresh CUDA
context): the ceilings, batch-1 and small-batch decode and their variants, the GEMV tiling sweeps,
the offline runs and the gpt-fast peer. A section is `fn(ctx) -> dict`; the wrappers here
(`with_*`) set an engine variable in the child before the engine reads it."""
from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from typing import Any

from bench.throughput_context import Context, section_value

# Each GPU's ceilings as this bench's `ceilings` section measured them (H200: §37's run; H100: §43's),
# used only by a run that has none measured on its own GPU: its fractions are then marked "assumed".
KNOWN_CEILINGS = {
    "H200": {"copy_GBps": 4240.8, "matmul_bf16_TFLOPs": 763.5, "matmul_fp8_TFLOPs": 1343.0},
    "H100": {"copy_GBps": 3024.7, "matmul_bf16_TFLOPs": 792.6, "matmul_fp8_TFLOPs": 1439.6},
}
B1_PROMPT = list(range(100, 228))  # decode_b1's prompt (bench/h200_bench.py)
B1_WARMUP, B1_STEPS = 5, 200


def need_cuda() -> None:
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
    need_cuda()
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
    need_cuda()
    from bench.h200_bench import LLAMA31_8B, decode_b1

    return decode_b1(ctx.model_dir, LLAMA31_8B, ctx.ceilings)


def run_decode_b1_no_pdl(ctx: Context) -> dict:
    """decode_b1 without programmatic dependent launch: this child's kernels see TANDEM_PDL=0."""
    from tandem_kernels.triton_common import PDL_ENV

    os.environ[PDL_ENV] = "0"
    return run_decode_b1(ctx)


def run_decode_b1_unfused(ctx: Context) -> dict:
    """decode_b1 with fused_decode_gemv off: every projection through cuBLAS (the default before §32)."""
    need_cuda()
    from bench.h200_bench import LLAMA31_8B, decode_b1

    return decode_b1(ctx.model_dir, LLAMA31_8B, ctx.ceilings, fused=False)


def run_decode_b1_fp8(ctx: Context) -> dict:
    """decode_b1 with FP8 weights (--quantization fp8): on a measured GPU all four projections
    as fused GEMVs over the e4m3 weights, activations unquantized (engine/model.py
    fused_decode_projections); the floor is read at the FP8 weights' bytes."""
    need_cuda()
    from bench.h200_bench import LLAMA31_8B, decode_b1

    return decode_b1(ctx.model_dir, LLAMA31_8B, ctx.ceilings, quantization="fp8")


def run_decode_b1_fp8_unfused(ctx: Context) -> dict:
    """decode_b1_fp8 with fused_decode_gemv off: cuBLASLt's FP8 GEMM, activations quantized per token."""
    need_cuda()
    from bench.h200_bench import LLAMA31_8B, decode_b1

    return decode_b1(ctx.model_dir, LLAMA31_8B, ctx.ceilings, fused=False, quantization="fp8")


def run_decode_b1_fused_gemv(ctx: Context) -> dict:
    """decode_b1 with EngineConfig.fused_decode_gemv True: the projections TANDEM_FUSED_GEMV names
    (else all four) as Triton GEMVs (tandem_kernels.gemv), the others cuBLAS."""
    need_cuda()
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
    need_cuda()
    from bench.h200_bench import gpu_parity

    (ctx.work / "parity").mkdir(parents=True, exist_ok=True)
    return gpu_parity(ctx.work / "parity", ["llama", "qwen3", "glm4"])


def run_gemv_sweep(ctx: Context, fp8: bool = False) -> dict:
    """kernel_bench's --gemv-sweep over GEMV_AB_TILINGS at GEMV_AB_WEIGHTS and GEMV_AB_ROWS (`fp8`:
    e4m3 weights against cuBLASLt's FP8 GEMM), with `best_tilings`: each weight's fastest tiling
    at 1 row, as TANDEM_GEMV_TILING takes it (and at each row count, best_tilings_by_rows)."""
    need_cuda()
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
    need_cuda()
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



def decode_section(batch: int, tuning: dict | None = None, fused: str = "", prompt_len: int = 128,
            quantization: str | None = None) -> Callable[[Context], dict]:
    """A section: h200_bench's decode_b1 at `batch` sequences of `prompt_len`-token prompts
    (`quantization`: the weights', as decode_b1 takes it); `tuning`: TANDEM_DECODE_TUNING's
    fields in this child; `fused`: the projections TANDEM_FUSED_GEMV names, as fused GEMVs at
    `batch` rows with the earlier gemv_sweep's (gemv_sweep_fp8's for FP8 weights) best tilings at
    `batch` rows (else at one row; TANDEM_GEMV_TILING) where this run measured them (else the
    GPU's, tandem_kernels/gemv_tilings.py)."""
    def section(ctx: Context) -> dict:
        need_cuda()
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
            tilings = (section_value(ctx.earlier, sweep, "best_tilings_by_rows") or {}).get(str(batch)) \
                or (section_value(ctx.earlier, f"{sweep}_b{batch}", "best_tilings_by_rows") or {}).get(str(batch)) \
                or section_value(ctx.earlier, sweep, "best_tilings")
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


def with_cublas_workspace(run: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """`run` with torch's cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8), where an engine's
    process has none by default (engine/cublas.py): cuBLAS may then choose its split-K kernels
    again (BENCHMARKS.md §17, §24-25: batch-1 decode 1.3-1.4% slower with them)."""
    return _with_env(run, lambda: CUBLAS_WORKSPACE)


def _engine_env(run: Callable[[Context], dict], module: str, name: str, value: str) -> Callable[[Context], dict]:
    """`run` with the variable that `module`.`name` names set to `value` (the module is imported in
    the child, as `_with_env` calls it, so no engine import reaches the parent)."""
    return _with_env(run, lambda: {getattr(importlib.import_module(module), name): value})


def with_fused_rotary(run: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """`run` with TANDEM_FUSED_ROTARY=1: decode-only steps rotate and store their K/V inside the
    decode attention kernel (engine/attention.py)."""
    return _engine_env(run, "engine.attention", "FUSED_ROTARY_ENV", "1")


def with_nano_batch(run: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """`run` with TANDEM_NANO_BATCH=auto: a decode graph of at least engine.nano_batch.MIN_ROWS
    rows runs two halves on two streams, one half's attention beside the other's GEMMs, where that
    replays faster than the plain step at a full context (engine/nano_batch.py,
    engine/cuda_graphs.py; the engine's log names the buckets)."""
    return _engine_env(run, "engine.nano_batch", "NANO_BATCH_ENV", "auto")


def with_cached_kv(run: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """`run` with TANDEM_EXTEND_NEW_KV=0: prefill attention reads every key and value from the
    cache, the new tokens' too (the behaviour before BENCHMARKS.md §30-31; engine/attention.py)."""
    return _engine_env(run, "engine.attention", "EXTEND_NEW_KV_ENV", "0")


def with_balanced_rounds(run: Callable[[Context], dict]) -> Callable[[Context], dict]:
    """`run` with TANDEM_DECODE_TUNING={"balance_rounds": true}: decode attention splits each
    context where a batch's programs would leave their last round of resident programs less than
    0.9 full (tandem_kernels.decode_attention.balanced_splits; an H100's 210-sequence bf16 batch
    runs two splits a sequence)."""
    return _engine_env(run, "tandem_kernels.decode_attention", "TUNING_ENV", '{"balance_rounds": true}')


def run_offline(ctx: Context, kv: str, quantization: str | None, max_running: int | None = None,
             kv_layout: str = "nhd") -> dict:
    """The offline workload; `max_running` (else --max-running, else derived) caps the batch;
    `kv_layout` is the KV cache's (EngineConfig.kv_cache_layout)."""
    need_cuda()
    from bench.h200_bench import offline

    a = ctx.args
    return offline(ctx.model_dir, a.offline_prompts, a.input_len, a.output_len, kv=kv,
                   max_running=max_running or a.max_running, quantization=quantization, kv_layout=kv_layout)


def run_offline_fp8_deferred_scales(ctx: Context) -> dict:
    """offline_fp8 with the FP8 scales deferred to the kernels that read the products: this
    child's model is built with TANDEM_FP8_DEFERRED_SCALES=1."""
    return _engine_env(lambda c: run_offline(c, "fp8", "fp8"), "engine.quant.fp8", "DEFERRED_SCALES_ENV", "1")(ctx)


def run_offline_bf16_untimed_buckets(ctx: Context) -> dict:
    """offline_bf16 with every decode graph up to the batch cap kept, untimed, as before timed
    buckets (engine/cuda_graphs.py): this child sees TANDEM_TIMED_BUCKETS=0."""
    return _engine_env(lambda c: run_offline(c, "auto", None), "engine.cuda_graphs", "TIMED_BUCKETS_ENV", "0")(ctx)


def run_offline_2d_tile(ctx: Context, quantization: str | None) -> dict:
    """An FP8-KV offline section with FP8_TUNING (the 2-D tile kernel) at every batch, as before
    the warp-split kernel took the full batches (BENCHMARKS.md §23): this child's
    TANDEM_DECODE_TUNING holds all of FP8_TUNING's fields."""
    import dataclasses

    from tandem_kernels.decode_attention import FP8_TUNING, TUNING_ENV

    os.environ[TUNING_ENV] = json.dumps(dataclasses.asdict(FP8_TUNING))
    return run_offline(ctx, "fp8", quantization)


def run_gptfast(ctx: Context) -> dict:
    need_cuda()
    from bench.gptfast_peer import measure

    return measure(ctx.model_dir, B1_PROMPT, B1_WARMUP, B1_STEPS, load_format="dummy")


def run_offline_subset(ctx: Context) -> dict:
    need_cuda()
    from bench.up_bench import make_prompts, offline

    a = ctx.args
    return offline(ctx.model_dir, make_prompts(a.services_prompts, a.input_len, ctx.vocab_size), a.output_len)

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

This file holds the table of sections, the runner and the command line; the sections themselves
are in bench/throughput_gpu.py (child processes) and bench/throughput_clusters.py (against
`tandem up`), the summary and its goals in bench/throughput_summary.py, and what they share
(`Section`, `Context`) in bench/throughput_context.py.
"""
from __future__ import annotations

import argparse
import datetime
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.throughput_clusters import Clusters, run_max_rate, run_online, run_services  # noqa: E402
from bench.throughput_context import Context, Section, log, section_value  # noqa: E402
from bench.throughput_gpu import (  # noqa: E402
    ALL_FUSED, SMALL_BATCH_TUNING, decode_section, run_ceilings, run_ceilings_for, run_decode_b1,
    run_decode_b1_fp8, run_decode_b1_fp8_unfused, run_decode_b1_fused_gemv, run_decode_b1_no_pdl,
    run_decode_b1_unfused, run_gemv_sweep, run_gemv_sweep_b4, run_gptfast, run_gpu_parity, run_offline,
    run_offline_2d_tile, run_offline_bf16_untimed_buckets, run_offline_fp8_deferred_scales, run_offline_subset,
    this_gpu_name, with_balanced_rounds, with_cached_kv, with_cublas_workspace, with_fused_rotary,
    with_nano_batch)
from bench.throughput_summary import GOALS, format_table, goal_text, run_ratios, small_batch, summarize  # noqa: E402


def _small_batch_sections(batch: int, what: str) -> list[Section]:
    """decode_b<batch>, with all four projections fused, and both with FP8 weights (group S)."""
    name = f"decode_b{batch}"
    return [
        Section(name, "S", 75, 35, "child", decode_section(batch), what),
        Section(f"{name}_fused_all", "S", 75, 35, "child", decode_section(batch, fused=ALL_FUSED),
                f"{name}, all four projections as fused GEMVs"),
        Section(f"{name}_fp8", "S", 90, 45, "child", decode_section(batch, quantization="fp8"),
                f"{name} with FP8 weights (fused where gemv_tilings.FP8_DEVICE_ROWS or TANDEM_FUSED_GEMV_ROWS "
                f"reach {batch} rows, else cuBLASLt's FP8 GEMM)"),
        Section(f"{name}_fp8_fused_all", "S", 90, 45, "child", decode_section(batch, fused=ALL_FUSED, quantization="fp8"),
                f"{name}_fp8, all four projections as fused GEMVs over the e4m3 weights"),
    ]

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


# An online section's (budget, expected) seconds: a new cluster's start (19-26 s on an H100), 80
# requests sent over 40 s at 2 req/s, and the point's 15 s margin for the last ones to finish; at
# 75 s a 26 s start cut the sending short (BENCHMARKS.md §51).
ONLINE_BUDGET = (95, 65)

SECTIONS: dict[str, Section] = {s.name: s for s in [
    Section("ceilings", "A", 45, 15, "child", run_ceilings, "device copy GB/s, bf16 and FP8 matmul TFLOP/s"),
    Section("decode_b1", "A", 75, 35, "child", run_decode_b1, "ours, batch 1, ms/token vs the weight-read floor"),
    # The offline runs' budgets leave room for an 80 GB H100 (~0.7 of an H200's speed here; offline_bf16 ran
    # past 150 s on one, BENCHMARKS §35).
    Section("offline_bf16", "A", 220, 120, "child", lambda c: run_offline(c, "auto", None), "offline, bf16 weights + KV"),
    Section("offline_fp8kv", "A", 200, 110, "child", lambda c: run_offline(c, "fp8", None), "bf16 weights, FP8 KV"),
    Section("offline_fp8", "A", 180, 100, "child", lambda c: run_offline(c, "fp8", "fp8"), "FP8 weights + FP8 KV"),
    Section("gptfast", "A", 200, 130, "child", run_gptfast, "gpt-fast-style peer, batch 1 (compiles first)"),
    Section("services", "B", 130, 90, "cluster", run_services, "`tandem up` (P + D on one GPU), 512 prompts"),
    Section("online", "B", *ONLINE_BUDGET, "cluster", run_online, "`tandem up`, Poisson 2 req/s, 1024/256"),
    Section("max_rate", "B", 170, 125, "cluster", run_max_rate, "`tandem up`, highest rate within the SLO"),
    Section("colocated", "B", 110, 80, "cluster", lambda c: run_services(c, "colocated"), "`tandem up --colocated`"),
    Section("online_colocated", "B", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "colocated"),
            "--colocated, 2 req/s"),
    Section("online_hold_reserving", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "disagg_hold_reserving"),
            "online with --gpu-turn-hold reserving: the held launch's cost on TPOT against `online` (always)"),
    Section("online_gil_100us", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "disagg_gil_100us"),
            "online with the workers' GIL switch interval at 0.1 ms (TANDEM_GIL_SWITCH_US; 0.5 ms by default): "
            "whether the held launch waits for the GIL"),
    Section("services_own_weights", "", 130, 90, "cluster", lambda c: run_services(c, "disagg_own_weights"),
            "`tandem up --no-share-weights`: a copy of the weights each, the decode worker's K/V smaller by one"),
    Section("online_own_weights", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "disagg_own_weights"),
            "online with --no-share-weights (TTFT / TPOT against `online`)"),
    Section("online_fp8", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "disagg_fp8"),
            "online with FP8 weights (`tandem up --quantization fp8`; TTFT / TPOT against `online`)"),
    Section("max_rate_fp8", "", 170, 125, "cluster", lambda c: run_max_rate(c, "disagg_fp8"),
            "max_rate with FP8 weights"),
    Section("online_colocated_fp8", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "colocated_fp8"),
            "online_colocated with FP8 weights"),
    Section("online_fp8_one_row", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "disagg_fp8_one_row"),
            "online_fp8 with fused GEMVs at one row only (TANDEM_FUSED_GEMV_ROWS=1): steps of 2+ sequences "
            "through cuBLASLt's FP8 GEMM, against online_fp8's fused ones"),
    Section("online_no_mps", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "disagg_no_mps"),
            "online with `tandem up --no-mps`: turns at every batch, where `online` runs under MPS on a GPU with "
            "its tools (turns only while the decode batch is small; BENCHMARKS.md §46-47)"),
    Section("services_no_mps", "", 130, 90, "cluster", lambda c: run_services(c, "disagg_no_mps"),
            "services with `tandem up --no-mps`"),
    Section("max_rate_no_mps", "", 170, 125, "cluster", lambda c: run_max_rate(c, "disagg_no_mps"),
            "max_rate with `tandem up --no-mps`"),
    Section("online_fp8_no_mps", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "disagg_fp8_no_mps"),
            "online_fp8 with `tandem up --no-mps`"),
    Section("max_rate_fp8_no_mps", "", 170, 125, "cluster", lambda c: run_max_rate(c, "disagg_fp8_no_mps"),
            "max_rate_fp8 with `tandem up --no-mps` (BENCHMARKS.md §46: 24 req/s on an H100, 26 under MPS)"),
    Section("online_mps_no_turn", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "disagg_mps_no_turn"),
            "online with --mps --no-gpu-turn: side by side at every batch (BENCHMARKS.md §45: TTFT P50 +4-5 ms)"),
    Section("online_fp8_mps_no_turn", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "disagg_fp8_mps_no_turn"),
            "online_fp8 with --mps --no-gpu-turn"),
    Section("max_rate_fp8_mps_no_turn", "", 170, 125, "cluster", lambda c: run_max_rate(c, "disagg_fp8_mps_no_turn"),
            "max_rate_fp8 with --mps --no-gpu-turn"),
    Section("online_mps_layer_push", "", *ONLINE_BUDGET, "cluster", lambda c: run_online(c, "disagg_mps_layer_push"),
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
    Section("decode_b1_attn_prefetch", "S", 75, 35, "child", decode_section(1, SMALL_BATCH_TUNING),
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
    Section("decode_b1_fp8_fused_all", "S", 90, 45, "child", decode_section(1, fused=ALL_FUSED, quantization="fp8"),
            "decode_b1_fp8, all four projections as fused GEMVs at gemv_sweep_fp8's tilings (on any GPU)"),
    Section("decode_b1_fused_qkv_o", "S", 75, 35, "child", decode_section(1, fused="qkv,o_proj"),
            "decode_b1, qkv (norm folded in) and o_proj as fused GEMVs, gemv_sweep's tilings"),
    Section("decode_b1_fused_qkv_o_down", "S", 75, 35, "child", decode_section(1, fused="qkv,o_proj,down"),
            "decode_b1, qkv, o_proj and down as fused GEMVs"),
    Section("decode_b1_fused_o_down", "S", 75, 35, "child", decode_section(1, fused="o_proj,down"),
            "decode_b1, o_proj and down as fused GEMVs"),
    Section("decode_b1_fused_all", "S", 75, 35, "child", decode_section(1, fused=ALL_FUSED),
            "decode_b1, all four projections as fused GEMVs (norms and SiLU inside)"),
    *_small_batch_sections(2, "2 sequences, ms a step"),
    *_small_batch_sections(4, "4 sequences (the online TPOT's batch), ms a step"),
    Section("decode_b4_attn_prefetch", "S", 75, 35, "child", decode_section(4, SMALL_BATCH_TUNING),
            "decode_b4 with decode attention's first tile before the wait"),
    Section("decode_b4_fused_qkv_o", "S", 75, 35, "child", decode_section(4, fused="qkv,o_proj"),
            "decode_b4, qkv and o_proj as fused GEMVs"),
    Section("decode_b4_ctx1024", "", 75, 35, "child", decode_section(4, prompt_len=1024),
            "4 sequences of 1,024-token prompts: the online TPOT's step (its attention reads ~4% of the weights' bytes, at a third of copy speed)"),
    Section("decode_b1_no_pdl", "", 75, 35, "child", run_decode_b1_no_pdl,
            "decode_b1 with TANDEM_PDL=0 (no programmatic dependent launch)"),
    Section("decode_b1_cublas_workspace", "", 75, 35, "child", with_cublas_workspace(run_decode_b1),
            "decode_b1 with CUBLAS_WORKSPACE_CONFIG=:4096:8 (torch's workspace: split-K GEMMs allowed)"),
    Section("decode_b1_fused_gemv", "", 75, 35, "child", run_decode_b1_fused_gemv,
            "decode_b1 with fused_decode_gemv (TANDEM_FUSED_GEMV: which projections; TANDEM_GEMV_TILING)"),
    Section("decode_b1_fused_rotary", "", 75, 35, "child", with_fused_rotary(run_decode_b1),
            "decode_b1 with TANDEM_FUSED_ROTARY=1 (rotary + the step's K/V store inside decode attention)"),
    Section("offline_fp8_nano_batch", "", 125, 100, "child", with_nano_batch(lambda c: run_offline(c, "fp8", "fp8")),
            "offline_fp8 with TANDEM_NANO_BATCH=auto (full decode batches as two overlapped halves where faster)"),
    Section("offline_fp8kv_nano_batch", "", 140, 110, "child", with_nano_batch(lambda c: run_offline(c, "fp8", None)),
            "offline_fp8kv with TANDEM_NANO_BATCH=auto"),
    Section("offline_bf16_nano_batch", "", 150, 120, "child", with_nano_batch(lambda c: run_offline(c, "auto", None)),
            "offline_bf16 with TANDEM_NANO_BATCH=auto"),
    Section("offline_bf16_balance_rounds", "", 150, 120, "child",
            with_balanced_rounds(lambda c: run_offline(c, "auto", None)),
            "offline_bf16 with decode attention's splits filling the last round of programs (balance_rounds)"),
    Section("offline_fp8kv_balance_rounds", "", 140, 110, "child",
            with_balanced_rounds(lambda c: run_offline(c, "fp8", None)),
            "offline_fp8kv with balance_rounds"),
    Section("offline_bf16_fused_rotary", "", 150, 120, "child", with_fused_rotary(lambda c: run_offline(c, "auto", None)),
            "offline_bf16 with TANDEM_FUSED_ROTARY=1"),
    Section("offline_fp8_fused_rotary", "", 125, 100, "child", with_fused_rotary(lambda c: run_offline(c, "fp8", "fp8")),
            "offline_fp8 with TANDEM_FUSED_ROTARY=1"),
    Section("offline_fp8_cached_kv", "", 125, 100, "child", with_cached_kv(lambda c: run_offline(c, "fp8", "fp8")),
            "offline_fp8 with TANDEM_EXTEND_NEW_KV=0 (prefill attention reads the new tokens from the cache)"),
    Section("offline_fp8kv_cached_kv", "", 140, 110, "child", with_cached_kv(lambda c: run_offline(c, "fp8", None)),
            "offline_fp8kv with TANDEM_EXTEND_NEW_KV=0"),
    Section("offline_bf16_cached_kv", "", 150, 120, "child", with_cached_kv(lambda c: run_offline(c, "auto", None)),
            "offline_bf16 with TANDEM_EXTEND_NEW_KV=0"),
    Section("offline_fp8_deferred_scales", "", 125, 100, "child", run_offline_fp8_deferred_scales,
            "offline_fp8 with TANDEM_FP8_DEFERRED_SCALES=1 (unit-scale GEMMs, scales applied by the readers)"),
    Section("offline_bf16_untimed_buckets", "", 150, 120, "child", run_offline_bf16_untimed_buckets,
            "offline_bf16 with TANDEM_TIMED_BUCKETS=0 (every decode graph up to max_running, none timed)"),
    Section("offline_fp8kv_hnd", "", 140, 110, "child", lambda c: run_offline(c, "fp8", None, kv_layout="hnd"),
            "offline_fp8kv on a head-major KV cache (kv_cache_layout hnd: each head's slots of a block together)"),
    Section("offline_fp8_hnd", "", 125, 100, "child", lambda c: run_offline(c, "fp8", "fp8", kv_layout="hnd"),
            "offline_fp8 on a head-major KV cache (kv_cache_layout hnd)"),
    Section("offline_fp8kv_2d_tile", "", 140, 110, "child", lambda c: run_offline_2d_tile(c, None),
            "offline_fp8kv with FP8_TUNING at every batch (no warp-split kernel; TANDEM_DECODE_TUNING)"),
    Section("offline_fp8_2d_tile", "", 125, 100, "child", lambda c: run_offline_2d_tile(c, "fp8"),
            "offline_fp8 with FP8_TUNING at every batch (no warp-split kernel; TANDEM_DECODE_TUNING)"),
]}
GROUPS = {g: [n for n, s in SECTIONS.items() if s.group == g] for g in ("A", "B", "S")}
GROUPS["S"].insert(1, "decode_b1")  # S compares its variants with A's batch-1 row, in the same run


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
    p.add_argument("--only", default="", help="comma list of sections or groups (A, B, S) to run (a decode_* section "
                                          "brings `ceilings`: its fractions are of them); default: all")
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
    # The decode sections' fractions are of this machine's copy speed: a run with one measures the
    # ceilings too (15 s), since another machine's, even another card of the same kind, are off by
    # the machines' spread (BENCHMARKS.md §51); --skip ceilings leaves them out.
    floors = any(n.startswith("decode_") for n in only if n not in skip)
    chosen = [SECTIONS[n] for n in SECTIONS
              if (n in only or (n == "ceilings" and floors)) and n not in skip]  # the table's order
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
    result["goals"] = {k: goal_text(k) for k, (op, _) in GOALS.items() if op}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    failed = False

    def write() -> None:
        run_record["ratios"] = run_ratios(sections, list(run_record["section_seconds"]))  # what this run measured
        result.update(summarize(sections, result["runs"]))
        result["small_batch"] = small_batch(sections, GROUPS["S"])
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
    for weight, us in (section_value(sections, "gemv_sweep", "gemv_us_at_1_row") or {}).items():
        tiling = (section_value(sections, "gemv_sweep", "best_tilings") or {}).get(weight)
        print(f"gemv {weight:<23} cuBLAS {us.get('cublas')} us, fused {us.get('fused')} us ({tiling})", flush=True)
    print(format_table(summarize(sections, result["runs"])), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

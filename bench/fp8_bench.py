"""FP8 weights on one H200: kernel checks, a decoder layer's GEMMs bf16 vs FP8, the offline workload.

    python bench/fp8_bench.py --out bench/results/fp8_h200.json [--num-prompts 1000] [--baseline]

(a) each FP8 kernel (per-token quantize, RMSNorm / residual-add + RMSNorm + quantize,
    SiLU-and-multiply + quantize, and the cuBLASLt GEMM of tandem_kernels.ops.fp8_linear) against its
    torch reference at Llama-3.1-8B shapes, with its time next to the bf16 op it replaces;
(b) one decoder layer's GEMMs with the ops that feed them, bf16 (norm -> GEMM, GEMM, norm ->
    GEMM, SiLU-and-multiply -> GEMM) vs FP8 (the fused quantizing variants -> _scaled_mm), each
    captured in a CUDA graph, at M in {1, 16, 64, 256, 1024, 4096}; also the GEMMs alone;
(c) the offline workload (bench/h200_bench.py `offline`): FP8 weights + FP8 KV, 1024 in / 1024
    out, dummy weights of the 8B shape (--baseline adds bf16 weights + FP8 KV on the same prompts).
Budgeted to finish in under 9 minutes; prints a table and writes --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.h200_bench import LLAMA31_8B, log, median_ms, offline, write_model  # noqa: E402

H, I, Q, KV = 4096, 14336, 4096, 1024  # hidden, intermediate, q_size, kv_size (8 KV heads x 128)
M_SIZES = (1, 16, 64, 256, 1024, 4096)
# A decoder layer's four projections, [N, K] (out, in features).
LAYER_SHAPES = {"qkv": (Q + 2 * KV, H), "o": (H, Q), "gate_up": (2 * I, H), "down": (H, I)}


def e4m3_steps(got: torch.Tensor, want: torch.Tensor) -> dict:
    """How far two e4m3 tensors are apart: share of equal bytes, largest relative difference."""
    g, w = got.float(), want.float()
    rel = ((g - w).abs() / w.abs().clamp(min=2.0 ** -6)).max().item()
    return {"equal": round((got.view(torch.uint8) == want.view(torch.uint8)).float().mean().item(), 5),
            "max_rel": round(rel, 4)}


def kernels_check() -> dict:
    from tandem_kernels import ops, reference as ref

    res = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for m in (1, 256, 4096):
        x = torch.randn(m, H, device="cuda", generator=g, dtype=torch.bfloat16)
        r = torch.randn(m, H, device="cuda", generator=g, dtype=torch.bfloat16)
        w = torch.rand(H, device="cuda", generator=g, dtype=torch.bfloat16) + 0.5
        up = torch.randn(m, 2 * I, device="cuda", generator=g, dtype=torch.bfloat16)
        q, s, summed = ops.fused_add_rms_norm_fp8(x, r, w, 1e-5)
        rq, rs, rsum = ref.fused_add_rms_norm_fp8(x, r, w, 1e-5)
        entry = {"fused_add_rms_norm_fp8": {**e4m3_steps(q, rq), "scale_max_rel": _rel(s, rs),
                                            "residual_equal": bool(torch.equal(summed, rsum))}}
        q, s = ops.rms_norm_fp8(x, w, 1e-5)
        rq, rs = ref.rms_norm_fp8(x, w, 1e-5)
        entry["rms_norm_fp8"] = {**e4m3_steps(q, rq), "scale_max_rel": _rel(s, rs)}
        q, s = ops.silu_and_mul_fp8(up)
        rq, rs = ref.silu_and_mul_fp8(up)
        entry["silu_and_mul_fp8"] = {**e4m3_steps(q, rq), "scale_max_rel": _rel(s, rs)}
        q, s = ops.quantize_fp8_per_token(x)
        rq, rs = ref.quantize_fp8_per_token(x)
        entry["quantize_fp8_per_token"] = {**e4m3_steps(q, rq), "scale_max_rel": _rel(s, rs)}
        # The GEMM: cuBLASLt vs the float32 emulation on the same e4m3 operands.
        from engine.quant.fp8 import quantize_weight_per_channel

        wq, ws = quantize_weight_per_channel(torch.randn(Q + 2 * KV, H, device="cuda", generator=g) * 0.02)
        got = ops.fp8_linear(q, s, wq, ws, None, torch.bfloat16)
        want = ref.fp8_linear(q, s, wq, ws, None, torch.float32)
        entry["fp8_linear"] = {"scaled_mm": ops.scaled_mm_applies(q, wq, torch.bfloat16),
                               "rel_err_vs_fp32_emulation": _rel_norm(got.float(), want)}
        if m == 4096:  # the fused kernels' time against the bf16 ops they replace
            entry["ms"] = {
                "fused_add_rms_norm": median_ms(lambda: ops.fused_add_rms_norm(x, r, w, 1e-5)),
                "fused_add_rms_norm_fp8": median_ms(lambda: ops.fused_add_rms_norm_fp8(x, r, w, 1e-5)),
                "silu_and_mul": median_ms(lambda: ops.silu_and_mul(up)),
                "silu_and_mul_fp8": median_ms(lambda: ops.silu_and_mul_fp8(up)),
                "quantize_fp8_per_token": median_ms(lambda: ops.quantize_fp8_per_token(x)),
            }
        res[str(m)] = entry
    return res


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(((a - b).abs() / b.abs()).max().item(), 6)


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(((a - b).norm() / b.norm()).item(), 6)


def graph_ms(fn, reps: int = 20) -> float:
    """Median ms of one replay of `fn` captured in a CUDA graph (no launch overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, reps=reps)


def layer_gemms() -> dict:
    """A decoder layer's four projections with the ops that feed them, bf16 vs FP8."""
    from engine.quant.fp8 import quantize_weight_per_channel
    from tandem_kernels import ops

    g = torch.Generator(device="cuda").manual_seed(1)
    shapes = LAYER_SHAPES
    w16 = {k: torch.randn(n, k_, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for k, (n, k_) in shapes.items()}
    w8 = {k: quantize_weight_per_channel(w) for k, w in w16.items()}
    norm_w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    res = {}
    for m in M_SIZES:
        x = torch.randn(m, H, device="cuda", generator=g, dtype=torch.bfloat16)
        resid = torch.randn(m, H, device="cuda", generator=g, dtype=torch.bfloat16)
        attn = torch.randn(m, Q, device="cuda", generator=g, dtype=torch.bfloat16)

        def bf16_layer():
            a, r = ops.fused_add_rms_norm(x, resid, norm_w, 1e-5)
            F.linear(a, w16["qkv"])
            o = F.linear(attn, w16["o"])
            a, r = ops.fused_add_rms_norm(o, r, norm_w, 1e-5)
            F.linear(ops.silu_and_mul(F.linear(a, w16["gate_up"])), w16["down"])

        def fp8_layer():
            q, s, r = ops.fused_add_rms_norm_fp8(x, resid, norm_w, 1e-5)
            ops.fp8_linear(q, s, *w8["qkv"], None, torch.bfloat16)
            q, s = ops.quantize_fp8_per_token(attn)
            o = ops.fp8_linear(q, s, *w8["o"], None, torch.bfloat16)
            q, s, r = ops.fused_add_rms_norm_fp8(o, r, norm_w, 1e-5)
            gu = ops.fp8_linear(q, s, *w8["gate_up"], None, torch.bfloat16)
            q, s = ops.silu_and_mul_fp8(gu)
            ops.fp8_linear(q, s, *w8["down"], None, torch.bfloat16)

        xs = {k: torch.randn(m, k_, device="cuda", generator=g, dtype=torch.bfloat16) for k, (_, k_) in shapes.items()}
        xq = {k: ops.quantize_fp8_per_token(v) for k, v in xs.items()}

        def bf16_gemms():
            for k in shapes:
                F.linear(xs[k], w16[k])

        def fp8_gemms():
            for k in shapes:
                ops.fp8_linear(*xq[k], *w8[k], None, torch.bfloat16)

        row = {"bf16_layer_ms": graph_ms(bf16_layer), "fp8_layer_ms": graph_ms(fp8_layer),
               "bf16_gemms_ms": graph_ms(bf16_gemms), "fp8_gemms_ms": graph_ms(fp8_gemms)}
        row["layer_speedup"] = round(row["bf16_layer_ms"] / row["fp8_layer_ms"], 3)
        row["gemms_speedup"] = round(row["bf16_gemms_ms"] / row["fp8_gemms_ms"], 3)
        res[str(m)] = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
        log(f"layer M={m}: {res[str(m)]}")
    return res


GEMM_SCALINGS = ("rowwise", "rowwise_fast_accum", "tensorwise", "tensorwise_fast_accum")


def gemm_scalings(m_sizes=(64, 384, 1024, 4096)) -> dict:
    """torch._scaled_mm at a layer's four projection shapes, with the scales the engine uses (a
    [M, 1] scale per token, a [1, N] per output channel: cuBLASLt's row-wise path) against one
    scale per tensor, each with and without fast accumulation, beside bf16 F.linear: TFLOP/s of
    the four GEMMs together, CUDA-graph replays. Tells whether the row-wise scales, rather than
    FP8 itself, hold the FP8 GEMMs at ~0.5-0.6 of the FP8 ceiling."""
    g = torch.Generator(device="cuda").manual_seed(2)
    shapes = LAYER_SHAPES
    w16 = {k: torch.randn(n, k_, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for k, (n, k_) in shapes.items()}
    w8 = {k: w.to(torch.float8_e4m3fn) for k, w in w16.items()}
    out: dict = {}
    for m in m_sizes:
        flops = sum(2.0 * m * n * k_ for n, k_ in shapes.values())
        xs = {k: torch.randn(m, k_, device="cuda", generator=g, dtype=torch.bfloat16) for k, (_, k_) in shapes.items()}
        x8 = {k: v.to(torch.float8_e4m3fn) for k, v in xs.items()}
        row_scale = {k: (torch.ones(m, 1, device="cuda"), torch.ones(1, shapes[k][0], device="cuda")) for k in shapes}
        one = torch.ones((), device="cuda")

        def run(scaling: str):
            fast = scaling.endswith("fast_accum")
            for k in shapes:
                sa, sb = row_scale[k] if scaling.startswith("rowwise") else (one, one)
                torch._scaled_mm(x8[k], w8[k].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                 use_fast_accum=fast)

        def bf16():
            for k in shapes:
                F.linear(xs[k], w16[k])

        row = {"bf16": round(flops / graph_ms(bf16) / 1e9, 1)}
        for scaling in GEMM_SCALINGS:
            try:
                row[scaling] = round(flops / graph_ms(lambda scaling=scaling: run(scaling)) / 1e9, 1)
            except Exception as exc:  # a combination this torch / cuBLASLt refuses
                row[scaling] = repr(exc)[:100]
        out[str(m)] = row
        log(f"GEMM scalings M={m} (TFLOP/s): {row}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/fp8_h200.json")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-running", type=int, default=512)
    p.add_argument("--budget-s", type=float, default=300.0, help="cap on the offline run's seconds (prompts cut to fit)")
    p.add_argument("--baseline", action="store_true", help="also bf16 weights + FP8 KV (adds ~4 minutes)")
    p.add_argument("--gemm-scalings", action="store_true",
                   help="only _scaled_mm's row-wise vs per-tensor scales (and fast accumulation) vs bf16, then exit")
    p.add_argument("--m-sizes", default="64,384,1024,4096", help="with --gemm-scalings: the GEMMs' rows, comma list")
    a = p.parse_args()
    if a.gemm_scalings:
        m_sizes = tuple(int(m) for m in a.m_sizes.split(","))
        print(json.dumps({"command": "python bench/fp8_bench.py " + " ".join(sys.argv[1:]),
                          "device": torch.cuda.get_device_name(), "gemm_scalings_tflops": gemm_scalings(m_sizes)}))
        # (one line, the output's last: the progress lines come before it)
        return
    t0 = time.perf_counter()
    res: dict = {"command": "python bench/fp8_bench.py " + " ".join(sys.argv[1:]), "device": torch.cuda.get_device_name()}
    log("kernels vs references")
    res["kernels"] = kernels_check()
    log(json.dumps(res["kernels"]["256"]))
    log("decoder-layer GEMMs")
    res["layer"] = layer_gemms()
    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "llama31-8b", LLAMA31_8B)
        log("offline: FP8 weights + FP8 KV")
        res["offline_fp8"] = offline(model_dir, a.num_prompts, 1024, 1024, kv="fp8", max_running=a.max_running,
                                     budget_s=a.budget_s, quantization="fp8")
        log(json.dumps(res["offline_fp8"]))
        if a.baseline:
            res["offline_bf16w_fp8kv"] = offline(model_dir, res["offline_fp8"]["prompts"], 1024, 1024, kv="fp8",
                                                 max_running=a.max_running, quantization=None)
    res["offline_fp8_out_tok_s"] = res["offline_fp8"]["output_tok_s"]
    res["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print("\nM      bf16 layer ms  fp8 layer ms  layer x  bf16 GEMMs ms  fp8 GEMMs ms  GEMMs x")
    for m, row in res["layer"].items():
        print(f"{m:<6} {row['bf16_layer_ms']:>13.4f} {row['fp8_layer_ms']:>13.4f} {row['layer_speedup']:>8.3f} "
              f"{row['bf16_gemms_ms']:>14.4f} {row['fp8_gemms_ms']:>13.4f} {row['gemms_speedup']:>8.3f}")
    for name in ("offline_fp8", "offline_bf16w_fp8kv"):
        if name in res:
            o = res[name]
            print(f"{name}: {o['output_tok_s']} out tok/s ({o['prompts']} prompts, {o['seconds']} s, "
                  f"{o['kv_blocks']} KV blocks, {o['preemptions']} preemptions)")
    print("kernels at M=256: " + ", ".join(f"{k} equal={v.get('equal')}" for k, v in res["kernels"]["256"].items()
                                            if isinstance(v, dict) and "equal" in v))
    print(f"total {res['seconds']} s; wrote {a.out}")


if __name__ == "__main__":
    main()

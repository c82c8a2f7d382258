"""Where the FP8 decode kernel's time goes (GPU only): the engine's stage-1 program with parts taken
out, one at a time, timed on the offline shape (batch 384, context 1024, one split).

Variants (each a constexpr switch of `_probe_stage1`; results are wrong on purpose except `full`):
  full        the engine's kernel body as it was before the block-table lookahead (its bandwidth
              matched tandem_kernels.decode_attention at 2 stages; the engine's FP8 default now runs 3,
              which this copy does not pipeline: compare it with `engine`)
  no_softmax  scores go to the P·V dot as they are: no max, exp2 or rescale
  no_pv       no V load and no P·V dot (the row sums stand in for the output)
  no_dots     K and V loaded and widened, summed instead of multiplied
  loads_raw   K and V loaded as bytes and summed as integers: the gather alone
The gap between neighbouring rows is what that part costs.

    python3 bench/fp8_decode_probe.py [--block-order sequential] [--out F]   # GPU
    TRITON_INTERPRET=1 python3 bench/fp8_decode_probe.py --cpu-check   # `full` equals the reference
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.kernel_bench import BLOCK_ORDERS, Shapes, bench_ms, interpreter_missing, max_err, paged_kv  # noqa: E402
from tandem_kernels import decode_attention as da  # noqa: E402
from tandem_kernels import reference as ref  # noqa: E402
from tandem_kernels.triton_common import widen  # noqa: E402

VARIANTS = {"full": 0, "no_softmax": 1, "no_pv": 2, "no_dots": 3, "loads_raw": 4}


@triton.jit
def _probe_stage1(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, o_ptr, q_s0, q_s1, kc_s0, kc_s1, kc_s2, bt_s0,
                  o_s0, o_s1, qk_scale, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, OPAQUE_V: tl.constexpr, FP8: tl.constexpr,
                  MODE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + h
    d = tl.arange(0, D)
    h_mask = h < GROUP
    q = tl.load(q_ptr + b * q_s0 + heads[:, None] * q_s1 + d[None, :], mask=h_mask[:, None], other=0.0)
    if FP8:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    raw = tl.zeros([BLOCK_N, D], tl.int32)
    bt_row = bt_ptr + b * bt_s0
    for n0 in range(0, ctx, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs < ctx
        blk = tl.load(bt_row + offs // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = (blk * kc_s0 + (offs % BLOCK_SIZE) * kc_s1 + kvh * kc_s2)[:, None] + d[None, :]
        if MODE == 4:
            if FP8:
                kb = tl.load(k_ptr.to(tl.pointer_type(tl.uint8)) + row, mask=n_mask[:, None], other=0)
                vb = tl.load(v_ptr.to(tl.pointer_type(tl.uint8)) + row, mask=n_mask[:, None], other=0)
            else:
                kb = tl.load(k_ptr.to(tl.pointer_type(tl.int16)) + row, mask=n_mask[:, None], other=0)
                vb = tl.load(v_ptr.to(tl.pointer_type(tl.int16)) + row, mask=n_mask[:, None], other=0)
            raw += kb.to(tl.int32) + vb.to(tl.int32)
        else:
            k = tl.load(k_ptr + row, mask=n_mask[:, None], other=0.0).to(q.dtype)
            if MODE == 3:
                v = widen(tl.load(v_ptr + row, mask=n_mask[:, None], other=0.0), q.dtype, OPAQUE_V)
                acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)[None, :]
            else:
                s = tl.dot(q, tl.trans(k)) * qk_scale
                s = tl.where(n_mask[None, :], s, float("-inf"))
                if MODE == 1:
                    p = tl.where(n_mask[None, :], s, 0.0)
                    l_i += tl.sum(p, 1)
                    v = widen(tl.load(v_ptr + row, mask=n_mask[:, None], other=0.0), q.dtype, OPAQUE_V)
                    acc += tl.dot(p.to(q.dtype), v)
                else:
                    m_new = tl.maximum(m_i, tl.max(s, 1))
                    alpha = tl.exp2(m_i - m_new)
                    p = tl.exp2(s - m_new[:, None])
                    l_i = l_i * alpha + tl.sum(p, 1)
                    if MODE == 0:
                        v = widen(tl.load(v_ptr + row, mask=n_mask[:, None], other=0.0), q.dtype, OPAQUE_V)
                        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
                    else:
                        acc = acc * alpha[:, None]
                    m_i = m_new
    if MODE == 4:
        acc += tl.sum(raw, 0).to(tl.float32)[None, :]
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(o_ptr + b * o_s0 + heads[:, None] * o_s1 + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=h_mask[:, None])


def launch(variant: str, q, kc, vc, table, cl, out, block_n: int, opaque_v: bool, warps: int, stages: int) -> None:
    """One run of `_probe_stage1` for `variant` (a key of VARIANTS) into `out`, one split, q's scale
    head_dim**-0.5, cache scales 1."""
    hq, d = q.shape[1], q.shape[2]
    hk = kc.shape[2]
    _probe_stage1[(q.shape[0], hk)](
        q, kc, vc, table, cl, out, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        table.stride(0), out.stride(0), out.stride(1), d ** -0.5 * da.LOG2E,
        GROUP=hq // hk, BLOCK_H=max(16, triton.next_power_of_2(hq // hk)), D=d, BLOCK_N=block_n,
        BLOCK_SIZE=kc.shape[1], OPAQUE_V=opaque_v, FP8=kc.dtype == torch.float8_e4m3fn, MODE=VARIANTS[variant],
        num_warps=warps, num_stages=stages)


def cpu_check() -> int:
    """Under the interpreter: `full` gives the reference's output on an FP8 cache (GQA 4, partial
    blocks), and every other variant runs and writes finite values."""
    s = Shapes(hq=8, hk=2, d=32, block_size=16)
    kc, vc, table, cl = paged_kv([45, 70], s, torch.float8_e4m3fn, "cpu")
    q = torch.randn(2, s.hq, s.d, dtype=torch.bfloat16)
    want = ref.paged_decode_attention(q, kc, vc, table, cl, s.d ** -0.5, 1.0, 1.0)
    bad = 0
    for variant in VARIANTS:
        out = torch.full_like(q, float("nan"))
        launch(variant, q, kc, vc, table, cl, out, 16, False, 4, 2)
        if variant == "full":
            err = max_err(out, want)
            ok = err < 2e-2
            print(f"full: max error {err:.2e} against the reference", "ok" if ok else "TOO LARGE")
        else:
            ok = bool(torch.isfinite(out.float()).all())
            print(f"{variant}: {'finite' if ok else 'NOT FINITE'}")
        bad += not ok
    return 1 if bad else 0


def probe(batch: int, ctx: int, order: str = "random") -> list[dict]:
    s = Shapes(decode_batch=batch, decode_ctx=ctx)
    rows = []
    for cache in (torch.float8_e4m3fn, torch.bfloat16):
        fp8 = cache == torch.float8_e4m3fn
        kc, vc, table, cl = paged_kv([ctx] * batch, s, cache, "cuda", order=order)
        q = torch.randn(batch, s.hq, s.d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        moved = 2 * batch * ctx * s.hk * s.d * kc.element_size()
        tuning = da.default_tuning(cache)

        def engine():
            return da.paged_decode_attention(q, kc, vc, table, cl, s.d ** -0.5, 0.5, 1.5)

        cases = [("engine", engine)]
        for name in VARIANTS:
            def fn(name=name):
                launch(name, q, kc, vc, table, cl, out, tuning.block_n, fp8 and "v" in tuning.opaque_cvt,
                       tuning.num_warps, tuning.num_stages)
            cases.append((name, fn))
        for name, fn in cases:
            try:
                ms = bench_ms(fn, reps=30)
                row = {"cache": str(cache).split(".")[-1], "batch": batch, "ctx": ctx, "order": order, "variant": name,
                       "us": round(ms * 1e3, 1), "GB/s": round(moved / ms / 1e6)}
            except Exception as exc:
                row = {"cache": str(cache).split(".")[-1], "variant": name, "error": repr(exc)[:200]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del kc, vc
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--cpu-check", action="store_true", help="under TRITON_INTERPRET=1: check the variants on the CPU")
    ap.add_argument("--block-order", choices=BLOCK_ORDERS, default="random",
                    help="where each sequence's KV blocks lie (bench.kernel_bench.paged_kv)")
    args = ap.parse_args()
    if args.cpu_check:
        if interpreter_missing("--cpu-check"):
            return 2
        return cpu_check()
    if not torch.cuda.is_available():
        print("no CUDA device; use --cpu-check with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    rows = probe(384, 1024, args.block_order) + probe(128, 4096, args.block_order)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

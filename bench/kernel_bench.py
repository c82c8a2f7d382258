"""Kernel benchmark: Triton kernels checked against tandem_kernels.reference at real shapes, then timed
against ceilings measured in the same run (device copy bandwidth, bf16 matmul FLOP/s).

On a GPU: `python bench/kernel_bench.py` (Llama-3.1-8B shapes), prints one JSON dict.
`--sweep` also times alternative tile configurations of the attention kernels.
On CPU: `TRITON_INTERPRET=1 python bench/kernel_bench.py --cpu-smoke` runs the correctness part
at tiny shapes through the Triton interpreter.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from tandem_kernels import reference as ref  # noqa: E402


@dataclass(frozen=True)
class Shapes:
    tokens: int = 8192  # prefill chunk: norm / silu / rotary / extend attention
    hidden: int = 4096
    inter: int = 14336
    hq: int = 32
    hk: int = 8
    d: int = 128
    block_size: int = 16
    decode_batch: int = 64
    decode_ctx: int = 4096
    copy_bytes: int = 2 << 30
    eps: float = 1e-5


SMOKE = Shapes(tokens=37, hidden=96, inter=80, hq=4, hk=2, d=32, decode_batch=3, decode_ctx=300,
               copy_bytes=1 << 20)


BLOCK_ORDERS = ("random", "sequential")


def interpreter_missing(flag: str) -> bool:
    """True, after saying so on stderr, when `flag` (a CPU mode) runs without TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    print(f"{flag} needs TRITON_INTERPRET=1 in the environment", file=sys.stderr)
    return True


def paged_kv(lens: list[int], s: Shapes, dtype: torch.dtype, dev: str, spare: int = 7, order: str = "random"):
    """Random K/V caches and block tables holding `lens` tokens per sequence. order "random":
    blocks scattered over the cache (a cache after much churn); "sequential": each sequence's
    blocks side by side, as a fresh engine hands them out to a batch admitted together (the
    engine's FP8 decode kernel read 3.7 TB/s at a shape where random order here reads 3.0,
    BENCHMARKS.md section 13)."""
    if order not in BLOCK_ORDERS:
        raise ValueError(f"order: one of {BLOCK_ORDERS}, got {order!r}")
    need = [(n + s.block_size - 1) // s.block_size for n in lens]
    num_blocks = sum(need) + spare
    shape = (num_blocks, s.block_size, s.hk, s.d)
    kc = torch.randn(shape, device=dev, dtype=torch.float32).to(dtype)
    vc = torch.randn(shape, device=dev, dtype=torch.float32).to(dtype)
    perm = (torch.randperm(num_blocks, device=dev) if order == "random" else torch.arange(num_blocks, device=dev)).to(torch.int32)
    width = max(1, max(need))
    table = torch.zeros((len(lens), width), dtype=torch.int32, device=dev)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n]
        at += n
    return kc, vc, table, torch.tensor(lens, dtype=torch.int32, device=dev)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / (1 + |b|): absolute near zero, relative for large values."""
    a, b = a.float(), b.float()
    return ((a - b).abs() / (1 + b.abs())).max().item() if a.numel() else 0.0


def correctness(s: Shapes, dev: str) -> dict:
    """Max scaled error (see max_err) of each Triton kernel against the reference, within tolerance or not.

    A kernel that raises is recorded with its error, and the other checks still run.
    """
    from tandem_kernels import activation, decode_attention, extend_attention, norm, rotary

    torch.manual_seed(0)
    bf = torch.bfloat16
    res: dict[str, dict] = {}

    def record(name: str, check, tol: float) -> None:
        try:
            err = check()
            res[name] = {"max_err": err, "tol": tol, "ok": err <= tol}
        except Exception as exc:  # keep going: one broken kernel should not hide the others
            res[name] = {"error": repr(exc)[:500], "ok": False}

    x = torch.randn(s.tokens, s.hidden, device=dev, dtype=bf)
    r = torch.randn_like(x)
    w = torch.rand(s.hidden, device=dev) + 0.5
    record("rms_norm", lambda: max_err(norm.rms_norm(x, w, s.eps), ref.rms_norm(x, w, s.eps)), 0.02)

    def fused() -> float:
        got, want = norm.fused_add_rms_norm(x, r, w, s.eps), ref.fused_add_rms_norm(x, r, w, s.eps)
        return max(max_err(got[0], want[0]), max_err(got[1], want[1]))

    record("fused_add_rms_norm", fused, 0.02)
    g = torch.randn(s.tokens, 2 * s.inter, device=dev, dtype=bf)
    record("silu_and_mul", lambda: max_err(activation.silu_and_mul(g), ref.silu_and_mul(g)), 0.02)

    inv = 1.0 / (500000.0 ** (torch.arange(0, s.d, 2, device=dev).float() / s.d))
    cs = ref.rope_cos_sin_cache(s.tokens + 64, s.d, inv)
    qkv = torch.randn(s.tokens, (s.hq + 2 * s.hk) * s.d, device=dev, dtype=bf)
    q, k, v = qkv.split([s.hq * s.d, s.hk * s.d, s.hk * s.d], dim=-1)
    q, k, v = (t.view(s.tokens, -1, s.d) for t in (q, k, v))  # strided views, as the engine passes
    pos = torch.randperm(s.tokens + 64, device=dev)[:s.tokens]

    def rot(cache_dtype: torch.dtype) -> float:
        blocks = (s.tokens + s.block_size - 1) // s.block_size + 3
        kc = torch.zeros(blocks, s.block_size, s.hk, s.d, device=dev, dtype=cache_dtype)
        caches = [kc.clone() for _ in range(4)]
        slots = torch.randperm(blocks * s.block_size, device=dev)[:s.tokens]
        slots[::5] = -1
        got = rotary.rotary_and_store_kv(q, k, v, pos, cs, caches[0], caches[1], slots, s.d, True, 0.7, 0.9)
        want = ref.rotary_and_store_kv(q, k, v, pos, cs, caches[2], caches[3], slots, s.d, True, 0.7, 0.9)
        return max(max_err(got[0], want[0]), max_err(got[1], want[1]),
                   max_err(caches[0], caches[2]), max_err(caches[1], caches[3]))

    record("rotary_and_store_kv[bfloat16]", lambda: rot(bf), 0.02)
    record("rotary_and_store_kv[float8_e4m3fn]", lambda: rot(torch.float8_e4m3fn), 0.13)

    scale = s.d ** -0.5
    b = s.decode_batch
    lens = torch.randint(1, s.decode_ctx + 1, (b,)).tolist()
    lens[0] = s.decode_ctx

    def decode(cache_dtype: torch.dtype) -> float:
        kc, vc, table, cl = paged_kv(lens, s, cache_dtype, dev)
        qd = torch.randn(b, s.hq, s.d, device=dev, dtype=bf)
        got = decode_attention.paged_decode_attention(qd, kc, vc, table, cl, scale, 0.5, 1.5)
        return max_err(got, ref.paged_decode_attention(qd, kc, vc, table, cl, scale, 0.5, 1.5))

    record("paged_decode_attention[bfloat16]", lambda: decode(bf), 0.03)
    record("paged_decode_attention[float8_e4m3fn]", lambda: decode(torch.float8_e4m3fn), 0.03)

    def extend(cache_dtype: torch.dtype, new_kv: bool = False) -> float:
        # A chunk after a prefix, a fresh prompt, and a single token, packed.
        q_lens = [max(1, s.tokens // 8), max(1, s.tokens // 16) + 3, 1]
        ctx = [q_lens[0] + 3 * q_lens[0] + 5, q_lens[1], 1 + s.decode_ctx // 4]
        kc, vc, table, sl = paged_kv(ctx, s, cache_dtype, dev)
        qsl = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=dev)
        qe = torch.randn(sum(q_lens), s.hq, s.d, device=dev, dtype=bf)
        new = tuple(torch.randn(sum(q_lens), s.hk, s.d, device=dev, dtype=bf) for _ in range(2)) if new_kv else None
        got = extend_attention.extend_attention(qe, kc, vc, table, qsl, sl, scale, 0.5, 1.5, new_kv=new)
        return max_err(got, ref.extend_attention(qe, kc, vc, table, qsl, sl, scale, 0.5, 1.5, new_kv=new))

    record("extend_attention[bfloat16]", lambda: extend(bf), 0.03)
    record("extend_attention[float8_e4m3fn]", lambda: extend(torch.float8_e4m3fn), 0.03)
    record("extend_attention_new_kv[bfloat16]", lambda: extend(bf, True), 0.03)
    record("extend_attention_new_kv[float8_e4m3fn]", lambda: extend(torch.float8_e4m3fn, True), 0.03)
    return res


def bench_ms(fn, reps: int = 50, graph: bool = True) -> float:
    """Median GPU milliseconds per call. With graph, replayed from a CUDA graph so that host launch
    overhead (as in the engine's graph-captured decode) does not count; plain do_bench otherwise
    or if capture fails."""
    import triton.testing

    fn()  # compile outside the capture
    if not graph:
        return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median")
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=reps, return_mode="median")
    except Exception:
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median")


def ceilings(s: Shapes) -> dict:
    n = s.copy_bytes // 2
    src = torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    # Plain timing: a copy replayed from a graph ran well below its eager speed on an H200.
    copy_ms = bench_ms(lambda: dst.copy_(src), graph=False)
    del src, dst
    a = torch.randn(s.tokens, s.hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(s.hidden, s.inter, device="cuda", dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ w, graph=False)
    return {
        "copy_gbps": 2 * s.copy_bytes / copy_ms / 1e6,  # bytes read + bytes written
        "matmul_tflops": 2 * s.tokens * s.hidden * s.inter / mm_ms / 1e9,
        "matmul_shape": [s.tokens, s.hidden, s.inter],
    }


def decode_case(s: Shapes, cache_dtype: torch.dtype) -> tuple[callable, int]:
    from tandem_kernels import decode_attention

    b, ctx = s.decode_batch, s.decode_ctx
    kc, vc, table, cl = paged_kv([ctx] * b, s, cache_dtype, "cuda")
    q = torch.randn(b, s.hq, s.d, device="cuda", dtype=torch.bfloat16)
    moved = 2 * b * ctx * s.hk * s.d * kc.element_size() + 2 * q.numel() * q.element_size()
    return (lambda: decode_attention.paged_decode_attention(q, kc, vc, table, cl, s.d ** -0.5)), moved


def extend_case(s: Shapes, q_len: int, prefix: int, cache_dtype: torch.dtype = torch.bfloat16, seqs: int = 1,
                new_kv: bool = False) -> tuple[callable, float]:
    """`seqs` sequences of q_len new tokens after `prefix` cached ones, packed in one launch;
    `new_kv`: the new tokens' K/V read from views of a qkv row (as the engine passes them)."""
    from tandem_kernels import extend_attention

    kc, vc, table, sl = paged_kv([prefix + q_len] * seqs, s, cache_dtype, "cuda")
    t = seqs * q_len
    qkv = torch.randn(t, (s.hq + 2 * s.hk) * s.d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (x.view(t, -1, s.d) for x in qkv.split([s.hq * s.d, s.hk * s.d, s.hk * s.d], dim=-1))
    q = q.contiguous()  # as the rotary kernel returns it
    qsl = torch.arange(0, t + 1, q_len, dtype=torch.int32, device="cuda")
    visible = q_len * prefix + q_len * (q_len + 1) // 2  # (query, key) pairs under the causal mask
    flops = 4.0 * s.hq * s.d * visible * seqs
    new = (k.contiguous(), v) if new_kv else None
    return (lambda: extend_attention.extend_attention(q, kc, vc, table, qsl, sl, s.d ** -0.5, new_kv=new)), flops


def timed(out: dict, name: str, case) -> None:
    """out[name] = case(), or the error it raised."""
    try:
        out[name] = case()
    except Exception as exc:
        out[name] = {"error": repr(exc)[:500]}


def speed(s: Shapes, ceil: dict) -> dict:
    from tandem_kernels import activation, norm, rotary

    out: dict[str, dict] = {}
    bf = torch.bfloat16

    def decode(cache_dtype: torch.dtype) -> dict:
        fn, moved = decode_case(s, cache_dtype)
        ms = bench_ms(fn)
        gbps = moved / ms / 1e6
        return {"us": ms * 1e3, "gbps": gbps, "frac_of_copy": gbps / ceil["copy_gbps"],
                "batch": s.decode_batch, "ctx": s.decode_ctx}

    def extend(q_len: int, prefix: int, cache_dtype: torch.dtype = bf, new_kv: bool = False) -> dict:
        fn, flops = extend_case(s, q_len, prefix, cache_dtype, new_kv=new_kv)
        ms = bench_ms(fn)
        tflops = flops / ms / 1e9
        return {"ms": ms, "tflops": tflops, "frac_of_matmul": tflops / ceil["matmul_tflops"],
                "q_len": q_len, "prefix": prefix}

    timed(out, "decode_attention_bf16", lambda: decode(bf))
    timed(out, "decode_attention_fp8", lambda: decode(torch.float8_e4m3fn))
    timed(out, "extend_attention", lambda: extend(s.tokens, 0))
    timed(out, "extend_attention_chunk_after_prefix", lambda: extend(s.tokens // 4, 3 * s.tokens // 4))
    timed(out, "extend_attention_fp8", lambda: extend(s.tokens, 0, torch.float8_e4m3fn))
    # The new tokens' K/V as computed rather than from the cache (the engine's default).
    timed(out, "extend_attention_new_kv", lambda: extend(s.tokens, 0, new_kv=True))
    timed(out, "extend_attention_fp8_new_kv", lambda: extend(s.tokens, 0, torch.float8_e4m3fn, new_kv=True))
    timed(out, "extend_attention_chunk_after_prefix_new_kv",
          lambda: extend(s.tokens // 4, 3 * s.tokens // 4, new_kv=True))

    t = s.tokens
    x = torch.randn(t, s.hidden, device="cuda", dtype=bf)
    r = torch.randn_like(x)
    w = torch.ones(s.hidden, device="cuda", dtype=bf)
    g = torch.randn(t, 2 * s.inter, device="cuda", dtype=bf)
    row = t * s.hidden * 2
    mem_cases = [
        ("rms_norm", lambda: norm.rms_norm(x, w, s.eps), 2 * row),
        ("fused_add_rms_norm", lambda: norm.fused_add_rms_norm(x, r, w, s.eps), 4 * row),
        ("silu_and_mul", lambda: activation.silu_and_mul(g), 3 * t * s.inter * 2),
    ]
    inv = 1.0 / (500000.0 ** (torch.arange(0, s.d, 2, device="cuda").float() / s.d))
    cs = ref.rope_cos_sin_cache(t, s.d, inv)
    qkv = torch.randn(t, (s.hq + 2 * s.hk) * s.d, device="cuda", dtype=bf)
    q, k, v = (y.view(t, -1, s.d) for y in qkv.split([s.hq * s.d, s.hk * s.d, s.hk * s.d], dim=-1))
    kc = torch.empty((t // s.block_size + 1, s.block_size, s.hk, s.d), device="cuda", dtype=bf)
    vc = torch.empty_like(kc)
    pos = torch.arange(t, device="cuda")
    slots = torch.randperm(t, device="cuda")
    # q, k, v read; q_rot, k_rot written; k, v written to the cache.
    rot_bytes = (s.hq + 2 * s.hk) * t * s.d * 2 + (s.hq + s.hk) * t * s.d * 2 + 2 * s.hk * t * s.d * 2
    mem_cases.append(("rotary_and_store_kv",
                      lambda: rotary.rotary_and_store_kv(q, k, v, pos, cs, kc, vc, slots, s.d, True), rot_bytes))
    for name, fn, moved in mem_cases:
        def case(fn=fn, moved=moved) -> dict:
            ms = bench_ms(fn)
            gbps = moved / ms / 1e6
            return {"us": ms * 1e3, "gbps": gbps, "frac_of_copy": gbps / ceil["copy_gbps"]}

        timed(out, name, case)
    return out


DECODE_CACHES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}  # --decode-caches names


def _decode_grid(cache: torch.dtype, batch: int) -> list:
    """decode_sweep's tunings for `cache` at `batch`: tiles, stages and widening, deeper staging,
    the softmax bookkeeping variants and, at batch 1, the split lengths."""
    from tandem_kernels import decode_attention as da

    fp8 = cache == torch.float8_e4m3fn
    grid = list(itertools.product((64, 128), (2, 3), (4,), ("", "v", "kv")))
    grid += [(64, 2, 8, "v"), (128, 2, 8, "v"), (32, 2, 4, "v"), (32, 3, 4, "v"), (32, 4, 4, "v"), (64, 4, 4, "v")]
    tunings = [da.DecodeTuning(bn, st, w, 128, 4, opaque) for bn, st, w, opaque in grid if fp8 or not opaque]
    # deeper staging with the splits aimed at the programs an SM then holds (bench/kernel_ir.py):
    # block 32 holds 6 (both caches, 3 or 4 stages), bf16 block 64 at 3 stages 3
    cvt = "v" if fp8 else ""
    tunings += [da.DecodeTuning(32, st, 4, 128, 6, cvt) for st in (3, 4)]
    if not fp8:
        tunings.append(da.DecodeTuning(64, 3, 4, 128, 3, cvt))
    base = da.default_tuning(cache)  # the softmax bookkeeping variants on the default tiles
    tunings += [dataclasses.replace(base, block_n=bn, defer_sum=defer, lazy_rescale=lazy)
                for bn in (64, 128) for defer, lazy in ((True, False), (False, True), (True, True))]
    if batch == 1:
        tunings += [da.DecodeTuning(min(base.block_n, mp), base.num_stages, base.num_warps, mp, r, base.opaque_cvt)
                    for mp, r in ((64, 4), (32, 4), (64, 8))]
    return tunings


def spread_lens(ctx: int, batch: int, spread: float) -> list[int]:
    """`batch` context lengths from ctx * (1 + spread) down to ctx * (1 - spread), evenly (mean
    ctx): an engine's running batch, oldest sequence first, as requests admitted one after another
    hold it (the offline FP8 run's full batch: 1,024 to 2,048 tokens, spread 1/3 around 1,536).
    spread 0: every length is ctx."""
    if not 0 <= spread < 1:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    if batch == 1 or not spread:
        return [ctx] * batch
    hi, lo = ctx * (1 + spread), ctx * (1 - spread)
    return [max(1, round(hi - (hi - lo) * i / (batch - 1))) for i in range(batch)]


def decode_sweep(order: str = "random", only: list | None = None, caches: tuple[str, ...] = ("bf16", "fp8"),
                 shapes: tuple[tuple[int, int], ...] | None = None, spread: float = 0.0) -> dict:
    """Every decode-attention tuning on the shapes the engine meets: the kernel issue's batch 64 at
    context 4096, the offline workload's batch 384 at 1024, and batch-1 decode at 1024. Each row:
    [cache, batch, ctx, block_n, stages, warps, opaque_cvt, min_partition, resident, defer_sum,
    lazy_rescale, narrow_offsets, unsigned_index, warp_split, prefetch, min_splits, GB/s, max error
    vs reference]. `order`: where each sequence's KV blocks lie (paged_kv). `only`: these DecodeTunings instead of the grid
    (_decode_grid), also at batch 512 / context 1,536 (the FP8 offline run's full batch), on
    `caches` (DECODE_CACHES names). `shapes`: these (batch, context) pairs instead. `spread`: the
    contexts of a batch vary around its ctx (spread_lens); GB/s counts the bytes of each."""
    from tandem_kernels import decode_attention as da

    rows: list[list] = []
    shapes = shapes or ((64, 4096), (384, 1024), (1, 1024)) + (((512, 1536),) if only else ())
    for (batch, ctx) in shapes:
        s = Shapes(decode_batch=batch, decode_ctx=ctx)
        for cache in [DECODE_CACHES[c] for c in caches]:
            lens = spread_lens(ctx, batch, spread)
            kc, vc, table, cl = paged_kv(lens, s, cache, "cuda", order=order)
            q = torch.randn(batch, s.hq, s.d, device="cuda", dtype=torch.bfloat16)
            moved = 2 * sum(lens) * s.hk * s.d * kc.element_size() + 2 * q.numel() * q.element_size()
            check = min(batch, 4)
            want = ref.paged_decode_attention(q[:check], kc, vc, table[:check], cl[:check], s.d ** -0.5, 0.5, 1.5)
            tunings = list(only) if only else _decode_grid(cache, batch)
            for t in tunings:
                def fn(t=t):
                    return da.paged_decode_attention(q, kc, vc, table, cl, s.d ** -0.5, 0.5, 1.5, tuning=t)
                try:
                    err = max_err(fn()[:check], want)
                    gbps = round(moved / bench_ms(fn, reps=30) / 1e6)
                except Exception as exc:  # a configuration that does not compile or fit
                    err, gbps = None, repr(exc)[:80]
                rows.append([str(cache).split(".")[-1], batch, ctx, t.block_n, t.num_stages, t.num_warps,
                             t.opaque_cvt, t.min_partition, t.resident, t.defer_sum, t.lazy_rescale, t.narrow_offsets,
                             t.unsigned_index, t.warp_split, t.prefetch, t.min_splits, gbps, err])
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress: the sweep takes minutes
            del kc, vc
    return {"rows [cache, batch, ctx, block_n, stages, warps, opaque_cvt, min_partition, resident, defer_sum, "
            "lazy_rescale, narrow_offsets, unsigned_index, warp_split, prefetch, min_splits, GB/s, err]": rows}


def _at_more_rows(fastest: list) -> list:
    """The tilings gemv_sweep times past its first row count: the three fastest at it, and each
    with every row against the whole weight tile (GemvTiling.wide_rows, sums reduced each tile)."""
    wide = [dataclasses.replace(t, wide_rows=True, late_reduce=False) for t in fastest]
    return list(dict.fromkeys([*fastest, *wide]))


def gemv_sweep(rows_list: tuple[int, ...] = (1, 4), cold_bytes: int = 512 << 20, weights: tuple[str, ...] = (),
               tilings: list | None = None, fp8: bool = False) -> dict:
    """The fused decode GEMV (tandem_kernels.gemv) against what it replaces (cuBLAS through
    F.linear plus the separate norm / SiLU kernels), at the Llama-3.1-8B layer's four weights.
    `fp8`: e4m3 weights with a scale per row (engine/quant/fp8.py), against cuBLASLt's FP8 GEMM
    with the activations quantized per token by the norm / SiLU kernel before it (W8A8).

    As in a decode step, every call reads a weight no call before it read lately: each timed
    CUDA graph runs the GEMV over copies of the weight totalling at least `cold_bytes` (far past
    L2), one after another, and the time is the graph's over the copies. Tilings: every
    block_n x block_k x warps with prefetch, six with late_reduce and three without prefetch, at
    the first row count; the three
    fastest of each weight at the others, each also with wide_rows. Rows: [weight, rows, tiling (GemvTiling's fields), us,
    weight GB/s, max error]; the "unfused" row of each weight has tiling None.
    `weights` (names of the cases below) and `tilings` (GemvTiling) narrow the sweep; given
    tilings are each timed at every row count."""
    from bench.kernel_ir import GEMV_SHAPES
    from tandem_kernels import gemv as gm
    from tandem_kernels import ops

    cases = dict(GEMV_SHAPES)
    every_rows = tilings is not None
    if tilings is None:
        tilings = [gm.GemvTiling(block_n=bn, block_k=bk, num_warps=w)
                   for bn, bk, w in itertools.product((4, 8, 16), (512, 1024, 2048), (4, 8))]
        tilings += [gm.GemvTiling(block_n=bn, block_k=bk, late_reduce=True) for bn in (4, 8, 16) for bk in (256, 512)]
        tilings += [gm.GemvTiling(block_n=bn, block_k=bk, prefetch=False) for bn, bk in ((4, 1024), (8, 512), (8, 1024))]
    if weights:
        unknown = set(weights) - set(cases)
        if unknown:
            raise ValueError(f"--gemv-weights: unknown {sorted(unknown)}; choose from {sorted(cases)}")
        cases = {k: v for k, v in cases.items() if k in weights}
    rows_out: list[list] = []
    for name, (n, k, norm, silu) in cases.items():
        moved = n * k * (1 if fp8 else 2)
        copies = max(2, -(-cold_bytes // moved))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        scales = [None] * copies
        if fp8:
            from engine.quant.fp8 import quantize_weight_per_channel

            ws, scales = (list(z) for z in zip(*(quantize_weight_per_channel(w) for w in ws)))
        nw = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        best: list[tuple[float, gm.GemvTiling]] = []
        for i, m in enumerate(rows_list):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            kw = dict(residual=res if norm else None, norm_weight=nw if norm else None, eps=1e-5, silu_pair=silu)

            def unfused():
                for w, scale in zip(ws, scales):
                    if scale is None:
                        a = ops.fused_add_rms_norm(x, res, nw, 1e-5)[0] if norm else x
                        y = torch.nn.functional.linear(a, w)
                        if silu:
                            ops.silu_and_mul(y)
                        continue
                    q, qs = ops.fused_add_rms_norm_fp8(x, res, nw, 1e-5)[:2] if norm else ops.quantize_fp8_per_token(x)
                    y = ops.fp8_linear(q, qs, w, scale, None, torch.bfloat16)
                    if silu:
                        ops.silu_and_mul_fp8(y)

            want = ref.gemv(x, ws[0], None, weight_scale=scales[0], **kw)[0].float()
            us = bench_ms(unfused) * 1e3 / copies
            rows_out.append([name, m, None, round(us, 1), round(moved / us / 1e3), 0.0])
            print(json.dumps(rows_out[-1]), file=sys.stderr, flush=True)
            timed = []
            for t in (tilings if i == 0 or every_rows else _at_more_rows([t for _, t in best[:3]])):
                try:
                    got = gm.gemv(x, ws[0], tiling=t, weight_scale=scales[0], **kw)[0].float()
                    err = ((got - want).abs() / (1 + want.abs())).max().item()
                    us = bench_ms(lambda: [gm.gemv(x, w, tiling=t, weight_scale=sc, **kw) for w, sc in zip(ws, scales)],
                                  reps=30) * 1e3 / copies
                    timed.append((us, t))
                    rows_out.append([name, m, dataclasses.asdict(t), round(us, 1), round(moved / us / 1e3), err])
                except Exception as exc:  # a configuration that does not compile or fit
                    rows_out.append([name, m, dataclasses.asdict(t), repr(exc)[:80], None, None])
                print(json.dumps(rows_out[-1]), file=sys.stderr, flush=True)
            if i == 0:
                best = sorted(timed, key=lambda p: p[0])
        del ws
        torch.cuda.empty_cache()
    return {"rows [weight, rows, tiling (GemvTiling fields; null: unfused), us, weight GB/s, max error]": rows_out}


def extend_sweep(s: Shapes) -> dict:
    """extend_attention with each tile's block-table entries read a tile ahead or not
    (extend_attention.BLOCKS_AHEAD), bf16 and FP8, a whole prompt and a chunk after a prefix."""
    from tandem_kernels import extend_attention as ea

    rows = []
    saved = ea.BLOCKS_AHEAD
    for cache in (torch.bfloat16, torch.float8_e4m3fn):
        for q_len, prefix in ((s.tokens, 0), (s.tokens // 4, 3 * s.tokens // 4)):
            fn, flops = extend_case(s, q_len, prefix, cache)
            for ahead in (False, True):
                ea.BLOCKS_AHEAD = frozenset({cache} if ahead else ())
                try:
                    tflops = round(flops / bench_ms(fn, reps=30) / 1e9, 1)
                except Exception as exc:  # e.g. the deeper staging does not fit in shared memory
                    tflops = repr(exc)[:80]
                rows.append([str(cache).split(".")[-1], q_len, prefix, ahead, tflops])
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    ea.BLOCKS_AHEAD = saved
    return {"extend_blocks_ahead [cache, q_len, prefix, blocks_ahead, TFLOP/s]": rows}


# (block_m, block_n, warps, stages) that --extend-tiles times; the first is the module's default.
EXTEND_TILES = ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3),
                (64, 64, 4, 4), (128, 128, 8, 2), (128, 64, 8, 4))


def extend_tiles(s: Shapes, prompts: tuple[tuple[int, int], ...] = ((32, 256), (16, 512), (8, 1024), (4, 2048),
                                                                    (1, 8192)),
                 caches: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float8_e4m3fn),
                 tiles: tuple[tuple[int, int, int, int], ...] = EXTEND_TILES) -> dict:
    """extend_attention's `tiles` on whole prompts packed as a prefill step packs them
    (`prompts`: (count, length), the step's tokens split into equal prompts), on `caches`:
    shorter prompts have more of their work on the diagonal and in each tile's setup."""
    from tandem_kernels import extend_attention as ea

    rows = []
    saved = (ea.BLOCK_M, ea.BLOCK_N, ea.NUM_WARPS, ea.NUM_STAGES)
    for cache in caches:
        for seqs, q_len in prompts:
            fn, flops = extend_case(s, q_len, 0, cache, seqs)
            for cfg in tiles:
                ea.BLOCK_M, ea.BLOCK_N, ea.NUM_WARPS, ea.NUM_STAGES = cfg
                try:
                    tflops = round(flops / bench_ms(fn, reps=30) / 1e9, 1)
                except Exception as exc:  # a tile that does not compile or fit in shared memory
                    tflops = repr(exc)[:80]
                finally:
                    ea.BLOCK_M, ea.BLOCK_N, ea.NUM_WARPS, ea.NUM_STAGES = saved
                rows.append([str(cache).split(".")[-1], seqs, q_len, *cfg, tflops])
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"extend_tiles [cache, prompts, q_len, block_m, block_n, warps, stages, TFLOP/s]": rows}


# Peers extend_peers times against ours: name -> (q, k, v, k and v expanded to the query heads,
# cu_seqlens, prompts, length, scale) -> [T, Hq, D]. Both SDPA rows need prompts of one length.
def _peer_fa2_varlen(q, k, v, ke, ve, cu, seqs, n, scale):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, n, n, 0.0, True, False, scale=scale)[0]


def _peer_cudnn_ragged(q, k, v, ke, ve, cu, seqs, n, scale):
    return torch.ops.aten._cudnn_attention_forward(q, ke, ve, None, cu, cu, n, n, False, 0.0, True, False,
                                                   scale=scale)[0]


def _peer_sdpa(backend_name: str):
    def run(q, k, v, ke, ve, cu, seqs, n, scale):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qb, kb, vb = (x.view(seqs, n, q.shape[1], q.shape[2]).transpose(1, 2) for x in (q, ke, ve))
        with sdpa_kernel(getattr(SDPBackend, backend_name)):
            out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
        return out.transpose(1, 2).reshape(q.shape)
    return run


EXTEND_PEERS = {"torch_fa2_varlen": _peer_fa2_varlen, "cudnn_ragged": _peer_cudnn_ragged,
                "sdpa_cudnn_batched": _peer_sdpa("CUDNN_ATTENTION"), "sdpa_flash_batched": _peer_sdpa("FLASH_ATTENTION")}


def extend_peers(s: Shapes, prompts: tuple[tuple[int, int], ...] = ((8, 1024), (16, 512), (4, 2048), (1, 8192),
                                                                    (1, 1024), (2, 1024))) -> dict:
    """Prefill attention over fresh prompts (no cached prefix), packed as a prefill step packs
    them (`prompts`: (count, length)): ours (extend_attention with new_kv, as the engine calls it)
    against torch's own kernels on the same q, k, v: FlashAttention-2 varlen (GQA as is), cuDNN's
    ragged entry, and SDPA on [prompts, heads, length, dim] through cuDNN and through
    FlashAttention (k and v expanded to the query heads beforehand, not timed). TFLOP/s of the
    causal (query, key) pairs, and each peer's largest difference from ours."""
    from tandem_kernels import extend_attention as ea

    rows = []
    for seqs, n in prompts:
        t = seqs * n
        kc, vc, table, sl = paged_kv([n] * seqs, s, torch.bfloat16, "cuda")
        qkv = torch.randn(t, (s.hq + 2 * s.hk) * s.d, device="cuda", dtype=torch.bfloat16)
        q, k, v = (x.view(t, -1, s.d) for x in qkv.split([s.hq * s.d, s.hk * s.d, s.hk * s.d], dim=-1))
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        ke, ve = (x.repeat_interleave(s.hq // s.hk, dim=1) for x in (k, v))
        cu = torch.arange(0, t + 1, n, dtype=torch.int32, device="cuda")
        scale, flops = s.d ** -0.5, 4.0 * s.hq * s.d * (n * (n + 1) // 2) * seqs
        ours = (lambda: ea.extend_attention(q, kc, vc, table, cu, sl, scale, new_kv=(k, v)))
        want = ours().float()
        row: dict[str, Any] = {"prompts": seqs, "length": n,
                               "ours_TFLOPs": round(flops / bench_ms(ours, reps=40, graph=False) / 1e9, 1)}
        for name, peer in EXTEND_PEERS.items():
            fn = (lambda peer=peer: peer(q, k, v, ke, ve, cu, seqs, n, scale))
            try:
                diff = (fn().float() - want).abs().max().item()
                row[name] = {"TFLOPs": round(flops / bench_ms(fn, reps=40, graph=False) / 1e9, 1),
                             "max_diff": round(diff, 4)}
            except Exception as exc:  # a peer this torch or GPU lacks
                row[name] = {"error": repr(exc)[:200]}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return {"extend_peers": rows, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}


def sweep(s: Shapes) -> dict:
    """Time the attention kernels over alternative configurations."""
    from tandem_kernels import extend_attention as ea

    def run(fn, amount: float) -> float | str:
        try:
            return round(amount / bench_ms(fn, reps=30) / 1e6)
        except Exception as exc:  # a configuration that does not compile or fit
            return repr(exc)[:80]

    found: dict[str, list] = extend_tiles(s, ((1, s.tokens),), (torch.bfloat16,), EXTEND_TILES[:4])
    found["extend_fp8 [opaque_cvt, TFLOP/s]"] = []
    saved_cvt = ea.FP8_OPAQUE_CVT
    fn, flops = extend_case(s, s.tokens, 0, torch.float8_e4m3fn)
    for cvt in ("", "v", "kv"):
        ea.FP8_OPAQUE_CVT = cvt
        found["extend_fp8 [opaque_cvt, TFLOP/s]"].append([cvt, run(fn, flops / 1e3)])
    ea.FP8_OPAQUE_CVT = saved_cvt
    found.update(extend_sweep(s))
    found["decode"] = decode_sweep()
    return found


def _decode_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """--decode-shapes: "BxCTX,..." -> ((batch, context), ...), each at least 1."""
    try:
        shapes = tuple(tuple(int(n) for n in item.lower().split("x")) for item in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(sh) != 2 or min(sh) < 1 for sh in shapes):
        raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT[,...] of positive integers, got {text!r}")
    return shapes


def _gemv_tilings(specs: list[str] | None) -> list | None:
    if not specs:
        return None
    from tandem_kernels.gemv import GemvTiling

    return [GemvTiling(**json.loads(t)) for t in specs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, correctness only, on CPU")
    ap.add_argument("--sweep", action="store_true", help="also time alternative attention tile configs")
    ap.add_argument("--decode-sweep", action="store_true", help="only the decode-attention tunings (GPU)")
    ap.add_argument("--gemv-sweep", action="store_true", help="only the fused decode GEMV against cuBLAS (GPU)")
    ap.add_argument("--gemv-weights", default="", help="with --gemv-sweep: these weights only (qkv,o_proj,gate_up,down)")
    ap.add_argument("--gemv-rows", default="1,4", help="with --gemv-sweep: the row counts, comma list")
    ap.add_argument("--gemv-fp8", action="store_true",
                    help="with --gemv-sweep: e4m3 weights (a scale a row) against cuBLASLt's FP8 GEMM (W8A8)")
    ap.add_argument("--gemv-tiling", action="append", default=None, metavar="JSON",
                    help="with --gemv-sweep: time these GemvTiling fields instead of the grid (repeatable)")
    ap.add_argument("--extend-sweep", action="store_true",
                    help="only extend attention with its block-table entries read a tile ahead or not (GPU)")
    ap.add_argument("--extend-tiles", action="store_true",
                    help="only extend attention's tiles on packed prompts of 256-8,192 tokens (GPU)")
    ap.add_argument("--extend-peers", action="store_true",
                    help="only prefill attention on fresh packed prompts against torch's FlashAttention-2 and cuDNN (GPU)")
    ap.add_argument("--block-order", choices=BLOCK_ORDERS, default="random",
                    help="where the decode sweep's sequences' KV blocks lie (see paged_kv)")
    ap.add_argument("--decode-tuning", action="append", default=None, metavar="JSON",
                    help="with --decode-sweep: time these DecodeTuning fields instead of the grid (repeatable)")
    ap.add_argument("--decode-caches", default="bf16,fp8", help="with --decode-sweep: the caches, comma list")
    ap.add_argument("--decode-shapes", default=None, type=_decode_shapes, metavar="BxCTX,...",
                    help="with --decode-sweep: these batch x context shapes instead (e.g. 1x1024,16x2048)")
    ap.add_argument("--decode-spread", default=0.0, type=float, metavar="F",
                    help="with --decode-sweep: a batch's contexts run evenly from CTX*(1+F) down to CTX*(1-F) "
                         "(the offline FP8 run's full batch: 512x1536 with F 0.333); 0: all CTX")
    args = ap.parse_args()
    caches = tuple(args.decode_caches.split(","))
    if not 0 <= args.decode_spread < 1:
        ap.error(f"--decode-spread must be in [0, 1), got {args.decode_spread}")
    if not set(caches) <= set(DECODE_CACHES):
        ap.error(f"--decode-caches takes {', '.join(DECODE_CACHES)}, got {args.decode_caches!r}")
    if args.cpu_smoke:
        if interpreter_missing("--cpu-smoke"):
            return 2
        result = {"mode": "cpu-smoke", "shapes": asdict(SMOKE), "correctness": correctness(SMOKE, "cpu")}
    else:
        if not torch.cuda.is_available():
            print("no CUDA device; use --cpu-smoke with TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        if args.decode_sweep or args.gemv_sweep or args.extend_sweep or args.extend_tiles or args.extend_peers:
            only = None
            if args.decode_tuning:
                from tandem_kernels.decode_attention import DecodeTuning
                only = [DecodeTuning(**json.loads(t)) for t in args.decode_tuning]
            print(json.dumps({**(decode_sweep(args.block_order, only, caches, args.decode_shapes, args.decode_spread)
                                 if args.decode_sweep else {}),
                              **(gemv_sweep(rows_list=tuple(int(r) for r in args.gemv_rows.split(",")),
                                            weights=tuple(w for w in args.gemv_weights.split(",") if w),
                                            tilings=_gemv_tilings(args.gemv_tiling), fp8=args.gemv_fp8)
                                 if args.gemv_sweep else {}),
                              **(extend_sweep(Shapes()) if args.extend_sweep else {}),
                              **(extend_tiles(Shapes()) if args.extend_tiles else {}),
                              **(extend_peers(Shapes()) if args.extend_peers else {})}))
            return 0
        s = Shapes()
        result = {"mode": "gpu", "device": torch.cuda.get_device_name(), "shapes": asdict(s),
                  "correctness": correctness(s, "cuda")}
        ceil = ceilings(s)
        result["ceilings"] = ceil
        result["speed"] = speed(s, ceil)
        frac = result["speed"]["decode_attention_bf16"].get("frac_of_copy", 0.0)
        result["decode_target_met"] = frac >= 0.8
        if args.sweep:
            result["sweep"] = sweep(s)
    result["all_correct"] = all(c["ok"] for c in result["correctness"].values())
    print(json.dumps(result, indent=1))
    return 0 if result["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())

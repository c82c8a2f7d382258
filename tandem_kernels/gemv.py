"""Triton matrix-vector products for decode at small batch, with their neighbours fused in.

At batch 1 a decoder layer is a handful of weight-streaming GEMVs separated by small kernels
(the RMSNorm over x + residual before qkv and gate_up, SiLU-and-multiply after gate_up), each
costing a launch and a round trip through memory for a few KB of activations. `gemv` does one
GEMV with the norm as its prologue (every program re-reads the few rows of x, which stay in L2)
and SiLU-and-multiply as its epilogue (a program owns matching gate and up rows).

Under programmatic dependent launch (triton_common.pdl_begin) a kernel's programs may start
while the kernel before them still runs, and wait for it before they read what it wrote. A
GEMV's weights are written by no kernel, so with `GemvTiling.prefetch` each program loads its
first weight tile before that wait: the weight stream starts under the tail of the kernel before
(cuBLAS, launched without PDL, starts only after it). In the loop each program then loads its
next tile before it multiplies the current one.

FP8 weights (e4m3, one float32 scale per output row, engine/quant/fp8.py `Fp8Linear`) stream as
they are stored, half the bytes of bf16, and multiply the activations unquantized (the model's
dtype, widened to float32): the row's scale is applied to the float32 sum before it is rounded.
Where the FP8 projections' cuBLASLt GEMM runs no faster at one row than bf16's GEMV (BENCHMARKS.md
§6), this reads half the bytes.

Semantics equal tandem_kernels.reference.gemv: the unfused ops in sequence, with the same roundings
(the normalized activations and the GEMV outputs are rounded to x.dtype where the unfused path
stores them), up to the order of the fp32 accumulation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.gemv_tilings import TILING_ENV, GemvTiling, tiling_for
from tandem_kernels.norm import fused_add_rms_norm, rms_norm
from tandem_kernels.ops import GEMV_MAX_ROWS as MAX_ROWS, GEMV_PROJECTIONS as PROJECTIONS
from tandem_kernels.reference import check_weight_scale
from tandem_kernels.triton_common import next_pow2, pdl_begin, pdl_launch

NORM_CHUNK = 4096  # elements of x (rows x columns) the norm's sum of squares reads a step


@triton.jit
def _normed_chunk(x_ptr, res_ptr, nw_ptr, m, k, k_mask, mask, x_s0, res_s0, inv,
                  NORM: tl.constexpr, ADD_RES: tl.constexpr):
    """Rows `m`, columns `k` of the activations the GEMV multiplies (x, plus the residual when
    ADD_RES, normalized by `inv` and the norm weight when NORM; each rounded to x's dtype), in fp32."""
    x = tl.load(x_ptr + m[:, None] * x_s0 + k[None, :], mask=mask, other=0.0)
    if ADD_RES:
        r = tl.load(res_ptr + m[:, None] * res_s0 + k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if NORM:
        w = tl.load(nw_ptr + k, mask=k_mask, other=0.0)
        x = (x.to(tl.float32) * inv[:, None] * w[None, :].to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _weight_tile(w_rows, up_rows, r_mask, k, K, SILU_PAIR: tl.constexpr, W3D: tl.constexpr):
    """A program's weight tile at columns k (and its up rows' with SILU_PAIR; else the same tile):
    [BLOCK_N, BLOCK_K], or with W3D [1, BLOCK_N, BLOCK_K], loaded in the layout of the several rows'
    product it is broadcast into."""
    if W3D:
        mask = r_mask[None, :, None] & (k < K)[None, None, :]
        w = tl.load(w_rows[None, :, :] + k[None, None, :], mask=mask, other=0.0)
        if SILU_PAIR:
            wu = tl.load(up_rows[None, :, :] + k[None, None, :], mask=mask, other=0.0)
        else:
            wu = w
    else:
        mask = r_mask[:, None] & (k < K)[None, :]
        w = tl.load(w_rows + k[None, :], mask=mask, other=0.0)
        if SILU_PAIR:
            wu = tl.load(up_rows + k[None, :], mask=mask, other=0.0)
        else:
            wu = w
    return w, wu


@triton.jit
def _accumulate(acc, a, w, LATE_REDUCE: tl.constexpr):
    # One return, after an if/else: the compiler type-checks what follows an early return in a
    # constexpr branch too, and the two sums differ in shape.
    if LATE_REDUCE:
        acc = acc + a[:, None, :] * w.to(tl.float32)[None, :, :]
    else:
        acc = acc + tl.sum(a[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    return acc


@triton.jit
def _eighths(t, SHAPE: tl.constexpr):
    """t's last axis in eight interleaved parts (element j of every eight in part j), each `SHAPE`."""
    t = tl.reshape(t, SHAPE + [2, 2, 2])
    t0, t1 = tl.split(t)
    t00, t01 = tl.split(t0)
    t10, t11 = tl.split(t1)
    t000, t001 = tl.split(t00)
    t010, t011 = tl.split(t01)
    t100, t101 = tl.split(t10)
    t110, t111 = tl.split(t11)
    return t000, t001, t010, t011, t100, t101, t110, t111


@triton.jit
def _fma_eighths(acc, a, w, BM: tl.constexpr, BN: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BM, BN, BLOCK_K / 8] plus the product of rows a [BM, BLOCK_K] and tile w [1, BN, BLOCK_K],
    each eight neighbouring columns folded into their sum as a chain of multiply-adds
    (GemvTiling.fma_chain). The tile is widened before it is split (an e4m3 pair converts as one)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _eighths(tl.reshape(a, [BM, 1, BLOCK_K]), [BM, 1, BLOCK_K // 8])
    w0, w1, w2, w3, w4, w5, w6, w7 = _eighths(w.to(tl.float32), [1, BN, BLOCK_K // 8])
    acc = tl.fma(a0, w0, acc)
    acc = tl.fma(a1, w1, acc)
    acc = tl.fma(a2, w2, acc)
    acc = tl.fma(a3, w3, acc)
    acc = tl.fma(a4, w4, acc)
    acc = tl.fma(a5, w5, acc)
    acc = tl.fma(a6, w6, acc)
    acc = tl.fma(a7, w7, acc)
    return acc


@triton.jit
def _tile_step(acc, acc_up, w, wu, x_ptr, res_ptr, nw_ptr, m, m_mask, k0, K, x_s0, res_s0, inv,
               BLOCK_K: tl.constexpr, NORM: tl.constexpr, ADD_RES: tl.constexpr, SILU_PAIR: tl.constexpr,
               LATE_REDUCE: tl.constexpr, FLAT_ROW: tl.constexpr, W3D: tl.constexpr, FMA_CHAIN: tl.constexpr):
    """The sums after the weight tile at columns k0 (w, and wu with SILU_PAIR) times the activations there."""
    k = k0 + tl.arange(0, BLOCK_K)
    k_mask = k < K
    mask = m_mask[:, None] & k_mask[None, :]
    a = _normed_chunk(x_ptr, res_ptr, nw_ptr, m, k, k_mask, mask, x_s0, res_s0, inv, NORM, ADD_RES)
    if FLAT_ROW:
        a_row = tl.sum(a, 0)  # [BLOCK_K]: the one row
        acc += w.to(tl.float32) * a_row[None, :]
        if SILU_PAIR:
            acc_up += wu.to(tl.float32) * a_row[None, :]
    elif W3D:
        BM: tl.constexpr = a.shape[0]
        BN: tl.constexpr = w.shape[1]
        if FMA_CHAIN:
            acc = _fma_eighths(acc, a, w, BM, BN, BLOCK_K)
            if SILU_PAIR:
                acc_up = _fma_eighths(acc_up, a, wu, BM, BN, BLOCK_K)
        else:
            acc += tl.sum(tl.reshape(a[:, None, :] * w.to(tl.float32), [BM, BN, BLOCK_K // 8, 8]), 3)
            if SILU_PAIR:
                acc_up += tl.sum(tl.reshape(a[:, None, :] * wu.to(tl.float32), [BM, BN, BLOCK_K // 8, 8]), 3)
    else:
        acc = _accumulate(acc, a, w, LATE_REDUCE)
        if SILU_PAIR:
            acc_up = _accumulate(acc_up, a, wu, LATE_REDUCE)
    return acc, acc_up


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr, res_ptr, new_res_ptr, nw_ptr, w_ptr, ws_ptr, b_ptr, out_ptr,
    M, N_OUT, K, x_s0, res_s0, nres_s0, w_s0, out_s0, up_offset, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_K: tl.constexpr,
    NORM: tl.constexpr, ADD_RES: tl.constexpr, BIAS: tl.constexpr, SILU_PAIR: tl.constexpr, W_SCALE: tl.constexpr,
    LATE_REDUCE: tl.constexpr, PREFETCH: tl.constexpr, FLAT_ROW: tl.constexpr, W3D: tl.constexpr, STAGES: tl.constexpr,
    FMA_CHAIN: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    r_mask = rows < N_OUT
    w_rows = w_ptr + rows[:, None].to(tl.int64) * w_s0
    up_rows = w_ptr + (rows[:, None] + up_offset).to(tl.int64) * w_s0
    if PREFETCH:  # no kernel writes the weights: the first tile's loads need not wait (module docstring)
        w_next, wu_next = _weight_tile(w_rows, up_rows, r_mask, tl.arange(0, BLOCK_K), K, SILU_PAIR, W3D)
    pdl_begin(PDL)
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    inv = tl.zeros([BLOCK_M], tl.float32)
    if NORM:  # rsqrt(mean(s^2) + eps) of each row s = x (+ residual), s rounded as the unfused sum is;
        # NORM_K columns a step: at one row all of an 8B model's 4,096 in one round trip to L2
        ss = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, NORM_K):
            k = k0 + tl.arange(0, NORM_K)
            k_mask = k < K
            mask = m_mask[:, None] & k_mask[None, :]
            s = _normed_chunk(x_ptr, res_ptr, nw_ptr, m, k, k_mask, mask, x_s0, res_s0, inv, False, ADD_RES)
            if ADD_RES:
                if pid == 0:  # one program writes the new residual stream x + residual
                    tl.store(new_res_ptr + m[:, None] * nres_s0 + k[None, :], s.to(new_res_ptr.dtype.element_ty),
                             mask=mask)
            ss += tl.sum(s * s, 1)
        inv = 1.0 / tl.sqrt(ss / K + eps)
    if FLAT_ROW:  # one row: its activations a vector over the weight tile, sums per lane
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    elif W3D:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // 8], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K // 8], tl.float32)
    elif LATE_REDUCE:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if STAGES > 1:  # Triton pipelines the tiles' loads (GemvTiling.stages); a prefetched first tile goes first
        start = 0
        if PREFETCH:
            acc, acc_up = _tile_step(acc, acc_up, w_next, wu_next, x_ptr, res_ptr, nw_ptr, m, m_mask, 0, K, x_s0,
                                     res_s0, inv, BLOCK_K, NORM, ADD_RES, SILU_PAIR, LATE_REDUCE, FLAT_ROW, W3D,
                                     FMA_CHAIN)
            start = BLOCK_K
        for k0 in tl.range(start, K, BLOCK_K, num_stages=STAGES):
            w, wu = _weight_tile(w_rows, up_rows, r_mask, k0 + tl.arange(0, BLOCK_K), K, SILU_PAIR, W3D)
            acc, acc_up = _tile_step(acc, acc_up, w, wu, x_ptr, res_ptr, nw_ptr, m, m_mask, k0, K, x_s0, res_s0, inv,
                                     BLOCK_K, NORM, ADD_RES, SILU_PAIR, LATE_REDUCE, FLAT_ROW, W3D,
                                     FMA_CHAIN)
    else:
        for k0 in range(0, K, BLOCK_K):
            if PREFETCH:  # this tile arrived (or is arriving); ask for the next before using it
                w, wu = w_next, wu_next
                w_next, wu_next = _weight_tile(w_rows, up_rows, r_mask, k0 + BLOCK_K + tl.arange(0, BLOCK_K), K,
                                               SILU_PAIR, W3D)
            else:
                w, wu = _weight_tile(w_rows, up_rows, r_mask, k0 + tl.arange(0, BLOCK_K), K, SILU_PAIR, W3D)
            acc, acc_up = _tile_step(acc, acc_up, w, wu, x_ptr, res_ptr, nw_ptr, m, m_mask, k0, K, x_s0, res_s0, inv,
                                     BLOCK_K, NORM, ADD_RES, SILU_PAIR, LATE_REDUCE, FLAT_ROW, W3D,
                                     FMA_CHAIN)
    if FLAT_ROW:
        acc2 = tl.sum(acc, 1)[None, :]
        up2 = tl.sum(acc_up, 1)[None, :]
    elif LATE_REDUCE:
        acc2 = tl.sum(acc, 2)
        up2 = tl.sum(acc_up, 2)
    else:
        acc2 = acc
        up2 = acc_up
    if W_SCALE:  # FP8 weights: each output row's scale, on the float32 sum
        acc2 = acc2 * tl.load(ws_ptr + rows, mask=r_mask, other=0.0)[None, :]
        if SILU_PAIR:
            up2 = up2 * tl.load(ws_ptr + rows + up_offset, mask=r_mask, other=0.0)[None, :]
    if BIAS:
        acc2 += tl.load(b_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_PAIR:
            up2 += tl.load(b_ptr + rows + up_offset, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    out_ty = out_ptr.dtype.element_ty
    y = acc2.to(out_ty)
    if SILU_PAIR:  # silu_and_mul of the rounded gate and up outputs, as the unfused path does
        g = y.to(tl.float32)
        u = up2.to(out_ty).to(tl.float32)
        y = (g / (1.0 + tl.exp(-g)) * u).to(out_ty)
    tl.store(out_ptr + m[:, None] * out_s0 + rows[None, :], y, mask=m_mask[:, None] & r_mask[None, :])


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
    silu_pair: bool = False, weight_scale: torch.Tensor | None = None, tiling: GemvTiling | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See tandem_kernels.reference.gemv. x: [M, K] with M <= MAX_ROWS; weight: [N, K] (e4m3 with
    `weight_scale` [N]). tiling: the launch shape (None: GemvTiling()); results agree across
    tilings to rounding."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] must share K, got {tuple(x.shape)} and {tuple(weight.shape)}")
    m_rows = x.shape[0]
    if m_rows > MAX_ROWS:
        raise ValueError(f"x: at most {MAX_ROWS} rows, got {m_rows}")
    if residual is not None and (norm_weight is None or residual.shape != x.shape):
        raise ValueError("residual needs norm_weight and the shape of x")
    if silu_pair and weight.shape[0] % 2:
        raise ValueError(f"silu_pair: weight needs an even number of rows, got {weight.shape[0]}")
    check_weight_scale(weight, weight_scale)
    tiling = tiling or GemvTiling()
    if tiling.separate_norm and norm_weight is not None:  # the norm's own kernel, then a GEMV without it
        if residual is not None:
            x, new_res = fused_add_rms_norm(x, residual, norm_weight, eps)
        else:
            x, new_res = rms_norm(x, norm_weight, eps), None
        return gemv(x, weight, bias, silu_pair=silu_pair, weight_scale=weight_scale, tiling=tiling)[0], new_res
    x = x.contiguous()
    n_out = weight.shape[0] // 2 if silu_pair else weight.shape[0]
    out = torch.empty((m_rows, n_out), dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(x) if residual is not None else None
    if m_rows == 0:
        return out, new_res
    grid, args, consts = gemv_launch(x, weight.contiguous(), bias, residual, norm_weight, eps, silu_pair,
                                     tiling, out, new_res, weight_scale)
    _gemv_kernel[grid](*args, **consts)
    return out, new_res


def gemv_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                norm_weight: torch.Tensor | None, eps: float, silu_pair: bool, t: GemvTiling, out: torch.Tensor,
                new_res: torch.Tensor | None, weight_scale: torch.Tensor | None = None) -> tuple[tuple[int], list, dict]:
    """_gemv_kernel's launch for checked, contiguous x and weight: (grid, positional args, keyword
    constants incl. num_warps). One home for `gemv` and for bench/kernel_ir.py, which compiles the
    kernel as a launch specializes it, on tensors of the meta device."""
    m_rows, k_dim = x.shape
    n_out = out.shape[1]
    res = residual.contiguous() if residual is not None else x
    block_m = max(1, next_pow2(m_rows))
    block_k = max(16, min(t.block_k if t.wide_rows else t.block_k // block_m, next_pow2(k_dim)))
    args = [x, res, new_res if new_res is not None else x, norm_weight if norm_weight is not None else x,
            weight, weight_scale.float().contiguous() if weight_scale is not None else x,
            bias if bias is not None else x, out,
            m_rows, n_out, k_dim, x.stride(0), res.stride(0), new_res.stride(0) if new_res is not None else 0,
            weight.stride(0), out.stride(0), n_out, float(eps)]
    consts = dict(BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=block_k,
                  NORM_K=max(16, min(next_pow2(k_dim), NORM_CHUNK // block_m)), NORM=norm_weight is not None,
                  ADD_RES=residual is not None, BIAS=bias is not None, SILU_PAIR=silu_pair,
                  W_SCALE=weight_scale is not None,
                  LATE_REDUCE=t.late_reduce, PREFETCH=t.prefetch, FLAT_ROW=t.flat_row and t.late_reduce and block_m == 1,
                  W3D=t.flat_row and t.late_reduce and block_m > 1,  # flat_row's several-row product
                  STAGES=t.stages, FMA_CHAIN=t.fma_chain,
                  num_warps=t.num_warps, **pdl_launch(x.device))
    return (triton.cdiv(n_out, t.block_n),), args, consts


__all__ = ["MAX_ROWS", "NORM_CHUNK", "PROJECTIONS", "TILING_ENV", "GemvTiling", "gemv", "gemv_launch", "tiling_for"]

"""Triton RMSNorm and fused residual-add + RMSNorm (one read of x and residual, both outputs written).

Semantics match tandem_kernels.reference.rms_norm / fused_add_rms_norm exactly: statistics in fp32,
the residual sum rounded to x.dtype before it is normalized, outputs in x.dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.quant import FP8_MIN_SCALE, check_deferred_scales, check_rows, row_scale, to_e4m3_range
from tandem_kernels.reference import DeferredScales
from tandem_kernels.triton_common import next_pow2, pdl_begin, pdl_launch, soft_fp8_round

MAX_HIDDEN = 65536  # one row is held in registers: beyond this a looped kernel would be needed
ELEMS_PER_WARP = 512  # tile elements per warp


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    n_rows, rows_inner, x_s0, x_s1, r_s0, r_s1, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    # Rows are addressed as (row // rows_inner) * s0 + (row % rows_inner) * s1 so that a strided
    # [T, H, D] view (q/k norm on a slice of a fused qkv output) needs no copy.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    outer, inner = rows // rows_inner, rows % rows_inner
    x = tl.load(x_ptr + (outer * x_s0 + inner * x_s1)[:, None] + cols[None, :], mask=mask, other=0.0)
    dense = rows[:, None] * n_cols + cols[None, :]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (outer * r_s0 + inner * r_s1)[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + dense, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = xf * rstd[:, None] * w[None, :]
    tl.store(out_ptr + dense, y.to(out_ptr.dtype.element_ty), mask=mask)


def _row_view(x: torch.Tensor, name: str) -> tuple[torch.Tensor, int, int, int, int]:
    """(tensor, n_rows, rows_inner, s0, s1) addressing x's rows without a copy where possible."""
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 1, 1, 0, 0
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x, x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    x = x.reshape(-1, x.shape[-1])
    return x, x.shape[0], 1, x.stride(0), 0


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    n_cols = x.shape[-1] if x.dim() else 0
    if weight.dim() != 1 or weight.shape[0] != n_cols:
        raise ValueError(f"weight must have shape [{n_cols}], got {tuple(weight.shape)}")
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"x hidden size {n_cols} exceeds {MAX_HIDDEN}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    weight = weight.contiguous()
    xv, n_rows, inner, xs0, xs1 = _row_view(x, "x")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    if residual is not None:
        rv, _, _, rs0, rs1 = _row_view(residual, "residual")
    else:
        rv, rs0, rs1 = xv, 0, 0
    if n_rows == 0 or n_cols == 0:
        return out, res_out
    block_n = next_pow2(n_cols)
    # Small rows (q/k norm over head_dim) are batched several to a program.
    block_m = max(1, min(64, 2048 // block_n))
    num_warps = min(32, max(4, block_n * block_m // ELEMS_PER_WARP))
    grid = (triton.cdiv(n_rows, block_m),)
    _rms_norm_kernel[grid](
        xv, rv, weight, out, res_out,
        n_rows, inner, xs0, xs1, rs0, rs1, n_cols, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
        **pdl_launch(x.device),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim, fp32 math, returned in x.dtype."""
    out, _ = _launch(x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual), the sum rounded to x.dtype; new tensors."""
    return _launch(x, residual, weight, eps)


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_fp8_kernel(
    x_ptr, res_ptr, w_ptr, q_ptr, scale_ptr, res_out_ptr, xr_ptr, xc_ptr,
    n_rows, x_s0, r_s0, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_X_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFT_ROUND: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    # _rms_norm_kernel on 2-D rows, its output rounded to x.dtype (as the unfused norm stores it)
    # and then quantized per row: the GEMM after it reads e4m3 and one scale per token.
    # HAS_X_SCALES: x is an FP8 GEMM's unscaled product; its row and column scales apply first.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + (rows * x_s0)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_X_SCALES:
        xr = tl.load(xr_ptr + rows, mask=row_mask, other=0.0)
        xc = tl.load(xc_ptr + cols, mask=cols < n_cols, other=0.0)
        x = (x.to(tl.float32) * xr[:, None] * xc[None, :]).to(x_ptr.dtype.element_ty)
    dense = rows[:, None] * n_cols + cols[None, :]
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (rows * r_s0)[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + dense, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=1) / n_cols
    rstd = 1.0 / tl.sqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = (xf * rstd[:, None] * w[None, :]).to(x.dtype).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(y), axis=1))
    q = to_e4m3_range(y, scale[:, None], SOFT_ROUND)
    tl.store(q_ptr + dense, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + rows, scale, mask=row_mask)


def _launch_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                x_scales: DeferredScales | None):
    x = check_rows(x)
    n_rows, n_cols = x.shape
    xr, xc = check_deferred_scales(x_scales, n_rows, n_cols)
    if weight.dim() != 1 or weight.shape[0] != n_cols:
        raise ValueError(f"weight must have shape [{n_cols}], got {tuple(weight.shape)}")
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"x hidden size {n_cols} exceeds {MAX_HIDDEN}")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        residual = check_rows(residual, "residual")
    weight = weight.contiguous()
    q = torch.empty((n_rows, n_cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((n_rows, 1), dtype=torch.float32, device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if n_rows == 0:
        return q, scale, res_out
    if n_cols == 0:
        return q, scale.fill_(FP8_MIN_SCALE), res_out
    block_n = next_pow2(n_cols)
    block_m = max(1, min(64, 2048 // block_n))
    num_warps = min(32, max(4, block_n * block_m // ELEMS_PER_WARP))
    rv = residual if residual is not None else x
    _rms_norm_fp8_kernel[(triton.cdiv(n_rows, block_m),)](
        x, rv, weight, q, scale, res_out if res_out is not None else x, xr if xr is not None else scale,
        xc if xc is not None else scale, n_rows, x.stride(0), rv.stride(0), n_cols, float(eps),
        HAS_RESIDUAL=residual is not None, HAS_X_SCALES=xr is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        SOFT_ROUND=soft_fp8_round(), num_warps=num_warps, **pdl_launch(x.device),
    )
    return q, scale, res_out


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 x_scales: DeferredScales | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (q [T, H] e4m3, scale [T, 1] float32) of rms_norm(x); see tandem_kernels.reference."""
    q, scale, _ = _launch_fp8(x, None, weight, eps, x_scales)
    return q, scale


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    x_scales: DeferredScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, x + residual): fused_add_rms_norm with its output quantized per token, one kernel."""
    return _launch_fp8(x, residual, weight, eps, x_scales)

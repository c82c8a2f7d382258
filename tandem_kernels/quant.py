"""Triton per-token FP8 (e4m3) quantization of activation rows, and the row quantizer the fused
norm and SiLU-and-multiply FP8 kernels share.

Semantics match tandem_kernels.reference.quantize_fp8_per_token: scale = max(amax / 448, FP8_MIN_SCALE),
q = clamp(x / scale, +-448) rounded to nearest even, both divisions exact (div_rn), so the GPU
kernels reproduce the reference bit for bit on the same input.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.triton_common import pdl_begin, pdl_launch, round_to_e4m3, soft_fp8_round

FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (448.0 * 512.0)
CHUNK = 4096  # elements of a row a program holds at once


@triton.jit
def row_scale(amax):
    """The float32 scale of rows whose largest magnitude is `amax`."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1.0 / (448.0 * 512.0))


@triton.jit
def to_e4m3_range(y, scale, SOFT_ROUND: tl.constexpr):
    """fp32 y / scale clamped to +-448, ready for the cast to e4m3 (rounded first when SOFT_ROUND,
    see tandem_kernels.triton_common.soft_fp8_round)."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -448.0), 448.0)
    if SOFT_ROUND:
        q = round_to_e4m3(q)
    return q


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, x_row_stride, n_cols,
                          BLOCK: tl.constexpr, SOFT_ROUND: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    # One program per row, two passes over it: the row's largest magnitude, then the stores.
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * x_row_stride
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = row_scale(tl.max(amax, axis=0))
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        q = to_e4m3_range(x, scale, SOFT_ROUND)
        tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def check_rows(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    """x as a 2-D tensor with unit column stride (copied only when it must be)."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, features], got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def check_deferred_scales(scales: tuple[torch.Tensor, torch.Tensor] | None, n_rows: int,
                          n_cols: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(row_scale, col_scale) of an unscaled FP8 product [n_rows, n_cols] as contiguous float32
    vectors, or (None, None) when `scales` is None; ValueError naming x_scales on a bad shape."""
    if scales is None:
        return None, None
    row, col = scales
    if row.numel() != n_rows or col.numel() != n_cols:
        raise ValueError(f"x_scales: expected {n_rows} row scales and {n_cols} column scales, got shapes "
                         f"{tuple(row.shape)} and {tuple(col.shape)}")
    return row.reshape(-1).float().contiguous(), col.reshape(-1).float().contiguous()


def block_for(n_cols: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a row loop over n_cols columns."""
    block = min(CHUNK, triton.next_power_of_2(max(n_cols, 16)))
    return block, (4 if block <= 1024 else 8)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] e4m3, scale [T, 1] float32); see tandem_kernels.reference."""
    x = check_rows(x)
    rows, n_cols = x.shape
    q = torch.empty((rows, n_cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    if n_cols == 0:
        return q, scale.fill_(FP8_MIN_SCALE)
    block, warps = block_for(n_cols)
    _quantize_rows_kernel[(rows,)](x, q, scale, x.stride(0), n_cols, BLOCK=block,
                                   SOFT_ROUND=soft_fp8_round(), num_warps=warps, **pdl_launch(x.device))
    return q, scale

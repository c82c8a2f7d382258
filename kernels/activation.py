"""Triton SiLU-and-multiply: x [..., 2*I] -> silu(x[..., :I]) * x[..., I:], fp32 math, x.dtype out."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    base = x_ptr + row * x_row_stride
    gate = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> [..., I] = silu(gate) * up, computed in fp32, returned in x.dtype."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x last dim must be even (gate and up halves), got shape {tuple(x.shape)}")
    inter = x.shape[-1] // 2
    if x.stride(-1) != 1 or (x.dim() > 2 and not x.is_contiguous()):
        x = x.contiguous()
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(inter))
    grid = (rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, out, x2.stride(0), inter, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out

"""Triton SiLU-and-multiply: x [..., 2*I] -> silu(x[..., :I]) * x[..., I:], fp32 math, x.dtype out."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.quant import FP8_MIN_SCALE, block_for, check_deferred_scales, check_rows, row_scale, to_e4m3_range
from tandem_kernels.reference import DeferredScales
from tandem_kernels.triton_common import num_sms, pdl_begin, pdl_launch, soft_fp8_round

BLOCK = 2048
# silu_and_mul_fp8 holds a whole row in registers (one read of it; the two-pass loop reads it twice,
# the second time from L2) up to this many columns: 16,384 fp32 values over 32 warps is 16 a lane
# (sm_90, Triton 3.6: 32 registers, 2 programs an SM; 44 and 1 with deferred scales; no spills).
ONE_PASS_MAX = 16384


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
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
    _silu_and_mul_kernel[grid](x2, out, x2.stride(0), inter, BLOCK=block, num_warps=4 if block <= 1024 else 8,
                               **pdl_launch(x.device))
    return out


@triton.jit
def _load_hinted(ptrs, mask, HINT: tl.constexpr, KEEP: tl.constexpr):
    """A masked load; with HINT, as L1 should treat its lines: KEEP, lines to keep (a deferred
    GEMM's column scales, which every row reads again), else lines to drop first (a row, read once)."""
    if not HINT:
        return tl.load(ptrs, mask=mask, other=0.0)
    if KEEP:
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _gate_and_up(base, xc_ptr, xr, cols, mask, inter, HAS_X_SCALES: tl.constexpr, SCALES_L1: tl.constexpr):
    """A row's gate and up at `cols`, in float32; with HAS_X_SCALES the row is an FP8 GEMM's
    unscaled product, scaled here (row scale xr, column scales at xc_ptr) and rounded to its dtype.
    SCALES_L1 (with HAS_X_SCALES): the column scales stay in L1 for the next row the SM takes, and
    the row's own lines leave first."""
    gate = _load_hinted(base + cols, mask, SCALES_L1, False)
    up = _load_hinted(base + inter + cols, mask, SCALES_L1, False)
    if HAS_X_SCALES:
        gate_scale = _load_hinted(xc_ptr + cols, mask, SCALES_L1, True)
        up_scale = _load_hinted(xc_ptr + inter + cols, mask, SCALES_L1, True)
        gate = (gate.to(tl.float32) * xr * gate_scale).to(base.dtype.element_ty)
        up = (up.to(tl.float32) * xr * up_scale).to(base.dtype.element_ty)
    return gate.to(tl.float32), up.to(tl.float32)


@triton.jit
def _silu_fp8_row(gate, up, q_ptr, scale_ptr, row, cols, mask, inter, DTYPE: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """Quantize one whole row's product (gate, up in float32) and store it and its scale."""
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(DTYPE).to(tl.float32)
    scale = row_scale(tl.max(tl.abs(y), axis=0))
    q = to_e4m3_range(y, scale, SOFT_ROUND)
    tl.store(q_ptr + row * inter + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit(do_not_specialize=["rows"])  # a step's row count: no variant for each value class of it
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, xr_ptr, xc_ptr, x_row_stride, inter, rows,
                             HAS_X_SCALES: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                             PERSISTENT: tl.constexpr, SCALES_L1: tl.constexpr, SOFT_ROUND: tl.constexpr,
                             PDL: tl.constexpr):
    pdl_begin(PDL)
    if PERSISTENT:  # ONE_PASS, no x scales: rows pid, pid + programs, ...; the next row's loads
        # are issued before this row's product, maximum and stores, so they are in flight while
        # this program (not only another one on its SM) works on the row it holds.
        first = tl.program_id(0).to(tl.int64)
        step = tl.num_programs(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < inter
        base = x_ptr + first * x_row_stride
        gate = tl.load(base + cols, mask=mask, other=0.0)
        up = tl.load(base + inter + cols, mask=mask, other=0.0)
        for row in tl.range(first, rows, step, num_stages=1):
            nxt = row + step
            more = cols < tl.where(nxt < rows, inter, 0)  # the row past the last loads nothing
            base = x_ptr + nxt * x_row_stride
            gate_next = tl.load(base + cols, mask=more, other=0.0)
            up_next = tl.load(base + inter + cols, mask=more, other=0.0)
            _silu_fp8_row(gate.to(tl.float32), up.to(tl.float32), q_ptr, scale_ptr, row, cols, mask, inter,
                          x_ptr.dtype.element_ty, SOFT_ROUND)
            gate, up = gate_next, up_next
        return
    # One program per row. ONE_PASS (BLOCK covers the row): the product stays in registers
    # between its largest magnitude and the quantized stores. Otherwise two passes, the second
    # recomputing the product from the row, by then in cache.
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * x_row_stride
    if HAS_X_SCALES:
        xr = tl.load(xr_ptr + row)
    else:
        xr = 1.0
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        mask = cols < inter
        gate, up = _gate_and_up(base, xc_ptr, xr, cols, mask, inter, HAS_X_SCALES, SCALES_L1)
        _silu_fp8_row(gate, up, q_ptr, scale_ptr, row, cols, mask, inter, x_ptr.dtype.element_ty, SOFT_ROUND)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < inter
        gate, up = _gate_and_up(base, xc_ptr, xr, cols, mask, inter, HAS_X_SCALES, SCALES_L1)
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(y))
    scale = row_scale(tl.max(amax, axis=0))
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < inter
        gate, up = _gate_and_up(base, xc_ptr, xr, cols, mask, inter, HAS_X_SCALES, SCALES_L1)
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        q = to_e4m3_range(y, scale, SOFT_ROUND)
        tl.store(q_ptr + row * inter + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def silu_and_mul_fp8(x: torch.Tensor, x_scales: DeferredScales | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, 2*I] -> (q [T, I] e4m3, scale [T, 1] float32): silu_and_mul rounded to x.dtype,
    quantized per token in the same kernel (see tandem_kernels.reference.silu_and_mul_fp8)."""
    x = check_rows(x)
    if x.shape[-1] % 2:
        raise ValueError(f"x last dim must be even (gate and up halves), got shape {tuple(x.shape)}")
    rows, inter = x.shape[0], x.shape[1] // 2
    xr, xc = check_deferred_scales(x_scales, rows, 2 * inter)
    q = torch.empty((rows, inter), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    if inter == 0:
        return q, scale.fill_(FP8_MIN_SCALE)
    consts, per_sm = silu_fp8_consts(silu_fp8_shape(inter), deferred=xr is not None)
    programs = min(rows, per_sm * num_sms(x.device)) if per_sm else rows
    _silu_and_mul_fp8_kernel[(programs,)](x, q, scale, xr if xr is not None else scale,
                                          xc if xc is not None else scale, x.stride(0), inter, rows, **consts,
                                          SOFT_ROUND=soft_fp8_round(), **pdl_launch(x.device))
    return q, scale


def silu_fp8_consts(shape: dict, deferred: bool) -> tuple[dict, int]:
    """(_silu_and_mul_fp8_kernel's shape constants, with HAS_X_SCALES and PERSISTENT; programs an
    SM, 0 for a program a row) for a `silu_fp8_shape` and rows with or without deferred scales:
    the persistent loop only for whole rows without them, L1 hints only with them."""
    consts = dict(shape)
    per_sm = consts.pop("PERSIST")
    persistent = bool(per_sm) and consts["ONE_PASS"] and not deferred
    consts["SCALES_L1"] = consts["SCALES_L1"] and deferred
    return {**consts, "HAS_X_SCALES": deferred, "PERSISTENT": persistent}, per_sm if persistent else 0


def silu_fp8_shape(inter: int) -> dict:
    """BLOCK, ONE_PASS, num_warps, PERSIST and SCALES_L1 of _silu_and_mul_fp8_kernel over rows of
    `inter` outputs. PERSIST > 0 (whole rows without deferred scales only): that many programs an
    SM, each taking every so-many-th row and loading its next row while it finishes one; 0: one
    program per row. PERSIST is 0 here: `bench/silu_fp8_bench.py --sweep` times the alternative
    (BENCHMARKS.md §25; on the H200 it was slower, 273 µs against 232 at 8,448 rows, §27).
    SCALES_L1 (rows with deferred scales only): their column scales, twice a row's bytes and the
    same for every row, are loaded to stay in L1 and the row to leave it first; off, as the H200
    measured it slower (384 rows 24.5 µs against 22.6 without, 512 rows 32.3 against 29.8, §27);
    `--sweep` times both."""
    whole = triton.next_power_of_2(max(inter, 16))
    if whole <= ONE_PASS_MAX:
        return dict(BLOCK=whole, ONE_PASS=True, num_warps=max(4, min(32, whole // 512)), PERSIST=0, SCALES_L1=False)
    block, warps = block_for(inter)
    return dict(BLOCK=block, ONE_PASS=False, num_warps=warps, PERSIST=0, SCALES_L1=False)

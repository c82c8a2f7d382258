"""Triton row argmax for greedy sampling: the first index of each row's largest value.

torch's argmax over a [rows, vocab] tensor of few rows spreads a row over few blocks (27.7 µs for
one 128,256-column float32 row on an H200, BENCHMARKS.md §28). Here stage 1 gives every
CHUNK columns of a row a program (its largest value and that value's first index), and stage 2
takes each row's first best over its chunks. Semantics match tandem_kernels.reference.argmax_rows
(torch.argmax: ties go to the lowest index, NaN counts as larger than every number).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.triton_common import next_pow2, pdl_begin, pdl_launch

CHUNK = 4096


@triton.jit
def _first_best(v, index, none):
    """(largest of v, NaN above every number, as float32 +inf; the lowest `index` holding it)."""
    v = tl.where(v != v, float("inf"), v)
    best = tl.max(v, 0)
    return best, tl.min(tl.where(v == best, index, none), 0)


@triton.jit(do_not_specialize=["cols", "x_s0"])
def _argmax_chunks(x_ptr, val_ptr, idx_ptr, cols, x_s0, chunks, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    v = tl.load(x_ptr + row * x_s0 + offs, mask=offs < cols, other=float("-inf")).to(tl.float32)
    best, first = _first_best(v, offs, cols)
    tl.store(val_ptr + row * chunks + c, best)
    tl.store(idx_ptr + row * chunks + c, first)


@triton.jit
def _argmax_rows(val_ptr, idx_ptr, out_ptr, chunks, cols, CHUNKS_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    mask = c < chunks
    v = tl.load(val_ptr + row * chunks + c, mask=mask, other=float("-inf"))
    index = tl.load(idx_ptr + row * chunks + c, mask=mask, other=cols)
    _, first = _first_best(v, index, cols)
    tl.store(out_ptr + row, first.to(tl.int64))  # padding (lanes, chunks) is -inf at index cols: never first


def launch_shape(cols: int, max_chunk: int = CHUNK) -> dict:
    """How a two-stage row reduction splits a row of `cols` columns into chunks of at most
    `max_chunk`: CHUNK (columns a stage-1 program), chunks (stage-1 programs a row), CHUNKS_PAD
    (stage 2's lanes) and stage 1's warps. One home for argmax_rows, bench/kernel_ir.py and
    tandem_kernels.sampling's first pass."""
    chunk = min(max_chunk, next_pow2(cols))
    chunks = triton.cdiv(cols, chunk)
    return {"CHUNK": chunk, "chunks": chunks, "CHUNKS_PAD": max(2, next_pow2(chunks)),
            "num_warps": 4 if chunk >= 1024 else 1}


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, cols] (any float dtype, unit column stride) -> [rows] int64: see the module docstring."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"x must be [rows, cols] with cols >= 1, got shape {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    shape = launch_shape(cols)
    chunks = shape["chunks"]
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    pdl = pdl_launch(x.device)
    _argmax_chunks[(rows, chunks)](x, vals, idx, cols, x.stride(0), chunks, CHUNK=shape["CHUNK"],
                                   num_warps=shape["num_warps"], **pdl)
    _argmax_rows[(rows,)](vals, idx, out, chunks, cols, CHUNKS_PAD=shape["CHUNKS_PAD"], num_warps=1, **pdl)
    return out

"""Triton sampling with top-k, top-p and min-p filters and no sort.

A sampled row's token is the winner of an exponential race among the tokens its filters allow
(tandem_kernels.reference.sample_filtered states the rule). Sorting a [rows, vocab] block to
find a nucleus costs a quarter of a 128-row decode step at a 128k vocabulary (BENCHMARKS.md §37);
here the rows are streamed instead, as FlashInfer's samplers do:

1. one pass, CHUNK columns a program: each chunk's largest logit at or above the top-k
   threshold (`kth`, found by the caller with a top-k of k values, not a sort), its softmax
   normaliser, and the race's winner there;
2. one program a row combines its chunks (the row's max, normaliser and winner) and, while the
   winner is not allowed (the softmax mass strictly above it reaches top_p of the normaliser, a
   pass over the row; or it lies below the min-p floor), runs the next race among the tokens
   strictly above the rejected one, with the same noise.

Every allowed token lies strictly above any rejected one (top-p keeps a most-likely set; the
min-p floor is a threshold), so each race's set still holds the allowed set, and its winner,
once allowed, is the allowed set's own winner: the token the sorted filter gives, with no
randomness spent twice. Rounds are few on real distributions (each one drops the rejected token
and every token below it); a mass check is one more pass over the row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.argmax import launch_shape
from tandem_kernels.triton_common import next_pow2, pdl_begin, pdl_launch

# Launch shape (bench/sampling_kernel.py, H100, 128 rows x 128,256 columns, BENCHMARKS.md §38): the
# first pass 59 µs at 2,048 columns a program against 77 at 4,096; a top-p mass pass 101 µs at
# 8,192 columns a load and 16 warps against 138 at 4,096 and 8.
CHUNK = 2048  # columns of a row one first-pass program takes
BLOCK = 8192  # columns a finishing program loads at once
NUM_WARPS = 16  # the finishing program's
# Races a row may run: each drops at least the rejected token, and on a real distribution a few
# do (BENCHMARKS.md §38); the bound only keeps a malformed row from holding the GPU.
MAX_ROUNDS = tl.constexpr(64)


@triton.jit(do_not_specialize=["cols", "x_s0", "n_s0"])
def _chunk_race(x_ptr, n_ptr, inv_t_ptr, kth_ptr, m_ptr, z_ptr, best_ptr, idx_ptr, cols, x_s0, n_s0, chunks,
                CHUNK: tl.constexpr, PDL: tl.constexpr):
    """One CHUNK of a row: its largest logit at or above kth, the softmax normaliser against it,
    and the race's best score there and that score's first index."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    inb = offs < cols
    v = tl.load(x_ptr + row * x_s0 + offs, mask=inb, other=float("-inf")).to(tl.float32)
    e = tl.load(n_ptr + row * n_s0 + offs, mask=inb, other=1.0)
    inv_t = tl.load(inv_t_ptr + row)
    keep = inb & (v >= tl.load(kth_ptr + row)) & (v > float("-inf"))
    m = tl.max(tl.where(keep, v, float("-inf")), 0)
    z = tl.sum(tl.where(keep, tl.exp((v - m) * inv_t), 0.0), 0)
    score = tl.where(keep, v * inv_t - tl.log(e), float("-inf"))
    best = tl.max(score, 0)
    at = row * chunks + c
    tl.store(m_ptr + at, m)
    tl.store(z_ptr + at, z)
    tl.store(best_ptr + at, best)
    tl.store(idx_ptr + at, tl.min(tl.where(score == best, offs, cols), 0))


@triton.jit
def _mass_above(x_ptr, cols, inv_t, kth, m, x_tok, BLOCK: tl.constexpr):
    """The softmax mass (against max m) of the row's tokens strictly above x_tok and at or
    above kth. Sums per lane, one reduction at the end: loads are all the loop waits on."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < cols, other=float("-inf")).to(tl.float32)
        acc += tl.where((v > x_tok) & (v >= kth), tl.exp((v - m) * inv_t), 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _race(x_ptr, n_ptr, cols, inv_t, kth, above, floor, BLOCK: tl.constexpr):
    """(winner, its logit, its score): the first index of the largest x * inv_t - log(noise)
    among the columns with x >= kth, x > above and x >= floor (finite); the score -inf where
    there is none. Best per lane, then across."""
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    idx = tl.full([BLOCK], cols, dtype=tl.int32)
    for start in range(0, cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < cols
        v = tl.load(x_ptr + offs, mask=inb, other=float("-inf")).to(tl.float32)
        e = tl.load(n_ptr + offs, mask=inb, other=1.0)
        keep = (v >= kth) & (v > above) & (v >= floor) & (v > float("-inf"))
        score = tl.where(keep, v * inv_t - tl.log(e), float("-inf"))
        take = score > best  # a lane's earlier column wins its ties
        best = tl.where(take, score, best)
        idx = tl.where(take, offs, idx)
    b = tl.max(best, 0)
    tok = tl.minimum(tl.min(tl.where(best == b, idx, cols), 0), cols - 1)
    return tok, tl.load(x_ptr + tok).to(tl.float32), b


@triton.jit(do_not_specialize=["cols", "x_s0", "n_s0"])
def _finish(x_ptr, n_ptr, inv_t_ptr, kth_ptr, top_p_ptr, min_p_gap_ptr, m_ptr, z_ptr, best_ptr, idx_ptr, out_ptr,
            cols, x_s0, n_s0, chunks, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """A row's chunks combined (max, normaliser, the race's winner), then races among the
    tokens above each rejected winner until one is allowed."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_ptr += row * x_s0
    n_ptr += row * n_s0
    inv_t = tl.load(inv_t_ptr + row)
    kth = tl.load(kth_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    c = tl.arange(0, CHUNKS_PAD)
    at = row * chunks + c
    valid = c < chunks
    mc = tl.load(m_ptr + at, mask=valid, other=float("-inf"))
    m = tl.max(mc, 0)
    z = tl.sum(tl.where(mc > float("-inf"), tl.load(z_ptr + at, mask=valid, other=0.0) * tl.exp((mc - m) * inv_t),
                        0.0), 0)
    bc = tl.load(best_ptr + at, mask=valid, other=float("-inf"))
    b = tl.max(bc, 0)
    tok = tl.minimum(tl.min(tl.where(bc == b, tl.load(idx_ptr + at, mask=valid, other=cols), cols), 0), cols - 1)
    x_tok = tl.load(x_ptr + tok).to(tl.float32)

    floor = m + tl.load(min_p_gap_ptr + row)  # min_p 0: -inf
    limit = top_p * z
    above = float("-inf")
    race = x_tok < floor
    done = False
    rounds = 0
    while not done:
        if race:
            tok, x_tok, b = _race(x_ptr, n_ptr, cols, inv_t, kth, above, floor, BLOCK)
        mass = 0.0
        if top_p < 1.0:
            mass = _mass_above(x_ptr, cols, inv_t, kth, m, x_tok, BLOCK)
        # A row with no finite logit (all masked, or NaN) has no candidate: never loop on it.
        rounds += 1
        done = (mass < limit) | (b == float("-inf")) | (rounds >= MAX_ROUNDS)
        above = x_tok
        race = True
    tl.store(out_ptr + row, tok.to(tl.int64))


def sample_filtered(x: torch.Tensor, temperature: torch.Tensor, kth: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """See tandem_kernels.reference.sample_filtered."""
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if noise.stride(1) != 1:
        noise = noise.contiguous()
    dev = x.device
    shape = launch_shape(cols, CHUNK)
    chunks = shape["chunks"]
    temperature = temperature.float()
    inv_t = temperature.reciprocal()
    kth = kth.float().contiguous()
    m, z, best = (torch.empty((rows, chunks), dtype=torch.float32, device=dev) for _ in range(3))
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=dev)
    pdl = pdl_launch(dev)
    _chunk_race[(rows, chunks)](x, noise, inv_t, kth, m, z, best, idx, cols, x.stride(0), noise.stride(0), chunks,
                                CHUNK=shape["CHUNK"], num_warps=shape["num_warps"], **pdl)
    _finish[(rows,)](x, noise, inv_t, kth, top_p.float().contiguous(), torch.log(min_p.float()) * temperature,
                     m, z, best, idx, out, cols, x.stride(0), noise.stride(0), chunks,
                     CHUNKS_PAD=shape["CHUNKS_PAD"], BLOCK=min(BLOCK, next_pow2(cols)), num_warps=NUM_WARPS,
                     **pdl)
    return out

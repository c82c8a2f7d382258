"""Triton paged decode attention: split-KV flash-decoding with GQA grouping.

Stage 1 (its kernels are in tandem_kernels.decode_stage1): one program per (sequence, KV head,
KV split) loads each K/V tile of its split once and scores it against all the query heads of
that KV head's group with tl.dot, keeping an online softmax in fp32; it writes a normalized
partial output and its log-sum-exp (log2 domain).
Stage 2: one program per (sequence, query head) merges the splits by their log-sum-exp.
With a single split, stage 1 writes the final output directly. An FP8 cache's V tile is widened to
fp16 where it is loaded (DecodeTuning.opaque_cvt), so it reaches the MMA as fp16 through shared
memory rather than as bytes gathered across rows.
Every launch decision depends only on tensor shapes (block_tables.shape[1] bounds the context),
so a captured CUDA graph stays valid for any context lengths. The split count is fixed by those
shapes, but each sequence's split length is its own context divided among the splits (at least
`min_partition`): a graph captured for the longest context a model allows still spreads a short
context over every split rather than giving it all to the first.
Semantics match tandem_kernels.reference.paged_decode_attention; a context_len of 0 gives zeros.
`rotary_store_and_decode` also rotates the queries and stores the step's own K and V in stage 1
(one kernel fewer a layer than rotary.rotary_and_store_kv before attention), with the semantics of
the two in turn (reference.rotary_store_and_decode).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem_kernels.decode_stage1 import PER_STEP_ARGS, _decode_stage1, _decode_stage1_warps, _live_splits
from tandem_kernels.reference import attention_output
from tandem_kernels.rotary import check_rotary_args
from tandem_kernels.triton_common import (env_overridden, interpreting, next_pow2, num_sms, pdl_begin, pdl_launch,
                                          soft_fp8_round, upcast_dots)

TUNING_ENV = "TANDEM_DECODE_TUNING"  # JSON of DecodeTuning fields over the default (experiments, A/B runs)
LOG2E = 1.4426950408889634
LAZY_RESCALE_LOG2 = 8.0  # DecodeTuning.lazy_rescale: the growth of a row's max that forces a rescale
NUM_WARPS = 4
MAX_SPLITS = 64
BALANCE_FILL = 0.9  # DecodeTuning.balance_rounds: how full the last round of programs must be
BALANCE_MAX_SPLITS = 8  # and the most splits it divides a context into for that


@dataclass(frozen=True)
class DecodeTuning:
    """How stage 1 is launched and shaped; every choice keeps the kernel's semantics.

    block_n: KV tokens per loop iteration.   min_partition: fewest KV tokens a split is given.
    num_stages: Triton's software pipelining. Past 2, each tile's block-table entries are read one
      tile ahead, so that the K/V loads depend on nothing loaded in their own iteration and the
      pipeliner keeps num_stages - 1 tiles in flight while a tile's math runs; at 2 it stages one
      tile, whose copy is issued after a tile's math and awaited before the next tile's.
    resident: stage-1 programs per SM that the split count aims to fill; it should be what the
      kernel's registers and shared memory let an SM hold (`bench/kernel_ir.py` reports it), or a
      batch that fills the GPU once at `resident` runs in two waves at fewer.
    opaque_cvt: which FP8 tiles ("", "v" or "kv") are widened to fp16 where they are loaded, by
      inline PTX the compiler keeps in place (see e4m3_to_f16_opaque); the interpreter, which runs
      no PTX, widens them with a plain cast.
    defer_sum: keep each lane's share of the softmax's row sums through the loop and add them up
      once at the end (one cross-warp reduction a tile fewer, a few more registers).
    narrow_offsets: compute the K/V addresses with 32-bit offsets where every offset the cache
      views allow fits in 31 bits (the launcher checks; otherwise 64-bit): fewer integer
      instructions a tile, which FP8 tiles, half a bf16 tile's bytes, are short of.
    unsigned_index: a token's block-table index and slot by unsigned division and remainder (a
      shift and a mask; the tokens' positions are never negative) instead of signed ones: fewer
      integer instructions a tile, which pays where the loop, not the memory, is the limit (FP8).
    lazy_rescale: move a row's running max, and rescale its accumulator, only when some row's max
      grew by more than LAZY_RESCALE_LOG2 (scores are in log2 units; the unnormalized weights
      then stay below 2**LAZY_RESCALE_LOG2, far inside fp16 and fp32), instead of every tile.
    warp_split: each warp keeps an online softmax of its own over its share of every tile
      (block_n / num_warps consecutive tokens: 3-D dots, the warps along their batch dimension),
      and the warps' states merge once, after the loop (_decode_stage1_warps). The 2-D tile's row
      max and its P operand cross the warps through shared memory, behind barriers, every tile;
      here nothing does, at an accumulator per warp in registers. defer_sum and lazy_rescale do
      not apply.
    prefetch: load each program's first K/V tile before waiting on the kernel before (PDL), the
      step's own token excepted (the 2-D tile only, and not with rotary_store_and_decode's store;
      see _decode_stage1).
    prefetch_tiles: with prefetch, how many of a program's first tiles (1 or 2) are loaded before
      the wait. At 2 a program of two tiles (batch 4 at ~1,100 tokens of context, the online
      step) issues every K/V load before the wait, at twice the tile's registers held over it.
    min_splits: the fewest splits a launch divides each context into (where its contexts reach
      that many min_partition-token splits), even where the batch alone fills a round of resident
      programs: a batch of 1.2 rounds runs as two, the second a fifth full, and more, shorter
      programs fill the last round (choose_splits).
    balance_rounds: where a batch's (sequence, KV head) programs fill more than one round of
      resident programs, divide each context into the fewest splits (up to BALANCE_MAX_SPLITS)
      whose programs fill their last round to BALANCE_FILL (balanced_splits): at one split a
      batch of 3.2 rounds (an H100's 210 sequences) runs four, the last a fifth full.
    """

    block_n: int = 64
    num_stages: int = 2
    num_warps: int = NUM_WARPS
    min_partition: int = 128
    resident: int = 4
    opaque_cvt: str = ""
    defer_sum: bool = False
    lazy_rescale: bool = False
    narrow_offsets: bool = False
    unsigned_index: bool = False
    warp_split: bool = False
    prefetch: bool = False
    prefetch_tiles: int = 1
    min_splits: int = 1
    balance_rounds: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.min_splits <= MAX_SPLITS:
            raise ValueError(f"min_splits must be in [1, {MAX_SPLITS}], got {self.min_splits}")
        if self.opaque_cvt not in ("", "v", "kv"):
            raise ValueError(f"opaque_cvt must be '', 'v' or 'kv', got {self.opaque_cvt!r}")
        if self.prefetch_tiles not in (1, 2):
            raise ValueError(f"prefetch_tiles must be 1 or 2, got {self.prefetch_tiles}")
        if self.warp_split and (self.block_n % self.num_warps or self.block_n // self.num_warps < 16):
            raise ValueError(f"warp_split needs block_n a multiple of 16 * num_warps, got block_n {self.block_n} "
                             f"and num_warps {self.num_warps}")


# Chosen by `python3 bench/kernel_bench.py --decode-sweep` on an H200 (BENCHMARKS.md §2, §14-16):
# at batch 1 shorter splits fill more SMs; FP8 caches need V widened where it is loaded (0.51-0.54
# of copy bandwidth with the compiler's own placement of the cast), a second tile in flight, their
# tiles being half a bf16 tile's bytes (3 stages: +4% at batch 384, +17% at batch 64 / 4096 tokens),
# and the row sums kept lane by lane (defer_sum: +4% at every engine shape); bf16 tiles keep the
# memory busy with one (3 stages: no faster at batch 384, 20% slower at batch 64 / 4096 tokens,
# where its 3 programs an SM run the splits aimed at 4 in two waves) and gain nothing from
# defer_sum. FP8 loops are short of integer instructions: 32-bit K/V offsets (narrow_offsets) take
# a quarter of them out (216 -> 161 a warp and tile) and read +2.8-5.3% at the engine's shapes;
# bf16 loses 1-14% with them. Unsigned table math (unsigned_index: a shift and a mask for a
# token's block and slot) reads FP8 +1.8-2.2% more at every engine shape; bf16 loses 12% at batch
# 64 / 4,096 tokens and ~1% at the full batches with it. Splits of 64 tokens (min_partition)
# matter only where a batch is too small to fill the GPU: at batch 1 / 1,024 tokens bf16 686 GB/s
# against 575 with 128, FP8 355 against 306.
BF16_TUNING = DecodeTuning(min_partition=64)
FP8_TUNING = DecodeTuning(block_n=64, num_stages=3, min_partition=64, opaque_cvt="v", defer_sum=True,
                          narrow_offsets=True, unsigned_index=True)
# FP8 caches where the batch alone fills most of the GPU (batch x KV heads >= FP8_WIDE_FROM programs
# an SM): the warp-split loop (no cross-warp softmax a tile), 32-token tiles of 16 tokens per warp,
# 8 programs an SM. It reads +4-10% faster from batch 96 up (3,184 vs 3,013 GB/s at batch 96 / 1,024
# tokens, 3,745 vs 3,459 at 128 / 1,024, 3,942 vs 3,573 at 128 / 2,048, 3,675 vs 3,569 at 512 /
# 1,536) and offline_fp8kv runs +5%; below that its programs fill too little of a round, or its
# splits are shorter, and FP8_TUNING's read faster (batch 80 / 1,024 tokens: 2,691 vs 2,811; batch
# 64 / 1,024: 3,144 vs 3,434; batch 1: 364 vs 453). BENCHMARKS.md §23.
FP8_WIDE_TUNING = dataclasses.replace(FP8_TUNING, block_n=32, num_warps=2, resident=8, warp_split=True)
FP8_WIDE_FROM = 5.5  # (sequence, KV head) pairs an SM: between batch 80 (4.8, loses) and 96 (5.8, wins)
# Where a batch is too small to keep the memory busy, a program's time is its chain of dependent
# loads, and the prefetching tunings load the first tile before the PDL wait (DecodeTuning.prefetch)
# for batch x KV heads <= PREFETCH_UPTO programs an SM (0.25: batch 4 and below on Llama-3.1-8B /
# H200). The tile held over the wait costs bf16 registers (95 -> 164 a thread: 3 programs an SM, so
# the splits aim at 3); FP8, held to 4 an SM by shared memory, stays at 4 (96 -> 123 registers).
# Measured (BENCHMARKS.md §31): batch 1 4.479 -> 4.413 ms a token, batch 4 4.487 -> 4.465 ms a
# step; batch 8 was not measured, so it keeps the plain tunings.
PREFETCH_UPTO = 0.25
BF16_PREFETCH_TUNING = dataclasses.replace(BF16_TUNING, prefetch=True, resident=3)
FP8_PREFETCH_TUNING = dataclasses.replace(FP8_TUNING, prefetch=True)
# FP8 caches: whether the dots run in fp16 rather than q's dtype (e4m3 -> fp16 is exact; q is
# clamped to the fp16 range first).
FP8_F16 = True
_STAGE2_PER_STEP = PER_STEP_ARGS[1:]


def stage1_kernel(tuning: DecodeTuning):
    """The stage-1 kernel a tuning launches (its arguments are stage1_launch's either way)."""
    return _decode_stage1_warps if tuning.warp_split else _decode_stage1


@triton.jit(do_not_specialize=_STAGE2_PER_STEP)
def _decode_stage2(
    o_ptr, lse_ptr, ctx_ptr, out_ptr,
    o_s0, o_s1, o_s2, lse_s0, lse_s1, out_s0, out_s1, splits,
    D: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, MIN_PARTITION: tl.constexpr,
    BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    n_valid = _live_splits(ctx, splits, MIN_PARTITION, BLOCK_N)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < n_valid
    lse = tl.load(lse_ptr + b * lse_s0 + head * lse_s1 + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no valid split (context 0): all weights are 0
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    parts = tl.load(o_ptr + b * o_s0 + head * o_s1 + s[:, None] * o_s2 + d[None, :],
                    mask=(w > 0.0)[:, None] & (d < D)[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * out_s0 + head * out_s1 + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def choose_splits(batch: int, num_kv_heads: int, max_context: int, sms: int,
                  tuning: DecodeTuning = BF16_TUNING) -> int:
    """The split count of a launch whose contexts are at most `max_context`; depends on shapes only.

    Splits only until (sequence, KV head, split) programs fill one round of resident programs
    (`tuning.resident` per SM): more, shorter programs cost more than they balance; and no more
    than `max_context` fills with splits of `tuning.min_partition` tokens. With
    `tuning.balance_rounds`, a batch past one round is split until its last round is full enough
    (balanced_splits). At least `tuning.min_splits`, where `max_context` fills that many. (The
    kernel gives each sequence its own split length: its context over this count.)
    """
    pairs = max(1, batch * num_kv_heads)
    round_size = tuning.resident * sms
    wanted = max(1, min(MAX_SPLITS, round_size // pairs))
    partition = triton.cdiv(max(1, max_context), wanted)
    shortest = max(tuning.min_partition, tuning.block_n)
    partition = max(shortest, next_pow2(partition))
    splits = triton.cdiv(max(1, max_context), partition)
    while splits > MAX_SPLITS:
        partition *= 2
        splits = triton.cdiv(max_context, partition)
    most = min(MAX_SPLITS, triton.cdiv(max(1, max_context), shortest))
    if tuning.balance_rounds:
        splits = max(splits, balanced_splits(pairs, round_size, most))
    return max(splits, min(tuning.min_splits, most))


def balanced_splits(pairs: int, round_size: int, most: int) -> int:
    """The fewest splits (at most `most`, BALANCE_MAX_SPLITS) that let `pairs` (sequence, KV head)
    programs, each split that many ways, fill their last round of `round_size` resident programs
    to BALANCE_FILL of the rounds they take (equal programs run in whole rounds); the best-filling
    count where none does; 1 where the pairs fit one round."""
    if pairs <= round_size:
        return 1

    def fill(s: int) -> float:
        return pairs * s / (round_size * triton.cdiv(pairs * s, round_size))

    counts = range(1, max(1, min(most, BALANCE_MAX_SPLITS)) + 1)
    return next((s for s in counts if fill(s) >= BALANCE_FILL), max(counts, key=lambda s: (fill(s), -s)))


def check_paged_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor) -> tuple[int, int]:
    """Validate shapes shared by the attention kernels; return (group size, block size)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[3] != q.shape[2] or c.stride(-1) != 1:
            raise ValueError(f"{name} must be [blocks, block_size, kv_heads, {q.shape[2]}] with a contiguous last dim")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    hq, hk = q.shape[1], k_cache.shape[2]
    if hk == 0 or hq % hk:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {hk}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [seqs, max_blocks], got shape {tuple(block_tables.shape)}")
    block_size = k_cache.shape[1]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    return hq // hk, block_size


def cache_scales(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The dequantization scales in force: only FP8 caches are scaled (as in the reference)."""
    if k_cache.dtype == torch.float8_e4m3fn:
        return float(k_scale), float(v_scale)
    return 1.0, 1.0


def default_tuning(cache_dtype: torch.dtype, programs: int = 0, sms: int = 1) -> DecodeTuning:
    """The tuning of a launch on a `cache_dtype` cache with `programs` (sequence, KV head) pairs on
    `sms` SMs, with TUNING_ENV's fields over it where that is set. Up to PREFETCH_UPTO pairs an SM
    (at least one): the prefetching tunings; FP8 caches take FP8_WIDE_TUNING from FP8_WIDE_FROM
    pairs an SM; 0 pairs: BF16_TUNING or FP8_TUNING."""
    small = 0 < programs <= PREFETCH_UPTO * sms
    if cache_dtype != torch.float8_e4m3fn:
        base = BF16_PREFETCH_TUNING if small else BF16_TUNING
    elif small:
        base = FP8_PREFETCH_TUNING
    else:
        base = FP8_WIDE_TUNING if programs >= FP8_WIDE_FROM * sms else FP8_TUNING
    return env_overridden(base, TUNING_ENV, os.environ.get(TUNING_ENV, ""))


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
    tuning: DecodeTuning | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] attends to its first context_lens[b] cached tokens; returns [B, Hq, D] in q.dtype,
    written into `out` when given (reference.attention_output: a slice of a mixed batch's output).

    tuning: the launch shape (None: the default for the cache dtype); results agree across tunings
    to rounding.
    """
    return _decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, tuning, out, None)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, scale: float, k_scale: float, v_scale: float, tuning: DecodeTuning | None,
            out: torch.Tensor | None, step: StepKV | None) -> torch.Tensor:
    _, block_size = check_paged_args(q, k_cache, v_cache, block_tables)
    bsz, hq, dim = q.shape
    hk = k_cache.shape[2]
    if block_tables.shape[0] < bsz or context_lens.shape[0] < bsz:
        raise ValueError("block_tables and context_lens need a row per sequence in q")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = attention_output(q, out)
    if bsz == 0:
        return out
    sms = num_sms(q.device)
    tuning = tuning or default_tuning(k_cache.dtype, bsz * hk, sms)
    splits = choose_splits(bsz, hk, block_tables.shape[1] * block_size, sms, tuning)
    partial = lse = None
    if splits > 1:
        partial = torch.empty((bsz, hq, splits, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, hq, splits), dtype=torch.float32, device=q.device)
    grid, args, consts = stage1_launch(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
                                       tuning, splits, out, partial, lse, step)
    stage1_kernel(tuning)[grid](*args, **consts)
    if splits == 1:
        return out
    _decode_stage2[(bsz, hq)](
        partial, lse, context_lens, out,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), splits,
        D=dim, D_PAD=next_pow2(dim), SPLITS_PAD=next_pow2(splits), MIN_PARTITION=consts["MIN_PARTITION"],
        BLOCK_N=consts["BLOCK_N"], num_warps=4, **pdl_launch(q.device),
    )
    return out


class StepKV(NamedTuple):
    """The step's own token for rotary_store_and_decode: k (unrotated) and v [B, Hk, D], the
    positions [B] and cos/sin cache that rotate it, the slots [B] it is stored at (< 0: not)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    rotary_dim: int
    is_neox: bool


def rotary_store_and_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, rotary_dim: int, is_neox: bool,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
    v_scale: float = 1.0, tuning: DecodeTuning | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """rotary.rotary_and_store_kv(q, k, v, ...) and then paged_decode_attention of the rotated q,
    in one kernel (two with several splits): q [B, Hq, D] and k [B, Hk, D] arrive unrotated, the
    rotated k and v are written at slot_mapping (< 0: skipped), and q attends to its first
    context_lens[b] cached tokens, the step's own among them. Returns [B, Hq, D] in q.dtype."""
    q, k, v, cos_sin_cache = check_rotary_args(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                               rotary_dim)
    step = StepKV(k, v, positions, cos_sin_cache, slot_mapping, rotary_dim, bool(is_neox))
    return _decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, tuning, out, step)


def _last_offset(cache: torch.Tensor) -> int:
    """The largest element offset from a cache view's start that indexing it can reach."""
    return sum((n - 1) * s for n, s in zip(cache.shape, cache.stride()))


def stage1_launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, k_scale: float, v_scale: float, tuning: DecodeTuning,
    splits: int, out: torch.Tensor, partial: torch.Tensor | None, lse: torch.Tensor | None,
    step: StepKV | None = None,
) -> tuple[tuple[int, int, int], list, dict]:
    """Stage 1's launch for checked arguments: (grid, positional args, keyword constants incl.
    num_warps / num_stages). One split writes `out` directly; more write `partial` and `lse` for
    stage 2. With `step`, q is unrotated and the kernel rotates it and stores the step's K and V
    (rotary_store_and_decode). One home for the launcher and for bench/kernel_ir.py, which
    compiles the kernel as a launch specializes it, on tensors of the meta device."""
    group, block_size = q.shape[1] // k_cache.shape[2], k_cache.shape[1]
    bsz, _, dim = q.shape
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    d_pad = max(16, next_pow2(dim))
    k_scale, v_scale = cache_scales(k_cache, k_scale, v_scale)
    f16 = fp8 and FP8_F16 and q.element_size() == 2  # fp32 queries keep fp32 dots
    opaque = tuning.opaque_cvt if fp8 and f16 and not interpreting() else ""
    block_n, stages = tuning.block_n, tuning.num_stages
    if d_pad * q.element_size() > 256:  # wide rows: keep the staged K/V tiles within shared memory
        block_n, stages = 64, min(stages, 2)
    consts = dict(GROUP=group, BLOCK_H=max(8 if tuning.warp_split else 16, next_pow2(group)), D=dim, D_PAD=d_pad, BLOCK_N=block_n,
                  MIN_PARTITION=max(tuning.min_partition, block_n), BLOCK_SIZE=block_size,
                  DIRECT=splits == 1, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  UPCAST=upcast_dots(q.dtype) and not f16, F16=f16,
                  OPAQUE_K="k" in opaque, OPAQUE_V="v" in opaque,
                  DEFER_SUM=tuning.defer_sum, LAZY=tuning.lazy_rescale, LAZY_LOG2=LAZY_RESCALE_LOG2,
                  BLOCKS_AHEAD=stages > 2, num_warps=tuning.num_warps, num_stages=stages,
                  NARROW=tuning.narrow_offsets and max(_last_offset(k_cache), _last_offset(v_cache)) < 2**31,
                  UNSIGNED=tuning.unsigned_index,
                  **({"WARPS": tuning.num_warps} if tuning.warp_split else {}),
                  **pdl_launch(q.device))
    kc, vc = k_cache, v_cache
    if splits == 1:
        o, o_strides, lse, lse_strides = out, (out.stride(0), out.stride(1), 0), out, (0, 0)
    else:
        o, o_strides, lse_strides = partial, partial.stride()[:3], lse.stride()[:2]
    args = [q, kc, vc, block_tables, context_lens, o, lse,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
            vc.stride(0), vc.stride(1), vc.stride(2), block_tables.stride(0), *o_strides, *lse_strides,
            float(scale) * k_scale * LOG2E, float(v_scale)]
    if step is None:  # the step's arguments are not read: any pointer, no strides
        args += [q, q, q, q, q, 0, 0, 0, 0, 0, 1.0]
        consts.update(ROTARY=False, ROT=2, IS_NEOX=True, STORE_FP8=False, SOFT_ROUND=False,
                      PREFETCH=tuning.prefetch_tiles if tuning.prefetch and not tuning.warp_split else 0)
    else:
        args += [step.k, step.v, step.positions, step.cos_sin_cache, step.slot_mapping,
                 step.k.stride(0), step.k.stride(1), step.v.stride(0), step.v.stride(1),
                 step.cos_sin_cache.stride(0), k_scale]
        consts.update(ROTARY=True, ROT=step.rotary_dim, IS_NEOX=step.is_neox, STORE_FP8=fp8,
                      SOFT_ROUND=fp8 and soft_fp8_round(), PREFETCH=0)
    return (bsz, k_cache.shape[2], splits), args, consts

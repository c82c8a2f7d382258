"""The stage-1 kernels of the paged decode attention (tandem_kernels.decode_attention has the
tuning, the launch and stage 2).

One program per (sequence, KV head, KV split) scores each K/V tile of its split against all the
query heads of that KV head's group with tl.dot, keeping an online softmax in fp32, and writes
a normalized partial output and its log-sum-exp (log2 domain), or the output itself where there
is one split. With ROTARY (decode_attention.rotary_store_and_decode) the queries arrive unrotated:
each program rotates its group's, and the program whose split ends at the context first rotates and
stores the step's own K and V (`_step_token`), so that no separate kernel runs before attention. `_decode_stage1` holds a tile as [heads, tokens] across its warps;
`_decode_stage1_warps` (DecodeTuning.warp_split) gives each warp its own share of the tile and
softmax, merged after the loop. Both take the arguments `stage1_launch` builds.
"""
from __future__ import annotations

import triton
import triton.language as tl

from tandem_kernels.rotary import rotary_cos_sin, rotary_lanes, rotate_rows, store_at_slot
from tandem_kernels.triton_common import (dot, first_tile_blocks, first_tile_blocks_at, next_tile_blocks,
                                          next_tile_blocks_at, pdl_begin, tile_blocks_at, token_place, widen)

# Integer arguments that change from step to step (block-table width, split count).
# Triton would compile a variant for each of their value classes (1, a multiple of 16, other),
# which a server first meets while serving; these stay generic, so the variants are fixed by
# the model and a warm-up covers them.
PER_STEP_ARGS = ["bt_s0", "o_s0", "o_s1", "lse_s0", "lse_s1", "splits"]
_STAGE1_PER_STEP = PER_STEP_ARGS[:-1]  # stage 1 reads its split count from its grid


@triton.jit
def _seq_partition(ctx, splits, MIN_PARTITION: tl.constexpr, BLOCK_N: tl.constexpr):
    """KV tokens per split for a sequence of `ctx` tokens: its context over `splits`, in whole
    tiles, at least MIN_PARTITION; splits past the context get none."""
    part = tl.cdiv(tl.cdiv(ctx, splits), BLOCK_N) * BLOCK_N
    return tl.maximum(part, MIN_PARTITION)


@triton.jit
def _live_splits(ctx, splits, MIN_PARTITION: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many of a sequence's `splits` its `ctx` tokens reach (0 for an empty context): the
    splits whose partial outputs a merge reads."""
    return tl.cdiv(ctx, _seq_partition(ctx, splits, MIN_PARTITION, BLOCK_N))


@triton.jit
def _program_split(ctx_ptr, MIN_PARTITION: tl.constexpr, BLOCK_N: tl.constexpr):
    """This stage-1 program's (sequence as int64, KV head, split, context length, and its split's
    tokens start .. end; start >= end for a split past the context): the grid is (sequences, KV
    heads, splits)."""
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    partition = _seq_partition(ctx, tl.num_programs(2), MIN_PARTITION, BLOCK_N)
    start = split * partition
    return b, tl.program_id(1), split, ctx, start, tl.minimum(start + partition, ctx)


@triton.jit
def _step_token(
    q_ptr, b, kvh, q_s0, q_s1, heads, h_mask, d, d_mask, ctx,
    kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, kn_s0, kn_s1, vn_s0, vn_s1, cs_s0,
    k_cache_ptr, v_cache_ptr, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, k_store_scale, v_store_scale,
    BLOCK_SIZE: tl.constexpr, MIN_PARTITION: tl.constexpr, BLOCK_N: tl.constexpr, ROT: tl.constexpr,
    IS_NEOX: tl.constexpr, STORE_FP8: tl.constexpr, SOFT_ROUND: tl.constexpr,
):
    """ROTARY: sequence b's queries of this KV head's group ([BLOCK_H, D_PAD], q's dtype) rotated
    at positions[b]. The program whose split holds position ctx - 1 (one per sequence and KV head)
    first writes the step's rotated K and V into the cache at slot_mapping[b] (unless < 0), as
    rotary.rotary_and_store_kv would, and passes a barrier before any tile is read, so that it
    reads what it wrote (no other program reads that slot). The K/V tiles are read through L2
    (cp.async.cg), where the store has gone."""
    partner, sign, ci, in_rot = rotary_lanes(d, ROT, IS_NEOX)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    cos, sin = rotary_cos_sin(cs_ptr + pos * cs_s0, ci, in_rot, ROT)
    q = rotate_rows(q_ptr + b * q_s0 + heads[:, None] * q_s1, d, h_mask[:, None] & d_mask[None, :],
                    partner, sign, in_rot, cos, sin)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    # The owner is found from the partition rather than the split's `end`: a test on `end` here
    # moved the KV loop's bound tests to the uniform datapath (Triton 3.9, sm_90: ~12 more
    # instructions an iteration of the loop that follows).
    owner = (ctx > 0) & (tl.program_id(2) == (ctx - 1) // _seq_partition(ctx, tl.num_programs(2), MIN_PARTITION,
                                                                            BLOCK_N)) & (slot >= 0)
    if owner:  # one program a sequence and KV head; the others neither load nor wait here
        row = tl.zeros([1, 1], dtype=tl.int64)
        mask = (row == 0) & d_mask[None, :]
        k = rotate_rows(kn_ptr + b * kn_s0 + kvh * kn_s1 + row, d, mask, partner, sign, in_rot, cos, sin)
        v = tl.load(vn_ptr + b * vn_s0 + kvh * vn_s1 + row + d[None, :], mask=mask, other=0.0)
        store_at_slot(k, v, slot, kvh * kc_s2 + row, kvh * vc_s2 + row, d, mask, k_cache_ptr, v_cache_ptr,
                      kc_s0, kc_s1, vc_s0, vc_s1, BLOCK_SIZE, k_store_scale, v_store_scale, STORE_FP8, SOFT_ROUND)
        tl.debug_barrier()  # the stores above are visible to the whole program from here on
    return q


@triton.jit
def _load_kv(ptr, offs, DTYPE: tl.constexpr, OPAQUE: tl.constexpr, mask):
    return widen(tl.load(ptr + offs, mask=mask, other=0.0), DTYPE, OPAQUE)


@triton.jit
def _tile_offsets(bt_row, n0, end, kvh, d, d_mask, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
                  BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NARROW: tl.constexpr, UNSIGNED: tl.constexpr):
    """(K offsets, V offsets, mask) of the tile of tokens n0 .. n0 + BLOCK_N (those before `end`)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs < end
    blk = tile_blocks_at(bt_row, n0, tl.arange(0, BLOCK_N), end, BLOCK_SIZE, True, UNSIGNED)
    _, slot_off = token_place(offs, BLOCK_SIZE, UNSIGNED)
    if NARROW:
        blk = blk.to(tl.int32)
    k_offs = (blk * kc_s0 + slot_off * kc_s1 + kvh * kc_s2)[:, None] + d[None, :]
    v_offs = (blk * vc_s0 + slot_off * vc_s1 + kvh * vc_s2)[:, None] + d[None, :]
    return k_offs, v_offs, n_mask[:, None] & d_mask[None, :]


@triton.jit
def _tile_step(q, k, v, v_cache_ptr, v_offs, kv_mask, n_mask, m_i, l_i, l_lanes, acc, qk_scale,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr, OPAQUE_V: tl.constexpr, DEFER_SUM: tl.constexpr,
               LAZY: tl.constexpr, LAZY_LOG2: tl.constexpr, V_READY: tl.constexpr):
    """_decode_stage1's online-softmax update by one K/V tile: k loaded, v too with V_READY (else
    loaded here at v_offs, after the scores, as the loop has always placed it)."""
    s = dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_tile = tl.max(s, 1)
    # The rescale by alpha: lazily (when some row's max grew past LAZY_LOG2, accumulator
    # included), or every tile (the accumulator's in the same expression as its P·V dot).
    if LAZY:  # every row has a live key in the tile, so m_tile is finite; the first tile rescales
        if tl.max(m_tile - m_i, 0) > LAZY_LOG2:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            if DEFER_SUM:
                l_lanes = l_lanes * alpha[:, None]
            else:
                l_i = l_i * alpha
            m_i = m_new
    else:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - m_new)
        if DEFER_SUM:
            l_lanes = l_lanes * alpha[:, None]
        else:
            l_i = l_i * alpha
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])
    if DEFER_SUM:
        l_lanes += p
    else:
        l_i += tl.sum(p, 1)
    if not V_READY:
        v = _load_kv(v_cache_ptr, v_offs, q.dtype, OPAQUE_V, kv_mask)
    if LAZY:
        acc += dot(p.to(q.dtype), v, PRECISION, UPCAST)
    else:
        acc = acc * alpha[:, None] + dot(p.to(q.dtype), v, PRECISION, UPCAST)
    return m_i, l_i, l_lanes, acc


@triton.jit
def _early_tile(k_cache_ptr, v_cache_ptr, bt_row, n0, end, ctx, kvh, d, d_mask,
                kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
                BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, NARROW: tl.constexpr, UNSIGNED: tl.constexpr):
    """(K, V, K offsets, V offsets, mask) of the tile of tokens n0 .. n0 + BLOCK_N (those before
    `end`), loaded before the PDL wait: every row but the step's own token (position ctx - 1),
    which the kernel before writes (left 0 here; _early_tile_step reads it)."""
    k_offs, v_offs, mask = _tile_offsets(bt_row, n0, end, kvh, d, d_mask, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
                                         BLOCK_N, BLOCK_SIZE, NARROW, UNSIGNED)
    early = mask & (n0 + tl.arange(0, BLOCK_N) != ctx - 1)[:, None]
    k = tl.load(k_cache_ptr + k_offs, mask=early, other=0.0)
    v = tl.load(v_cache_ptr + v_offs, mask=early, other=0.0)
    return k, v, k_offs, v_offs, mask


@triton.jit
def _early_tile_step(q, k, v, k_cache_ptr, v_cache_ptr, k_offs, v_offs, mask, n0, end, ctx,
                     m_i, l_i, l_lanes, acc, qk_scale, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                     UPCAST: tl.constexpr, OPAQUE_K: tl.constexpr, OPAQUE_V: tl.constexpr,
                     DEFER_SUM: tl.constexpr, LAZY: tl.constexpr, LAZY_LOG2: tl.constexpr):
    """_tile_step by a tile _early_tile loaded, after the wait: the step's own token's row is
    read now."""
    mine = mask & (n0 + tl.arange(0, BLOCK_N) == ctx - 1)[:, None]
    k = tl.where(mine, tl.load(k_cache_ptr + k_offs, mask=mine, other=0.0), k)
    v = tl.where(mine, tl.load(v_cache_ptr + v_offs, mask=mine, other=0.0), v)
    return _tile_step(q, widen(k, q.dtype, OPAQUE_K), widen(v, q.dtype, OPAQUE_V), v_cache_ptr, v_offs, mask,
                      n0 + tl.arange(0, BLOCK_N) < end, m_i, l_i, l_lanes, acc, qk_scale,
                      PRECISION, UPCAST, OPAQUE_V, DEFER_SUM, LAZY, LAZY_LOG2, True)


@triton.jit(do_not_specialize=_STAGE1_PER_STEP)
def _decode_stage1(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, o_ptr, lse_ptr,
    q_s0, q_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, bt_s0,
    o_s0, o_s1, o_s2, lse_s0, lse_s1,
    qk_scale, v_scale,
    kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, kn_s0, kn_s1, vn_s0, vn_s1, cs_s0, k_store_scale,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_PARTITION: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, F16: tl.constexpr, OPAQUE_K: tl.constexpr, OPAQUE_V: tl.constexpr,
    DEFER_SUM: tl.constexpr, LAZY: tl.constexpr, LAZY_LOG2: tl.constexpr, BLOCKS_AHEAD: tl.constexpr,
    PDL: tl.constexpr, NARROW: tl.constexpr, UNSIGNED: tl.constexpr,
    ROTARY: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr, STORE_FP8: tl.constexpr,
    SOFT_ROUND: tl.constexpr, PREFETCH: tl.constexpr,
):
    """PREFETCH (tiles, 0-2; not with ROTARY): the program's first PREFETCH K/V tiles are loaded
    before the PDL wait, but for the step's own token (position ctx - 1), which the kernel before
    (rotary and store) writes; that row is read after the wait. The contexts, the block tables
    (copied in before the step) and every other cached token are written by no kernel of the step."""
    if PREFETCH:
        b, kvh, split, ctx, start, end = _program_split(ctx_ptr, MIN_PARTITION, BLOCK_N)
        d = tl.arange(0, D_PAD)
        d_mask = d < D
        k0, v0, k0_offs, v0_offs, first_mask = _early_tile(
            k_cache_ptr, v_cache_ptr, bt_ptr + b * bt_s0, start, end, ctx, kvh, d, d_mask,
            kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, BLOCK_N, BLOCK_SIZE, NARROW, UNSIGNED)
        if PREFETCH > 1:
            k1, v1, k1_offs, v1_offs, second_mask = _early_tile(
                k_cache_ptr, v_cache_ptr, bt_ptr + b * bt_s0, start + BLOCK_N, end, ctx, kvh, d, d_mask,
                kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, BLOCK_N, BLOCK_SIZE, NARROW, UNSIGNED)
    pdl_begin(PDL)
    if not PREFETCH:
        b, kvh, split, ctx, start, end = _program_split(ctx_ptr, MIN_PARTITION, BLOCK_N)
        d = tl.arange(0, D_PAD)
        d_mask = d < D
    if (start < ctx) | (split == 0):  # split 0 always writes: context 0 must give zeros
        h = tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + h
        h_mask = h < GROUP
        if ROTARY:
            q = _step_token(q_ptr, b, kvh, q_s0, q_s1, heads, h_mask, d, d_mask, ctx,
                            kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, kn_s0, kn_s1, vn_s0, vn_s1, cs_s0,
                            k_cache_ptr, v_cache_ptr, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, k_store_scale,
                            v_scale, BLOCK_SIZE, MIN_PARTITION, BLOCK_N, ROT, IS_NEOX, STORE_FP8, SOFT_ROUND)
        else:
            q = tl.load(q_ptr + b * q_s0 + heads[:, None] * q_s1 + d[None, :],
                        mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        if F16:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        l_lanes = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)  # DEFER_SUM: the row sums, lane by lane
        acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
        bt_row = bt_ptr + b * bt_s0
        loop_start = start
        if PREFETCH:  # the tiles loaded before the wait, each with the step's own row read now
            if start < end:
                m_i, l_i, l_lanes, acc = _early_tile_step(
                    q, k0, v0, k_cache_ptr, v_cache_ptr, k0_offs, v0_offs, first_mask, start, end, ctx,
                    m_i, l_i, l_lanes, acc, qk_scale, BLOCK_N, PRECISION, UPCAST, OPAQUE_K, OPAQUE_V,
                    DEFER_SUM, LAZY, LAZY_LOG2)
            loop_start = start + BLOCK_N
            if PREFETCH > 1:
                if loop_start < end:
                    m_i, l_i, l_lanes, acc = _early_tile_step(
                        q, k1, v1, k_cache_ptr, v_cache_ptr, k1_offs, v1_offs, second_mask, loop_start, end, ctx,
                        m_i, l_i, l_lanes, acc, qk_scale, BLOCK_N, PRECISION, UPCAST, OPAQUE_K, OPAQUE_V,
                        DEFER_SUM, LAZY, LAZY_LOG2)
                loop_start += BLOCK_N
        blk_next = first_tile_blocks(bt_row, loop_start, end, BLOCK_N, BLOCK_SIZE, BLOCKS_AHEAD, UNSIGNED)
        for n0 in range(loop_start, end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs < end
            blk, blk_next = next_tile_blocks(blk_next, bt_row, n0, end, BLOCK_N, BLOCK_SIZE, BLOCKS_AHEAD,
                                             UNSIGNED=UNSIGNED)
            _, slot_off = token_place(offs, BLOCK_SIZE, UNSIGNED)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            if NARROW:  # every offset fits in 31 bits (stage1_launch checks)
                blk = blk.to(tl.int32)
            k = _load_kv(k_cache_ptr, (blk * kc_s0 + slot_off * kc_s1 + kvh * kc_s2)[:, None] + d[None, :],
                         q.dtype, OPAQUE_K, kv_mask)
            m_i, l_i, l_lanes, acc = _tile_step(
                q, k, k, v_cache_ptr, (blk * vc_s0 + slot_off * vc_s1 + kvh * vc_s2)[:, None] + d[None, :], kv_mask,
                n_mask, m_i, l_i, l_lanes, acc, qk_scale, PRECISION, UPCAST, OPAQUE_V, DEFER_SUM, LAZY, LAZY_LOG2,
                False)
        if DEFER_SUM:
            l_i = tl.sum(l_lanes, 1)
        has = l_i > 0.0
        out = acc * (v_scale / tl.where(has, l_i, 1.0))[:, None]
        o_mask = h_mask[:, None] & d_mask[None, :]
        if DIRECT:
            tl.store(o_ptr + b * o_s0 + heads[:, None] * o_s1 + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=o_mask)
        else:
            tl.store(o_ptr + b * o_s0 + heads[:, None] * o_s1 + split * o_s2 + d[None, :], out, mask=o_mask)
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + b * lse_s0 + heads * lse_s1 + split, lse, mask=h_mask)


@triton.jit(do_not_specialize=_STAGE1_PER_STEP)
def _decode_stage1_warps(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, o_ptr, lse_ptr,
    q_s0, q_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, bt_s0,
    o_s0, o_s1, o_s2, lse_s0, lse_s1,
    qk_scale, v_scale,
    kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, kn_s0, kn_s1, vn_s0, vn_s1, cs_s0, k_store_scale,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_PARTITION: tl.constexpr, BLOCK_SIZE: tl.constexpr, DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, F16: tl.constexpr, OPAQUE_K: tl.constexpr, OPAQUE_V: tl.constexpr,
    DEFER_SUM: tl.constexpr, LAZY: tl.constexpr, LAZY_LOG2: tl.constexpr, BLOCKS_AHEAD: tl.constexpr,
    PDL: tl.constexpr, NARROW: tl.constexpr, UNSIGNED: tl.constexpr,
    ROTARY: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr, STORE_FP8: tl.constexpr,
    SOFT_ROUND: tl.constexpr, PREFETCH: tl.constexpr, WARPS: tl.constexpr,
):
    """_decode_stage1 with DecodeTuning.warp_split: a tile is [WARPS, BLOCK_N // WARPS] tokens,
    each row of it one warp's, with its own running max, sum and accumulator; they merge after
    the loop. The dots are transposed against _decode_stage1's (scores [tokens, heads], the
    accumulator [D, heads]), so the query heads are the MMA's N (BLOCK_H: at least 8) rather than
    its M (at least 16): less padding of a 4-head group, half the accumulator. Same arguments
    (DEFER_SUM, LAZY and PREFETCH are not used)."""
    pdl_begin(PDL)
    b, kvh, split, ctx, start, end = _program_split(ctx_ptr, MIN_PARTITION, BLOCK_N)
    if (start < ctx) | (split == 0):  # split 0 always writes: context 0 must give zeros
        TW: tl.constexpr = BLOCK_N // WARPS
        h = tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + h
        d = tl.arange(0, D_PAD)
        h_mask = h < GROUP
        d_mask = d < D
        if ROTARY:
            q_t = tl.trans(_step_token(q_ptr, b, kvh, q_s0, q_s1, heads, h_mask, d, d_mask, ctx,
                                       kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, kn_s0, kn_s1, vn_s0, vn_s1,
                                       cs_s0, k_cache_ptr, v_cache_ptr, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
                                       k_store_scale, v_scale, BLOCK_SIZE, MIN_PARTITION, BLOCK_N, ROT, IS_NEOX,
                                       STORE_FP8, SOFT_ROUND))
        else:
            q_t = tl.load(q_ptr + b * q_s0 + heads[None, :] * q_s1 + d[:, None],
                          mask=d_mask[:, None] & h_mask[None, :], other=0.0)  # [D_PAD, BLOCK_H]
        if F16:
            q_t = tl.minimum(tl.maximum(q_t.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        q3 = tl.broadcast_to(q_t[None, :, :], (WARPS, D_PAD, BLOCK_H))
        tok = tl.arange(0, WARPS)[:, None] * TW + tl.arange(0, TW)[None, :]  # [WARPS, TW]: a warp's tokens
        m_i = tl.full([WARPS, BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([WARPS, BLOCK_H], tl.float32)
        acc = tl.zeros([WARPS, D_PAD, BLOCK_H], tl.float32)
        bt_row = bt_ptr + b * bt_s0
        blk_next = first_tile_blocks_at(bt_row, start, tok, end, BLOCK_SIZE, BLOCKS_AHEAD, UNSIGNED)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + tok
            n_mask = offs < end
            blk, blk_next = next_tile_blocks_at(blk_next, bt_row, n0, tok, end, BLOCK_N, BLOCK_SIZE, BLOCKS_AHEAD,
                                                UNSIGNED=UNSIGNED)
            _, slot_off = token_place(offs, BLOCK_SIZE, UNSIGNED)
            kv_mask = n_mask[:, :, None] & d_mask[None, None, :]
            if NARROW:  # every offset fits in 31 bits (stage1_launch checks)
                blk = blk.to(tl.int32)
            k = _load_kv(k_cache_ptr, (blk * kc_s0 + slot_off * kc_s1 + kvh * kc_s2)[:, :, None] + d[None, None, :],
                         q_t.dtype, OPAQUE_K, kv_mask)
            s = dot(k, q3, PRECISION, UPCAST) * qk_scale  # [WARPS, TW, BLOCK_H]
            s = tl.where(n_mask[:, :, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A warp whose tokens all lie past the end (so far) has no max yet: subtract 0 instead.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None, :])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            v = _load_kv(v_cache_ptr, (blk * vc_s0 + slot_off * vc_s1 + kvh * vc_s2)[:, :, None] + d[None, None, :],
                         q_t.dtype, OPAQUE_V, kv_mask)
            acc = acc * alpha[:, None, :] + dot(tl.permute(v, (0, 2, 1)), p.to(q_t.dtype), PRECISION, UPCAST)
        m_all = tl.max(m_i, 0)  # [BLOCK_H]: the warps' states merged
        weight = tl.exp2(m_i - tl.where(m_all == float("-inf"), 0.0, m_all)[None, :])
        l_all = tl.sum(l_i * weight, 0)
        acc_all = tl.sum(acc * weight[:, None, :], 0)  # [D_PAD, BLOCK_H]
        has = l_all > 0.0
        out = acc_all * (v_scale / tl.where(has, l_all, 1.0))[None, :]
        o_mask = d_mask[:, None] & h_mask[None, :]
        if DIRECT:
            tl.store(o_ptr + b * o_s0 + heads[None, :] * o_s1 + d[:, None],
                     out.to(o_ptr.dtype.element_ty), mask=o_mask)
        else:
            tl.store(o_ptr + b * o_s0 + heads[None, :] * o_s1 + split * o_s2 + d[:, None], out, mask=o_mask)
            lse = tl.where(has, m_all + tl.log2(tl.where(has, l_all, 1.0)), float("-inf"))
            tl.store(lse_ptr + b * lse_s0 + heads * lse_s1 + split, lse, mask=h_mask)

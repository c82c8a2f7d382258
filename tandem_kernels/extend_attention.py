"""Triton extend (prefill) attention over a paged KV cache.

Queries of several sequences are packed ([T, Hq, D], rows split by query_start_loc). A sequence's
new tokens are the last q_len of its seq_len cached tokens (rotary_and_store_kv already wrote
them), so the whole context, prefix and new tokens alike, is read from the cache through the
block table. One program per (query head, BLOCK_M query rows of one sequence): flash-attention
online softmax in fp32, tl.dot on tensor cores, KV tiles before the tile's first query position
run without a mask, tiles past its last query position are never visited. The tile -> sequence
map is found in the kernel by binary search over query_start_loc, so a launch needs no host sync.
Semantics match tandem_kernels.reference.extend_attention.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.decode_attention import LOG2E, cache_scales, check_paged_args
from tandem_kernels.reference import attention_output
from tandem_kernels.triton_common import (dot, first_tile_blocks, interpreting, next_pow2, next_tile_blocks,
                                          pdl_begin, pdl_launch, upcast_dots, widen)

BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 8  # two warpgroups, 64 query rows each, on wgmma
NUM_STAGES = 3
FP8_F16 = True  # FP8 caches: dots in fp16 (see decode_attention.FP8_F16)
FP8_OPAQUE_CVT = "v"  # FP8 tiles widened where loaded ("", "v", "kv"; see decode_attention.DecodeTuning)
# Which caches read each KV tile's block-table entries one tile ahead, so that its K/V loads depend
# on nothing loaded in their own iteration and Triton's pipeliner keeps a tile in flight during a
# tile's math (as decode_attention does past 2 stages); without it the pipeliner awaits every copy
# before the math. `bench/kernel_bench.py --extend-sweep` on the H200: FP8 +4%, bf16 -3%
# (its shared memory is then full: one program an SM either way; BENCHMARKS.md §15).
BLOCKS_AHEAD = frozenset({torch.float8_e4m3fn})


@triton.jit
def _load_kv(ptrs, n_mask, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    if MASKED:
        if EVEN_D:
            return tl.load(ptrs, mask=n_mask[:, None], other=0.0)
        else:
            return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            return tl.load(ptrs)
        else:
            return tl.load(ptrs, mask=d_mask[None, :], other=0.0)


@triton.jit
def _online_softmax(s, m_i, l_i):
    """One tile's scores s [BLOCK_M, BLOCK_N] (log2 units, -inf where masked) into the running
    max and sum: (p, alpha, m_new, l_new)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no key yet keeps a finite max, so exp2 never sees -inf - -inf (NaN).
    m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, n0, blk_ahead, bt_row, k_cache_ptr, v_cache_ptr, kvh,
    kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, q_pos, kv_end, d, d_mask, qk_scale, v_scale,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, OPAQUE_K: tl.constexpr, OPAQUE_V: tl.constexpr,
    AHEAD: tl.constexpr, SCALE_V: tl.constexpr,
):
    """One cached KV tile into the online softmax; returns (acc, m, l, blk_ahead): the block
    lookahead as `next_tile_blocks` carries it. SCALE_V: its values times v_scale here (where
    the accumulator also holds unscaled new tokens' values), else at the end."""
    offs = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs < kv_end
    blk, blk_ahead = next_tile_blocks(blk_ahead, bt_row, n0, kv_end, BLOCK_N, BLOCK_SIZE, AHEAD, MASKED)
    slot_off = offs % BLOCK_SIZE
    k = _load_kv(k_cache_ptr + (blk * kc_s0 + slot_off * kc_s1 + kvh * kc_s2)[:, None] + d[None, :],
                 n_mask, d_mask, MASKED, EVEN_D)
    s = dot(q, tl.trans(widen(k, q.dtype, OPAQUE_K)), PRECISION, UPCAST) * qk_scale
    if MASKED:
        s = tl.where((offs[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
    p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
    v = _load_kv(v_cache_ptr + (blk * vc_s0 + slot_off * vc_s1 + kvh * vc_s2)[:, None] + d[None, :],
                 n_mask, d_mask, MASKED, EVEN_D)
    pv = dot(p.to(q.dtype), widen(v, q.dtype, OPAQUE_V), PRECISION, UPCAST)
    if SCALE_V:
        pv = pv * v_scale
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i, blk_ahead


@triton.jit
def _attend_new_tile(
    q, acc, m_i, l_i, n0, kn_ptr, vn_ptr, kn_s0, kn_s1, vn_s0, vn_s1, kvh, first_row, prefix,
    q_pos, kv_end, d, d_mask, qk_scale,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One tile of the sequence's new tokens (positions n0 .. n0 + BLOCK_N, from `prefix` on)
    into the online softmax, read from k / v as computed: position `prefix` is row `first_row`
    of them. Returns (acc, m, l)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs < kv_end
    rows = (first_row + offs - prefix).to(tl.int64)
    k = _load_kv(kn_ptr + (rows * kn_s0 + kvh * kn_s1)[:, None] + d[None, :], n_mask, d_mask, MASKED, EVEN_D)
    s = dot(q, tl.trans(k.to(q.dtype)), PRECISION, UPCAST) * qk_scale
    if MASKED:
        s = tl.where((offs[None, :] <= q_pos[:, None]) & n_mask[None, :], s, float("-inf"))
    p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)
    v = _load_kv(vn_ptr + (rows * vn_s0 + kvh * vn_s1)[:, None] + d[None, :], n_mask, d_mask, MASKED, EVEN_D)
    acc = acc * alpha[:, None] + dot(p.to(q.dtype), v.to(q.dtype), PRECISION, UPCAST)
    return acc, m_new, l_i


# A mixed step passes the rows after its decodes (engine/attention.py: block_tables[n:],
# seq_lens[n:]), whose 16-byte alignment varies with the decode count: specialized on it, the
# kernel would compile afresh inside a serving step (~2 s) for each combination warm-up missed.
# They are read one int32 at a time, so alignment buys nothing.
@triton.jit(do_not_specialize=["bt_s0", "num_seqs", "num_tiles"],
            do_not_specialize_on_alignment=["bt_ptr", "qsl_ptr", "seq_lens_ptr"])
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    q_s0, q_s1, o_s0, o_s1, kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, bt_s0,
    num_seqs, num_tiles, qk_scale, v_scale,
    kn_ptr, vn_ptr, kn_s0, kn_s1, vn_s0, vn_s1, qk_scale_new,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, F16: tl.constexpr, OPAQUE_K: tl.constexpr, OPAQUE_V: tl.constexpr,
    AHEAD: tl.constexpr, NEW_KV: tl.constexpr, UPCAST_NEW: tl.constexpr, PDL: tl.constexpr,
):
    """NEW_KV: the new tokens' K/V are read from kn / vn (k rotated, v as projected; rows packed
    as q's), where they are contiguous and in q's dtype, before the cached context before them
    (with F16, q turns fp16 only for the cached tiles); else everything from the cache."""
    pdl_begin(PDL)
    head = tl.program_id(0)  # heads vary fastest: a GQA group's programs share K/V through L2
    tile = num_tiles - 1 - tl.program_id(1)  # later query tiles see more keys: start them first
    kvh = head // GROUP
    # Sequence i owns tiles [qsl[i] // BLOCK_M + i, qsl[i+1] // BLOCK_M + i + 1): at least
    # cdiv(q_len_i, BLOCK_M) of them, num_tiles = T // BLOCK_M + B in all. Find the owner.
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid
        else:
            hi = mid
    seq = lo
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m_block = tile - (q_start // BLOCK_M + seq)
    if m_block * BLOCK_M < q_len:
        ctx = tl.load(seq_lens_ptr + seq)
        first_pos = ctx - q_len + m_block * BLOCK_M
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_pos = first_pos + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        d_mask = d < D
        tok = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * q_s0 + head * q_s1 + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        kv_end = tl.minimum(ctx, first_pos + BLOCK_M)
        cached_end = kv_end
        if NEW_KV:
            prefix = ctx - q_len
            cached_end = prefix
            new_full = prefix + (first_pos + 1 - prefix) // BLOCK_N * BLOCK_N  # keys every query of the tile sees
            for n0 in range(prefix, new_full, BLOCK_N):
                acc, m_i, l_i = _attend_new_tile(q, acc, m_i, l_i, n0, kn_ptr, vn_ptr, kn_s0, kn_s1, vn_s0, vn_s1,
                                                 kvh, q_start, prefix, q_pos, kv_end, d, d_mask, qk_scale_new,
                                                 BLOCK_N, False, EVEN_D, PRECISION, UPCAST_NEW)
            for n0 in range(new_full, kv_end, BLOCK_N):
                acc, m_i, l_i = _attend_new_tile(q, acc, m_i, l_i, n0, kn_ptr, vn_ptr, kn_s0, kn_s1, vn_s0, vn_s1,
                                                 kvh, q_start, prefix, q_pos, kv_end, d, d_mask, qk_scale_new,
                                                 BLOCK_N, True, EVEN_D, PRECISION, UPCAST_NEW)
            full_end = prefix // BLOCK_N * BLOCK_N  # every cached key lies before every query
        else:
            full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys every query of the tile sees
        if F16:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        bt_row = bt_ptr + seq.to(tl.int64) * bt_s0
        blk = first_tile_blocks(bt_row, 0, cached_end, BLOCK_N, BLOCK_SIZE, AHEAD)
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i, blk = _attend_tile(q, acc, m_i, l_i, n0, blk, bt_row, k_cache_ptr, v_cache_ptr, kvh,
                                              kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, q_pos, cached_end, d,
                                              d_mask, qk_scale, v_scale, BLOCK_N, BLOCK_SIZE, False, EVEN_D,
                                              PRECISION, UPCAST, OPAQUE_K, OPAQUE_V, AHEAD, NEW_KV)
        for n0 in range(full_end, cached_end, BLOCK_N):
            acc, m_i, l_i, blk = _attend_tile(q, acc, m_i, l_i, n0, blk, bt_row, k_cache_ptr, v_cache_ptr, kvh,
                                              kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2, q_pos, cached_end, d,
                                              d_mask, qk_scale, v_scale, BLOCK_N, BLOCK_SIZE, True, EVEN_D,
                                              PRECISION, UPCAST, OPAQUE_K, OPAQUE_V, AHEAD, NEW_KV)
        if NEW_KV:  # the cached tiles' values were scaled as they were added
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        else:
            out = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
        tl.store(out_ptr + tok[:, None] * o_s0 + head * o_s1 + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    k_scale: float = 1.0, v_scale: float = 1.0, out: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens q [T, Hq, D] over their paged context (see module doc).

    query_start_loc: int32 [B+1]; seq_lens: [B] context lengths including the new tokens;
    block_tables: int32 [B, max_blocks]. Returns [T, Hq, D] in q.dtype: `out` when given
    (reference.attention_output), else a new tensor. new_kv: the new tokens' (k, v) [T, Hk, D] as
    computed, read in place of their cached copies (reference.extend_attention).
    """
    check_paged_args(q, k_cache, v_cache, block_tables)
    if new_kv is not None:
        for name, x in zip(("new k", "new v"), new_kv):
            if x.shape != (q.shape[0], k_cache.shape[2], q.shape[2]) or x.stride(-1) != 1:
                raise ValueError(f"{name} must be [{q.shape[0]}, {k_cache.shape[2]}, {q.shape[2]}] with a contiguous "
                                 f"last dim, got shape {tuple(x.shape)}")
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs < 0 or seq_lens.shape[0] < num_seqs or block_tables.shape[0] < num_seqs:
        raise ValueError("query_start_loc must be [B+1] with seq_lens and block_tables rows for each B")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = attention_output(q, out)
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    grid, args, consts = extend_launch(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                       k_scale, v_scale, out, new_kv)
    _extend_kernel[grid](*args, **consts)
    return out


def extend_launch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, k_scale: float, v_scale: float,
    out: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[tuple[int, int], list, dict]:
    """The kernel's launch for checked arguments: (grid, positional args, keyword constants incl.
    num_warps / num_stages); one home for extend_attention and bench/kernel_ir.py (which compiles
    the kernel as a launch specializes it, on tensors of the meta device)."""
    group, block_size = q.shape[1] // k_cache.shape[2], k_cache.shape[1]
    num_seqs = query_start_loc.shape[0] - 1
    tokens, hq, dim = q.shape
    num_tiles = tokens // BLOCK_M + num_seqs
    k_scale, v_scale = cache_scales(k_cache, k_scale, v_scale)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    f16 = fp8 and FP8_F16 and q.element_size() == 2  # fp32 queries keep fp32 dots
    opaque = FP8_OPAQUE_CVT if f16 and not interpreting() else ""
    d_pad = max(16, next_pow2(dim))
    # Shared memory holds NUM_STAGES K and V tiles: shrink them past 128 x 16-bit per row.
    block_n, stages = (BLOCK_N, NUM_STAGES) if d_pad * q.element_size() <= 256 else (64, 2)
    kc, vc = k_cache, v_cache
    args = [q, kc, vc, block_tables, query_start_loc, seq_lens, out,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
            block_tables.stride(0), num_seqs, num_tiles,
            float(scale) * k_scale * LOG2E, v_scale]
    if new_kv is None:  # not read: any pointer, no strides
        args += [q, q, 0, 0, 0, 0, 1.0]
    else:
        kn, vn = new_kv
        args += [kn, vn, kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), float(scale) * LOG2E]
    consts = dict(GROUP=group, D=dim, D_PAD=d_pad, EVEN_D=dim == d_pad, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
                  BLOCK_SIZE=block_size, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                  UPCAST=upcast_dots(q.dtype) and not f16, F16=f16, OPAQUE_K="k" in opaque, OPAQUE_V="v" in opaque,
                  AHEAD=k_cache.dtype in BLOCKS_AHEAD and stages > 2, NEW_KV=new_kv is not None,
                  UPCAST_NEW=upcast_dots(q.dtype), num_warps=NUM_WARPS, num_stages=stages,
                  **pdl_launch(q.device))
    return (hq, num_tiles), args, consts

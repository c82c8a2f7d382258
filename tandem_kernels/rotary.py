"""Triton rotary embedding fused with the write of K and V into the paged KV cache.

One program per token rotates all its query heads and KV heads (neox/rotate-half or interleaved
pairs, over the first rotary_dim features) and stores the rotated K and V at slot_mapping[t]
(skipped when < 0), quantizing to FP8 e4m3 (value / scale, clamped to +-448) for FP8 caches.
Semantics match tandem_kernels.reference.rotary_and_store_kv, apply_rotary and store_kv.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem_kernels.triton_common import next_pow2, pdl_begin, pdl_launch, quantize_for_store, soft_fp8_round

NUM_WARPS = 2  # for tiles of up to 4096 elements; twice that above


@triton.jit
def rotary_lanes(d, ROT: tl.constexpr, IS_NEOX: tl.constexpr):
    """For features d [D_PAD]: (partner, sign, cos/sin index, rotated?). Output feature d is
    x[d] * cos[ci] + sign * x[partner] * sin[ci] where d < ROT, else x[d] (partner = d, ci = 0)."""
    in_rot = d < ROT
    if IS_NEOX:
        first = d < ROT // 2
        ci = tl.where(first, d, d - ROT // 2)
        partner = tl.where(first, d + ROT // 2, d - ROT // 2)
    else:
        first = d % 2 == 0
        ci = d // 2
        partner = d ^ 1
    sign = tl.where(first, -1.0, 1.0)
    return tl.where(in_rot, partner, d), sign, tl.where(in_rot, ci, 0), in_rot


@triton.jit
def rotary_cos_sin(cs_row, ci, in_rot, ROT: tl.constexpr):
    """cos and sin (fp32, [D_PAD]) of one position's row of the cos/sin cache; 1 and 0 past ROT."""
    cos = tl.load(cs_row + ci, mask=in_rot, other=1.0).to(tl.float32)
    sin = tl.load(cs_row + ROT // 2 + ci, mask=in_rot, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rotate_rows(rows, d, mask, partner, sign, in_rot, cos, sin):
    """Load the [R, D_PAD] tile at row pointers `rows` [R, 1] (masked by `mask`) and return it
    rotated, in its own dtype."""
    x = tl.load(rows + d[None, :], mask=mask, other=0.0)
    xp = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    rotated = x.to(tl.float32) * cos[None, :] + sign[None, :] * xp * sin[None, :]
    return tl.where(in_rot[None, :], rotated.to(x.dtype), x)


@triton.jit
def store_at_slot(k, v, slot, k_heads, v_heads, d, mask, k_cache_ptr, v_cache_ptr, kc_s0, kc_s1, vc_s0, vc_s1,
                  block_size, k_scale, v_scale, IS_FP8: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """Write one token's K and V tiles [R, D_PAD] into the paged caches at `slot` (>= 0), each
    value quantized as store_kv does for FP8 caches; `k_heads` / `v_heads` [R, 1] are the rows'
    head offsets in each cache (head x its stride), `mask` [R, D_PAD] the elements written."""
    blk = slot // block_size
    off = slot % block_size
    kq = quantize_for_store(k.to(tl.float32), k_scale, IS_FP8, SOFT_ROUND)
    tl.store(k_cache_ptr + blk * kc_s0 + off * kc_s1 + k_heads + d[None, :], kq.to(k_cache_ptr.dtype.element_ty),
             mask=mask)
    vq = quantize_for_store(v.to(tl.float32), v_scale, IS_FP8, SOFT_ROUND)
    tl.store(v_cache_ptr + blk * vc_s0 + off * vc_s1 + v_heads + d[None, :], vq.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _rotate_heads(
    src_ptr, s0, s1, t, heads, d, partner, sign, in_rot, cos, sin,
    H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, ROTATE: tl.constexpr,
):
    """Load token t's [H_PAD, D_PAD] tile of src and return (rotated in src dtype, mask)."""
    mask = (heads < H)[:, None] & (d < D)[None, :]
    rows = src_ptr + t * s0 + heads[:, None] * s1
    if ROTATE:
        x = rotate_rows(rows, d, mask, partner, sign, in_rot, cos, sin)
    else:
        x = tl.load(rows + d[None, :], mask=mask, other=0.0)
    return x, mask


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr,
    pos_ptr, cos_sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
    q_s0, q_s1, k_s0, k_s1, v_s0, v_s1, cs_stride,
    kc_s0, kc_s1, kc_s2, vc_s0, vc_s1, vc_s2,
    block_size, k_scale, v_scale,
    HQ: tl.constexpr, HK: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, ROT: tl.constexpr, IS_NEOX: tl.constexpr,
    HAS_Q: tl.constexpr, HAS_K: tl.constexpr, ROTATE: tl.constexpr, WRITE_K: tl.constexpr,
    STORE: tl.constexpr, IS_FP8: tl.constexpr, SOFT_ROUND: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    partner, sign, ci, in_rot = rotary_lanes(d, ROT, IS_NEOX)
    if ROTATE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos, sin = rotary_cos_sin(cos_sin_ptr + pos * cs_stride, ci, in_rot, ROT)
    else:
        cos = tl.full([D_PAD], 1.0, tl.float32)
        sin = tl.zeros([D_PAD], tl.float32)

    if HAS_Q:
        hq = tl.arange(0, HQ_PAD)
        q, q_mask = _rotate_heads(q_ptr, q_s0, q_s1, t, hq, d, partner, sign, in_rot, cos, sin,
                                  HQ, HQ_PAD, D, ROTATE)
        tl.store(q_out_ptr + (t * HQ + hq[:, None]) * D + d[None, :], q, mask=q_mask)

    if HAS_K:
        hk = tl.arange(0, HK_PAD)
        k, k_mask = _rotate_heads(k_ptr, k_s0, k_s1, t, hk, d, partner, sign, in_rot, cos, sin,
                                  HK, HK_PAD, D, ROTATE)
        if WRITE_K:
            tl.store(k_out_ptr + (t * HK + hk[:, None]) * D + d[None, :], k, mask=k_mask)
        if STORE:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:
                v = tl.load(v_ptr + t * v_s0 + hk[:, None] * v_s1 + d[None, :], mask=k_mask, other=0.0)
                store_at_slot(k, v, slot, hk[:, None] * kc_s2, hk[:, None] * vc_s2, d, k_mask, k_cache_ptr,
                              v_cache_ptr, kc_s0, kc_s1, vc_s0, vc_s1, block_size, k_scale, v_scale, IS_FP8,
                              SOFT_ROUND)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_3d(x: torch.Tensor, name: str) -> None:
    if x.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")


def _check_rotary(head_dim: int, rotary_dim: int, cos_sin_cache: torch.Tensor) -> None:
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rotary_dim:
        raise ValueError(f"cos_sin_cache must be [positions, {rotary_dim}], got {tuple(cos_sin_cache.shape)}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, hk: int, d: int) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[2] != hk or c.shape[3] != d or c.stride(-1) != 1:
            raise ValueError(f"{name} must be [blocks, block_size, {hk}, {d}] with a contiguous last dim")
    if k_cache.dtype != v_cache.dtype or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")


def _launch(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, rotary_dim, is_neox,
            k_scale, v_scale, *, rotate: bool, write_k: bool, store: bool):
    ref = q if q is not None else k
    t, d = ref.shape[0], ref.shape[2]
    hq = q.shape[1] if q is not None else 1
    hk = k.shape[1] if k is not None else 1
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device) if q is not None else None
    k_out = torch.empty((t, hk, d), dtype=k.dtype, device=k.device) if write_k else None
    if t == 0:
        return q_out, k_out
    dummy = ref
    q_ = q if q is not None else dummy
    k_ = k if k is not None else dummy
    v_ = v if v is not None else dummy
    kc = k_cache if k_cache is not None else dummy
    vc = v_cache if v_cache is not None else dummy
    cs = cos_sin_cache if cos_sin_cache is not None else dummy
    pos = positions if positions is not None else dummy
    slots = slot_mapping if slot_mapping is not None else dummy
    d_pad = next_pow2(d)
    hq_pad, hk_pad = next_pow2(hq), next_pow2(hk)
    tile = d_pad * (hq_pad if q is not None else 0) + d_pad * hk_pad
    _rotary_store_kernel[(t,)](
        q_, k_, v_, q_out if q_out is not None else dummy, k_out if k_out is not None else dummy,
        pos, cs, slots, kc, vc,
        q_.stride(0), q_.stride(1), k_.stride(0), k_.stride(1), v_.stride(0), v_.stride(1),
        cs.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        kc.shape[1] if k_cache is not None else 1, float(k_scale), float(v_scale),
        HQ=hq, HK=hk, HQ_PAD=hq_pad, HK_PAD=hk_pad, D=d, D_PAD=d_pad, ROT=rotary_dim,
        IS_NEOX=bool(is_neox), HAS_Q=q is not None, HAS_K=k is not None, ROTATE=rotate,
        WRITE_K=write_k, STORE=store, IS_FP8=kc.dtype == torch.float8_e4m3fn,
        SOFT_ROUND=soft_fp8_round(), num_warps=NUM_WARPS if tile <= 4096 else 2 * NUM_WARPS,
        **pdl_launch(ref.device),
    )
    return q_out, k_out


def rotary_and_store_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, rotary_dim: int, is_neox: bool,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D], write rotated k and v [T, Hk, D] into the cache at
    slot_mapping [T] (slots < 0 skipped); return new contiguous (q_rot, k_rot)."""
    q, k, v, cos_sin_cache = check_rotary_args(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                               rotary_dim)
    return _launch(q, k, v, positions, cos_sin_cache, k_cache, v_cache,
                   slot_mapping, rotary_dim, is_neox, k_scale, v_scale,
                   rotate=True, write_k=True, store=True)


def check_rotary_args(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checks of rotary_and_store_kv's arguments (ValueError naming the one that is off);
    returns q, k, v and cos_sin_cache with a contiguous last dim."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_3d(x, name)
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not agree")
    if positions.shape != (q.shape[0],) or slot_mapping.shape != (q.shape[0],):
        raise ValueError("positions and slot_mapping must be [tokens]")
    _check_rotary(q.shape[2], rotary_dim, cos_sin_cache)
    _check_cache(k_cache, v_cache, k.shape[1], k.shape[2])
    return tuple(_last_dim_contiguous(x) for x in (q, k, v, cos_sin_cache))


def apply_rotary(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int, is_neox: bool
) -> torch.Tensor:
    """Rotate the first rotary_dim features of x [T, H, D] at positions [T]; a new tensor."""
    _check_3d(x, "x")
    if positions.shape != (x.shape[0],):
        raise ValueError("positions must be [tokens]")
    _check_rotary(x.shape[2], rotary_dim, cos_sin_cache)
    out, _ = _launch(_last_dim_contiguous(x), None, None, positions, _last_dim_contiguous(cos_sin_cache),
                     None, None, None, rotary_dim, is_neox, 1.0, 1.0,
                     rotate=True, write_k=False, store=False)
    return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write k, v [T, Hk, D] into the paged caches at slot_mapping [T]; slots < 0 skipped."""
    _check_3d(k, "k")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError("slot_mapping must be [tokens]")
    _check_cache(k_cache, v_cache, k.shape[1], k.shape[2])
    _launch(None, _last_dim_contiguous(k), _last_dim_contiguous(v), None, None, k_cache, v_cache,
            slot_mapping, k.shape[2], True, k_scale, v_scale, rotate=False, write_k=False, store=True)

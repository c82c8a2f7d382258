"""Plain-torch reference for every kernel: the CPU path, and the oracle the Triton kernels are tested against.

Shapes: T tokens in a batch, B sequences, Hq query heads, Hk KV heads (Hq % Hk == 0), D head dim.
Paged cache per layer: K and V of shape [num_blocks, block_size, Hk, D]. A token's slot is
block_id * block_size + offset. FP8 caches (torch.float8_e4m3fn) store value / scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32, returned in x.dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual)."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(summed, weight, eps), summed


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
    silu_pair: bool = False, weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decode GEMV with its neighbours: returns (y, x + residual or None).

    a = rms_norm(x + residual) (fused_add_rms_norm) with `residual`, rms_norm(x) with only
    `norm_weight`, else x; y = a @ weight.T + bias; with silu_pair, y = silu_and_mul(y) (gate rows
    first, then up rows). Each step rounds to x.dtype as the unfused ops do. With `weight_scale`
    [N] (float32), weight is e4m3 and y = (a @ weight.T) * weight_scale + bias in float32, the
    activations unquantized, rounded to x.dtype once (as the kernel does).
    """
    check_weight_scale(weight, weight_scale)
    new_residual = None
    if norm_weight is not None and residual is not None:
        x, new_residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    elif norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    if weight_scale is not None:
        y = x.float() @ weight.float().t() * weight_scale.float()
        y = (y if bias is None else y + bias.float()).to(x.dtype)
    else:
        y = F.linear(x, weight, bias)
    return (silu_and_mul(y) if silu_pair else y), new_residual


def check_weight_scale(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> None:
    """ValueError unless a GEMV's weight is e4m3 exactly when it has a scale per output row."""
    if weight_scale is None:
        if weight.dtype == FP8_DTYPE:
            raise ValueError("weight: e4m3 weights need weight_scale (one float32 scale per output row)")
        return
    if weight.dtype != FP8_DTYPE or weight_scale.shape != (weight.shape[0],):
        raise ValueError(f"weight_scale: [N] scales go with an e4m3 weight [N, K]; got {weight.dtype} weight "
                         f"{tuple(weight.shape)} and scales {tuple(weight_scale.shape)}")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, cols] -> [rows] int64: each row's first index of its largest value (NaN counts as
    larger than every number), as torch.argmax."""
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"x must be [rows, cols] with cols >= 1, got shape {tuple(x.shape)}")
    return x.argmax(dim=-1)


def sample_filtered(x: torch.Tensor, temperature: torch.Tensor, kth: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One sampled token a row: the exponential race among the tokens its filters allow.

    x [S, V] logits (any float dtype, taken as float32; -inf never wins), temperature [S] (> 0),
    kth [S] the top-k threshold in x's units (-inf: no top-k), top_p [S] (>= 1: no top-p),
    min_p [S] (0: no min-p), noise [S, V] Exponential(1) draws (> 0). Returns [S] int64.

    With w_i = exp((x_i - max) / t) over the tokens at or above kth, token i is allowed when
    x_i >= kth, x_i >= max + t * log(min_p), and the mass of the tokens strictly above it,
    sum of w_j over x_j > x_i, is below top_p * sum(w) (so equal logits are kept or dropped
    together, and top-p renormalises over the top-k survivors, as vLLM orders them). The token
    is the first index of the largest x_i / t - log(noise_i) among the allowed: a draw from
    softmax(x / t) restricted to them.
    """
    x = x.float()
    inv_t = temperature.float().reciprocal().unsqueeze(1)
    kth, top_p, min_p = kth.float().unsqueeze(1), top_p.float().unsqueeze(1), min_p.float().unsqueeze(1)
    valid = (x >= kth) & (x > float("-inf"))
    m = torch.where(valid, x, float("-inf")).amax(dim=1, keepdim=True)
    w = torch.where(valid, torch.exp((x - m) * inv_t), 0.0)
    allowed = valid & (x >= m + torch.log(min_p) * temperature.float().unsqueeze(1))
    if bool((top_p < 1.0).any()):
        vals, order = x.sort(dim=1, descending=True)
        ws = w.gather(1, order)
        ahead = ws.cumsum(dim=1) - ws  # mass before each position in sorted order
        cols = torch.arange(x.shape[1], device=x.device).expand_as(vals)
        starts = torch.ones_like(vals, dtype=torch.bool)
        starts[:, 1:] = vals[:, 1:] != vals[:, :-1]
        first = torch.where(starts, cols, 0).cummax(dim=1).values  # the first position of each tie
        above = torch.empty_like(ahead).scatter_(1, order, ahead.gather(1, first))
        allowed &= (above < top_p * w.sum(dim=1, keepdim=True)) | (top_p >= 1.0)
    score = torch.where(allowed, x * inv_t - torch.log(noise.float()), float("-inf"))
    return score.argmax(dim=1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*I] -> silu(x[..., :I]) * x[..., I:]."""
    gate, up = x.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(x.dtype)


def rope_cos_sin_cache(
    max_positions: int, rotary_dim: int, inv_freq: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[max_positions, rotary_dim] with cos in the first half and sin in the second."""
    t = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())  # [P, rotary_dim/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def apply_rotary(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int, is_neox: bool
) -> torch.Tensor:
    """Rotate the first `rotary_dim` features of x: [T, H, D] at `positions`: [T].

    is_neox=True rotates halves (rotate_half, Llama/Qwen in Hugging Face layout); False rotates
    interleaved pairs (GPT-J style, GLM).
    """
    cos_sin = cos_sin_cache[positions.long()].float()  # [T, rotary_dim]
    cos, sin = cos_sin.chunk(2, dim=-1)  # [T, rotary_dim/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot, passthrough = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), passthrough], dim=-1)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k, v: [T, Hk, D] into the paged caches at `slot_mapping`: [T] (int64). Slots < 0 are
    skipped. The caches may be any strided view of [blocks, block_size, Hk, D] (a head-major one)."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = _quantize(k[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = _quantize(v[keep], v_cache.dtype, v_scale)


def rotary_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k, write rotated k and v into the cache; return (q_rot, k_rot)."""
    q = apply_rotary(q, positions, cos_sin_cache, rotary_dim, is_neox)
    k = apply_rotary(k, positions, cos_sin_cache, rotary_dim, is_neox)
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k


def rotary_store_and_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A decode step's attention from unrotated q, k, v [B, H, D]: rotary_and_store_kv, then
    paged_decode_attention of the rotated q (into `out` when given)."""
    q, _ = rotary_and_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, rotary_dim,
                               is_neox, k_scale, v_scale)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, out=out)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, scale: float = 1.0
) -> torch.Tensor:
    """The first `length` tokens of one sequence's cache as [length, Hk, D] (dequantized, float32)."""
    block_size = cache.shape[1]
    n = (length + block_size - 1) // block_size
    blocks = cache[block_table[:n].long()]  # [n, block_size, Hk, D]
    out = blocks.reshape(n * block_size, *cache.shape[2:])[:length]
    return _dequantize(out, scale)


def attention_output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Where an attention kernel writes its [T, Hq, D] result: `out` when given (checked: q's shape,
    dtype and device, a contiguous last dim; a slice of a larger output is fine), else a new tensor."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} like q, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.dim() and out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dim")
    return out


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of new tokens over a paged context that already holds them.

    q: [T, Hq, D], the queries of every sequence packed; sequence i owns rows
    query_start_loc[i]:query_start_loc[i+1] (int32, [B+1]); its context is its first seq_lens[i]
    cached tokens, the new ones last (its queries sit at positions seq_lens[i] - q_len .. seq_lens[i]-1).
    Decode is the case q_len == 1. Returns [T, Hq, D] in q.dtype, written into `out` when given
    (attention_output).
    new_kv: the new tokens' (k, v) [T, Hk, D] as computed (k rotated), packed as q is: read in place
    of their cached copies, unscaled (an FP8 cache's copies are their rounding); the context
    before them still comes from the cache.
    """
    out = attention_output(q, out)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    hq, hk, d = q.shape[1], k_cache.shape[2], q.shape[2]
    for i, ctx in enumerate(lens):
        s, e = starts[i], starts[i + 1]
        if e == s:
            continue
        q_len = e - s
        if new_kv is None:
            k = gather_kv(k_cache, block_tables[i], ctx, k_scale)  # [ctx, Hk, D]
            v = gather_kv(v_cache, block_tables[i], ctx, v_scale)
        else:
            k = torch.cat([gather_kv(k_cache, block_tables[i], ctx - q_len, k_scale), new_kv[0][s:e].float()])
            v = torch.cat([gather_kv(v_cache, block_tables[i], ctx - q_len, v_scale), new_kv[1][s:e].float()])
        # GQA without copies: query head h uses KV head h // (Hq // Hk).
        qi = q[s:e].float().view(q_len, hk, hq // hk, d).permute(1, 2, 0, 3)  # [Hk, G, q_len, D]
        scores = torch.matmul(qi, k.permute(1, 2, 0)[:, None]) * scale  # [Hk, G, q_len, ctx]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.matmul(probs, v.permute(1, 0, 2)[:, None])  # [Hk, G, q_len, D]
        out[s:e] = o.permute(2, 0, 1, 3).reshape(q_len, hq, d).to(q.dtype)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D] attends to its first context_lens[b] cached tokens;
    written into `out` when given (attention_output).

    Vectorized over the batch (one gather of every sequence's blocks, padded to the longest).
    """
    out = attention_output(q, out)
    b, hq, d = q.shape
    if b == 0:
        return out
    block_size, hk = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    nb = -(-max_len // block_size)
    tables = block_tables[:, :nb].long()
    k = _dequantize(k_cache[tables], k_scale).reshape(b, nb * block_size, hk, d)  # [B, L, Hk, D]
    v = _dequantize(v_cache[tables], v_scale).reshape(b, nb * block_size, hk, d)
    qg = q.float().view(b, hk, hq // hk, d)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale  # [B, Hk, G, L]
    pad = torch.arange(nb * block_size, device=q.device)[None, :] >= context_lens[:, None].long()
    scores = scores.masked_fill(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty context attends to nothing: zeros
    out.copy_(torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(b, hq, d))
    return out


def _quantize(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype == torch.float8_e4m3fn:
        return (x.float() / scale).clamp(-448.0, 448.0).to(dtype)
    return x.to(dtype)


def _dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    if x.dtype == torch.float8_e4m3fn:
        return x.float() * scale
    return x.float()


# ---- FP8 weights (W8A8): per-token activation quantization and the scaled GEMM ---------------
# An activation row x is stored as q = clamp(x / s, +-448) in e4m3 with one float32 scale
# s = max(amax(|x|) / 448, FP8_MIN_SCALE); a weight as e4m3 rows with one float32 scale per
# output channel. The GEMM is y = (q_x @ q_w^T) * s_x * s_w (+ bias), accumulated in float32:
# products of e4m3 values are exact in float32, so a GPU GEMM differs only in summation order.
# With deferred scales the GEMM stops at the product p = q_x @ q_w^T (rounded to the output
# dtype) and the kernel that reads y applies them: y = p * s_x * s_w, rounded to p's dtype, so it
# reads the value the scaled GEMM would have stored, rounded once more.

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_MIN_SCALE = 1.0 / (448.0 * 512.0)  # keeps an all-zero row's scale finite (its q is 0)


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (q [T, K] e4m3, scale [T, 1] float32) with x ~= q * scale, one scale per row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


DeferredScales = tuple[torch.Tensor, torch.Tensor]  # (row_scale [T, 1], col_scale [N]) float32


def apply_deferred_scales(p: torch.Tensor, scales: DeferredScales | None) -> torch.Tensor:
    """p [T, N] (an FP8 GEMM's unscaled product) * row_scale * col_scale, in float32, rounded to
    p.dtype; p itself where `scales` is None."""
    if scales is None:
        return p
    row_scale, col_scale = scales
    return (p.float() * row_scale * col_scale.float().view(1, -1)).to(p.dtype)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 x_scales: DeferredScales | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_per_token(rms_norm(x)): the norm's output rounded to x.dtype first, as the
    unfused ops would. x_scales: x is an unscaled FP8 product (apply_deferred_scales first)."""
    return quantize_fp8_per_token(rms_norm(apply_deferred_scales(x, x_scales), weight, eps))


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    x_scales: DeferredScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, x + residual): fused_add_rms_norm with its normalized output quantized per token.
    x_scales: x is an unscaled FP8 product (apply_deferred_scales first)."""
    y, summed = fused_add_rms_norm(apply_deferred_scales(x, x_scales), residual, weight, eps)
    q, scale = quantize_fp8_per_token(y)
    return q, scale, summed


def silu_and_mul_fp8(x: torch.Tensor, x_scales: DeferredScales | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_per_token(silu_and_mul(x)), the product rounded to x.dtype first. x_scales:
    x [T, 2I] is an unscaled FP8 product, col_scale [2I] (apply_deferred_scales first)."""
    return quantize_fp8_per_token(silu_and_mul(apply_deferred_scales(x, x_scales)))


def fp8_linear(
    q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """y [T, N] = (q [T, K] @ weight [N, K]^T) * x_scale [T, 1] * weight_scale [N] + bias, in
    float32, returned in out_dtype: the float32 emulation of the cuBLASLt FP8 GEMM."""
    y = torch.matmul(q.float(), weight.float().t()) * x_scale * weight_scale.float().view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_product(q: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """p [T, N] = q [T, K] @ weight [N, K]^T in float32, returned in out_dtype: fp8_linear with
    its scales deferred to the kernel that reads p (apply_deferred_scales)."""
    return torch.matmul(q.float(), weight.float().t()).to(out_dtype)

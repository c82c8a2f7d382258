"""What one forward pass needs to know about the batch's place in the paged KV cache."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tandem_kernels import ops


# "1": a decode-only step rotates its queries and stores its own K and V inside the decode
# attention kernel (tandem_kernels.ops.rotary_store_and_decode), one kernel a layer fewer than
# rotary_and_store_kv before attention; "0" (default): the two kernels.
FUSED_ROTARY_ENV = "TANDEM_FUSED_ROTARY"


# "1": prefill attention reads the new tokens' K/V as computed (the rotary kernel's k, the
# projection's v: contiguous rows in the model's dtype) and only the context before them from the
# cache, as vLLM's prefill does; an FP8 cache then rounds the new tokens only for later steps.
# The default: on an H200 the kernel is 1.29x faster on an FP8 cache, 1.13x on bf16 (BENCHMARKS.md
# §31). "0": every key and value from the cache.
EXTEND_NEW_KV_ENV = "TANDEM_EXTEND_NEW_KV"


def extend_new_kv_enabled() -> bool:
    """Whether prefill attention reads the new tokens' K/V as computed (EXTEND_NEW_KV_ENV)."""
    value = os.environ.get(EXTEND_NEW_KV_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{EXTEND_NEW_KV_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def fused_rotary_enabled() -> bool:
    """Whether decode-only steps take the fused rotary + store + attention (FUSED_ROTARY_ENV)."""
    value = os.environ.get(FUSED_ROTARY_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{FUSED_ROTARY_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


@dataclass
class AttentionMetadata:
    """Batch layout for attention. Tokens of all sequences are packed along one axis.

    slot_mapping[t]: cache slot (block_id * block_size + offset) where token t's K/V go.
    block_tables: [B, max_blocks] int32, each sequence's block ids (padded with 0).
    query_start_loc: [B+1] int32, sequence i owns packed rows query_start_loc[i]:query_start_loc[i+1].
    seq_lens: [B] int32, each sequence's context length including this step's tokens.
    is_decode: every sequence contributes exactly one token (enables the decode kernel / graphs).
    num_decode_seqs: in a batch that is not all decode, how many leading sequences have one query
      token each (decodes, or a prompt's last token); `attend` runs them through the decode kernel.
    tail_query_start_loc: [B - num_decode_seqs + 1] int32, query_start_loc of the other sequences
      counted from their first row (set when num_decode_seqs > 0).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    is_decode: bool
    k_scale: float = 1.0
    v_scale: float = 1.0
    num_decode_seqs: int = 0
    tail_query_start_loc: torch.Tensor | None = None


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
           scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of the batch's packed queries q [T, Hq, D] over the paged cache (their own K/V
    already stored). One-token sequences go through the decode kernel (a KV head's query group
    shares each K/V tile), the rest through extend attention (tiles of query rows): a decode in a
    mixed batch would otherwise fill a whole tile of query rows by itself. Each kernel writes its
    rows of one output (no concatenation: at an 8k-token prefill step a copy of the output per layer
    was ~1.1 ms of the step). new_kv: the batch's (k, v) [T, Hk, D] as computed, which extend
    attention reads for the new tokens (ops.extend_attention)."""
    if meta.is_decode:
        return ops.paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                          meta.k_scale, meta.v_scale)
    n = meta.num_decode_seqs
    if n == 0:
        return ops.extend_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                    scale, meta.k_scale, meta.v_scale, new_kv=new_kv)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ops.paged_decode_attention(q[:n], k_cache, v_cache, meta.block_tables[:n], meta.seq_lens[:n], scale,
                               meta.k_scale, meta.v_scale, out=out[:n])
    ops.extend_attention(q[n:], k_cache, v_cache, meta.block_tables[n:], meta.tail_query_start_loc,
                         meta.seq_lens[n:], scale, meta.k_scale, meta.v_scale, out=out[n:],
                         new_kv=None if new_kv is None else (new_kv[0][n:], new_kv[1][n:]))
    return out

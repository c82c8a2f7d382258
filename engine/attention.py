"""What one forward pass needs to know about the batch's place in the paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Batch layout for attention. Tokens of all sequences are packed along one axis.

    slot_mapping[t]: cache slot (block_id * block_size + offset) where token t's K/V go.
    block_tables: [B, max_blocks] int32, each sequence's block ids (padded with 0).
    query_start_loc: [B+1] int32, sequence i owns packed rows query_start_loc[i]:query_start_loc[i+1].
    seq_lens: [B] int32, each sequence's context length including this step's tokens.
    is_decode: every sequence contributes exactly one token (enables the decode kernel / graphs).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    is_decode: bool
    k_scale: float = 1.0
    v_scale: float = 1.0

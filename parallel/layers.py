"""Sharded replacements for the model's linear layers and embeddings, built from the full modules.

Column-parallel layers keep this rank's output rows and need no communication; row-parallel
layers keep this rank's input columns and sum their partial outputs over the group; the
vocabulary is split in contiguous row ranges (padded to equal size), looked up with masking and
summed, and projected to logits shard by shard and gathered.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel.comm import TPGroup

logger = logging.getLogger(__name__)


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


class ColumnParallelLinear(nn.Linear):
    """This rank's output rows of a (merged) projection: y_r = x W_r^T + b_r, no communication.

    `segments` are (start, length) row ranges of the full weight; the local weight is their
    concatenation in order, so a merged q|k|v or gate|up layout stays merged on every rank.
    """

    segments: tuple[tuple[int, int], ...]

    @classmethod
    def from_linear(cls, full: nn.Linear, segments: Sequence[tuple[int, int]]) -> ColumnParallelLinear:
        rows = [full.weight.data[start:start + length] for start, length in segments]
        weight = torch.cat(rows)
        layer = cls(full.in_features, weight.shape[0], bias=full.bias is not None, device="meta")
        layer.weight = _frozen(weight)
        if full.bias is not None:
            layer.bias = _frozen(torch.cat([full.bias.data[start:start + length] for start, length in segments]))
        layer.segments = tuple((int(s), int(n)) for s, n in segments)
        return layer

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, segments={list(self.segments)}"


class RowParallelLinear(nn.Linear):
    """This rank's input columns [start, start + length) of a projection; outputs summed over ranks.

    The input is the matching column-parallel output (already sharded), so one all-reduce per
    layer restores the full result; a bias is added once, after the sum.
    """

    tp: TPGroup
    columns: tuple[int, int]  # (start, length) of the full weight's input columns held here

    @classmethod
    def from_linear(cls, full: nn.Linear, start: int, length: int, tp: TPGroup) -> RowParallelLinear:
        layer = cls(length, full.out_features, bias=full.bias is not None, device="meta")
        layer.weight = _frozen(full.weight.data[:, start:start + length])
        if full.bias is not None:
            layer.bias = _frozen(full.bias.data)
        layer.tp = tp
        layer.columns = (int(start), int(length))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def vocab_shard(vocab_size: int, tp: TPGroup) -> tuple[int, int, int]:
    """(first row, rows held, padded rows) of this rank's slice of the vocabulary."""
    padded = -(-vocab_size // tp.world_size)
    start = tp.rank * padded
    return start, max(0, min(padded, vocab_size - start)), padded


def shard_vocab_rows(weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's rows of a [vocab, hidden] matrix, zero-padded so every rank holds as many."""
    start, rows, padded = vocab_shard(weight.shape[0], tp)
    shard = weight.new_zeros((padded, weight.shape[1]))
    shard[:rows] = weight[start:start + rows]
    return shard


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over ranks: each rank looks up the ids it holds
    (zeros for the others) and the sum over ranks is the full embedding, exactly."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.vocab_start, self.num_rows, _ = vocab_shard(vocab_size, tp)
        self.weight = _frozen(shard_vocab_rows(weight, tp))

    @classmethod
    def from_embedding(cls, full: nn.Embedding, tp: TPGroup) -> VocabParallelEmbedding:
        return cls(full.weight.data, full.num_embeddings, tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_rows)
        x = F.embedding(torch.where(inside, local, torch.zeros_like(local)), self.weight)
        return self.tp.all_reduce(x.masked_fill(~inside.unsqueeze(-1), 0))

    def extra_repr(self) -> str:
        return f"vocab [{self.vocab_start}, {self.vocab_start + self.num_rows}) of {self.vocab_size}"


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: TPGroup) -> torch.Tensor:
    """Full logits [rows, vocab_size] (hidden's dtype, as CausalLM.logits) on every rank from this
    rank's padded vocab rows."""
    local = torch.matmul(hidden, weight.t())  # local: [rows, padded shard]
    if tp.world_size == 1:
        return local[:, :vocab_size]
    rows, shard = local.shape
    gathered = tp.all_gather(local)  # [world * rows, shard], rank-major
    full = gathered.view(tp.world_size, rows, shard).permute(1, 0, 2).reshape(rows, tp.world_size * shard)
    return full[:, :vocab_size]

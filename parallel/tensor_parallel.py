"""Tensor parallelism for engine.model.CausalLM, applied after construction by swapping modules.

The model file stays plain (one definition, no TP branches). `apply_tensor_parallel` rewrites a
built, loaded model so this rank keeps 1/world of it:

    qkv_proj      column-parallel: this rank's query heads and its KV heads (KV heads are split
                  when num_kv_heads >= world, else each rank keeps the one its query heads use)
    o_proj        row-parallel, all-reduce
    gate_up_proj  column-parallel: this rank's slice of gate and the same slice of up
    down_proj     row-parallel, all-reduce
    embed_tokens  vocab-parallel (masked lookup, all-reduce); lm_head vocab-parallel, logits gathered
    norms, rotary replicated

and sets each attention module's head counts to the local ones. The KV cache of a rank holds
only its KV heads: build it from `shard_config(config, world)`.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from engine.config import ModelConfig
from engine.model import CausalLM
from engine.weights import load_model
from parallel.comm import TPGroup
from parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_vocab_rows,
    vocab_parallel_logits,
)

logger = logging.getLogger(__name__)


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """ValueError naming the config field that cannot be split `world_size` ways."""
    if config.num_heads % world_size:
        raise ValueError(f"num_attention_heads: {config.num_heads} is not divisible by tensor parallel size {world_size}")
    kv = config.num_kv_heads
    if (kv >= world_size and kv % world_size) or (kv < world_size and world_size % kv):
        raise ValueError(
            f"num_key_value_heads: {kv} must divide, or be a multiple of, tensor parallel size {world_size}"
        )
    if config.intermediate_size % world_size:
        raise ValueError(f"intermediate_size: {config.intermediate_size} is not divisible by tensor parallel size {world_size}")


def kv_head_range(num_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first KV head, KV heads) held by `rank`: a 1/world slice, or one replicated head."""
    if num_kv_heads >= world_size:
        per = num_kv_heads // world_size
        return rank * per, per
    return rank // (world_size // num_kv_heads), 1


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The per-rank shapes (heads, KV heads, MLP width): what a rank's KVCache is built from."""
    check_shardable(config, world_size)
    _, kv_local = kv_head_range(config.num_kv_heads, 0, world_size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=kv_local,
        intermediate_size=config.intermediate_size // world_size,
    )


class TensorParallelCausalLM(CausalLM):
    """A CausalLM after `apply_tensor_parallel`: the same forward, logits gathered over the vocab shards."""

    tp: TPGroup

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_parallel_logits(hidden, weight, self.config.vocab_size, self.tp)


def apply_tensor_parallel(model: CausalLM, rank: int, world_size: int, group: Any = None) -> CausalLM:
    """Shard `model` in place for rank `rank` of `world_size` in process `group` (None: default).

    Every rank must call this on the same full weights and then run every forward and `logits`
    call in lockstep. Returns the model (now a TensorParallelCausalLM); world_size 1 is a no-op.
    """
    tp = TPGroup(rank, world_size, group)
    cfg = model.config
    check_shardable(cfg, world_size)
    if world_size == 1:
        return model
    d = cfg.head_dim
    heads = cfg.num_heads // world_size
    q0 = rank * heads * d
    kv0, kv_heads = kv_head_range(cfg.num_kv_heads, rank, world_size)
    inter = cfg.intermediate_size // world_size
    i0 = rank * inter
    for layer in model.layers:
        attn = layer.self_attn
        attn.qkv_proj = ColumnParallelLinear.from_linear(attn.qkv_proj, [
            (q0, heads * d),  # q: this rank's query heads
            (cfg.q_size + kv0 * d, kv_heads * d),  # k
            (cfg.q_size + cfg.kv_size + kv0 * d, kv_heads * d),  # v
        ])
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, q0, heads * d, tp)
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.q_size, attn.kv_size = heads * d, kv_heads * d
        mlp = layer.mlp
        mlp.gate_up_proj = ColumnParallelLinear.from_linear(
            mlp.gate_up_proj, [(i0, inter), (cfg.intermediate_size + i0, inter)]
        )
        mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, i0, inter, tp)
    model.embed_tokens = VocabParallelEmbedding.from_embedding(model.embed_tokens, tp)
    if model.lm_head is not None:
        rows = shard_vocab_rows(model.lm_head.weight.data, tp)
        model.lm_head = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        model.lm_head.weight = torch.nn.Parameter(rows, requires_grad=False)
    model.tp = tp
    model.__class__ = TensorParallelCausalLM
    logger.info("rank %d/%d: %d query heads, KV heads [%d, %d), MLP columns [%d, %d)",
                rank, world_size, heads, kv0, kv0 + kv_heads, i0, i0 + inter)
    return model


def load_tensor_parallel_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup,
    load_format: str = "auto",
) -> CausalLM:
    """Load the model on the host, keep this rank's shard, and return the shard on `device`.

    The device never holds more than the shard (the host briefly holds the whole model per
    rank process; a loader that narrows each tensor as it streams in would avoid that). Dummy
    weights are drawn on `device`'s generator one parameter at a time, because random draws
    differ between CPU and CUDA generators and every rank must shard the weights an unsharded
    engine on `device` would draw.
    """
    device = torch.device(device)
    model = load_model(model_dir, config, dtype, torch.device("cpu"), load_format, dummy_draw_device=device)
    apply_tensor_parallel(model, tp.rank, tp.world_size, tp.group)
    return model.to(device)

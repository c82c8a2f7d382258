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
from engine.rope import build_cos_sin_cache
from engine.weights import LOAD_FORMATS, Placement, default_dtype, stream_checkpoint
from parallel.comm import TPGroup
from parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_vocab_rows,
    vocab_parallel_logits,
    vocab_shard,
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
    """This rank's shard of the model on `device`, equal to `apply_tensor_parallel` of the full
    model, without ever holding the full model: the module tree is built and sharded on the
    meta device, only the shard is allocated, and each checkpoint tensor (one in host memory at
    a time) has its rows and columns that belong here copied in (`ShardPlacer`). Dummy weights
    are drawn one full parameter at a time on `device`'s generator, in the unsharded model's
    order, and sliced: every rank shards the weights an unsharded engine on `device` draws.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: must be one of {LOAD_FORMATS}, got {load_format!r}")
    device = torch.device(device)
    with torch.device("meta"), default_dtype(dtype):
        model = CausalLM(config)
    full_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    apply_tensor_parallel(model, tp.rank, tp.world_size, tp.group)
    model.to_empty(device=device)
    model.cos_sin_cache = build_cos_sin_cache(config, device).to(torch.float32)
    placer = ShardPlacer(model, tp)
    with torch.no_grad():
        if load_format == "dummy":
            _draw_dummy_shards(model, placer, full_shapes, device)
        else:
            for name, placement, tensor in stream_checkpoint(Path(model_dir), config, full_shapes):
                placer.place(name, placement, tensor)
    return model.eval().requires_grad_(False)


class ShardPlacer:
    """Copies pieces of full parameters into this rank's shards.

    `place` takes rows [row_offset, row_offset + rows) of a full (merged) parameter and writes
    the part this rank holds: column-parallel rows by their segments, row-parallel columns,
    vocabulary rows of the embedding and lm_head (padding rows stay zero), replicated
    parameters whole.
    """

    def __init__(self, model: CausalLM, tp: TPGroup) -> None:
        self.tp = tp
        self.vocab_size = model.config.vocab_size
        self.params = dict(model.named_parameters())
        self.owners = {f"{mod_name}.{p_name}" if mod_name else p_name: module
                       for mod_name, module in model.named_modules() for p_name, _ in module.named_parameters(recurse=False)}
        for name in ("embed_tokens.weight", "lm_head.weight"):
            if name in self.params:
                self.params[name].data.zero_()

    def place(self, name: str, placement: Placement, tensor: torch.Tensor) -> None:
        target = placement.target
        local = self.params[target].data
        module = self.owners[target]
        off, rows = placement.row_offset, tensor.shape[0]
        if placement.rows is not None and rows != placement.rows:
            raise ValueError(f"weights: {name!r} has {rows} rows, expected {placement.rows}")
        if isinstance(module, ColumnParallelLinear):
            self._check_cols(name, tensor, local)
            at = 0
            for start, length in module.segments:  # local rows [at, at + length) are full rows [start, ...)
                a, b = max(start, off), min(start + length, off + rows)
                if a < b:
                    local[at + a - start:at + b - start].copy_(tensor[a - off:b - off])
                at += length
        elif isinstance(module, RowParallelLinear) and target.endswith("weight"):
            start, length = module.columns
            full_cols = length * self.tp.world_size
            if tensor.dim() != 2 or tensor.shape[1] != full_cols:
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected ({local.shape[0]}, {full_cols})")
            local[off:off + rows].copy_(tensor[:, start:start + length])
        elif target in ("embed_tokens.weight", "lm_head.weight"):
            self._check_cols(name, tensor, local)
            start, held, _ = vocab_shard(self.vocab_size, self.tp)
            a, b = max(start, off), min(start + held, off + rows)
            if a < b:
                local[a - start:b - start].copy_(tensor[a - off:b - off])
        else:
            dest = local.narrow(0, off, rows) if local.dim() else local
            if dest.shape != tensor.shape:
                raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)

    @staticmethod
    def _check_cols(name: str, tensor: torch.Tensor, local: torch.Tensor) -> None:
        if tensor.shape[1:] != local.shape[1:]:
            raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, expected rows of {tuple(local.shape[1:])}")


def _draw_dummy_shards(model: CausalLM, placer: ShardPlacer, full_shapes: dict[str, tuple[int, ...]],
                       device: torch.device, seed: int = 0, std: float = 0.02) -> None:
    """`engine.weights.init_dummy_weights` of the full model, sliced to this rank's shard."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = next(iter(placer.params.values())).dtype
    for name, shape in full_shapes.items():  # the unsharded model's order: the same draws
        if "norm" in name:
            placer.params[name].data.fill_(1.0)
            continue
        full = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
        placer.place(name, Placement(name, 0, None, (name,)), full)

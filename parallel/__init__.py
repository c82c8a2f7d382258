"""Tensor parallelism for the engine's model, applied by rewriting modules after construction.

`apply_tensor_parallel(model, rank, world_size, group)` shards a loaded CausalLM in place;
`shard_config` gives the per-rank shapes a KV cache is built from; `parallel.runner` drives a
sharded replica (rank 0 runs the engine, the other ranks follow its steps).
"""
from __future__ import annotations

from parallel.comm import TPGroup, init_tensor_parallel
from parallel.tensor_parallel import (
    TensorParallelCausalLM,
    apply_tensor_parallel,
    check_shardable,
    kv_head_range,
    load_tensor_parallel_model,
    shard_config,
)

__all__ = [
    "TPGroup",
    "TensorParallelCausalLM",
    "apply_tensor_parallel",
    "check_shardable",
    "init_tensor_parallel",
    "kv_head_range",
    "load_tensor_parallel_model",
    "shard_config",
]

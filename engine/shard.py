"""How an Engine gets its model, the shape of its KV cache and its model runner: `ModelShard`.

An Engine holds one process's part of a model replica. `WholeModel` (the default) is all of it
in this process. Another package may split a replica over processes (tensor parallelism:
`parallel.runner.TensorParallelShard`) by implementing `ModelShard`; the engine itself never
knows how the replica is split, and never imports that package.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.model import CausalLM, LayerHook
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.weights import load_model

logger = logging.getLogger(__name__)

# A follower's hook for each step it runs: the step's extras (bytes rank 0 attached) in, the
# after-layer hook for that step out (None: none).
OnFollowerStep = Callable[[bytes], LayerHook | None]


class ModelShard(ABC):
    """This process's part of one model replica, as `Engine.__init__` uses it.

    Call order (all on the thread that builds the engine, once each): `load`, then
    `agree_block_counts` (every process of the replica calls it at the same point), then
    `make_runner`. Afterwards, the engine that got a runner schedules and calls `runner.execute`
    / `runner.launch` from its step loop and `runner.stop()` from `Engine.close()`; an engine
    that got None is a follower and spends its life in `follow()` until the scheduling process
    closes. Failures: ValueError naming the field for a model or config this shard cannot take
    (raised before any weights load where possible); errors of the processes' links propagate.

    runs_alone: no other process runs this engine's steps; then the engine may capture decode
      CUDA graphs, overlap its steps and run warm-up steps. A shard that splits the replica
      over processes sets it False: every step there must be mirrored on the other processes.
    """

    runs_alone: bool = True

    @abstractmethod
    def load(self, path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
             load_format: str) -> tuple[CausalLM, ModelConfig]:
        """The model (or this process's part of it) and the config its KV cache is shaped by."""

    def agree_block_counts(self, num_blocks: int, num_host_blocks: int, device: torch.device) -> tuple[int, int]:
        """The device and host KV block counts every process of the replica can hold."""
        return num_blocks, num_host_blocks

    @abstractmethod
    def make_runner(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler, eos_token_ids: frozenset[int],
                    device: torch.device) -> ModelRunner | None:
        """The runner of this engine's steps; None when this process follows another's steps."""

    def follow(self, model: CausalLM, kv_cache: KVCache, device: torch.device,
               on_step: OnFollowerStep | None = None) -> int:
        """A follower: run the scheduling process's steps on this part of the model until it
        closes; returns the steps run. RuntimeError where this process schedules itself."""
        raise RuntimeError("follow: only tensor-parallel ranks other than 0 follow; this engine runs step()")

    def describe(self) -> str:
        """What the engine's start-up log line adds (e.g. " (tensor parallel rank 1 of 2)")."""
        return ""


class WholeModel(ModelShard):
    """The whole model in this process (the default)."""

    def load(self, path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
             load_format: str) -> tuple[CausalLM, ModelConfig]:
        return load_model(path, config, dtype, device, load_format), config

    def make_runner(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler, eos_token_ids: frozenset[int],
                    device: torch.device) -> ModelRunner:
        return ModelRunner(model, kv_cache, sampler, eos_token_ids, device)

    def __str__(self) -> str:
        return "this engine"

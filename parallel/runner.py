"""Driving a tensor-parallel model replica: rank 0 schedules, every rank runs the same step.

Every rank builds `engine.Engine(config, TensorParallelShard(tp))` (`shard_for(tp)`), the
engine's `ModelShard` for a rank. Rank 0's engine runs as usual (scheduler, radix cache,
sampler) with a `TPModelRunner`, which broadcasts each step's inputs (token ids, positions, the
AttentionMetadata tensors, the rows to sample, swap orders) before running its own shard. The
other ranks sit in `follower_loop` (`Engine.follow()`): receive a step, run the
same forward on their shard and their KV cache, take part in the logits gather, repeat. Block
ids are rank 0's; every rank's cache has the same number of blocks, each holding only that
rank's KV heads.

Step extras: a service that must act on every rank at a layer point (a prefill worker pushing
each rank's KV heads as soon as a layer is computed) sets `TPModelRunner.step_extras`; the bytes
it returns for a step travel inside that step's broadcast, and a follower's `on_step(extras)`
(see `follower_loop`) turns them into the after-layer hook it runs that step with. Riding in
the same broadcast keeps them in lockstep with the step itself, with no second channel to order.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.model import CausalLM, LayerHook
from engine.model_runner import BatchInputs, ModelRunner, SchedulerOutput, WhileRunning
from engine.outputs import StepPlan
from engine.sampler import Sampler, SamplerOutput
from engine.shard import ModelShard, OnFollowerStep, WholeModel
from parallel.comm import TPGroup
from parallel.tensor_parallel import load_tensor_parallel_model, shard_config

logger = logging.getLogger(__name__)

_STOP, _STEP = 0, 1
# kind, tokens, seqs, block-table width, sampled rows, is_decode, swaps out, swaps in, swap words, extra bytes,
# leading one-token sequences (AttentionMetadata.num_decode_seqs)
_HEADER = 11
Swaps = list[tuple[list[int], list[int]]]
# Rank 0: the extras of a step (b"" for none). Followers: the after-layer hook for a step's
# extras (engine.shard.OnFollowerStep).
StepExtras = Callable[[StepPlan], bytes]


@dataclass
class Step:
    """One engine step as every rank runs it; no tokens means only the swaps."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor
    swap_out: Swaps = field(default_factory=list)
    swap_in: Swaps = field(default_factory=list)
    extras: bytes = b""  # opaque to the runner: see the module docstring


def run_step(model: CausalLM, kv_cache: KVCache, step: Step, after_layer: LayerHook | None = None) -> torch.Tensor | None:
    """Apply the step's swaps, run the forward over the paged cache, and return the float32
    logits of the sampled rows (None when nothing is sampled). Every rank of a group calls it
    with the same step."""
    for dev_blocks, host_blocks in step.swap_out:
        kv_cache.swap_out(dev_blocks, host_blocks)
    for host_blocks, dev_blocks in step.swap_in:
        kv_cache.swap_in(host_blocks, dev_blocks)
    if step.input_ids.numel() == 0:
        return None
    hidden = model(step.input_ids, step.positions, kv_cache.layers, step.meta, after_layer)
    if step.sample_rows.numel() == 0:
        return None
    return model.logits(hidden[step.sample_rows])


def prefill_step(prompts: list[list[int]], block_tables: list[list[int]], block_size: int, device: torch.device,
                 all_rows: bool = False) -> Step:
    """A packed prefill of whole prompts into the given blocks (a small driver for tests and
    benchmarks; the engine builds the same metadata in ModelRunner.prepare). Samples each
    prompt's last row, or every row with `all_rows`."""
    if len(prompts) != len(block_tables):
        raise ValueError(f"block_tables: {len(block_tables)} tables for {len(prompts)} prompts")
    ids, pos, slots, qsl, rows = [], [], [], [0], []
    for prompt, table in zip(prompts, block_tables):
        if len(table) * block_size < len(prompt):
            raise ValueError(f"block_tables: {len(table)} blocks cannot hold a prompt of {len(prompt)} tokens")
        ids += prompt
        pos += range(len(prompt))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(len(prompt))]
        rows += range(qsl[-1], qsl[-1] + len(prompt)) if all_rows else [qsl[-1] + len(prompt) - 1]
        qsl.append(qsl[-1] + len(prompt))
    width = max(len(t) for t in block_tables)

    def t(x: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=t(slots), block_tables=t([tb + [0] * (width - len(tb)) for tb in block_tables], torch.int32),
        query_start_loc=t(qsl, torch.int32), seq_lens=t([len(p) for p in prompts], torch.int32), is_decode=False,
    )
    return Step(t(ids), t(pos), meta, t(rows))


def _swap_words(swaps: Swaps) -> list[int]:
    words: list[int] = []
    for src, dst in swaps:
        words += [len(src), *src, *dst]
    return words


def _parse_swaps(words: list[int], count: int) -> tuple[Swaps, list[int]]:
    swaps, i = [], 0
    for _ in range(count):
        n = words[i]
        swaps.append((words[i + 1:i + 1 + n], words[i + 1 + n:i + 1 + 2 * n]))
        i += 1 + 2 * n
    return swaps, words[i:]


def _bytes_to_words(data: bytes) -> torch.Tensor:
    padded = data + b"\0" * (-len(data) % 8)
    return torch.from_numpy(np.frombuffer(padded, dtype=np.int64).copy())


def send_step(tp: TPGroup, step: Step | None, device: torch.device) -> None:
    """Rank 0: broadcast `step` (None: tell the followers to stop) as two int64 tensors."""
    if tp.world_size == 1:
        return
    if step is None:
        tp.broadcast(torch.tensor([_STOP] + [0] * (_HEADER - 1), dtype=torch.int64, device=device))
        return
    m = step.meta
    t, (b, w), s = step.input_ids.numel(), tuple(m.block_tables.shape), step.sample_rows.numel()
    swaps = _swap_words(step.swap_out) + _swap_words(step.swap_in)
    header = [_STEP, t, b, w, s, int(m.is_decode), len(step.swap_out), len(step.swap_in), len(swaps),
              len(step.extras), m.num_decode_seqs]
    tp.broadcast(torch.tensor(header, dtype=torch.int64, device=device))
    parts = [step.input_ids, step.positions, m.slot_mapping, m.block_tables.reshape(-1), m.query_start_loc,
             m.seq_lens, step.sample_rows, torch.tensor(swaps, dtype=torch.int64)]
    if step.extras:
        parts.append(_bytes_to_words(step.extras))
    tp.broadcast(torch.cat([p.to(device=device, dtype=torch.int64) for p in parts]))


def recv_step(tp: TPGroup, device: torch.device, kv_cache: KVCache) -> Step | None:
    """A follower: the next step from rank 0, or None when rank 0 stopped."""
    header = tp.await_broadcast(torch.empty(_HEADER, dtype=torch.int64, device=device)).tolist()
    kind, t, b, w, s, is_decode, n_out, n_in, n_words, n_extra, n_decode = header
    if kind == _STOP:
        return None
    extra_words = -(-n_extra // 8)
    body = tp.broadcast(torch.empty(3 * t + b * w + (b + 1) + b + s + n_words + extra_words, dtype=torch.int64,
                                    device=device))
    ids, pos, slots, tables, qsl, lens, rows, rest, extra = torch.split(
        body, [t, t, t, b * w, b + 1, b, s, n_words, extra_words])
    swap_out, words = _parse_swaps(rest.tolist(), n_out)
    swap_in, _ = _parse_swaps(words, n_in)
    extras = extra.cpu().numpy().tobytes()[:n_extra] if n_extra else b""
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=tables.view(b, w).to(torch.int32), query_start_loc=qsl.to(torch.int32),
        seq_lens=lens.to(torch.int32), is_decode=bool(is_decode), k_scale=kv_cache.k_scale, v_scale=kv_cache.v_scale,
        num_decode_seqs=n_decode, tail_query_start_loc=(qsl[n_decode:] - n_decode).to(torch.int32) if n_decode else None,
    )
    return Step(ids, pos, meta, rows, swap_out, swap_in, extras)


def _empty_step(device: torch.device, kv_cache: KVCache) -> Step:
    none = torch.empty(0, dtype=torch.int64, device=device)
    meta = AttentionMetadata(none, torch.empty((0, 0), dtype=torch.int32, device=device), none.to(torch.int32),
                             none.to(torch.int32), False, kv_cache.k_scale, kv_cache.v_scale)
    return Step(none, none, meta, none)


class TPModelRunner(ModelRunner):
    """Rank 0's ModelRunner: broadcasts each step to the other ranks, then runs its own shard.

    Decode CUDA graphs are not captured (every rank would have to replay its graph in step).
    `step_extras` (None: none), when set, is called with each step's StepPlan before the step is
    broadcast; its bytes reach the followers' `on_step` (see the module docstring).
    """

    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler, eos_token_ids: frozenset[int],
                 device: torch.device, tp: TPGroup) -> None:
        super().__init__(model, kv_cache, sampler, eos_token_ids, device)
        self.tp = tp
        self.stopped = False
        self.step_extras: StepExtras | None = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, after_layer: LayerHook | None = None,
                before_forward: Callable[[], None] | None = None,
                while_running: WhileRunning | None = None) -> tuple[list[int], SamplerOutput | None]:
        """As `ModelRunner.execute`; the samples are in once sampling returns, so `while_running`
        is told so at once."""
        if self.stopped:
            raise RuntimeError("tensor-parallel runner was stopped")
        batch: BatchInputs | None = self.prepare(out) if out.scheduled else None
        if before_forward is not None:
            before_forward()
        if batch is None:
            step = _empty_step(self.device, self.kv_cache)
        else:
            step = Step(batch.input_ids, batch.positions, batch.meta, batch.sample_rows)
        step.swap_out, step.swap_in = list(out.swap_out), list(out.swap_in)
        if self.step_extras is not None and batch is not None:
            step.extras = self.step_extras(StepPlan(out))
        send_step(self.tp, step, self.device)
        logits = run_step(self.model, self.kv_cache, step, after_layer)
        if batch is None or logits is None:
            return [], None
        samples = self.sample(out, batch.sample_index, logits[: len(batch.sample_index)])  # less the padding rows
        if while_running is not None:
            while_running(lambda: True)
        return batch.sample_index, samples

    def stop(self) -> None:
        """Release the followers from `follower_loop` (idempotent)."""
        if not self.stopped:
            self.stopped = True
            send_step(self.tp, None, self.device)


def follower_loop(model: CausalLM, kv_cache: KVCache, tp: TPGroup, device: torch.device,
                  on_step: OnFollowerStep | None = None) -> int:
    """Run rank 0's steps on this rank's shard until rank 0 stops; returns the steps run.

    on_step: called with each step's extras (b"" when rank 0 sent none) before its forward; the
      hook it returns runs after each layer of that step, at the same points as rank 0's
      `after_layer` (`Engine.follow(on_step)` passes it through).
    """
    steps = 0
    with torch.inference_mode():
        while (step := recv_step(tp, device, kv_cache)) is not None:
            after_layer = on_step(step.extras) if on_step is not None else None
            run_step(model, kv_cache, step, after_layer)
            steps += 1
    logger.info("tensor parallel rank %d: stopped after %d steps", tp.rank, steps)
    return steps


class TensorParallelShard(ModelShard):
    """One rank of a tensor-parallel group as an Engine's `ModelShard`: the rank loads only its
    shard of the model, its KV cache holds only its KV heads, and the block counts are the
    minimum over the ranks (block ids are rank 0's). Rank 0 gets a `TPModelRunner`; the other
    ranks get none and run rank 0's steps in `Engine.follow()`. Every rank builds its Engine
    from the same config at the same time (the block counts are agreed in a collective)."""

    runs_alone = False

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp

    def load(self, path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
             load_format: str) -> tuple[CausalLM, ModelConfig]:
        kv_config = shard_config(config, self.tp.world_size)  # ValueError before any loading
        return load_tensor_parallel_model(path, config, dtype, device, self.tp, load_format), kv_config

    def agree_block_counts(self, num_blocks: int, num_host_blocks: int, device: torch.device) -> tuple[int, int]:
        num_blocks, num_host_blocks = self.tp.min_ints([num_blocks, num_host_blocks], device)
        return num_blocks, num_host_blocks

    def make_runner(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler, eos_token_ids: frozenset[int],
                    device: torch.device) -> TPModelRunner | None:
        if self.tp.rank != 0:
            return None
        return TPModelRunner(model, kv_cache, sampler, eos_token_ids, device, self.tp)

    def follow(self, model: CausalLM, kv_cache: KVCache, device: torch.device,
               on_step: OnFollowerStep | None = None) -> int:
        if self.tp.rank == 0:
            return super().follow(model, kv_cache, device, on_step)
        return follower_loop(model, kv_cache, self.tp, device, on_step)

    def describe(self) -> str:
        return f" (tensor parallel rank {self.tp.rank} of {self.tp.world_size})"

    def __str__(self) -> str:
        return f"tensor-parallel rank {self.tp.rank}"


def shard_for(tp: TPGroup | None) -> ModelShard:
    """The Engine's ModelShard for this process's rank of `tp`; a group of one (or None) is the
    whole model."""
    return TensorParallelShard(tp) if tp is not None and tp.world_size > 1 else WholeModel()

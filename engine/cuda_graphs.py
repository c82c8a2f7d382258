"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed with fresh inputs.

An eager decode step of a large model is bound by host launch overhead on the H200; a graph
replays every kernel of the step with one launch. Inputs live in static buffers; a batch of n
sequences runs the smallest captured bucket >= n, its padding rows writing to no cache slot.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model import CausalLM

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                   640, 768, 896, 1024)
# Decode graphs are captured up to this batch size. The derived max_running stops at 512
# (engine.memory.MAX_RUNNING_CEILING_CUDA); a larger explicit one (an FP8 KV pool holds twice the
# sequences) runs its decode steps from graphs up to here, eagerly beyond.
MAX_GRAPH_BATCH = DEFAULT_BUCKETS[-1]


def smallest_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest of the sorted `buckets` that holds `n`, or None."""
    for b in buckets:
        if b >= n:
            return b
    return None


def capture_graph(forward: Callable[[], torch.Tensor], pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`forward` run twice (Triton compiles and autotunes outside the capture), then captured
    into a graph drawing on `pool` (None: a new one); returns the graph and its output."""
    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_cache: KVCache, max_batch: int, max_model_len: int,
                 buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        self.model, self.kv_cache = model, kv_cache
        dev = kv_cache.layers[0][0].device
        self.buckets = sorted({b for b in buckets if b <= max_batch} | {max_batch})
        self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_model_len // kv_cache.block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((n, self.max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs], is_decode=True,
            k_scale=self.kv_cache.k_scale, v_scale=self.kv_cache.v_scale,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller ones reuse its memory pool."""
        layers = self.kv_cache.layers
        for bs in reversed(self.buckets):
            meta = self._meta(bs)
            graph, self.outputs[bs] = capture_graph(
                lambda: self.model(self.input_ids[:bs], self.positions[:bs], layers, meta), self.pool)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s", self.buckets)

    def bucket(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Replay the graph for this batch; None when it does not fit (caller runs eagerly)."""
        n = input_ids.shape[0]
        bs = self.bucket(n)
        width = meta.block_tables.shape[1]
        if bs is None or bs not in self.graphs or width > self.max_blocks:
            return None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

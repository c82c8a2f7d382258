"""CUDA graphs for prefill steps: one captured forward per token-count bucket, replayed with fresh inputs.

A prompt's forward queues ~12 kernels a layer (four GEMMs, two norms, rotary + KV store, extend
attention, SiLU-and-multiply, ...), each behind a Python call and a launch. For a prompt of up
to a few thousand tokens the GPU runs them faster than the host can queue them: on the H200,
a 1,024-token prompt of the Llama-3.1-8B shape keeps the GPU busy 21 ms of a 26–47 ms step,
depending on the host (BENCHMARKS §20). A graph queues the whole forward in one launch, so the
step takes its GPU time wherever it runs. (vLLM and SGLang capture prefill the same way, as
"piecewise" graphs around their attention; ours need no split: extend attention finds each
tile's sequence on the device and takes its sizes from device tensors.)

A step runs the smallest bucket of at least its token count, if it is a pure prefill step
(no one-token rows: those go through the decode kernel), has at most `max_seqs` sequences and
its block tables fit. Padding is inert: pad rows are stored at no cache slot (slot -1), belong
to no sequence (the extra sequences are empty: their query_start_loc repeat the real token
count and their lengths are 0, so extend attention's tiles over them exit at once), and every
other op is row-wise (GEMMs, norms, rotary, SiLU-and-multiply, per-token FP8 scales), so real
rows compute exactly what they compute unpadded, up to the GEMMs' choice of kernel for the
padded M.
"""
from __future__ import annotations

import logging

import torch

from engine.attention import AttentionMetadata
from engine.cuda_graphs import capture_graph, smallest_bucket
from engine.kv_cache import KVCache
from engine.model import CausalLM

logger = logging.getLogger(__name__)

# Token-count buckets: fine steps where a prompt's padding would cost the most GPU time.
DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048,
                   2560, 3072, 3584, 4096)
MAX_SEQS = 32  # sequences a captured step holds (a step with more runs eagerly)


def graph_token_limit(requested: int, max_batched_tokens: int) -> int:
    """The largest prefill graph an engine captures: what it was asked for, but no larger than a
    step can be (max_batched_tokens)."""
    return min(requested, max_batched_tokens)


def buckets_up_to(max_tokens: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> list[int]:
    """The buckets captured for steps of at most `max_tokens` tokens (empty for 0)."""
    if max_tokens <= 0:
        return []
    return sorted({b for b in buckets if b < max_tokens} | {max_tokens})


class PrefillGraphs:
    def __init__(self, model: CausalLM, kv_cache: KVCache, max_tokens: int, max_model_len: int,
                 max_seqs: int = MAX_SEQS, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> None:
        if max_tokens < 1:
            raise ValueError(f"prefill_graph_tokens: must be >= 1 to capture prefill graphs, got {max_tokens}")
        self.model, self.kv_cache = model, kv_cache
        dev = kv_cache.layers[0][0].device
        self.buckets = buckets_up_to(max_tokens, buckets)
        self.max_tokens, self.max_seqs = self.buckets[-1], max_seqs
        self.max_blocks = -(-max_model_len // kv_cache.block_size)
        n, s = self.max_tokens, max_seqs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((s, self.max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(s, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(s + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0  # steps run from a graph

    def _meta(self, tokens: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], block_tables=self.block_tables,
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, is_decode=False,
            k_scale=self.kv_cache.k_scale, v_scale=self.kv_cache.v_scale,
        )

    def bucket(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def fits(self, num_tokens: int, meta: AttentionMetadata) -> int | None:
        """The bucket a step of `num_tokens` packed rows with `meta` replays, or None (eager)."""
        if meta.is_decode or meta.num_decode_seqs or meta.block_tables.shape[1] > self.max_blocks:
            return None
        if meta.query_start_loc.shape[0] - 1 > self.max_seqs:
            return None
        return self.bucket(num_tokens)

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Copy a step into the static buffers, padded to `bucket` tokens and `max_seqs`
        sequences; returns the (input_ids, positions, meta) the bucket's graph was captured on."""
        n = input_ids.shape[0]
        b = meta.query_start_loc.shape[0] - 1
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bucket].fill_(-1)
        self.query_start_loc[: b + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.query_start_loc[b + 1 :].fill_(n)
        self.seq_lens[:b].copy_(meta.seq_lens[:b], non_blocking=True)
        self.seq_lens[b:].fill_(0)
        self.block_tables[:b, :width].copy_(meta.block_tables[:b], non_blocking=True)
        return self.input_ids[:bucket], self.positions[:bucket], self._meta(bucket)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller ones reuse its memory pool. The
        captures run on one empty sequence that owns every row, stored nowhere."""
        layers = self.kv_cache.layers
        for tokens in reversed(self.buckets):
            self.slot_mapping.fill_(-1)
            self.query_start_loc.fill_(tokens)
            self.query_start_loc[0] = 0
            self.seq_lens.fill_(0)
            self.seq_lens[0] = tokens
            ids, pos, meta = self.input_ids[:tokens], self.positions[:tokens], self._meta(tokens)
            graph, self.outputs[tokens] = capture_graph(lambda: self.model(ids, pos, layers, meta), self.pool)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[tokens] = graph
        torch.cuda.synchronize()
        logger.info("captured prefill graphs for %s tokens", self.buckets)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Replay the graph for this step; None when it does not fit one (the caller runs it eagerly)."""
        n = input_ids.shape[0]
        bucket = self.fits(n, meta)
        if bucket is None or bucket not in self.graphs:
            return None
        self.stage(input_ids, positions, meta, bucket)
        self.graphs[bucket].replay()
        self.replays += 1
        return self.outputs[bucket][:n]

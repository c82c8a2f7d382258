"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed with fresh inputs.

An eager decode step of a large model is bound by host launch overhead on the H200; a graph
replays every kernel of the step with one launch. Inputs live in static buffers; a batch of n
sequences runs the smallest kept bucket >= n, its padding rows writing to no cache slot.

Which buckets are kept is measured: cuBLAS's GEMMs run far slower at some row counts than at a
larger one (bf16, a layer's four GEMMs on the H200: 712 TFLOP/s at 384 rows, 486 at 448, 760
at 512; BENCHMARKS.md §17), and a padding row costs a decode step little besides its GEMM rows
(its attention reads one token). So after capture every bucket is replayed and timed, with the
buckets above the batch cap up to the next power of two as candidates (`spare_buckets`), and a
bucket that is not faster than some larger one is dropped (`fastest_buckets`): its batches run
the larger graph. TANDEM_TIMED_BUCKETS=0 keeps every bucket up to the cap, untimed.

With TANDEM_NANO_BATCH=1 a bucket of at least engine.nano_batch.MIN_ROWS rows captures its step as
two halves on two streams, one half's attention beside the other's GEMMs (engine/nano_batch.py).
With TANDEM_NANO_BATCH=auto such a bucket captures both steps and, once the buckets are kept as
above (on the plain steps), times them with every row at a full context (the overlap hides
attention, which padding rows barely have) and keeps the faster.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.nano_batch import MIN_ROWS as NANO_MIN_ROWS
from engine.nano_batch import TIMING_CONTEXT as NANO_TIMING_CONTEXT
from engine.nano_batch import Streams, nano_batch_mode, overlapped_forward, overlapped_wins

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
                   640, 768, 896, 1024)
# Decode graphs are captured up to this batch size. The derived max_running stops at 512
# (engine.memory.MAX_RUNNING_CEILING_CUDA); a larger explicit one (an FP8 KV pool holds twice the
# sequences) runs its decode steps from graphs up to here, eagerly beyond.
MAX_GRAPH_BATCH = DEFAULT_BUCKETS[-1]
TIMED_BUCKETS_ENV = "TANDEM_TIMED_BUCKETS"  # "0": no timing, no spare buckets
BUCKET_MARGIN = 0.02  # a bucket is dropped only if a larger one replays this much faster
# A max_running the engine derived is lowered to a bucket that decodes more rows a ms, no lower
# than this share of it (`throughput_cap`): fewer sequences at once only where it pays per token.
THROUGHPUT_CAP_FLOOR = 0.75
TIMING_ROUNDS, TIMING_REPLAYS = 3, 5  # each bucket's time: the best round's mean of its replays


def timed_buckets_enabled() -> bool:
    value = os.environ.get(TIMED_BUCKETS_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{TIMED_BUCKETS_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def spare_buckets(max_batch: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> list[int]:
    """The buckets above `max_batch` captured as candidates for its largest batches: those up to
    the next power of two (and MAX_GRAPH_BATCH)."""
    limit = min(1 << max(0, max_batch - 1).bit_length(), MAX_GRAPH_BATCH)
    return [b for b in buckets if max_batch < b <= limit]


def fastest_buckets(times: dict[int, float], max_batch: int, margin: float = BUCKET_MARGIN) -> list[int]:
    """The buckets worth replaying, from each captured bucket's replay time: a bucket is dropped
    if a larger one is faster by `margin` (a difference within it is taken for noise, and the
    smaller bucket stays), so the smallest kept bucket holding a batch is the fastest that holds
    it, to the margin. Kept buckets above the one that holds `max_batch` (the largest batch) are
    dropped. `times` must hold a bucket >= max_batch."""
    kept, best_above = [], math.inf
    for bucket in sorted(times, reverse=True):
        if best_above >= times[bucket] * (1 - margin):
            kept.append(bucket)
        best_above = min(best_above, times[bucket])
    kept.sort()
    top = smallest_bucket(kept, max_batch)
    if top is None:
        raise ValueError(f"no timed bucket holds the largest batch {max_batch}: {sorted(times)}")
    return [b for b in kept if b <= top]


def throughput_cap(times: dict[int, float], buckets: list[int], max_batch: int,
                   floor: float = THROUGHPUT_CAP_FLOOR, margin: float = BUCKET_MARGIN) -> int:
    """The cap on running sequences that decodes the most rows a ms of what a step costs besides
    attention: the kept bucket in [floor x max_batch, max_batch) with the most rows a ms of its
    replay (every row a padding row, so the GEMMs and the step's fixed costs), if it beats
    max_batch rows in the bucket that holds them by more than `margin`; else max_batch.

    At a full batch a token's attention costs the same whatever the batch, so a step's tokens a
    ms are highest where the rest is: cuBLAS runs some row counts far slower than a slightly
    smaller one (§26-27: bf16 GEMMs at 419 rows, in the 419-row graph, against 384)."""
    top = smallest_bucket(buckets, max_batch)
    if top is None or top not in times:
        return max_batch
    rate = {b: b / times[b] for b in buckets if floor * max_batch <= b < max_batch and b in times}
    best = max(rate, key=rate.__getitem__, default=None)
    if best is not None and rate[best] > max_batch / times[top] * (1 + margin):
        return best
    return max_batch


def smallest_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest of the sorted `buckets` that holds `n`, or None."""
    for b in buckets:
        if b >= n:
            return b
    return None


def time_each(runs: dict[Any, Callable[[], Any]]) -> dict[Any, float]:
    """The ms each of `runs` takes on the current CUDA stream: TIMING_ROUNDS rounds over all of
    them, in turn forwards and backwards (so that a clock change, or another process's work on a
    shared GPU, falls on no one of them alone), in each the mean of TIMING_REPLAYS calls after
    one unmeasured; the best round counts."""
    best: dict[int, float] = {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    order = list(runs.items())
    for round_ in range(TIMING_ROUNDS):
        for key, run in (order if round_ % 2 == 0 else order[::-1]):
            run()
            start.record()
            for _ in range(TIMING_REPLAYS):
                run()
            end.record()
            end.synchronize()
            best[key] = min(best.get(key, math.inf), start.elapsed_time(end) / TIMING_REPLAYS)
    return best


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
        self.timed = timed_buckets_enabled()
        self.max_running = max_batch
        spares = spare_buckets(max_batch, buckets) if self.timed else []
        self.buckets = sorted({b for b in buckets if b <= max_batch} | {max_batch} | set(spares))
        self.max_batch = self.buckets[-1]  # the static buffers' rows
        self.replay_ms: dict[int, float] = {}  # each captured bucket's replay time, when timed
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
        # Overlapped halves (TANDEM_NANO_BATCH): its mode, the streams shared by the buckets that
        # split, the buckets whose kept graph is overlapped, and (auto) each candidate's graph
        # and output until they are timed against the plain ones.
        self.nano_mode = nano_batch_mode() if dev.type == "cuda" else "0"
        self.nano_streams = Streams(dev) if self.nano_mode != "0" else None
        self.nano_buckets: list[int] = []
        self.nano_candidates: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, bs: int, overlapped: bool = False) -> Callable[[], torch.Tensor]:
        """Bucket `bs`'s step over the static buffers: the model's forward, or its overlapped
        halves (engine/nano_batch.py)."""
        args = (self.input_ids[:bs], self.positions[:bs], self.kv_cache.layers, self._meta(bs))
        if overlapped:
            return lambda: overlapped_forward(self.model, *args, streams=self.nano_streams)
        return lambda: self.model(*args)

    def _splits(self, bs: int) -> bool:
        """Whether bucket `bs` may run as overlapped halves (TANDEM_NANO_BATCH, MIN_ROWS rows)."""
        return self.nano_streams is not None and bs >= NANO_MIN_ROWS

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs], is_decode=True,
            k_scale=self.kv_cache.k_scale, v_scale=self.kv_cache.v_scale,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller ones reuse its memory pool."""
        for bs in reversed(self.buckets):
            always = self.nano_mode == "1" and self._splits(bs)
            graph, self.outputs[bs] = capture_graph(self._forward(bs, overlapped=always), self.pool)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            if always:
                self.nano_buckets.append(bs)
            elif self.nano_mode == "auto" and self._splits(bs):
                self.nano_candidates[bs] = capture_graph(self._forward(bs, overlapped=True), self.pool)
        torch.cuda.synchronize()
        logger.info("captured decode graphs for batch sizes %s", self.buckets)
        if self.timed:  # on the plain graphs: the GEMMs' row counts, as without halves
            self.keep_fastest()
        for bs in [b for b in self.nano_candidates if b not in self.graphs]:  # a dropped bucket's
            del self.nano_candidates[bs]
        if self.nano_candidates:
            self.keep_faster_halves()

    def keep_faster_halves(self) -> None:
        """TANDEM_NANO_BATCH=auto: replay each candidate bucket's plain and overlapped graphs with
        every row at a full context (`full_context`) and keep the overlapped one where it is
        faster by more than BUCKET_MARGIN (`overlapped_wins`); the other graph is released."""
        with self.full_context(max(self.nano_candidates)):
            runs = {(bs, False): self.graphs[bs].replay for bs in self.nano_candidates}
            runs.update({(bs, True): graph.replay for bs, (graph, _) in self.nano_candidates.items()})
            times = time_each(runs)
        plain = {bs: t for (bs, over), t in times.items() if not over}
        overlapped = {bs: t for (bs, over), t in times.items() if over}
        self.nano_buckets = overlapped_wins(plain, overlapped, BUCKET_MARGIN)
        for bs in self.nano_buckets:
            self.graphs[bs], self.outputs[bs] = self.nano_candidates[bs]
        self.nano_candidates.clear()
        logger.info("decode graphs as overlapped halves for %s (ms a replay at a full context, plain / overlapped: %s)",
                    self.nano_buckets or "no bucket",
                    {bs: f"{plain[bs]:.3f} / {overlapped[bs]:.3f}" for bs in sorted(plain)})

    @contextlib.contextmanager
    def full_context(self, rows: int):
        """The static buffers' first `rows` rows at a context of NANO_TIMING_CONTEXT tokens (at
        most what the block tables hold) on distinct blocks, as far as the pool has them, and
        storing nothing (slot -1); back to padding rows (context 1, block 0) after."""
        bsz = self.kv_cache.block_size
        per_row = max(1, min(NANO_TIMING_CONTEXT // bsz, self.max_blocks))
        ids = torch.arange(rows * per_row, device=self.block_tables.device) % self.kv_cache.num_blocks
        self.block_tables[:rows, :per_row].copy_(ids.view(rows, per_row))
        self.seq_lens[:rows].fill_(per_row * bsz)
        self.slot_mapping.fill_(-1)
        try:
            yield
        finally:
            self.block_tables.zero_()
            self.seq_lens.fill_(1)

    def time_replays(self) -> dict[int, float]:
        """Each captured bucket's replay time in ms (`time_each`), on the static inputs as capture
        left them: every row a padding row, so attention reads one token a row and the times
        differ by what the bucket's row count costs the rest of the step."""
        return time_each({bs: self.graphs[bs].replay for bs in self.buckets})

    def keep_fastest(self) -> None:
        """Time every captured bucket and keep only `fastest_buckets` (the others' graphs are
        released; their batches replay a larger graph)."""
        self.replay_ms = self.time_replays()
        kept = fastest_buckets(self.replay_ms, self.max_running)
        dropped = [b for b in self.buckets if b not in kept]
        for bs in dropped:
            del self.graphs[bs], self.outputs[bs]
        self.buckets = kept
        if dropped:
            logger.info("decode graphs kept %s; dropped %s, each slower than a larger one (ms a replay: %s)",
                        kept, dropped, {b: round(t, 3) for b, t in sorted(self.replay_ms.items())})

    def throughput_cap(self) -> int:
        """`throughput_cap` of the timed buckets (max_running itself when they were not timed)."""
        if not self.replay_ms:
            return self.max_running
        return throughput_cap(self.replay_ms, self.buckets, self.max_running)

    def bucket(self, n: int) -> int | None:
        return smallest_bucket(self.buckets, n)

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int | None:
        """Queue the copies of this batch into the graphs' inputs and return the bucket whose
        graph `replay` then runs; None when it does not fit (caller runs eagerly). The copies
        follow, in stream order, whatever replay was queued before them, so a step may be staged
        while the step before still runs and replayed later (Engine.step's hold)."""
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
        return bs

    def replay(self, bs: int, n: int) -> torch.Tensor:
        """Replay bucket `bs`'s graph on the inputs `stage` queued; the hidden states of its first
        `n` rows."""
        self.graphs[bs].replay()
        return self.outputs[bs][:n]

"""Turns a SchedulerOutput into tensors, runs the model over the paged cache and samples.

The runner owns the device state (model, KV cache, sampler); it knows nothing of queues. It is
the contract a `ModelShard` (engine/shard.py) builds runners against: `SchedulerOutput` is
re-exported here for runners defined outside the engine.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.device_idle import DeviceIdleClock
from engine.cuda_graphs import (DEFAULT_BUCKETS, DecodeGraphs, fastest_buckets, smallest_bucket, spare_buckets,
                                timed_buckets_enabled)
from engine.kv_cache import KVCache
from engine.model import CausalLM, LayerHook
from engine.sampler import PendingSamples, Sampler, SamplerOutput, SamplingRow
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.uploads import to_device

logger = logging.getLogger(__name__)

# Row counts of the LM head past the decode graphs' largest batch are multiples of this
# (ModelRunner.bucket_logits).
LOGITS_BUCKET_STEP = 256

# Engine.step's `while_running`, bound to the step: called with a probe that says whether the
# step's samples are on the host yet.
WhileRunning = Callable[[Callable[[], bool]], None]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    # Packed row index of each sampling sequence's last token, in sample_index's order; padded
    # to a bucket (ModelRunner.bucket_logits) by repeating the last, so the logits of
    # len(sample_index) rows are the first rows of the LM head's output.
    sample_rows: torch.Tensor
    sample_index: list[int]  # index into scheduled of each sampled row


__all__ = ["BatchInputs", "ModelRunner", "SchedulerOutput", "WhileRunning"]


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv_cache: KVCache, sampler: Sampler, eos_token_ids: frozenset[int], device: torch.device
    ) -> None:
        self.model, self.kv_cache, self.sampler = model, kv_cache, sampler
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.block_size = kv_cache.block_size
        self.graphs = None  # engine.cuda_graphs.DecodeGraphs once captured
        # engine.device_idle.DeviceIdleClock while the device's waits for the host are measured
        # (Engine.measure_device_idle); None: nothing is recorded.
        self.idle_clock: DeviceIdleClock | None = None
        self.prefill_graphs = None  # engine.prefill_graphs.PrefillGraphs once captured
        self.logits_buckets: list[int] | None = None  # see bucket_logits
        self.logits_max_rows = 0  # the most rows a step samples, once bucket_logits has run

    def bucket_logits(self, max_rows: int) -> list[int]:
        """Run the LM head on a bucketed number of rows from now on (the decode graphs' batch
        sizes up to `max_rows`, then every LOGITS_BUCKET_STEP rows, and `max_rows`), padding the
        sampled rows by repeating the last.

        cuBLAS picks a kernel for each row count, and CUDA loads a kernel the first time it
        runs, waiting for the device to drain when it does (lazy loading): an LM head over a
        row count not seen before stalls the host until the step before has finished, so the
        next step is not prepared meanwhile. With buckets the row counts are few and warm-up
        (engine/warm_up.py) runs each, and where buckets are timed (TANDEM_TIMED_BUCKETS, as
        the decode graphs' are) it times them, the spare buckets above `max_rows` among them,
        and keeps the fastest (`keep_fastest_logits`). Returns the buckets."""
        past_graphs = range(DEFAULT_BUCKETS[-1] + LOGITS_BUCKET_STEP, max_rows, LOGITS_BUCKET_STEP)
        spares = spare_buckets(max_rows) if timed_buckets_enabled() else []
        self.logits_buckets = sorted({b for b in DEFAULT_BUCKETS if b <= max_rows} | set(past_graphs) | {max_rows}
                                     | set(spares))
        self.logits_max_rows = max_rows
        return self.logits_buckets

    def keep_fastest_logits(self, times: dict[int, float]) -> list[int]:
        """Keep the logits buckets `fastest_buckets` picks from each one's measured LM-head time
        (ms; engine/warm_up.py measures them). Returns the buckets kept."""
        self.logits_buckets = fastest_buckets(times, self.logits_max_rows)
        return self.logits_buckets

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        graphs = DecodeGraphs(self.model, self.kv_cache, max_batch, max_model_len)
        graphs.capture()
        self.graphs = graphs

    def capture_prefill_graphs(self, max_tokens: int, max_model_len: int) -> None:
        from engine.prefill_graphs import PrefillGraphs

        graphs = PrefillGraphs(self.model, self.kv_cache, max_tokens, max_model_len)
        graphs.capture()
        self.prefill_graphs = graphs

    def prepare(self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None) -> BatchInputs:
        """Pack the scheduled sequences' new tokens, positions, cache slots and block tables.

        A sequence whose input token is still pending (sampled by the step before, which may
        still run) reads it from `prev_tokens`, that step's device tensor of samples, at
        `seq.pending_row`; the copy is queued on the device after that step.
        Host cost matters here (it runs every step, for every sequence): block tables come from a
        per-sequence int32 copy that only grows, and the token lists are never joined."""
        bs = self.block_size
        scheduled = out.scheduled
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_index: list[int] = []
        max_blocks = max((len(s.seq.block_table) for s in scheduled), default=1)
        tables = np.zeros((len(scheduled), max(max_blocks, 1)), dtype=np.int32)
        from_prev: list[tuple[int, int]] = []  # (row of this batch, row of prev_tokens)
        # One-token sequences are packed first, so that attention can send them to the decode
        # kernel (AttentionMetadata.num_decode_seqs). sample_index holds each sampled row's index
        # into `scheduled`, in packed order.
        single = [i for i, s in enumerate(scheduled) if s.num_new_tokens == 1]
        if 0 < len(single) < len(scheduled):
            order = single + [i for i, s in enumerate(scheduled) if s.num_new_tokens != 1]
        else:
            order = range(len(scheduled))
        for row, i in enumerate(order):
            s = scheduled[i]
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            table = seq.block_table
            if s.num_new_tokens == 1:
                if start >= seq.num_known_tokens:
                    if prev_tokens is None or seq.num_pending != 1:
                        raise RuntimeError(f"prepare: {seq.request_id}'s input token is pending without its step")
                    from_prev.append((len(ids), seq.pending_row))
                    ids.append(0)
                else:
                    ids.append(seq.token_at(start))
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                if end > seq.num_known_tokens:
                    raise RuntimeError(f"prepare: {seq.request_id} has pending tokens inside a multi-token chunk")
                ids.extend(seq.token_slice(start, end))
                pos.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + s.num_new_tokens)
            seq_lens.append(end)
            tables[row, : len(table)] = _table_row(seq)
            if s.samples:
                sample_rows.append(qsl[-1] - 1)
                sample_index.append(i)
        if sample_rows and self.logits_buckets is not None:
            padded = smallest_bucket(self.logits_buckets, len(sample_rows)) or len(sample_rows)
            sample_rows += [sample_rows[-1]] * (padded - len(sample_rows))
        rows, src = (list(x) for x in zip(*from_prev)) if from_prev else ([], [])
        is_decode = len(ids) == len(scheduled)
        num_decode = 0 if is_decode else len(single)
        tail_qsl = [q - num_decode for q in qsl[num_decode:]] if num_decode else []
        input_ids, pos_t, slots_t, qsl_t, lens_t, sample_t, rows_t, src_t, tail_t = self._upload(
            [ids, pos, slots, qsl, seq_lens, sample_rows, rows, src, tail_qsl])
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            block_tables=self._upload_table(tables),
            query_start_loc=qsl_t.to(torch.int32),
            seq_lens=lens_t.to(torch.int32),
            is_decode=is_decode,
            k_scale=self.kv_cache.k_scale,
            v_scale=self.kv_cache.v_scale,
            num_decode_seqs=num_decode,
            tail_query_start_loc=tail_t.to(torch.int32) if num_decode else None,
        )
        if from_prev:
            input_ids[rows_t] = prev_tokens[src_t]
        return BatchInputs(input_ids, pos_t, meta, sample_t, sample_index)

    def _upload(self, lists: list[list[int]]) -> list[torch.Tensor]:
        """int64 device tensors of `lists`, through one pinned buffer and one asynchronous copy
        (a copy from pageable memory may wait for the device to finish its queued work, which
        would undo the overlap of this step's preparation with the step before)."""
        sizes = [len(x) for x in lists]
        host = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=sum(sizes)))
        return list(torch.split(to_device(host, self.device), sizes))

    def _upload_table(self, tables: np.ndarray) -> torch.Tensor:
        return to_device(torch.from_numpy(tables), self.device)

    def execute(self, out: SchedulerOutput, after_layer: LayerHook | None = None,
                before_forward: Callable[[], None] | None = None,
                while_running: WhileRunning | None = None) -> tuple[list[int], SamplerOutput | None]:
        """Run swaps, the forward pass and sampling. Returns (scheduled indices that sampled, samples).
        `while_running(ready)`, in a step that samples, runs once the step is queued and before its
        samples are read; `ready()` says whether they are in (it returns at once or works until then)."""
        idx, pending, _ = self.launch(out, after_layer, before_forward=before_forward)
        if pending is None:
            return idx, None
        if while_running is not None:
            while_running(pending.ready)
        return idx, pending.result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, after_layer: LayerHook | None = None,
               prev_tokens: torch.Tensor | None = None,
               before_forward: Callable[[], None] | None = None,
               ) -> tuple[list[int], PendingSamples | None, torch.cuda.Event | None]:
        """Queue swaps, the forward pass and sampling without waiting for the device. Returns
        (scheduled indices that sample, their PendingSamples, the forward's end): the last is an
        event recorded between the forward and the LM head on a CUDA device (None elsewhere,
        where the forward has finished on return). `prev_tokens`: see `prepare`.
        `before_forward()` runs once the inputs are prepared (a decode graph's copied in), right
        before the forward is queued (`Engine.step`'s hold)."""
        for dev_blocks, host_blocks in out.swap_out:
            self.kv_cache.swap_out(dev_blocks, host_blocks)
        for host_blocks, dev_blocks in out.swap_in:
            self.kv_cache.swap_in(host_blocks, dev_blocks)
        if not out.scheduled:
            return [], None, None
        batch = self.prepare(out, prev_tokens)
        bucket = None
        if self.graphs is not None and batch.meta.is_decode and after_layer is None:
            bucket = self.graphs.stage(batch.input_ids, batch.positions, batch.meta)
        if before_forward is not None:
            before_forward()
        if self.idle_clock is not None:
            self.idle_clock.forward_starts()
        hidden = None
        if bucket is not None:
            hidden = self.graphs.replay(bucket, batch.input_ids.shape[0])
        elif self.prefill_graphs is not None and not batch.meta.is_decode:
            hidden = self.prefill_graphs.run(batch.input_ids, batch.positions, batch.meta)
            if hidden is not None and after_layer is not None:
                for layer in range(len(self.kv_cache.layers)):  # every layer's K/V is queued now
                    after_layer(layer)
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, self.kv_cache.layers, batch.meta, after_layer)
        forward_done = None
        if self.device.type == "cuda":
            forward_done = torch.cuda.Event()
            forward_done.record()
        if not batch.sample_index:
            if self.idle_clock is not None:
                self.idle_clock.step_ends()
            return [], None, forward_done
        logits = self.model.logits(hidden[batch.sample_rows])[: len(batch.sample_index)]
        samples = self.sampler.launch(logits, self._rows(out, batch.sample_index), prev_tokens)
        if self.idle_clock is not None:
            self.idle_clock.step_ends()
        return batch.sample_index, samples, forward_done

    def stop(self) -> None:
        """`Engine.close()`: release whatever runs beside this runner (nothing here; a
        tensor-parallel runner releases its followers). Idempotent."""

    def sample(self, out: SchedulerOutput, sample_index: list[int], logits: torch.Tensor) -> SamplerOutput:
        """Sample one token for each scheduled sequence in `sample_index` (rows of `logits`)."""
        return self.sampler(logits, self._rows(out, sample_index))

    def _rows(self, out: SchedulerOutput, sample_index: list[int]) -> list[SamplingRow]:
        """The sampler's rows of the sampling sequences: each sequence keeps its row from step to
        step (its token lists grow in place), rebuilt when its params or lists are replaced."""
        scheduled = out.scheduled
        return [_sampling_row(scheduled[i].seq, self.eos_token_ids) for i in sample_index]


def _sampling_row(seq: Sequence, eos_token_ids: frozenset[int]) -> SamplingRow:
    row = seq.sampling_row
    if (row is None or row.params is not seq.params or row.prompt_token_ids is not seq.prompt_token_ids
            or row.output_token_ids is not seq.output_token_ids or row.eos_token_ids is not eos_token_ids):
        row = seq.sampling_row = SamplingRow(seq.params, seq.prompt_token_ids, seq.output_token_ids, eos_token_ids)
    row.pending = seq.num_pending  # the step in flight's token, not yet in output_token_ids
    row.pending_row = seq.pending_row  # where it is among that step's tokens
    return row


def _table_row(seq: Sequence) -> np.ndarray:
    """`seq.block_table` as int32, from a cache on the sequence that is extended in place while
    the table only grows (the scheduler appends blocks) and rebuilt when the list is replaced."""
    table = seq.block_table
    cache = seq.table_cache
    if cache is None or cache[0] is not table or cache[2] > len(table):
        arr = np.empty(max(16, 2 * len(table)), dtype=np.int32)
        arr[: len(table)] = table
        seq.table_cache = cache = [table, arr, len(table)]
    owner, arr, filled = cache
    n = len(table)
    if n > filled:
        if n > len(arr):
            grown = np.empty(2 * n, dtype=np.int32)
            grown[:filled] = arr[:filled]
            cache[1] = arr = grown
        arr[filled:n] = table[filled:n]
        cache[2] = n
    return arr[:n]

"""A large decode batch as two halves on two CUDA streams: one half's attention beside the other's GEMMs.

At a full batch a decode step's attention streams the KV cache (memory-bound: 13.7 ms of an FP8
step of 512 rows, BENCHMARKS.md §28) and its GEMMs multiply every weight (compute-bound: 5.2
ms); one after the other, each leaves the other's unit idle. Split into halves, the halves'
phases can overlap (as NanoFlow does): while half A attends in layer l, half B runs its o_proj,
MLP and next qkv, and the other way round:

    GEMM stream       qkv A0 | qkv B0 | (wait att A0) post A0, qkv A1 | (wait att B0) post B0, qkv B1 | ...
    attention stream  (wait qkv A0) att A0 | (wait qkv B0) att B0 | (wait qkv A1) att A1 | ...

where qkv is DecoderLayer.before_attention, att Attention.core and post after_attention. The
GEMM stream has the higher priority, so that its GEMMs take SMs as the attention's programs
finish (in eager steps: a CUDA graph replays every node at its launch stream's priority). A
half's GEMMs do half the rows (the weights are read twice a step); at these batches they stay
compute-bound (FP8: 256 rows; bf16 at 384 rows is near its ridge, and may not gain).

Rows are independent in a decode step, so the output is the plain forward's up to the GEMMs'
order of accumulation at another row count. Tensors that cross streams (qkv, the attention
output) are recorded on the stream that reads them, so the allocator does not hand their memory
to the writer's stream while the reader may still run. On a CPU the same phases run in the same
order, one after the other (no streams): what the tests check.

Used by the decode graphs (engine/cuda_graphs.py) for buckets of at least MIN_ROWS rows when
NANO_BATCH_ENV is "1", or, with "auto", where it replays faster than the plain step at a full
context; a single-GPU engine only (a tensor-parallel layer's all-reduce is not split).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from engine.attention import AttentionMetadata
from engine.config import EXPECTED_CONTEXT_TOKENS

# "1": decode graphs of >= MIN_ROWS rows run two halves overlapped; "auto": such a bucket captures
# both and keeps the faster at a full context (engine/cuda_graphs.py); "0" (default): off until
# measured on the device.
NANO_BATCH_ENV = "TANDEM_NANO_BATCH"
NANO_BATCH_MODES = ("0", "1", "auto")
MIN_ROWS = 128
# The context at which "auto" times a bucket's two steps: what a running sequence is expected to hold.
TIMING_CONTEXT = EXPECTED_CONTEXT_TOKENS


def nano_batch_mode() -> str:
    """NANO_BATCH_ENV's value, one of NANO_BATCH_MODES (default "0")."""
    value = os.environ.get(NANO_BATCH_ENV, "0")
    if value not in NANO_BATCH_MODES:
        raise ValueError(f"{NANO_BATCH_ENV} must be one of {', '.join(NANO_BATCH_MODES)}, got {value!r}")
    return value


def nano_batch_enabled() -> bool:
    """Whether NANO_BATCH_ENV asks for overlapped halves at all ("1" or "auto")."""
    return nano_batch_mode() != "0"


def overlapped_wins(plain_ms: dict[int, float], overlapped_ms: dict[int, float], margin: float) -> list[int]:
    """The buckets whose overlapped step replays faster than their plain one by more than
    `margin` (a share of the plain time; a difference within it is taken for noise and the plain
    graph stays), from each one's timed replays."""
    return sorted(b for b, t in overlapped_ms.items() if b in plain_ms and t < plain_ms[b] * (1 - margin))


def split_meta(meta: AttentionMetadata, rows: slice) -> AttentionMetadata:
    """A decode batch's metadata for the sequences `rows` (one token each)."""
    if not meta.is_decode:
        raise ValueError("split_meta: only a decode batch (one token a sequence) splits by rows")
    start, stop = rows.start, rows.stop
    return dataclasses.replace(
        meta, slot_mapping=meta.slot_mapping[rows], block_tables=meta.block_tables[rows],
        query_start_loc=meta.query_start_loc[start:stop + 1] - start, seq_lens=meta.seq_lens[rows])


class Streams:
    """The GEMM and attention streams, forked from the current stream and joined back into it.
    On a CPU, or with parallel=False (the halves one after the other on the current stream: what
    splitting alone costs), no streams: every phase runs in order."""

    def __init__(self, device: torch.device, parallel: bool = True) -> None:
        self.cuda = device.type == "cuda" and parallel
        if self.cuda:
            # A lower number is a higher priority; one past the device's range is clamped to it.
            self.gemm = torch.cuda.Stream(device, priority=-100)
            self.attn = torch.cuda.Stream(device, priority=0)

    def fork(self) -> None:
        if self.cuda:
            here = torch.cuda.current_stream()
            self.gemm.wait_stream(here)
            self.attn.wait_stream(here)

    def join(self) -> None:
        if self.cuda:
            here = torch.cuda.current_stream()
            here.wait_stream(self.gemm)
            here.wait_stream(self.attn)

    def on(self, name: str):
        return torch.cuda.stream(getattr(self, name)) if self.cuda else contextlib.nullcontext()

    def mark(self) -> torch.cuda.Event | None:
        """An event at this point of the current stream (None on a CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def after(self, event: torch.cuda.Event | None) -> None:
        """The current stream waits for `event`."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)

    def handed(self, tensor, reader: str) -> None:
        """`tensor`, written on one stream, is read on `reader`: its memory is not reused before that."""
        if self.cuda:
            for t in (tensor if isinstance(tensor, tuple) else (tensor,)):
                if isinstance(t, torch.Tensor):
                    t.record_stream(getattr(self, reader))


def overlapped_forward(model, input_ids: torch.Tensor, positions: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                       streams: Streams | None = None) -> torch.Tensor:
    """CausalLM.forward of a decode batch as two halves, scheduled as the module docstring draws;
    -> hidden states [T, hidden], as model(input_ids, positions, kv_caches, meta) returns them."""
    n = input_ids.shape[0]
    if n < 2:
        raise ValueError(f"overlapped_forward: a batch of at least 2 rows splits in halves, got {n}")
    streams = streams or Streams(input_ids.device)
    halves = (slice(0, n // 2), slice(n // 2, n))
    metas = [split_meta(meta, rows) for rows in halves]
    pos = [positions[rows] for rows in halves]
    layers, cos_sin = model.layers, model.cos_sin_cache
    residuals: list = [None, None]
    fused: list = [None, None]
    qkv: list = [None, None]
    qkv_ready: list = [None, None]

    def start(h: int, layer) -> None:  # on the GEMM stream: half h's norm and qkv in `layer`, handed on
        fused[h] = layer.fused_projections(xs[h], metas[h])
        qkv[h], residuals[h] = layer.before_attention(xs[h], residuals[h], fused[h])
        streams.handed(qkv[h], "attn")
        qkv_ready[h] = streams.mark()

    streams.fork()
    with streams.on("gemm"):
        x = model.embed_tokens(input_ids)
        xs = [x[rows] for rows in halves]
        for h in (0, 1):
            start(h, layers[0])
    for i, layer in enumerate(layers):
        attended: list = [None, None]
        done: list = [None, None]
        for h in (0, 1):  # half A's attention, then B's, on the attention stream
            with streams.on("attn"):
                streams.after(qkv_ready[h])
                attended[h] = layer.self_attn.core(pos[h], qkv[h], kv_caches[i], metas[h], cos_sin)
                streams.handed(attended[h], "gemm")
                done[h] = streams.mark()
        for h in (0, 1):  # then each half's rest of the layer and the next layer's qkv, as its attention ends
            with streams.on("gemm"):
                streams.after(done[h])
                xs[h], residuals[h] = layer.after_attention(attended[h], residuals[h], fused[h])
                if i + 1 < len(layers):
                    start(h, layers[i + 1])
    with streams.on("gemm"):
        out = torch.cat([model.norm(xs[h], residuals[h])[0] for h in (0, 1)])
    streams.join()
    return out

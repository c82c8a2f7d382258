"""Proto adapters shared by the prefill and decode services: stats, KV events, logprobs, finish.

The services' own request/response conversions live in prefill/adapters.py and
decode/adapters.py; generic ones (params, tier, finish reason) in tandem.wire.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from engine.outputs import FinishReason, StepOutput
from engine.sampler import TokenLogprobs
from tandem import wire
from tandem._proto.tandem.v1 import worker_pb2
from tandem._proto.tandem.v1 import tandem_pb2 as pb
from worker.events import KvEventBatch
from worker.stats import StatsSnapshot

logger = logging.getLogger(__name__)

ROLE_TO_PROTO = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
    "both": worker_pb2.WORKER_ROLE_BOTH,
}


def stats_to_proto(
    snap: StatsSnapshot, worker_id: str, role: str, kv_bytes_sent: int, kv_bytes_received: int, draining: bool
) -> worker_pb2.WorkerStats:
    """free_kv_blocks is `available_blocks`: free plus what the prefix cache would give up,
    i.e. the headroom a new request has (see `StatsSnapshot`)."""
    return worker_pb2.WorkerStats(
        worker_id=worker_id,
        role=ROLE_TO_PROTO[role],
        free_kv_blocks=snap.available_blocks,
        total_kv_blocks=snap.total_blocks,
        max_running=snap.max_running,
        max_model_len=snap.max_model_len,
        running=snap.running,
        waiting=snap.waiting + snap.swapped,
        queued_prefill_tokens=snap.queued_prefill_tokens,
        prefix_query_tokens=snap.prefix_query_tokens,
        prefix_hit_tokens=snap.prefix_hit_tokens,
        preemptions=snap.preemptions,
        kv_bytes_sent=int(kv_bytes_sent),
        kv_bytes_received=int(kv_bytes_received),
        draining=draining,
    )


def events_to_proto(batch: KvEventBatch, worker_id: str) -> worker_pb2.KvEventBatch:
    return worker_pb2.KvEventBatch(
        worker_id=worker_id, seq=batch.seq, reset=batch.reset, stored=batch.stored, removed=batch.removed
    )


def logprob_to_proto(lp: TokenLogprobs | None) -> pb.TokenLogprob | None:
    if lp is None:
        return None
    return wire.logprob_to_proto(wire.TokenLogprob(lp.token_id, lp.logprob, tuple(tuple(t) for t in lp.top)))


def logprob_to_meta(lp: TokenLogprobs | None) -> dict[str, Any] | None:
    """JSON form for the KV commit's metadata."""
    if lp is None:
        return None
    return {"token_id": lp.token_id, "logprob": lp.logprob, "top": [[int(t), float(p)] for t, p in lp.top]}


def logprob_from_meta(meta: Any) -> TokenLogprobs | None:
    if not isinstance(meta, dict):
        return None
    try:
        return TokenLogprobs(int(meta["token_id"]), float(meta["logprob"]), [(int(t), float(p)) for t, p in meta.get("top", [])])
    except (KeyError, TypeError, ValueError):
        logger.warning("ignoring malformed first-token logprob in kv commit: %r", meta)
        return None


def finish_to_proto(reason: FinishReason | None, stop_reason: str | int | None) -> tuple[int, str]:
    """(tandem.v1.FinishReason, stop_reason text) for an engine finish; PREFILLED is not one."""
    if reason is None or reason is FinishReason.PREFILLED:
        return pb.FINISH_REASON_UNSPECIFIED, ""
    text = ""
    if reason is FinishReason.STOP:
        text = "eos" if stop_reason is None else ("stop_token_id" if isinstance(stop_reason, int) else "stop_string")
    elif reason is FinishReason.ABORT:
        text = stop_reason if isinstance(stop_reason, str) else ""
    return wire.finish_reason_to_proto(reason.value), text


def chunk_from_outputs(
    outputs: Sequence[StepOutput], want_logprobs: bool, cached_tokens: int = 0
) -> worker_pb2.DecodeChunk:
    """One DecodeChunk with the tokens of consecutive outputs of one request; the finish
    reason comes from the last one."""
    chunk = worker_pb2.DecodeChunk(cached_tokens=cached_tokens)
    for out in outputs:
        chunk.token_ids.extend(out.new_token_ids)
        if want_logprobs:
            chunk.logprobs.extend(lp for lp in map(logprob_to_proto, out.new_logprobs) if lp is not None)
    last = outputs[-1] if outputs else None
    if last is not None and last.finished:
        chunk.finish_reason, chunk.stop_reason = finish_to_proto(last.finish_reason, last.stop_reason)
    return chunk

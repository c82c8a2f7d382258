"""The gateway's side of the worker protocol (protos/tandem/v1/worker.proto): builds the
requests it sends to prefill/decode workers and turns their answers into plain dataclasses.
The rest of the gateway never touches worker_pb2."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from tandem import wire
from tandem._proto.tandem.v1 import worker_pb2 as wpb
from tandem.types import SamplingParams, Tier
from tandem.wire import TokenLogprob

logger = logging.getLogger(__name__)

_ROLE_NAMES = {wpb.WORKER_ROLE_PREFILL: "prefill", wpb.WORKER_ROLE_DECODE: "decode", wpb.WORKER_ROLE_BOTH: "both"}
MAX_TIMEOUT_MS = 2**32 - 1


@dataclass(frozen=True)
class WorkerStatsView:
    worker_id: str
    role: str  # "prefill", "decode", "both" or "" (unspecified)
    free_kv_blocks: int
    total_kv_blocks: int
    running: int
    waiting: int
    queued_prefill_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    draining: bool
    kv_bytes_sent: int = 0  # KV-transfer payload bytes this worker pushed (prefill) ...
    kv_bytes_received: int = 0  # ... or took in (decode), since it started
    metrics_port: int = 0  # its Prometheus port on its host; 0: none
    max_running: int = 0  # sequences its engine runs at once (after any lowering); 0: not known
    max_model_len: int = 0  # the longest prompt + output its engine takes; 0: not known


@dataclass(frozen=True)
class Reservation:
    ok: bool
    reason: str
    reservation_id: int
    kv_address: str
    num_cached_blocks: int
    dst_block_ids: tuple[int, ...]
    free_blocks: int


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprob: TokenLogprob | None
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str | None  # set when the first token already ends the request
    stop_reason: str


@dataclass(frozen=True)
class WorkerChunk:
    """Token deltas from Decode / PrefillAndDecode; finish_reason on the last one."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None
    stop_reason: str
    cached_tokens: int


@dataclass(frozen=True)
class KvEventBatch:
    worker_id: str
    seq: int
    reset: bool
    stored: tuple[int, ...]
    removed: tuple[int, ...]


def timeout_ms(seconds: float | None) -> int:
    """Seconds left -> the uint32 ms the workers take (0 = no deadline; at least 1 when set)."""
    if seconds is None:
        return 0
    return min(max(int(seconds * 1000), 1), MAX_TIMEOUT_MS)


# ---------------------------------------------------------------- requests

def stats_request() -> wpb.StatsRequest:
    return wpb.StatsRequest()


def kv_events_request() -> wpb.KvEventsRequest:
    return wpb.KvEventsRequest()


def abort_request(request_id: str) -> wire.pb.AbortRequest:
    return wire.pb.AbortRequest(request_id=request_id)


def release_request(request_id: str, reservation_id: int) -> wpb.ReleaseRequest:
    return wpb.ReleaseRequest(request_id=request_id, reservation_id=reservation_id)


def reserve_request(request_id: str, token_ids: Sequence[int], max_tokens: int, tier: Tier,
                    timeout_s: float | None, num_output_tokens: int) -> wpb.ReserveRequest:
    return wpb.ReserveRequest(request_id=request_id, token_ids=token_ids, max_tokens=max_tokens,
                              tier=wire.tier_to_proto(tier), timeout_ms=timeout_ms(timeout_s),
                              num_output_tokens=num_output_tokens)


def kv_target(decode_worker_id: str, reservation: Reservation, voucher: str = "") -> wpb.KvTarget:
    return wpb.KvTarget(worker_id=decode_worker_id, kv_address=reservation.kv_address,
                        reservation_id=reservation.reservation_id, num_cached_blocks=reservation.num_cached_blocks,
                        dst_block_ids=reservation.dst_block_ids, voucher=voucher)


def prefill_request(request_id: str, token_ids: Sequence[int], params: SamplingParams, tier: Tier,
                    target: wpb.KvTarget | None, timeout_s: float | None,
                    num_output_tokens: int) -> wpb.PrefillRequest:
    """target None: it follows in a PrefillTarget call (`target_follows`)."""
    return wpb.PrefillRequest(request_id=request_id, token_ids=token_ids, params=wire.params_to_proto(params),
                              tier=wire.tier_to_proto(tier), target=target, target_follows=target is None,
                              timeout_ms=timeout_ms(timeout_s), num_output_tokens=num_output_tokens)


def prefill_target_request(request_id: str, target: wpb.KvTarget) -> wpb.PrefillTargetRequest:
    return wpb.PrefillTargetRequest(request_id=request_id, target=target)


def decode_request(request_id: str, reservation_id: int, first_token_id: int, params: SamplingParams,
                   timeout_s: float | None, stream_interval: int = 1) -> wpb.DecodeRequest:
    return wpb.DecodeRequest(request_id=request_id, reservation_id=reservation_id, first_token_id=first_token_id,
                             params=wire.params_to_proto(params), timeout_ms=timeout_ms(timeout_s),
                             stream_interval=stream_interval)


def generate_on_worker_request(request_id: str, token_ids: Sequence[int], params: SamplingParams, tier: Tier,
                               timeout_s: float | None, num_output_tokens: int,
                               stream_interval: int = 1) -> wpb.GenerateOnWorkerRequest:
    return wpb.GenerateOnWorkerRequest(request_id=request_id, token_ids=token_ids,
                                       params=wire.params_to_proto(params), tier=wire.tier_to_proto(tier),
                                       timeout_ms=timeout_ms(timeout_s), num_output_tokens=num_output_tokens,
                                       stream_interval=stream_interval)


# ---------------------------------------------------------------- responses

def stats_from_proto(msg: wpb.WorkerStats) -> WorkerStatsView:
    return WorkerStatsView(
        worker_id=msg.worker_id, role=_ROLE_NAMES.get(msg.role, ""), free_kv_blocks=msg.free_kv_blocks,
        total_kv_blocks=msg.total_kv_blocks, running=msg.running, waiting=msg.waiting,
        queued_prefill_tokens=msg.queued_prefill_tokens, prefix_query_tokens=msg.prefix_query_tokens,
        prefix_hit_tokens=msg.prefix_hit_tokens, preemptions=msg.preemptions, draining=msg.draining,
        kv_bytes_sent=msg.kv_bytes_sent, kv_bytes_received=msg.kv_bytes_received, metrics_port=msg.metrics_port,
        max_running=msg.max_running, max_model_len=msg.max_model_len,
    )


def reservation_from_proto(msg: wpb.ReserveResponse) -> Reservation:
    return Reservation(ok=msg.ok, reason=msg.reason, reservation_id=msg.reservation_id, kv_address=msg.kv_address,
                       num_cached_blocks=msg.num_cached_blocks, dst_block_ids=tuple(msg.dst_block_ids),
                       free_blocks=msg.free_blocks)


def prefill_result_from_proto(msg: wpb.PrefillResponse) -> PrefillResult:
    return PrefillResult(
        first_token_id=msg.first_token_id,
        first_logprob=wire.logprob_from_proto(msg.first_logprob) if msg.HasField("first_logprob") else None,
        prompt_tokens=msg.prompt_tokens, cached_tokens=msg.cached_tokens,
        finish_reason=wire.finish_reason_from_proto(msg.finish_reason), stop_reason=msg.stop_reason,
    )


def worker_chunk_from_proto(msg: wpb.DecodeChunk) -> WorkerChunk:
    return WorkerChunk(token_ids=tuple(msg.token_ids), logprobs=tuple(wire.logprob_from_proto(lp) for lp in msg.logprobs),
                       finish_reason=wire.finish_reason_from_proto(msg.finish_reason), stop_reason=msg.stop_reason,
                       cached_tokens=msg.cached_tokens)


def kv_events_from_proto(msg: wpb.KvEventBatch) -> KvEventBatch:
    return KvEventBatch(worker_id=msg.worker_id, seq=msg.seq, reset=msg.reset, stored=tuple(msg.stored),
                    removed=tuple(msg.removed))

"""tandem.v1.DecodeWorker messages <-> plain values; nothing else in decode/ touches worker_pb2
fields directly. Decoding raises ValueError naming the field for input the worker cannot use."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tandem import wire
from tandem._proto.tandem.v1 import worker_pb2
from tandem.types import SamplingParams, Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReserveInput:
    request_id: str
    token_ids: list[int]
    max_tokens: int
    tier: Tier
    timeout_s: float | None
    num_output_tokens: int


@dataclass(frozen=True)
class DecodeInput:
    request_id: str
    reservation_id: int
    first_token_id: int
    params: SamplingParams
    timeout_s: float | None
    stream_interval: int = 1  # new tokens per chunk after the first


@dataclass(frozen=True)
class LocalInput:
    """PrefillAndDecode: the whole request runs here."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    tier: Tier
    timeout_s: float | None
    num_output_tokens: int
    stream_interval: int = 1  # new tokens per chunk after the first


def _request_id(value: str) -> str:
    if not value:
        raise ValueError("request_id: must not be empty")
    return value


def _timeout(ms: int) -> float | None:
    return ms / 1000.0 if ms else None


def reserve_from_proto(msg: worker_pb2.ReserveRequest) -> ReserveInput:
    """The prompt itself is checked by the engine (`Engine.reserve`)."""
    return ReserveInput(
        request_id=_request_id(msg.request_id),
        token_ids=list(msg.token_ids),
        max_tokens=msg.max_tokens or SamplingParams().max_tokens,
        tier=wire.tier_from_proto(msg.tier),
        timeout_s=_timeout(msg.timeout_ms),
        num_output_tokens=msg.num_output_tokens,
    )


def decode_from_proto(msg: worker_pb2.DecodeRequest) -> DecodeInput:
    return DecodeInput(
        request_id=_request_id(msg.request_id),
        reservation_id=msg.reservation_id,
        first_token_id=msg.first_token_id,
        params=wire.params_from_proto(msg.params),
        timeout_s=_timeout(msg.timeout_ms),
        stream_interval=max(1, msg.stream_interval),
    )


def local_from_proto(msg: worker_pb2.GenerateOnWorkerRequest) -> LocalInput:
    """The prompt itself is checked by the engine (`Engine.admit`)."""
    return LocalInput(
        request_id=_request_id(msg.request_id),
        token_ids=list(msg.token_ids),
        params=wire.params_from_proto(msg.params),
        tier=wire.tier_from_proto(msg.tier),
        timeout_s=_timeout(msg.timeout_ms),
        num_output_tokens=msg.num_output_tokens,
        stream_interval=max(1, msg.stream_interval),
    )


def reserve_ok(reservation_id: int, kv_address: str, num_cached_blocks: int, dst_block_ids: list[int],
               free_blocks: int) -> worker_pb2.ReserveResponse:
    return worker_pb2.ReserveResponse(
        ok=True, reservation_id=reservation_id, kv_address=kv_address, num_cached_blocks=num_cached_blocks,
        dst_block_ids=dst_block_ids, free_blocks=free_blocks,
    )


def reserve_refused(reason: str, free_blocks: int) -> worker_pb2.ReserveResponse:
    return worker_pb2.ReserveResponse(ok=False, reason=reason, free_blocks=free_blocks)

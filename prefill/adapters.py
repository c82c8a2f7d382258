"""tandem.v1.PrefillWorker messages <-> plain values; nothing else in prefill/ reads
PrefillRequest fields. Decoding raises ValueError naming the field."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from engine.outputs import FinishReason, StepOutput
from tandem import wire
from tandem._proto.tandem.v1 import worker_pb2
from tandem.types import SamplingParams, Tier
from worker.adapters import finish_to_proto, logprob_to_proto
from worker.transfer import split_kv_addresses

logger = logging.getLogger(__name__)

_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KvTarget:
    """kv_address as the decode worker advertised it; kv_addresses: one endpoint per decode
    rank (a tensor-parallel decode worker advertises several, see worker.transfer)."""

    worker_id: str
    kv_address: str
    reservation_id: int
    num_cached_blocks: int
    dst_block_ids: list[int]
    kv_addresses: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrefillInput:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    tier: Tier
    target: KvTarget
    timeout_s: float | None
    num_output_tokens: int


def prefill_from_proto(msg: worker_pb2.PrefillRequest, block_size: int) -> PrefillInput:
    """Also checks that the target's blocks cover exactly the prompt blocks D lacks:
    len(dst_block_ids) == ceil(len(token_ids) / block_size) - num_cached_blocks."""
    if not msg.request_id:
        raise ValueError("request_id: must not be empty")
    if not msg.token_ids:
        raise ValueError("token_ids: the prompt must not be empty")
    if not msg.HasField("target"):
        raise ValueError("target: a KvTarget is required")
    t = msg.target
    addresses = split_kv_addresses(t.kv_address)
    for address in addresses:
        if not address.startswith(_SCHEMES):
            raise ValueError(f"target.kv_address: expected tcp://, ipc:// or inproc:// endpoints, got {t.kv_address!r}")
    prompt_blocks = -(-len(msg.token_ids) // block_size)
    if t.num_cached_blocks >= prompt_blocks:
        raise ValueError(f"target.num_cached_blocks: {t.num_cached_blocks} leaves none of the prompt's {prompt_blocks} blocks to send")
    want = prompt_blocks - t.num_cached_blocks
    if len(t.dst_block_ids) != want:
        raise ValueError(
            f"target.dst_block_ids: {len(t.dst_block_ids)} blocks for {want} prompt blocks to send "
            f"(block size here is {block_size}; prefill and decode workers must use the same)"
        )
    return PrefillInput(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        params=wire.params_from_proto(msg.params),
        tier=wire.tier_from_proto(msg.tier),
        target=KvTarget(t.worker_id, t.kv_address, t.reservation_id, t.num_cached_blocks, list(t.dst_block_ids),
                        tuple(addresses)),
        timeout_s=msg.timeout_ms / 1000.0 if msg.timeout_ms else None,
        num_output_tokens=msg.num_output_tokens,
    )


def prefill_response(out: StepOutput, prompt_tokens: int, cached_tokens: int, want_logprobs: bool) -> worker_pb2.PrefillResponse:
    msg = worker_pb2.PrefillResponse(
        first_token_id=out.new_token_ids[0], prompt_tokens=prompt_tokens, cached_tokens=cached_tokens
    )
    lp = logprob_to_proto(out.new_logprobs[0]) if want_logprobs and out.new_logprobs else None
    if lp is not None:
        msg.first_logprob.CopyFrom(lp)
    if out.finish_reason is not FinishReason.PREFILLED:
        msg.finish_reason, msg.stop_reason = finish_to_proto(out.finish_reason, out.stop_reason)
    return msg

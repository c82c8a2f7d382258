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
    target: KvTarget | None  # None: it follows (PrefillTarget)
    timeout_s: float | None
    num_output_tokens: int


def prefill_from_proto(msg: worker_pb2.PrefillRequest, block_size: int) -> PrefillInput:
    """The request, its target checked by `target_from_proto`; target None when it follows
    (`target_follows`: a PrefillTarget call brings it)."""
    if not msg.request_id:
        raise ValueError("request_id: must not be empty")
    if not msg.token_ids:
        raise ValueError("token_ids: the prompt must not be empty")
    if msg.target_follows:
        if msg.HasField("target"):
            raise ValueError("target: must be absent when target_follows is set (a PrefillTarget call brings it)")
        target = None
    elif not msg.HasField("target"):
        raise ValueError("target: a KvTarget is required (or target_follows, and a PrefillTarget call)")
    else:
        target = target_from_proto(msg.target, len(msg.token_ids), block_size)
    return PrefillInput(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        params=wire.params_from_proto(msg.params),
        tier=wire.tier_from_proto(msg.tier),
        target=target,
        timeout_s=msg.timeout_ms / 1000.0 if msg.timeout_ms else None,
        num_output_tokens=msg.num_output_tokens,
    )


def target_from_proto(t: worker_pb2.KvTarget, num_tokens: int, block_size: int, field: str = "target") -> KvTarget:
    """Checks that the target's blocks cover exactly the prompt blocks D lacks:
    len(dst_block_ids) == ceil(num_tokens / block_size) - num_cached_blocks. ValueError naming
    the field otherwise."""
    addresses = split_kv_addresses(t.kv_address)
    for address in addresses:
        if not address.startswith(_SCHEMES):
            raise ValueError(f"{field}.kv_address: expected tcp://, ipc:// or inproc:// endpoints, got {t.kv_address!r}")
    prompt_blocks = -(-num_tokens // block_size)
    if t.num_cached_blocks >= prompt_blocks:
        raise ValueError(f"{field}.num_cached_blocks: {t.num_cached_blocks} leaves none of the prompt's {prompt_blocks} "
                         "blocks to send")
    want = prompt_blocks - t.num_cached_blocks
    if len(t.dst_block_ids) != want:
        raise ValueError(
            f"{field}.dst_block_ids: {len(t.dst_block_ids)} blocks for {want} prompt blocks to send "
            f"(block size here is {block_size}; prefill and decode workers must use the same)"
        )
    return KvTarget(t.worker_id, t.kv_address, t.reservation_id, t.num_cached_blocks, list(t.dst_block_ids),
                    tuple(addresses))


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

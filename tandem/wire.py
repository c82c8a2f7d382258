"""Adapters between the tandem.v1 proto messages and Tandem's plain Python types.

Everything outside the generated package meets protobuf here (and in the SDK client): the
gateway and the SDK convert at the edge and work with `SamplingParams`, `Tier` and the small
dataclasses below. Torch-free. Also: the service names, stubs and servicer bases, and the
standard health + reflection services every server registers.
"""
from __future__ import annotations

import abc
import logging
from collections.abc import Coroutine, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem._proto.tandem.v1 import tandem_pb2 as pb
from tandem._proto.tandem.v1 import admin_pb2, admin_pb2_grpc, tandem_pb2_grpc, worker_pb2, worker_pb2_grpc
from tandem.types import SamplingParams, Tier

logger = logging.getLogger(__name__)

TANDEM_SERVICE = pb.DESCRIPTOR.services_by_name["Tandem"].full_name  # "tandem.v1.Tandem"
PREFILL_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"].full_name
DECODE_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name  # "tandem.v1.Admin"



def _servicer_base(module: Any, service: str) -> type:
    """The base class of a `service` servicer: each of its RPCs an abstract method, so a servicer
    that leaves one out fails when it is made (TypeError naming the RPC), where protoc's own bases
    answered UNIMPLEMENTED when it was called (tandem.protos_build drops those from the stubs)."""
    def rpc(name: str) -> Any:
        def method(self: Any, request: Any, context: Any) -> Any:
            """One RPC of the service; a servicer defines it (async for grpc.aio)."""
        method.__name__ = method.__qualname__ = name
        return abc.abstractmethod(method)

    methods = {m.name: rpc(m.name) for m in module.DESCRIPTOR.services_by_name[service].methods}
    return abc.ABCMeta(f"{service}Servicer", (), {"__module__": __name__, **methods})


TandemStub = tandem_pb2_grpc.TandemStub
TandemServicer = _servicer_base(pb, "Tandem")
add_tandem_servicer = tandem_pb2_grpc.add_TandemServicer_to_server
PrefillWorkerStub = worker_pb2_grpc.PrefillWorkerStub
PrefillWorkerServicer = _servicer_base(worker_pb2, "PrefillWorker")
add_prefill_worker_servicer = worker_pb2_grpc.add_PrefillWorkerServicer_to_server
DecodeWorkerStub = worker_pb2_grpc.DecodeWorkerStub
DecodeWorkerServicer = _servicer_base(worker_pb2, "DecodeWorker")
add_decode_worker_servicer = worker_pb2_grpc.add_DecodeWorkerServicer_to_server
AdminStub = admin_pb2_grpc.AdminStub
AdminServicer = _servicer_base(admin_pb2, "Admin")
add_admin_servicer = admin_pb2_grpc.add_AdminServicer_to_server

# SamplingParams fields carried as proto3 `optional` scalars (unset -> dataclass default).
_OPTIONAL_SCALARS = (
    "max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "seed", "min_tokens", "ignore_eos", "logprobs",
    "skip_special_tokens",
)

_TIER_TO_PROTO = {Tier.INTERACTIVE: pb.TIER_INTERACTIVE, Tier.STANDARD: pb.TIER_STANDARD,
                  Tier.BATCH: pb.TIER_BATCH}
_TIER_FROM_PROTO = {v: k for k, v in _TIER_TO_PROTO.items()} | {pb.TIER_UNSPECIFIED: Tier.STANDARD}

FINISH_REASONS = ("stop", "length", "abort", "error")
_FINISH_TO_PROTO = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
                    "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
                    "error": pb.FINISH_REASON_ERROR}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a prefix cache


@dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one generated token; `top` holds (token_id, logprob) alternatives, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Chunk:
    """One step of a generation stream: deltas, plus finish_reason/usage on the last chunk.

    finish_reason is None until the last chunk, then one of "stop", "length", "abort",
    "error". stop_reason says what stopped a "stop" ("eos", "stop_token_id", "stop_string");
    matched_stop is the stop string (str) or stop token id (int) that matched, if any.
    """

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str = ""
    matched_stop: str | int | None = None
    usage: Usage | None = None
    request_id: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ModelInfo:
    model: str
    model_identity: str
    vocab_size: int
    max_context: int
    block_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    num_prefill_workers: int
    num_decode_workers: int


@dataclass(frozen=True)
class GenerateInput:
    """A decoded GenerateRequest. `prompt` is text, or token ids (a tuple); "" when unset."""

    prompt: str | tuple[int, ...]
    params: SamplingParams
    tier: Tier
    request_id: str
    stream_text: bool
    stream_interval: int | None = None  # new tokens per chunk; 0: only the last chunk; None: the server's default


# ---------------------------------------------------------------- sampling params, tier

def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """Every field of `params` as a proto; None (seed, logprobs) stays unset.

    Does not validate. Raises ValueError naming the field only when a value cannot be
    represented on the wire at all (e.g. an int beyond int32, a negative stop token id).
    """
    msg = pb.SamplingParams()
    for name in _OPTIONAL_SCALARS:
        value = getattr(params, name)
        if value is not None:
            _set(msg, name, value)
    msg.stop.extend(params.stop)
    try:
        msg.stop_token_ids.extend(params.stop_token_ids)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"stop_token_ids: not representable as uint32: {exc}") from None
    return msg


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """SamplingParams from a proto; unset fields take the dataclass defaults. Does not validate."""
    kw: dict[str, Any] = {name: getattr(msg, name) for name in _OPTIONAL_SCALARS if msg.HasField(name)}
    return SamplingParams(stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids), **kw)


def tier_to_proto(tier: Tier | int | str) -> int:
    """Tier (or its int value / name) -> tandem.v1.Tier value. ValueError names `tier`."""
    return _TIER_TO_PROTO[Tier.parse(tier)]


def tier_from_proto(value: int) -> Tier:
    """tandem.v1.Tier value -> Tier; UNSPECIFIED means STANDARD; unknown -> ValueError naming `tier`."""
    try:
        return _TIER_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"tier: unknown tier value {value}; expected TIER_INTERACTIVE, "
                         "TIER_STANDARD or TIER_BATCH") from None


def finish_reason_to_proto(reason: str | None) -> int:
    """None (not finished) or one of FINISH_REASONS -> tandem.v1.FinishReason value."""
    try:
        return _FINISH_TO_PROTO[reason]
    except KeyError:
        raise ValueError(f"finish_reason: unknown reason {reason!r}; expected one of {FINISH_REASONS}") from None


def finish_reason_from_proto(value: int) -> str | None:
    """tandem.v1.FinishReason value -> None (UNSPECIFIED) or one of FINISH_REASONS."""
    try:
        return _FINISH_FROM_PROTO[value]
    except KeyError:
        raise ValueError(f"finish_reason: unknown finish reason value {value}") from None


# ---------------------------------------------------------------- usage, logprobs, chunks

def usage_to_proto(usage: Usage) -> pb.Usage:
    return pb.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    cached_tokens=usage.cached_tokens)


def usage_from_proto(msg: pb.Usage) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens)


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    """Note: logprobs travel as float32."""
    return TokenLogprob(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


def chunk_to_proto(chunk: Chunk) -> pb.GenerateChunk:
    msg = pb.GenerateChunk(
        request_id=chunk.request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        logprobs=[logprob_to_proto(lp) for lp in chunk.logprobs],
        finish_reason=finish_reason_to_proto(chunk.finish_reason),
        stop_reason=chunk.stop_reason,
        matched_stop="" if chunk.matched_stop is None else str(chunk.matched_stop),
    )
    if chunk.usage is not None:
        msg.usage.CopyFrom(usage_to_proto(chunk.usage))
    return msg


def chunk_from_proto(msg: pb.GenerateChunk) -> Chunk:
    matched: str | int | None = msg.matched_stop or None
    if matched is not None and msg.stop_reason == "stop_token_id" and matched.isdigit():
        matched = int(matched)
    return Chunk(
        token_ids=list(msg.token_ids),
        text=msg.text,
        logprobs=[logprob_from_proto(lp) for lp in msg.logprobs],
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        stop_reason=msg.stop_reason,
        matched_stop=matched,
        usage=usage_from_proto(msg.usage) if msg.HasField("usage") else None,
        request_id=msg.request_id,
    )


# ---------------------------------------------------------------- requests, model info

def generate_request_to_proto(prompt: str | Sequence[int], params: SamplingParams,
                              tier: Tier | int | str = Tier.STANDARD, request_id: str = "",
                              stream_text: bool = True, stream_interval: int | None = None) -> pb.GenerateRequest:
    """Build a GenerateRequest; a str prompt goes as text, anything else as token ids;
    stream_interval None leaves the field unset (a chunk every step).

    Raises ValueError naming `prompt` for token ids that do not fit uint32, and
    `stream_interval` for one that is not an integer in [0, 2**32).
    """
    msg = pb.GenerateRequest(params=params_to_proto(params), tier=tier_to_proto(tier),
                             request_id=request_id or "", stream_text=stream_text)
    if stream_interval is not None:
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) \
                or not 0 <= stream_interval < 2**32:
            raise ValueError(f"stream_interval: must be an integer >= 0, got {stream_interval!r}")
        msg.stream_interval = stream_interval
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        try:
            msg.token_ids.ids.extend(prompt)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"prompt: token ids must be integers in [0, 2**32): {exc}") from None
    return msg


def generate_request_from_proto(msg: pb.GenerateRequest) -> GenerateInput:
    """Decode a GenerateRequest. Raises ValueError naming `tier` for an unknown tier value;
    everything else is left to the gateway's validation (an unset prompt decodes to "")."""
    which = msg.WhichOneof("prompt")
    prompt: str | tuple[int, ...] = tuple(msg.token_ids.ids) if which == "token_ids" else msg.text
    return GenerateInput(
        prompt=prompt,
        params=params_from_proto(msg.params),
        tier=tier_from_proto(msg.tier),
        request_id=msg.request_id,
        stream_text=msg.stream_text if msg.HasField("stream_text") else True,
        stream_interval=msg.stream_interval if msg.HasField("stream_interval") else None,
    )


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=info.model, model_identity=info.model_identity, vocab_size=info.vocab_size,
        max_context=info.max_context, block_size=info.block_size,
        eos_token_ids=info.eos_token_ids, dtype=info.dtype,
        num_prefill_workers=info.num_prefill_workers, num_decode_workers=info.num_decode_workers,
    )


def model_info_from_proto(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model=msg.model, model_identity=msg.model_identity, vocab_size=msg.vocab_size,
        max_context=msg.max_context, block_size=msg.block_size,
        eos_token_ids=tuple(msg.eos_token_ids), dtype=msg.dtype,
        num_prefill_workers=msg.num_prefill_workers, num_decode_workers=msg.num_decode_workers,
    )


# ---------------------------------------------------------------- health and reflection

def add_health_and_reflection(server: grpc.Server | grpc.aio.Server,
                              service_names: Iterable[str], reflection_on: bool = True) -> Any:
    """Register grpc.health.v1.Health (every name in `service_names` and "" SERVING) and
    server reflection (those services plus health and reflection; unless `reflection_on` is
    False) on a sync or aio server.

    Returns the health servicer: `grpc_health.v1.health.HealthServicer` for a sync server,
    `grpc_health.v1.health.aio.HealthServicer` for an aio one (whose set() and
    enter_graceful_shutdown() are coroutines). Call before the server starts.
    """
    # Imported here: SDK users never need the server-side services.
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    names = tuple(service_names)
    serving = health_pb2.HealthCheckResponse.SERVING
    servicer: Any
    if isinstance(server, grpc.aio.Server):
        servicer = health.aio.HealthServicer()
        for name in names:
            _run_now(servicer.set(name, serving))
    else:
        # Non-blocking Watch, so health watchers do not hold the server's worker threads.
        servicer = health.HealthServicer(experimental_non_blocking=True,
                                         experimental_thread_pool=ThreadPoolExecutor(max_workers=1))
        for name in names:
            servicer.set(name, serving)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if reflection_on:
        reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return servicer


def _run_now(coro: Coroutine[Any, Any, None]) -> None:
    # aio HealthServicer.set() only suspends when a Watch is waiting; before the server
    # starts none is, so the coroutine completes in one step without an event loop.
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("add_health_and_reflection: call it before the server starts")


def _set(msg: Any, name: str, value: Any) -> None:
    try:
        setattr(msg, name, value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: cannot be sent as {type(value).__name__} {value!r}: {exc}") from None

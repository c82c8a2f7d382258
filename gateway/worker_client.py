"""The gateway's client of one worker: owns the worker's stub, turns calls into proto messages
and answers back into dataclasses (`gateway.adapters`), and classifies every failed RPC once.

Contract:
- One `WorkerClient` per `WorkerHandle` (`handle.client`), made with the handle; it lives in the
  gateway's event loop and every method must be called from that loop.
- The registry calls `stats()` and `kv_events()`; their RPC errors are raised as they are (a
  failed poll marks the worker down, whatever the code).
- The request flow (`gateway.request`) calls, per attempt, `reserve` then `prefill` then
  `decode` on a (P, D) pair, or `prefill_and_decode` on one worker; each takes the request's
  deadline (monotonic seconds) and sends what is left of it as the call's timeout. A failed
  call raises exactly one of:
    `WorkerRejected`  the request itself is at fault (bad argument): end it with `.code`;
    `DeadlineReached` the request's own deadline passed;
    `WorkerUnavailable` another worker may succeed (worker down, KV transfer failed): retry,
        avoiding `.worker`. A worker is not marked down here (a failed transfer is UNAVAILABLE
        while the worker is fine); the next Stats poll finds a dead one.
- `release` and `abort` are cleanup: they never raise an RPC error (failures are logged).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from gateway import adapters
from gateway.adapters import KvEventBatch, PrefillResult, Reservation, WorkerChunk, WorkerStatsView
from tandem import security, wire
from tandem.types import Role, SamplingParams, Tier

if TYPE_CHECKING:
    from gateway.workers import WorkerHandle

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

ABORT_TIMEOUT_S = 5.0
# A DEADLINE_EXCEEDED this close to the request's own deadline is the request's, not the worker's.
_DEADLINE_SLACK_S = 0.05
# Worker statuses that end the request as they are (the request itself is at fault), and the
# status the client gets for each.
_FINAL_CODES = {grpc.StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.UNIMPLEMENTED: grpc.StatusCode.INTERNAL,
                grpc.StatusCode.PERMISSION_DENIED: grpc.StatusCode.INTERNAL}


@dataclass(frozen=True)
class WorkerCredentials:
    """How the gateway reaches its workers: the cluster token every call carries (and the key
    of the KV-push vouchers), and the CA that verifies the workers' TLS certificates (None:
    plaintext channels)."""

    auth_token: str | None = field(default=None, repr=False)
    tls_ca: str | None = None

    def channel(self, address: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        return security.channel(address, tls_ca=self.tls_ca, options=options, aio=True)


class WorkerCallError(Exception):
    """A worker call of the request flow failed (see the subclasses)."""


class WorkerRejected(WorkerCallError):
    """The worker refused the request itself: end it with `code` and `details`."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class DeadlineReached(WorkerCallError):
    """The request's deadline passed while a worker served it."""


class WorkerUnavailable(WorkerCallError):
    """The attempt failed in a way another worker may not; `worker` is the one to avoid.
    `stage` is the retry metric's label; `cause` reads "<stage>: <why>"; `code` is the worker's
    gRPC status where it answered with one (None: the gateway gave up on it)."""

    def __init__(self, stage: str, cause: str, worker: WorkerHandle | None = None,
                 code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"{stage}: {cause}")
        self.stage, self.cause, self.worker, self.code = stage, f"{stage}: {cause}", worker, code


class ChunkStream:
    """The DecodeChunk stream of a Decode or PrefillAndDecode call, as `WorkerChunk`s; an RPC
    failure raises a `WorkerCallError`. `cancel()` ends the call (safe after it ended)."""

    def __init__(self, client: WorkerClient, call: grpc.aio.UnaryStreamCall, deadline: float) -> None:
        self._client = client
        self._call = call
        self._deadline = deadline

    def __aiter__(self) -> ChunkStream:
        self._messages = self._call.__aiter__()
        return self

    async def __anext__(self) -> WorkerChunk:
        try:
            msg = await self._messages.__anext__()
        except grpc.RpcError as exc:
            raise self._client.classify(exc, "decode", self._deadline) from None
        return adapters.worker_chunk_from_proto(msg)

    def cancel(self) -> None:
        self._call.cancel()


class KvEventStream:
    """A worker's KvEvents stream, as `KvEventBatch`es; RPC errors are raised as they are."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self._call = call

    def __aiter__(self) -> KvEventStream:
        self._messages = self._call.__aiter__()
        return self

    async def __anext__(self) -> KvEventBatch:
        return adapters.kv_events_from_proto(await self._messages.__anext__())

    def cancel(self) -> None:
        self._call.cancel()


class WorkerClient:
    """The calls the gateway makes to one worker (see the module docstring)."""

    def __init__(self, worker: WorkerHandle) -> None:
        self.worker = worker
        creds = worker.credentials or WorkerCredentials()
        self._token = creds.auth_token
        self._md = security.token_metadata(creds.auth_token)  # sent on every call
        self._stub: wire.PrefillWorkerStub | wire.DecodeWorkerStub = (
            wire.PrefillWorkerStub(worker.channel) if worker.role == Role.PREFILL
            else wire.DecodeWorkerStub(worker.channel))

    # ---------------------------------------------------------------- registry

    async def stats(self, timeout_s: float) -> WorkerStatsView:
        return adapters.stats_from_proto(await self._stub.Stats(adapters.stats_request(), timeout=timeout_s,
                                                                metadata=self._md))

    def kv_events(self) -> KvEventStream:
        return KvEventStream(self._stub.KvEvents(adapters.kv_events_request(), metadata=self._md))

    # ---------------------------------------------------------------- request flow

    def reserve(self, request_id: str, token_ids: Sequence[int], max_tokens: int, tier: Tier,
                num_output_tokens: int, deadline: float) -> asyncio.Future[Reservation]:
        """Start a Reserve on this (decode) worker; the future holds the Reservation or a
        WorkerCallError. The call is under way when this returns, so the caller can hold the
        future and, whatever happens to it, wait for the answer before aborting."""
        timeout = _remaining(deadline)
        call = self._stub.Reserve(adapters.reserve_request(request_id, token_ids, max_tokens, tier, timeout,
                                                           num_output_tokens), timeout=timeout, metadata=self._md)
        return asyncio.ensure_future(self._unary(call, "reserve", deadline, adapters.reservation_from_proto))

    def prefill(self, request_id: str, token_ids: Sequence[int], params: SamplingParams, tier: Tier,
                num_output_tokens: int, deadline: float, decode_worker_id: str = "",
                reservation: Reservation | None = None) -> asyncio.Future[PrefillResult]:
        """Start a Prefill on this (prefill) worker; the future holds its first token or a
        WorkerCallError. It pushes the KV into `reservation` on `decode_worker_id`; without one
        the target follows (`prefill_target`) and the worker computes meanwhile."""
        timeout = _remaining(deadline)
        target = None if reservation is None else self._target(request_id, decode_worker_id, reservation)
        call = self._stub.Prefill(adapters.prefill_request(request_id, token_ids, params, tier, target, timeout,
                                                           num_output_tokens), timeout=timeout, metadata=self._md)
        return asyncio.ensure_future(self._unary(call, "prefill", deadline, adapters.prefill_result_from_proto))

    async def prefill_target(self, request_id: str, decode_worker_id: str, reservation: Reservation,
                             deadline: float) -> None:
        """Send the target of a Prefill started without one; WorkerCallError when refused."""
        call = self._stub.PrefillTarget(
            adapters.prefill_target_request(request_id, self._target(request_id, decode_worker_id, reservation)),
            timeout=_remaining(deadline), metadata=self._md)
        await self._unary(call, "prefill", deadline, lambda _msg: None)

    def _target(self, request_id: str, decode_worker_id: str, reservation: Reservation) -> Any:
        """The KvTarget of `reservation`, with the gateway's voucher (a prefill worker pushes only
        to vouched targets)."""
        voucher = security.kv_voucher(self._token, request_id, reservation.reservation_id, decode_worker_id,
                                      reservation.kv_address)
        return adapters.kv_target(decode_worker_id, reservation, voucher)

    def decode(self, request_id: str, reservation_id: int, first_token_id: int, params: SamplingParams,
               deadline: float, stream_interval: int = 1) -> ChunkStream:
        """Decode the tokens after `first_token_id` into the reserved (and filled) blocks; a
        chunk every `stream_interval` tokens after the first."""
        timeout = _remaining(deadline)
        call = self._stub.Decode(adapters.decode_request(request_id, reservation_id, first_token_id, params,
                                                         timeout, stream_interval), timeout=timeout, metadata=self._md)
        return ChunkStream(self, call, deadline)

    def prefill_and_decode(self, request_id: str, token_ids: Sequence[int], params: SamplingParams, tier: Tier,
                           num_output_tokens: int, deadline: float, stream_interval: int = 1) -> ChunkStream:
        """Prefill and decode on this worker alone (role both, or a local prefill on a decode
        worker); a chunk every `stream_interval` tokens after the first."""
        timeout = _remaining(deadline)
        call = self._stub.PrefillAndDecode(adapters.generate_on_worker_request(
            request_id, token_ids, params, tier, timeout, num_output_tokens, stream_interval), timeout=timeout,
            metadata=self._md)
        return ChunkStream(self, call, deadline)

    async def release(self, request_id: str, reservation_id: int) -> None:
        """Give back a reservation whose request ended with the prefill's first token."""
        await _quietly(self._stub.Release(adapters.release_request(request_id, reservation_id),
                                          timeout=ABORT_TIMEOUT_S, metadata=self._md))

    async def abort(self, request_id: str) -> None:
        """Drop the request wherever it is on this worker (unknown ids are fine)."""
        await _quietly(self._stub.Abort(adapters.abort_request(request_id), timeout=ABORT_TIMEOUT_S, metadata=self._md))

    # ---------------------------------------------------------------- failures

    def classify(self, exc: grpc.RpcError, stage: str, deadline: float) -> WorkerCallError:
        code = exc.code()
        details = exc.details() or ""
        if code in _FINAL_CODES:
            return WorkerRejected(_FINAL_CODES[code], f"{details} (from {stage} on worker {self.worker.name})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline - time.monotonic() <= _DEADLINE_SLACK_S:
            return DeadlineReached()
        return WorkerUnavailable(stage, f"{code.name}: {details}", self.worker, code)

    async def _unary(self, call: grpc.aio.UnaryUnaryCall, stage: str, deadline: float,
                     convert: Callable[[Any], _T]) -> _T:
        try:
            return convert(await call)
        except grpc.RpcError as exc:
            raise self.classify(exc, stage, deadline) from None


def _remaining(deadline: float) -> float:
    """Seconds to the deadline (at least 1 ms, so it can always be sent as a timeout)."""
    return max(deadline - time.monotonic(), 0.001)


async def _quietly(call: grpc.aio.UnaryUnaryCall) -> None:
    try:
        await call
    except grpc.RpcError as exc:
        logger.debug("cleanup call failed: %s", exc.code().name)

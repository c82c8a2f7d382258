"""The public tandem.v1.Tandem servicer: the Generate stream, Abort and GetModelInfo over
gRPC. Admission (validation, tier queue, deadline) is gateway.admission's, shared with the HTTP
API; the work after admission is gateway.request's."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.admission import Admission, Rejected
from gateway.config import GatewayConfig
from gateway.malformed import MalformedMessage
from gateway.metrics import GatewayMetrics
from gateway.modelinfo import ServedModel
from gateway.request import RequestFailed, RequestState
from gateway.streaming import grouped
from tandem import wire
from tandem._proto.tandem.v1 import tandem_pb2 as pb

logger = logging.getLogger(__name__)


class TandemService(wire.TandemServicer):
    """Generate / Abort / GetModelInfo over the gateway's admission.

    Status codes: INVALID_ARGUMENT (a field, named in the message; or a message that does not
    parse, gateway.malformed), ALREADY_EXISTS (a client-chosen request_id already running),
    RESOURCE_EXHAUSTED (tier queue full, or more than `max_calls` calls in flight: the message
    names the tier; oversize messages are refused by gRPC itself), UNAVAILABLE (draining, no
    decode worker up, or no worker could serve the request within the retry bound),
    DEADLINE_EXCEEDED (the call's deadline or the tier's default deadline). The first chunk of a stream is sent at admission and carries the
    request id; tokens follow, grouped as the request's stream_interval says; the last chunk
    has finish_reason and usage.
    """

    def __init__(self, *, config: GatewayConfig, model: ServedModel, admission: Admission,
                 metrics: GatewayMetrics) -> None:
        self.config = config
        self.model = model
        self.admission = admission
        self.metrics = metrics

    @property
    def running(self) -> dict[str, RequestState]:
        return self.admission.running

    @property
    def max_calls(self) -> int:
        return self.admission.max_calls

    @property
    def calls(self) -> int:
        return self.admission.calls

    @property
    def calls_peak(self) -> int:
        return self.admission.calls_peak

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Writes the chunks itself (context.write) so that a chunk that cannot be sent because
        the caller is gone (its deadline passed meanwhile) ends the call as cancelled here,
        instead of an ERROR logged by gRPC."""
        with self.admission.call():
            # aclosing: the request's cleanup runs at once on every exit, cancellation included.
            async with contextlib.aclosing(self._generate(request, context)) as chunks:
                async for chunk in chunks:
                    try:
                        await context.write(chunk)
                    except Exception as exc:
                        if type(exc).__name__ != "ExecuteBatchError":
                            raise
                        logger.debug("a chunk for a caller already gone was dropped")
                        raise asyncio.CancelledError from None

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        arrival = time.monotonic()
        if isinstance(request, MalformedMessage):
            self.metrics.errors.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(request))
            return
        try:
            inp = wire.generate_request_from_proto(request)
        except ValueError as exc:
            self.metrics.errors.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        try:
            st = await self.admission.admit(inp, max_tokens_set=request.params.HasField("max_tokens"),
                                            arrival=arrival, time_remaining=context.time_remaining())
        except Rejected as exc:
            await self._fail(context, exc.code, exc.details)
            return
        try:
            yield pb.GenerateChunk(request_id=st.request_id)
            async with contextlib.aclosing(self.admission.outputs(st)) as items, \
                    contextlib.aclosing(grouped(items, st.admitted.stream_interval)) as chunks:
                async for item in chunks:
                    if isinstance(item, RequestFailed):
                        await self._fail(context, item.code, item.details)
                        return
                    yield wire.chunk_to_proto(item)
        finally:
            # The caller may leave before outputs() starts (at the first chunk): drop it then.
            # A no-op once outputs() has let the request go.
            self.admission.cancel(st)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if isinstance(request, MalformedMessage):
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(request))
        return pb.AbortResponse(found=self.admission.abort(request.request_id))

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        if isinstance(request, MalformedMessage):
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(request))
        pool = self.config.workers
        info = wire.ModelInfo(
            model=self.model.name, model_identity=self.model.identity, vocab_size=self.model.vocab_size,
            max_context=self.model.max_context, block_size=self.config.block_size,
            eos_token_ids=self.model.eos_token_ids, dtype=self.model.dtype,
            num_prefill_workers=len(pool.prefill) + len(pool.both),
            num_decode_workers=len(pool.decode) + len(pool.both),
        )
        return wire.model_info_to_proto(info)

    def stats(self) -> dict[str, Any]:
        """Queue depths and running count (for logs and tests)."""
        return self.admission.stats()

    async def _fail(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
        """End the call with `code` (admission already counted the error)."""
        try:
            await context.abort(code, details)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            if type(exc).__name__ != "ExecuteBatchError":
                raise
            # The status could not be sent: the caller is gone (its deadline passed as we ended
            # the call). Nothing to tell; gRPC expects a cancelled handler then, not an error.
            logger.debug("%s for a caller already gone: %s", code.name, details)
            raise asyncio.CancelledError from None

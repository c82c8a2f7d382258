"""The public tandem.v1.Tandem servicer: admission (validation, tier queue, deadline) and the
Generate stream, Abort and GetModelInfo. The work after admission is gateway.request's."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.malformed import MalformedMessage
from gateway.metrics import GatewayMetrics
from gateway.modelinfo import ServedModel
from gateway.placement import PlacementNeeds, Placer
from gateway.request import RequestFailed, RequestRunner, RequestState, drain_output
from gateway.streaming import OutputAssembler
from gateway.tiers import QueueFull
from gateway.validate import validate_request
from gateway.workers import WorkerRegistry
from tandem import wire
from tandem._proto.tandem.v1 import tandem_pb2 as pb
from tandem.rules import blocks_needed

logger = logging.getLogger(__name__)


class TandemService(wire.TandemServicer):
    """Generate / Abort / GetModelInfo over the gateway's runner.

    Status codes: INVALID_ARGUMENT (a field, named in the message; or a message that does not
    parse, gateway.malformed), ALREADY_EXISTS (a client-chosen request_id already running),
    RESOURCE_EXHAUSTED (tier queue full, or more than `max_calls` Generate calls in flight: the
    message names the tier; oversize messages are refused by gRPC itself), UNAVAILABLE (draining, or no worker could serve the
    request within the retry bound), DEADLINE_EXCEEDED (the call's deadline or the tier's
    default deadline). The first chunk of a stream is sent at admission and carries the
    request id; tokens follow; the last chunk has finish_reason and usage.
    """

    def __init__(self, *, config: GatewayConfig, model: ServedModel, runner: RequestRunner, placer: Placer,
                 dispatcher: Dispatcher, registry: WorkerRegistry, metrics: GatewayMetrics) -> None:
        self.config = config
        self.model = model
        self.runner = runner
        self.placer = placer
        self.dispatcher = dispatcher
        self.registry = registry
        self.metrics = metrics
        self.running: dict[str, RequestState] = {}
        self.draining = False
        pool = config.workers
        self.max_calls = config.liveness.call_bound(
            sum(t.capacity for t in config.tiers.values()),
            (len(pool.decode) + len(pool.both)) * pool.max_inflight_per_decode)
        self.calls = 0  # Generate calls in this servicer, admitted or not
        self.calls_peak = 0  # the most held at once (tests and fault runs read it)
        metrics.calls_inflight.set_function(lambda: self.calls)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """Writes the chunks itself (context.write) so that a chunk that cannot be sent because
        the caller is gone (its deadline passed meanwhile) ends the call as cancelled here,
        instead of an ERROR logged by gRPC."""
        self.calls += 1
        self.calls_peak = max(self.calls_peak, self.calls)
        try:
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
        finally:
            self.calls -= 1

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        arrival = time.monotonic()
        if isinstance(request, MalformedMessage):
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(request))
            return
        try:
            inp = wire.generate_request_from_proto(request)
            admitted = validate_request(inp, self.model, max_tokens_set=request.params.HasField("max_tokens"))
        except ValueError as exc:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        if self.calls > self.max_calls:
            self.metrics.calls_refused.labels(admitted.tier.name.lower(), "max_inflight_calls").inc()
            await self._fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"tier: {admitted.tier.name} request refused: the gateway holds {self.max_calls} calls "
                             f"(max_inflight_calls); retry later")
            return
        if self.draining:
            await self._fail(context, grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down")
            return
        request_id = admitted.request_id or uuid.uuid4().hex
        if request_id in self.running:
            await self._fail(context, grpc.StatusCode.ALREADY_EXISTS,
                             f"request_id: {request_id!r} is already running")
            return
        tier_cfg = self.config.tiers[admitted.tier]
        budget = tier_cfg.default_deadline_s
        remaining = context.time_remaining()
        if remaining is not None:
            budget = min(budget, remaining)
        deadline = arrival + budget
        # Capped by the context like the engine's; validation already keeps prompt + max_tokens
        # within max_context, so the cap changes no outcome here.
        needed = blocks_needed(len(admitted.prompt_ids), admitted.params.max_tokens, self.model.max_context,
                               self.config.block_size)
        largest = max((h.stats.total_kv_blocks for h in self.registry.decode_workers() if h.stats is not None),
                      default=None)
        if largest is not None and needed > largest:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                             f"max_tokens: prompt plus max_tokens needs {needed} KV blocks; the largest decode "
                             f"worker holds {largest}")
            return
        needs = PlacementNeeds(request_id, len(admitted.prompt_ids), needed)
        assembler = OutputAssembler(self.model.tokenizer, admitted.prompt_ids, admitted.params,
                                    self.model.eos_token_ids, self.model.max_context, admitted.stream_text)
        st = RequestState(request_id, admitted, assembler, arrival, deadline, needs)
        # Abort finds the request from here on (its id is known), whatever happens next.
        self.running[request_id] = st
        status = "ok"
        try:
            await self.placer.match_prompt(needs, admitted.prompt_ids)
            if not st.ended:  # else an Abort came while the prompt was matched: its chunk is on st.out
                try:
                    st.ticket = self.dispatcher.enqueue(needs, admitted.tier, deadline)
                except QueueFull as exc:
                    status = grpc.StatusCode.RESOURCE_EXHAUSTED.name
                    self.metrics.calls_refused.labels(admitted.tier.name.lower(), "queue_full").inc()
                    await self._fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                    return
                self.metrics.tokens_in.inc(len(admitted.prompt_ids))
                self.runner.start(st)
            yield pb.GenerateChunk(request_id=request_id)
            async for item in drain_output(st):
                if isinstance(item, RequestFailed):
                    status = item.code.name
                    await self._fail(context, item.code, item.details)
                    return
                yield wire.chunk_to_proto(item)
                if item.finish_reason is not None:
                    status = item.finish_reason
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            status = "cancelled"
            raise
        finally:
            self.runner.cancel(st)  # no-op once it ended; else it stops and frees what it holds
            if self.running.get(request_id) is st:
                del self.running[request_id]
            self.metrics.requests.labels(status).inc()
            self.metrics.e2e.labels(admitted.tier.name.lower()).observe(time.monotonic() - arrival)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if isinstance(request, MalformedMessage):
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(request))
        st = self.running.get(request.request_id)
        return pb.AbortResponse(found=st is not None and self.runner.abort(st))

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
        return {"running": len(self.running),
                "queued": {t.name.lower(): self.dispatcher.queues.depth(t) for t in self.config.tiers}}

    async def _fail(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
        self.metrics.errors.labels(code.name).inc()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            logger.info("rejected request: %s", details)
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

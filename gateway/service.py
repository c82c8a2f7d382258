"""The public tandem.v1.Tandem servicer: admission (validation, tier queue, deadline) and the
Generate stream, Abort and GetModelInfo. The work after admission is gateway.request's."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
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

    Status codes: INVALID_ARGUMENT (a field, named in the message), ALREADY_EXISTS (a
    client-chosen request_id already running), RESOURCE_EXHAUSTED (tier queue full; oversize
    messages are refused by gRPC itself), UNAVAILABLE (draining, or no worker could serve the
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

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        arrival = time.monotonic()
        try:
            inp = wire.generate_request_from_proto(request)
            admitted = validate_request(inp, self.model, max_tokens_set=request.params.HasField("max_tokens"))
        except ValueError as exc:
            await self._fail(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
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
        await self.placer.match_prompt(needs, admitted.prompt_ids)
        assembler = OutputAssembler(self.model.tokenizer, admitted.prompt_ids, admitted.params,
                                    self.model.eos_token_ids, self.model.max_context, admitted.stream_text)
        st = RequestState(request_id, admitted, assembler, arrival, deadline, needs)
        try:
            st.ticket = self.dispatcher.enqueue(needs, admitted.tier, deadline)
        except QueueFull as exc:
            await self._fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return
        self.running[request_id] = st
        self.metrics.tokens_in.inc(len(admitted.prompt_ids))
        st.task = asyncio.create_task(self.runner.run(st), name=f"request:{request_id}")
        status = "ok"
        try:
            yield pb.GenerateChunk(request_id=request_id)
            async for item in drain_output(st):
                if isinstance(item, RequestFailed):
                    status = item.code.name
                    await self._fail(context, item.code, item.details)
                    return
                yield wire.chunk_to_proto(item)
                if item.finish_reason is not None:
                    status = item.finish_reason
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            if st.task is not None and not st.task.done():
                st.task.cancel()  # client went away: the runner aborts the request on the workers
            self.running.pop(request_id, None)
            self.metrics.requests.labels(status).inc()
            self.metrics.e2e.labels(admitted.tier.name.lower()).observe(time.monotonic() - arrival)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        st = self.running.get(request.request_id)
        if st is None or st.task is None or st.task.done():
            return pb.AbortResponse(found=False)
        st.abort()
        return pb.AbortResponse(found=True)

    async def GetModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
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
        await context.abort(code, details)

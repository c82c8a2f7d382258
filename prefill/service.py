"""The tandem.v1.PrefillWorker servicer (grpc.aio; the engine runs on the engine thread).

Prefill queues the prompt as a prefill-only request; requests that queue while a step runs
share the next one (and `--batch-window-ms` can hold an idle engine for arrivals); the `KvPusher` pushes the KV during the step
that samples the first token and commits; the RPC answers once the commit is handed to the
transport.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from engine.engine import Engine
from kvtransfer import KVSender
from prefill import adapters as ad
from prefill.kv_push import KvPusher, PrefillFailed, PrefillJob, deadline_from
from prefill.tp_push import RankSends, check_pairing
from tandem import security, wire
from tandem._proto.tandem.v1 import tandem_pb2 as pb
from tandem._proto.tandem.v1 import worker_pb2
from worker.engine_loop import LoopStopped
from worker.runtime import WorkerRuntime, rpc

logger = logging.getLogger(__name__)

_FAILURE_STATUS = {
    "aborted": grpc.StatusCode.ABORTED,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "transfer": grpc.StatusCode.UNAVAILABLE,
    "engine": grpc.StatusCode.UNAVAILABLE,
}


class PrefillService(wire.PrefillWorkerServicer):
    """ranks: on rank 0 of a tensor-parallel worker, the collector of the other ranks' push
    results (None without TP); the caller routes the TP link's results into it and installs
    `pusher.step_extras` on the engine's TP runner."""

    def __init__(self, runtime: WorkerRuntime, sender: KVSender, ranks: RankSends | None = None,
                 auth_token: str | None = None) -> None:
        self.runtime = runtime
        self.auth_token = auth_token  # with a token, only targets the gateway vouched for get KV
        self.loop = runtime.loop
        self.sender = sender
        self.tp = ranks.world_size if ranks is not None else 1
        self.pusher = KvPusher(runtime.loop, sender, ranks, runtime.config.transfer.timeout_s,
                               runtime.config.transfer.push)
        runtime.loop.on_layer = self.pusher.on_layer

    @rpc("Prefill")
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        if self.runtime.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        engine = self.runtime.engine
        inp = ad.prefill_from_proto(request, engine.config.block_size)
        t = request.target
        if not security.check_kv_voucher(self.auth_token, t.voucher, inp.request_id, t.reservation_id, t.worker_id,
                                         t.kv_address):
            logger.warning("refused to push %s to %r: the target carries no valid gateway voucher",
                           inp.request_id, t.kv_address)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"target.kv_address: {t.kv_address!r} (decode worker {t.worker_id!r}) is not vouched "
                                "for by the gateway; refusing to push KV there")
        check_pairing(len(inp.target.kv_addresses), self.tp, inp.target.worker_id)
        job = PrefillJob(inp, engine.model_config.num_layers, deadline_from(inp.timeout_s))
        metrics = self.runtime.metrics
        arrived = time.monotonic()
        with self.runtime.tracked():
            await self.runtime.run(lambda e: self.pusher.start(e, job))
            try:
                done = await asyncio.shield(_observed(asyncio.wrap_future(job.done)))
            except PrefillFailed as exc:
                await context.abort(_FAILURE_STATUS[exc.kind], str(exc))
            except asyncio.CancelledError:
                logger.debug("prefill of %s cancelled by the caller", inp.request_id)
                try:
                    self.loop.abort(inp.request_id, "cancelled")
                except LoopStopped:
                    pass
                raise
            computed = time.monotonic()
            # The push honours the request's timeout: a send still pending at the deadline
            # answers DEADLINE_EXCEEDED (the decode worker's reservation expires on its own).
            left = None if job.deadline is None else max(0.0, job.deadline - computed)
            try:
                sent = await asyncio.wait_for(asyncio.shield(_observed(asyncio.wrap_future(done.send))), left)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"KV push of {inp.request_id} not handed over within timeout_ms")
            if not sent.ok:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV push of {inp.request_id} failed: {sent.error}")
            if metrics is not None:
                metrics.observe_prefill("compute", computed - arrived)
                metrics.observe_prefill("handover", time.monotonic() - computed)
            return ad.prefill_response(done.output, len(inp.token_ids), done.cached_tokens, inp.params.logprobs is not None)

    @rpc("Abort")
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        rid = request.request_id

        def abort(engine: Engine) -> bool:
            return self.loop.abort_now(rid, "aborted")

        return pb.AbortResponse(found=await self.runtime.run(abort))

    @rpc("Stats")
    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStats:
        return self.runtime.stats_proto()

    @rpc("KvEvents")
    async def KvEvents(self, request: worker_pb2.KvEventsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.KvEventBatch]:
        async for batch in self.runtime.kv_events(context):
            yield batch


def _observed(fut: asyncio.Future) -> asyncio.Future:
    """`fut`, with its outcome always retrieved: when the RPC is cancelled while a shielded
    future is pending, its later exception is expected and must not be logged by asyncio as
    "exception was never retrieved" (an ERROR with a traceback for every cancelled prefill)."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut

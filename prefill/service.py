"""The tandem.v1.PrefillWorker servicer (grpc.aio; the engine runs on the engine thread).

Prefill queues the prompt as a prefill-only request; requests that queue while a step runs
share the next one (and `--batch-window-ms` can hold an idle engine for arrivals); the `KvPusher` pushes the KV during the step
that samples the first token and commits; the RPC answers once the commit is handed to the
transport. A Prefill sent with `target_follows` is queued at once and its target comes in a
PrefillTarget call (checked like a Prefill's own: the voucher, the blocks, the TP pairing);
the pusher pushes once both the KV and the target are there. A tensor-parallel worker queues
such a prompt only once its target is known (every rank is told its push before the step).
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvtransfer import KVSender
from prefill import adapters as ad
from prefill.adapters import KvTarget
from prefill.kv_push import KvPusher, PrefillFailed, PrefillJob, deadline_from
from prefill.tp_push import RankSends, check_pairing
from tandem import security, wire
from tandem._proto.tandem.v1 import tandem_pb2 as pb
from tandem._proto.tandem.v1 import worker_pb2
from worker.engine_loop import LoopStopped
from worker.runtime import SharedRpcs, WorkerRuntime, rpc

logger = logging.getLogger(__name__)

# A PrefillTarget may overtake its Prefill on the way (two calls, two streams): it waits this
# long for the Prefill to arrive before it answers NOT_FOUND.
EARLY_TARGET_WAIT_S = 2.0

_FAILURE_STATUS = {
    "aborted": grpc.StatusCode.ABORTED,
    "deadline": grpc.StatusCode.DEADLINE_EXCEEDED,
    "transfer": grpc.StatusCode.UNAVAILABLE,
    "engine": grpc.StatusCode.UNAVAILABLE,
}


class PrefillService(SharedRpcs, wire.PrefillWorkerServicer):
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
                               runtime.config.transfer.push, target_timeout_s=runtime.config.transfer.timeout_s)
        runtime.loop.on_layer = self.pusher.on_layer
        runtime.loop.while_running = self.pusher.while_step_runs
        self._target_follows: dict[str, tuple[PrefillJob, asyncio.Event]] = {}  # Prefill calls awaiting a PrefillTarget
        self._early_targets: dict[str, asyncio.Future[None]] = {}  # PrefillTarget calls awaiting their Prefill

    async def _check_target(self, context: grpc.aio.ServicerContext, request_id: str, voucher: str,
                            target: KvTarget) -> None:
        """Abort the call unless the gateway vouched for `target`; KvPairingError unless its
        decode worker runs this worker's tensor-parallel size."""
        if not security.check_kv_voucher(self.auth_token, voucher, request_id, target.reservation_id,
                                         target.worker_id, target.kv_address):
            logger.warning("refused to push %s to %r: the target carries no valid gateway voucher",
                           request_id, target.kv_address)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"target.kv_address: {target.kv_address!r} (decode worker {target.worker_id!r}) is "
                                "not vouched for by the gateway; refusing to push KV there")
        check_pairing(len(target.kv_addresses), self.tp, target.worker_id)

    @rpc("Prefill")
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        if self.runtime.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        engine = self.runtime.engine
        inp = ad.prefill_from_proto(request, engine.config.block_size)
        if inp.target is not None:
            await self._check_target(context, inp.request_id, request.target.voucher, inp.target)
        elif inp.request_id in self._target_follows:
            raise ValueError(f"request_id: {inp.request_id!r} is already in this worker")
        job = PrefillJob(inp, engine.model_config.num_layers, deadline_from(inp.timeout_s))
        metrics = self.runtime.metrics
        arrived = time.monotonic()
        target_known = asyncio.Event()
        if inp.target is None:
            self._target_follows[inp.request_id] = (job, target_known)
            early = self._early_targets.pop(inp.request_id, None)
            if early is not None and not early.done():
                early.set_result(None)
        with self.runtime.tracked():
            try:
                if inp.target is None and self.tp > 1:
                    await self._await_target(context, job, target_known)
                await self.runtime.run(lambda e: self.pusher.start(e, job))
                done = await asyncio.shield(_observed(asyncio.wrap_future(job.done)))
            except PrefillFailed as exc:
                await context.abort(_FAILURE_STATUS[exc.kind], str(exc))
            except asyncio.CancelledError:
                logger.debug("prefill of %s cancelled by the caller", inp.request_id)
                try:
                    self.loop.submit(lambda e: self.pusher.abort(e, inp.request_id, "cancelled"))
                except LoopStopped:
                    pass
                raise
            finally:
                if self._target_follows.get(inp.request_id, (None,))[0] is job:
                    del self._target_follows[inp.request_id]
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
                if job.admitted_at is not None:
                    metrics.observe_prefill("queue", job.admitted_at - arrived)
                if job.sampled_at is not None:
                    metrics.observe_prefill("finish", computed - job.sampled_at)
                    if job.committed_at is not None:
                        metrics.observe_prefill("commit", job.committed_at - job.sampled_at)
            return ad.prefill_response(done.output, len(inp.token_ids), done.cached_tokens, inp.params.logprobs is not None)

    async def _await_target(self, context: grpc.aio.ServicerContext, job: PrefillJob, known: asyncio.Event) -> None:
        """Tensor parallel: wait for the target before the prompt is queued (bounded as the
        pusher bounds a computed prompt's wait)."""
        limit = self.pusher.target_timeout_s
        if job.deadline is not None:
            limit = min(limit, max(0.0, job.deadline - time.monotonic()))
        try:
            await asyncio.wait_for(known.wait(), limit)
        except TimeoutError:
            raise PrefillFailed("transfer", f"no KV target came for {job.inp.request_id} within {limit:g}s") from None

    async def _prefill_arrival(self, rid: str) -> tuple[PrefillJob, asyncio.Event] | None:
        """Wait up to EARLY_TARGET_WAIT_S for the Prefill of `rid` to arrive."""
        arrived = self._early_targets.setdefault(rid, asyncio.get_running_loop().create_future())
        try:
            await asyncio.wait_for(asyncio.shield(arrived), EARLY_TARGET_WAIT_S)
        except TimeoutError:
            pass
        finally:
            if self._early_targets.get(rid) is arrived:
                del self._early_targets[rid]
        return self._target_follows.get(rid)

    @rpc("PrefillTarget")
    async def PrefillTarget(self, request: worker_pb2.PrefillTargetRequest,
                            context: grpc.aio.ServicerContext) -> worker_pb2.PrefillTargetResponse:
        rid = request.request_id
        waiting = self._target_follows.get(rid) or await self._prefill_arrival(rid)
        if waiting is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request_id: no prefill of {rid!r} waits for a target (it ended, or was not "
                                "sent with target_follows)")
        job, known = waiting
        if job.target is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"request_id: the prefill of {rid!r} has its target")
        try:
            if not request.HasField("target"):
                raise ValueError("target: a KvTarget is required")
            target = ad.target_from_proto(request.target, len(job.inp.token_ids), self.runtime.engine.config.block_size)
            await self._check_target(context, rid, request.target.voucher, target)
        except BaseException:  # a refused target ends the prefill too: nothing waits on it
            self.loop.submit(lambda e: self.pusher.abort(e, rid, "aborted: its target was refused"))
            raise
        job.target = target  # the engine thread's hooks read it from here on
        self.pusher.target_set()
        known.set()
        await self.runtime.run(lambda e: self.pusher.target_arrived(e, job))
        return worker_pb2.PrefillTargetResponse()

    @rpc("Abort")
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        rid = request.request_id
        return pb.AbortResponse(found=await self.runtime.run(lambda e: self.pusher.abort(e, rid, "aborted")))



def _observed(fut: asyncio.Future) -> asyncio.Future:
    """`fut`, with its outcome always retrieved: when the RPC is cancelled while a shielded
    future is pending, its later exception is expected and must not be logged by asyncio as
    "exception was never retrieved" (an ERROR with a traceback for every cancelled prefill)."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut

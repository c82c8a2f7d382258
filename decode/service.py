"""The tandem.v1.DecodeWorker servicer (grpc.aio; the engine runs on the engine thread).

Disaggregated path: Reserve -> (the prefill worker pushes KV into the reserved blocks) ->
Decode waits for the transfer, activates the request and streams the tokens after the first.
Local path (role both, or a short prompt): PrefillAndDecode streams every token.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator

import grpc

from decode import adapters as ad
from decode.reservations import Reservation, ReservationState, ReservationTable
from engine.engine import Engine
from engine.outputs import FinishReason, StepOutput
from kvtransfer import KVReceiver, TransferResult
from tandem import wire
from tandem._proto.tandem.v1 import tandem_pb2 as pb
from tandem._proto.tandem.v1 import worker_pb2
from tandem.types import DEADLINE, SamplingParams
from worker.adapters import chunk_from_outputs, logprob_from_meta
from worker.engine_loop import LoopStopped
from worker.runtime import SharedRpcs, WorkerRuntime, rpc
from worker.streams import ItemStream, coalescing

logger = logging.getLogger(__name__)


class DecodeService(SharedRpcs, wire.DecodeWorkerServicer):
    """receiver: the KV receiver (None for role both: Reserve then answers ok=false).
    kv_timeout_s: how long a reservation lives when the request carries no timeout."""

    def __init__(self, runtime: WorkerRuntime, kv_timeout_s: float) -> None:
        self.runtime = runtime
        self.loop = runtime.loop
        self.receiver: KVReceiver | None = None
        self.kv_timeout_s = kv_timeout_s
        self.table = ReservationTable()
        self._ids = itertools.count(int(time.time() * 1000) << 12)  # unique across restarts

    # ---- KV receiver callback (receiver thread) -----------------------------------------------
    def on_transfer(self, result: TransferResult) -> None:
        res = self.table.by_transfer(result.request_id)
        if res is None:
            return
        res.resolve(result)
        if not result.ok:
            logger.warning("kv transfer for %s failed: %s", res.request_id, result.error)
            try:
                self.loop.submit(lambda e: self._end(e, res, f"transfer failed: {result.error}"))
            except LoopStopped:
                pass

    # ---- engine-thread helpers ----------------------------------------------------------------
    def _end(self, engine: Engine, res: Reservation, reason: str) -> bool:
        """Free a reservation that was not activated; False if it already left RESERVED."""
        if res.state is not ReservationState.RESERVED:
            return False
        res.state = ReservationState.RELEASED
        if res.timer is not None:
            res.timer.cancel()
        if self.receiver is not None:
            self.receiver.cancel(res.transfer_id)
        engine.release(res.request_id)
        self.table.remove(res, reason)
        res.resolve(TransferResult(res.transfer_id, False, error=reason))
        logger.debug("reservation %d of %s ended: %s", res.reservation_id, res.request_id, reason)
        return True

    def _reserve(self, engine: Engine, inp: ad.ReserveInput, reservation_id: int) -> tuple[Reservation | None, int]:
        params = SamplingParams(max_tokens=inp.max_tokens)
        got = engine.reserve(inp.request_id, inp.token_ids, params, inp.tier, num_output_tokens=inp.num_output_tokens)
        if got is None:
            return None, engine.num_free_blocks + engine.cache.evictable_blocks
        num_cached, dst = got
        lifetime = inp.timeout_s or self.kv_timeout_s
        res = Reservation(inp.request_id, reservation_id, num_cached, list(dst), inp.num_output_tokens,
                          time.monotonic() + lifetime)
        try:
            self.receiver.expect(res.transfer_id, res.dst_block_ids, engine.model_config.num_layers, lifetime)
        except BaseException:
            engine.release(inp.request_id)
            raise
        self.table.add(res)
        # The receiver fails the transfer at the deadline; this also frees a reservation whose
        # KV arrived but whose Decode never came.
        res.timer = self.loop.call_at(res.deadline, lambda e: self._end(e, res, "expired"))
        return res, engine.num_free_blocks + engine.cache.evictable_blocks

    # ---- RPCs -------------------------------------------------------------------------------
    @rpc("Reserve")
    async def Reserve(self, request: worker_pb2.ReserveRequest, context: grpc.aio.ServicerContext) -> worker_pb2.ReserveResponse:
        free = self.loop.stats.available_blocks
        if self.runtime.draining:
            return ad.reserve_refused("draining", free)
        if self.receiver is None:
            return ad.reserve_refused("this worker has no KV receiver (role both): use PrefillAndDecode", free)
        inp = ad.reserve_from_proto(request)
        rid = next(self._ids)
        self.loop.reserves_arriving += 1  # the gateway sent the prompt's Prefill with it: hold from now
        try:
            # It runs inside a held launch too: the prompt's prefill step, which the hold lets go
            # first, needs this answer (its KV target) before it ends.
            res, free = await self.runtime.run(lambda e: self._reserve(e, inp, rid), in_hold=True)
        finally:
            self.loop.reserves_arriving -= 1
        if res is None:
            return ad.reserve_refused("no free KV blocks", free)
        return ad.reserve_ok(rid, self.receiver.address, res.num_cached_blocks, res.dst_block_ids, free)

    @rpc("Decode")
    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeChunk]:
        inp = ad.decode_from_proto(request)
        res = self.table.get(inp.request_id)
        if res is None or res.reservation_id != inp.reservation_id:
            why = self.table.ended_reason(inp.request_id) or "no such reservation"
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"request {inp.request_id} reservation {inp.reservation_id}: {why}")
        deadline = time.monotonic() + inp.timeout_s if inp.timeout_s else None
        with self.runtime.tracked():
            try:
                result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(res.result)),
                                                None if deadline is None else max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                result = TransferResult(res.transfer_id, False, error="not committed within timeout_ms")
            if not result.ok:
                await self.runtime.run(lambda e: self._end(e, res, f"transfer failed: {result.error}"))
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer for {inp.request_id} failed: {result.error}")
            meta = result.meta or {}
            if meta.get("first_token_id", inp.first_token_id) != inp.first_token_id:
                logger.warning("%s: Decode's first token %d differs from the commit's %s; using Decode's",
                               inp.request_id, inp.first_token_id, meta.get("first_token_id"))
            stream = ItemStream(self.runtime.bridge)
            logprob = logprob_from_meta(meta.get("logprobs"))
            try:
                first = await self.runtime.run(lambda e: self._activate(e, res, inp, logprob, stream, deadline))
            except LookupError as exc:  # released meanwhile (abort, expiry): retryable elsewhere
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            if first.finished:
                yield chunk_from_outputs([StepOutput(inp.request_id, [], [], True, first.finish_reason, first.stop_reason)],
                                         False)
                return
            async for chunk in self._stream(stream, inp.request_id, inp.params, context):
                yield chunk

    def _activate(self, engine: Engine, res: Reservation, inp: ad.DecodeInput, logprob, stream: ItemStream,
                  deadline: float | None) -> StepOutput:
        if res.state is not ReservationState.RESERVED:
            raise LookupError(f"request_id: reservation of {inp.request_id} was {self.table.ended_reason(inp.request_id)}")
        res.state = ReservationState.DECODING
        if res.timer is not None:
            res.timer.cancel()
        self.table.remove(res, "activated")
        self.loop.listen(inp.request_id, coalescing(stream.put_all, inp.stream_interval))
        try:
            out = engine.activate(inp.request_id, inp.first_token_id, logprob, inp.params)
        except BaseException:
            self.loop.unlisten(inp.request_id)
            engine.release(inp.request_id)
            raise
        if out.finished:
            self.loop.unlisten(inp.request_id)
        elif deadline is not None:
            self._set_deadline(engine, inp.request_id, deadline)
        return out

    def _set_deadline(self, engine: Engine, request_id: str, deadline: float) -> None:
        request = engine.get(request_id)

        def expire(e: Engine) -> None:
            if request is not None and e.get(request_id) == request:
                self.loop.abort_now(request_id, DEADLINE)

        self.loop.call_at(deadline, expire)

    async def _stream(self, stream: ItemStream, request_id: str, params: SamplingParams,
                      context: grpc.aio.ServicerContext, cached_tokens=None) -> AsyncIterator[worker_pb2.DecodeChunk]:
        """DecodeChunks from the request's outputs until it finishes; aborts it if the client leaves."""
        finished = False
        first = True
        try:
            while not finished:
                outs: list[StepOutput] = []
                for item in await stream.get_batch():
                    if isinstance(item, BaseException):
                        finished = True
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {request_id} ended by the engine: {item}")
                    outs.append(item)
                last = outs[-1]
                finished = last.finished
                if finished and last.finish_reason is FinishReason.ABORT and last.stop_reason == DEADLINE:
                    if any(o.new_token_ids for o in outs):
                        yield chunk_from_outputs(outs[:-1], params.logprobs is not None)
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {request_id}: timeout_ms expired")
                yield chunk_from_outputs(outs, params.logprobs is not None,
                                         cached_tokens() if first and cached_tokens is not None else 0)
                first = False
        finally:
            if not finished:
                try:
                    self.loop.abort(request_id, "cancelled")
                except LoopStopped:
                    pass

    @rpc("PrefillAndDecode")
    async def PrefillAndDecode(self, request: worker_pb2.GenerateOnWorkerRequest,
                               context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.DecodeChunk]:
        if self.runtime.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "draining")
        inp = ad.local_from_proto(request)
        deadline = time.monotonic() + inp.timeout_s if inp.timeout_s else None
        stream = ItemStream(self.runtime.bridge)

        def add(engine: Engine):
            request = engine.admit(inp.token_ids, inp.params, inp.request_id, inp.tier,
                                   num_output_tokens=inp.num_output_tokens, field="token_ids")
            self.loop.listen(inp.request_id, coalescing(stream.put_all, inp.stream_interval))
            if deadline is not None:
                self._set_deadline(engine, inp.request_id, deadline)
            return request

        with self.runtime.tracked():
            request = await self.runtime.run(add)
            async for chunk in self._stream(stream, inp.request_id, inp.params, context,
                                            lambda: request.num_cached_tokens):
                yield chunk

    @rpc("Release")
    async def Release(self, request: worker_pb2.ReleaseRequest, context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseResponse:
        """Frees the request whatever its state, if reservation_id matches (0 matches any)."""
        rid, res_id = request.request_id, request.reservation_id

        def release(engine: Engine) -> bool:
            res = self.table.get(rid)
            if res is not None and res_id and res.reservation_id != res_id:
                return False
            found = res is not None and self._end(engine, res, "released")
            return self.loop.abort_now(rid, "released") or found

        return worker_pb2.ReleaseResponse(found=await self.runtime.run(release))

    @rpc("Abort")
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        rid = request.request_id

        def abort(engine: Engine) -> bool:
            res = self.table.get(rid)
            found = res is not None and self._end(engine, res, "aborted")
            return self.loop.abort_now(rid, "aborted") or found

        return pb.AbortResponse(found=await self.runtime.run(abort))



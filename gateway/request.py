"""One request's life after admission: the attempt flow. Wait for a decode slot (the
dispatcher), ask the placer where the prompt is computed, then run the attempt on the workers
(Reserve on D, Prefill on P, Decode on D; or PrefillAndDecode on one worker), stream what the
client has not seen yet, and retry on another worker after a failure.

Which workers serve an attempt is gateway.placement's decision; how a call to a worker is made
and how its failure is classified is gateway.worker_client's. Everything here runs in the
gateway's event loop, one `RequestRunner.run` task per request.

Exactly-once delivery: the `OutputAssembler` holds every token already sent; a retry prefills
prompt + those tokens (num_output_tokens tells the worker they are output) and only tokens
after them reach the client. Every worker that may hold the request is told to Abort when the
request ends any other way than the worker finishing it (client cancel, abort, deadline,
error, a stop string cut here).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from gateway.adapters import Reservation
from gateway.dispatch import Dispatcher, Waiter
from gateway.liveness import LivenessConfig, worker_stream_interval
from gateway.metrics import GatewayMetrics
from gateway.placement import Placement, PlacementNeeds, Placer
from gateway.streaming import Emission, OutputAssembler
from gateway.tiers import Ticket
from gateway.validate import AdmittedRequest
from gateway.worker_client import (ABORT_TIMEOUT_S, ChunkStream, DeadlineReached, WorkerRejected,
                                   WorkerUnavailable)
from gateway.workers import WorkerHandle
from tandem.wire import Chunk

logger = logging.getLogger(__name__)

RESERVE_BACKOFF_S = (0.01, 0.02, 0.05, 0.1, 0.2)
# How often a stream waiting on its worker looks whether the worker was drained (gateway.admin).
DRAIN_POLL_S = 0.25


class RequestFailed(Exception):
    """Ends the Generate call with `code` (sent as the gRPC status)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _NoRoom(Exception):
    """D refused the reservation (no free KV blocks): place the request again."""


@dataclass(eq=False)
class RequestState:
    """A request from admission to its last chunk. `out` carries the chunks after the first
    (which the service sends at admission with the request id), then the final Chunk or a
    RequestFailed."""

    request_id: str
    admitted: AdmittedRequest
    assembler: OutputAssembler
    arrival: float
    deadline: float
    needs: PlacementNeeds
    ticket: Ticket[Waiter] | None = None
    out: asyncio.Queue[Chunk | RequestFailed] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    aborted: bool = False
    started: bool = False  # its `run` task has begun (before that, cancelling it runs no code of it)
    ended: bool = False  # its final item (last chunk or RequestFailed) is on `out`
    cached_tokens: int = 0
    attempts: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    holders: dict[tuple[str, str], tuple[WorkerHandle, asyncio.Future[Reservation] | None]] = field(default_factory=dict)

    @property
    def worker_interval(self) -> int:
        """Tokens per chunk asked of the workers (gateway.liveness.worker_stream_interval)."""
        return worker_stream_interval(self.admitted.stream_interval)


class RequestRunner:
    """Runs admitted requests (one `run` task each); shared by every request of a gateway.

    Lifecycle (event loop only): the service makes a RequestState as soon as the request id is
    known, `start(st)` once its ticket is queued, and ends it with `abort(st)` (the Abort RPC:
    the stream gets its final chunk) or `cancel(st)` (the client went away). Both work at any
    moment: before `start`, before the task ran a line (then the task never runs and its
    ticket is withdrawn, its slot given back if one was granted), queued, or during any stage
    of an attempt (the attempt's `finally` gives back the slot and aborts every holder).
    """

    def __init__(self, *, dispatcher: Dispatcher, placer: Placer, block_size: int, max_retries: int,
                 metrics: GatewayMetrics, liveness: LivenessConfig | None = None,
                 prefill_target_follows: bool = True) -> None:
        self.dispatcher = dispatcher
        # Send a disaggregated attempt's Prefill with its Reserve (the target follows); an
        # attempt after a refused Reserve waits for the reservation, so a short decode worker
        # does not cost a prefill per retry.
        self.prefill_target_follows = prefill_target_follows
        self.placer = placer
        self.block_size = block_size
        self.max_retries = max_retries
        self.metrics = metrics
        self.liveness = liveness or LivenessConfig()
        self._background: set[asyncio.Task[Any]] = set()

    # ---------------------------------------------------------------- lifecycle

    def start(self, st: RequestState) -> None:
        """Run `st` (its ticket is queued) in a task of its own."""
        st.task = asyncio.create_task(self.run(st), name=f"request:{st.request_id}")
        st.task.add_done_callback(lambda _t: self._after(st))

    def _after(self, st: RequestState) -> None:
        if not st.started and st.ticket is not None:
            self.dispatcher.withdraw(st.ticket)  # cancelled before it ran: no code of it ever will

    def abort(self, st: RequestState) -> bool:
        """The Abort RPC: end the stream with FINISH_REASON_ABORT; False when it already ended."""
        if st.ended:
            return False
        st.aborted = True
        if st.started and st.task is not None and not st.task.done():
            st.task.cancel()  # run() ends it with the abort chunk and cleans up
            return True
        if st.task is not None:
            st.task.cancel()  # never ran: `_after` withdraws its ticket
        self._emit(st, st.assembler.finish("abort", "aborted by request"))
        return True

    def cancel(self, st: RequestState) -> None:
        """The client went away: stop the request wherever it is (nothing more is sent)."""
        if st.task is not None and not st.task.done():
            st.task.cancel()

    async def close(self) -> None:
        """Wait (briefly) for outstanding worker aborts."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=ABORT_TIMEOUT_S)

    # ---------------------------------------------------------------- top level

    async def run(self, st: RequestState) -> None:
        """Drive `st` to its end; the last item put on st.out is a final Chunk or RequestFailed
        (nothing when the client went away)."""
        st.started = True
        try:
            if st.aborted:
                raise asyncio.CancelledError
            async with asyncio.timeout(st.deadline - time.monotonic()):
                await self._attempts(st)
        except (TimeoutError, DeadlineReached):
            self._put(st, RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"deadline exceeded after {st.assembler.delivered} tokens"))
        except asyncio.CancelledError:
            if not st.aborted:
                raise
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                task.uncancel()
            if not st.ended:
                self._emit(st, st.assembler.finish("abort", "aborted by request"))
        except RequestFailed as exc:
            self._put(st, exc)
        except WorkerRejected as exc:
            self._put(st, RequestFailed(exc.code, exc.details))
        except Exception as exc:
            logger.exception("request %s failed", st.request_id)
            self._put(st, RequestFailed(grpc.StatusCode.INTERNAL, f"gateway error: {exc!r}"))
        finally:
            if st.ticket is not None:
                self.dispatcher.withdraw(st.ticket)  # no-op unless it is still queued
            self._abort_holders(st)

    async def _attempts(self, st: RequestState) -> None:
        assert st.ticket is not None
        failures = no_room = 0
        retry = False
        while True:
            worker = await self.dispatcher.acquire(st.ticket, retry=retry)
            retry = True
            backoff = 0.0
            try:
                await self._attempt(st, worker, target_follows=self.prefill_target_follows and not no_room)
                return
            except _NoRoom as exc:
                logger.debug("request %s: %s has no room (%s)", st.request_id, worker.name, exc)
                backoff = RESERVE_BACKOFF_S[min(no_room, len(RESERVE_BACKOFF_S) - 1)]
                no_room += 1
            except WorkerUnavailable as exc:
                failures += 1
                self.metrics.retries.labels(exc.stage).inc()
                failed = exc.worker or worker
                self.placer.avoid(st.needs, failed)
                logger.warning("request %s attempt %d failed on %s: %s", st.request_id, st.attempts,
                               failed.name, exc.cause)
                if failures > self.max_retries:
                    if st.assembler.delivered:
                        self._emit(st, st.assembler.finish("error", f"gave up after {failures} attempts: {exc.cause}"))
                        return
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                        f"no worker could serve the request ({failures} attempts): {exc.cause}")
            finally:
                self.dispatcher.release(worker, st.needs.needed_blocks)
                self.placer.release(st.needs)
                self._abort_holders(st)
            if backoff:  # D had no free blocks: give running requests a moment, slot released
                await asyncio.sleep(backoff)

    async def _attempt(self, st: RequestState, d: WorkerHandle, target_follows: bool) -> None:
        st.attempts += 1
        # Workers see one id per attempt, so a late Abort of an earlier attempt cannot hit this one.
        wrid = st.request_id if st.attempts == 1 else f"{st.request_id}#{st.attempts - 1}"
        tokens = list(st.admitted.prompt_ids) + st.assembler.output_ids
        n_out = st.assembler.delivered
        if st.attempts > 1 and n_out:  # output was streamed from a worker that failed: a migration
            self.metrics.migrations.labels(st.admitted.tier.name.lower()).inc()
        placement = self.placer.place(st.needs, d, len(tokens))
        if placement.local:
            self._note_prefill(st, wrid, placement)
            stream = d.client.prefill_and_decode(wrid, tokens, st.admitted.params, st.admitted.tier, n_out,
                                                 st.deadline, st.worker_interval)
            self._hold(st, d, wrid)
            await self._consume(st, d, wrid, stream)
        else:
            await self._disaggregated(st, placement, wrid, tokens, n_out, target_follows)

    def _note_prefill(self, st: RequestState, wrid: str, placement: Placement) -> None:
        w = placement.computes_prompt
        self.metrics.prefill_requests.labels(w.name).inc()
        self.dispatcher.note_prefill(wrid, st.admitted.tier, w, placement.reason)

    async def _disaggregated(self, st: RequestState, placement: Placement, wrid: str, tokens: list[int],
                             n_out: int, target_follows: bool) -> None:
        """Reserve on D, Prefill on P, Decode on D. target_follows: the Prefill goes out with the
        Reserve, without its target, and the target follows once D has reserved (P computes
        meanwhile; a refused Reserve aborts it). Else the Prefill waits for the reservation."""
        d = placement.decode
        params = st.admitted.params
        # 1. D reserves blocks. Shielded: if we are cancelled meanwhile, the cleanup waits for
        # the answer before aborting, so a late reservation cannot leak.
        reserve = d.client.reserve(wrid, tokens, params.max_tokens - n_out, st.admitted.tier, n_out, st.deadline)
        self._hold(st, d, wrid, reserve)
        reserve_sent = time.monotonic()
        resv = None if target_follows else await self._reserved(st, d, wrid, reserve, reserve_sent)
        # 2. P prefills and pushes the KV into D's reserved blocks.
        placement = await self.placer.route_prefill(st.needs, placement, tokens, resumed=n_out > 0)
        p = placement.computes_prompt
        self._note_prefill(st, wrid, placement)
        self._hold(st, p, wrid)
        t = time.monotonic()
        prefill = p.client.prefill(wrid, tokens, params, st.admitted.tier, n_out, st.deadline, d.name, resv)
        try:
            if resv is None:
                resv = await self._reserved(st, d, wrid, reserve, reserve_sent)
                target = p.client.prefill_target(wrid, d.name, resv, st.deadline)
                try:
                    await self._unless_stalled(p, "prefill", self.liveness.prefill_timeout(p), target)
                except WorkerUnavailable as exc:
                    # The prefill ended first (its target found nothing waiting, or never got an
                    # answer): say why it ended. A target P refused (pairing, voucher) ends the
                    # prefill too, and its own error is the reason, whichever answer came first.
                    ended_first = exc.code in (None, grpc.StatusCode.NOT_FOUND)
                    if ended_first and prefill.done() and not prefill.cancelled() and prefill.exception() is not None:
                        raise prefill.exception() from None
                    raise
            first = await self._unless_stalled(p, "prefill", self.liveness.prefill_timeout(p), prefill)
        finally:
            if not prefill.done():
                prefill.cancel()  # P aborts a prefill whose call is cancelled
            elif not prefill.cancelled():
                prefill.exception()  # read, so an error nobody awaits is not logged as lost
            self.placer.release(st.needs)
        self.metrics.worker_calls.labels("prefill").observe(time.monotonic() - t)
        self._unhold(st, p, wrid)  # P released its blocks once the KV was handed to the sender
        st.cached_tokens = max(st.cached_tokens, first.cached_tokens, resv.num_cached_blocks * self.block_size)
        self._emit(st, st.assembler.add([first.first_token_id], [first.first_logprob]))
        if st.assembler.finished or first.finish_reason is not None:
            if not st.assembler.finished:
                self._emit(st, st.assembler.finish(first.finish_reason or "stop", first.stop_reason))
            self._unhold(st, d, wrid)
            self._spawn(d.client.release(wrid, resv.reservation_id))
            return
        # 3. D decodes the tokens after the first one.
        stream = d.client.decode(wrid, resv.reservation_id, first.first_token_id, params, st.deadline,
                                 st.worker_interval)
        await self._consume(st, d, wrid, stream)

    async def _reserved(self, st: RequestState, d: WorkerHandle, wrid: str, reserve: asyncio.Future[Reservation],
                        sent: float) -> Reservation:
        """The answer to the Reserve sent at `sent`; _NoRoom when D refused it."""
        resv = await self._unless_stalled(d, "reserve", self.liveness.prefill_timeout(d), asyncio.shield(reserve))
        self.metrics.worker_calls.labels("reserve").observe(time.monotonic() - sent)
        if not resv.ok:
            self._unhold(st, d, wrid)
            raise _NoRoom(resv.reason or "reservation refused")
        return resv

    async def _consume(self, st: RequestState, w: WorkerHandle, wrid: str, stream: ChunkStream) -> None:
        """Relay a worker's chunks until the request ends; raises WorkerUnavailable on failure,
        also when the worker sends nothing for its stall timeout (gateway.liveness: the first
        chunk, which includes the prompt's computation or KV transfer, gets the prefill bound)."""
        got_first = False
        chunks = stream.__aiter__()
        last = started = time.monotonic()
        try:
            while True:
                limit = (self.liveness.stream_timeout(w, st.worker_interval) if got_first
                         else self.liveness.prefill_timeout(w))
                try:
                    chunk = await self._unless_stalled(w, "stream", limit, chunks.__anext__())
                except StopAsyncIteration:
                    break
                now = w.last_progress = time.monotonic()
                if got_first and chunk.token_ids:
                    self.liveness.observe_chunk(w, (now - last) / len(chunk.token_ids))
                last = now
                if not got_first:
                    got_first = True
                    self.metrics.worker_calls.labels("first_chunk").observe(now - started)
                    st.cached_tokens = max(st.cached_tokens, chunk.cached_tokens)
                    self.placer.release(st.needs)  # the prompt is computed
                self._emit(st, st.assembler.add(chunk.token_ids, chunk.logprobs))
                if st.assembler.finished:
                    if chunk.finish_reason is not None:
                        self._unhold(st, w, wrid)  # the worker ended it too: nothing to abort
                    return  # else: cut here (stop string, max_tokens); the holder gets Abort
                if chunk.finish_reason is not None:
                    if chunk.finish_reason in ("stop", "length"):
                        self._unhold(st, w, wrid)
                        self._emit(st, st.assembler.finish(chunk.finish_reason, chunk.stop_reason))
                        return
                    raise WorkerUnavailable("stream", f"worker ended it with {chunk.finish_reason}: "
                                                      f"{chunk.stop_reason}", w)
        finally:
            stream.cancel()
        raise WorkerUnavailable("stream", "ended without a final chunk", w)

    async def _unless_stalled(self, w: WorkerHandle, stage: str, limit: float, awaitable: Any) -> Any:
        """Await `awaitable` (a call on `w`) unless `w` stalls: it is stalled when this call got
        nothing for `limit` seconds AND no other call on `w` made progress in that time (a
        request waiting or preempted inside a busy worker is not a stall; a frozen worker
        stalls every call on it). Then `w` is suspect and the attempt fails like a dead
        worker's (WorkerUnavailable: the caller retries elsewhere; holders get Abort)."""
        if stage == "stream" and self._drained_elsewhere(w):
            if asyncio.iscoroutine(awaitable):
                awaitable.close()  # never awaited
            raise WorkerUnavailable(stage, f"worker {w.name} was {w.mark}: its streams move to another", w)
        task = asyncio.ensure_future(awaitable)
        waiting_since = time.monotonic()
        wait = limit
        try:
            while True:
                done, _ = await asyncio.wait((task,), timeout=min(wait, DRAIN_POLL_S))
                if done:
                    result = task.result()
                    w.last_progress = time.monotonic()
                    return result
                if stage == "stream" and self._drained_elsewhere(w):
                    raise WorkerUnavailable(stage, f"worker {w.name} was {w.mark}: its streams move to another", w)
                # Silence counts from this call's start or the worker's last progress, the later:
                # a worker idle (or new) before this call has not been silent on it.
                idle = time.monotonic() - max(w.last_progress, waiting_since)
                if idle >= limit:
                    break
                wait = max(limit - idle, 0.05)  # the worker is alive: wait until `limit` of silence on it
        finally:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                # Finished as this wait was cancelled or gave up: its error (a DeadlineReached, say)
                # has no reader any more, and unread it would be logged as never retrieved.
                task.exception()
        self.metrics.stalls.labels(stage).inc()
        self.placer.registry.suspect(w, f"no progress on a {stage} for {limit:.1f} s")
        raise WorkerUnavailable(stage, f"stalled: no progress on the worker for {limit:.1f} s", w)

    def _drained_elsewhere(self, w: WorkerHandle) -> bool:
        """`w` was drained or isolated (gateway.admin) and another decode worker can take its
        streams: they migrate, as a dead worker's do. With no other, they finish where they are."""
        return bool(w.mark) and any(h.routable for h in self.placer.registry.decode_workers() if h is not w)

    # ---------------------------------------------------------------- cleanup

    def _hold(self, st: RequestState, w: WorkerHandle, wrid: str,
              pending: asyncio.Future[Reservation] | None = None) -> None:
        st.holders[(w.address, wrid)] = (w, pending)

    def _unhold(self, st: RequestState, w: WorkerHandle, wrid: str) -> None:
        st.holders.pop((w.address, wrid), None)

    def _abort_holders(self, st: RequestState) -> None:
        """Tell every worker that may hold the request to drop it (in the background)."""
        holders, st.holders = st.holders, {}
        for (_, wrid), (w, pending) in holders.items():
            self._spawn(self._abort_on(w, wrid, pending))

    async def _abort_on(self, w: WorkerHandle, wrid: str, pending: asyncio.Future[Reservation] | None) -> None:
        if pending is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(pending), ABORT_TIMEOUT_S)
        await w.client.abort(wrid)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---------------------------------------------------------------- output

    def _emit(self, st: RequestState, em: Emission) -> None:
        if em.empty:
            return
        now = time.monotonic()
        tier = st.admitted.tier.name.lower()
        if em.token_ids:
            if st.first_token_at is None:
                st.first_token_at = now
                self.metrics.ttft.labels(tier).observe(now - st.arrival)
            elif st.last_token_at is not None:
                self.metrics.itl.labels(tier).observe((now - st.last_token_at) / len(em.token_ids))
            st.last_token_at = now
            self.metrics.tokens_out.inc(len(em.token_ids))
        chunk = Chunk(token_ids=em.token_ids, text=em.text, logprobs=em.logprobs, finish_reason=em.finish_reason,
                      stop_reason=em.stop_reason, matched_stop=em.matched_stop)
        if em.finish_reason is not None:
            chunk.usage = st.assembler.usage(st.cached_tokens)
        self._put(st, chunk)

    @staticmethod
    def _put(st: RequestState, item: Chunk | RequestFailed) -> None:
        if st.ended:
            return  # one final item per request (an abort racing the last chunk)
        if isinstance(item, RequestFailed) or item.finish_reason is not None:
            st.ended = True
        st.out.put_nowait(item)


async def drain_output(st: RequestState) -> AsyncIterator[Chunk | RequestFailed]:
    """Items of st.out until the final one."""
    while True:
        item = await st.out.get()
        yield item
        if isinstance(item, RequestFailed) or item.finish_reason is not None:
            return

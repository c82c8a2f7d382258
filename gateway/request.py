"""One request's life after admission: wait for a decode slot, run it on the workers
(Reserve on D, Prefill on P, Decode on D; or PrefillAndDecode on a role-both worker), stream
what the client has not seen yet, and retry on another worker after a failure.

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
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from gateway import adapters
from gateway.adapters import WorkerChunk
from gateway.dispatch import Dispatcher, Waiter
from gateway.metrics import GatewayMetrics
from gateway.routing import CacheAwareRouter
from gateway.streaming import Emission, OutputAssembler
from gateway.tiers import Ticket
from gateway.validate import AdmittedRequest
from gateway.workers import WorkerHandle, WorkerRegistry
from tandem.hashing import block_hashes
from tandem.wire import Chunk

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 5.0
RESERVE_BACKOFF_S = (0.01, 0.02, 0.05, 0.1, 0.2)
# Worker statuses that end the request as they are (the request itself is at fault).
_FINAL_CODES = {grpc.StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.UNIMPLEMENTED: grpc.StatusCode.INTERNAL,
                grpc.StatusCode.PERMISSION_DENIED: grpc.StatusCode.INTERNAL}


class RequestFailed(Exception):
    """Ends the Generate call with `code` (sent as the gRPC status)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class _Retry(Exception):
    """The attempt failed in a way another worker may not (worker down, transfer failed)."""

    def __init__(self, stage: str, cause: str, worker: WorkerHandle | None = None) -> None:
        super().__init__(f"{stage}: {cause}")
        self.stage, self.cause, self.worker = stage, f"{stage}: {cause}", worker


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
    ticket: Ticket[Waiter] | None = None
    out: asyncio.Queue[Chunk | RequestFailed] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    aborted: bool = False
    cached_tokens: int = 0
    attempts: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    holders: dict[tuple[str, str], tuple[WorkerHandle, asyncio.Future[Any] | None]] = field(default_factory=dict)

    def remaining(self) -> float:
        """Seconds to the deadline (at least 1 ms, so it can always be sent as a timeout)."""
        return max(self.deadline - time.monotonic(), 0.001)

    def abort(self) -> None:
        """Client asked (Abort RPC): end with FINISH_REASON_ABORT."""
        if self.task is not None and not self.task.done():
            self.aborted = True
            self.task.cancel()


class RequestRunner:
    """Runs admitted requests (one `run` task each); shared by every request of a gateway."""

    def __init__(self, *, registry: WorkerRegistry, dispatcher: Dispatcher, router: CacheAwareRouter,
                 index: Any, hash_seed: int, block_size: int, max_retries: int,
                 local_prefill_tokens: int, metrics: GatewayMetrics) -> None:
        self.registry = registry
        self.dispatcher = dispatcher
        self.router = router
        self.index = index
        self.hash_seed = hash_seed
        self.block_size = block_size
        self.max_retries = max_retries
        self.local_prefill_tokens = local_prefill_tokens
        self.metrics = metrics
        self._background: set[asyncio.Task[Any]] = set()

    async def close(self) -> None:
        """Wait (briefly) for outstanding worker aborts."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=ABORT_TIMEOUT_S)

    async def prefix_lookup(self, token_ids: Sequence[int]) -> tuple[tuple[int, ...], dict[str, int]]:
        """(block hashes, prefix-index match) of `token_ids`; ((), {}) without an index or
        while it is degraded (Redis unreachable), so routing is load-only then."""
        if self.index is None or self.router.config.policy != "cache_aware":
            return (), {}
        hashes = tuple(block_hashes(token_ids, self.block_size, self.hash_seed))
        try:
            matches = await self.index.amatch(hashes)
        except Exception as exc:  # the index is a hint; routing goes on load-only
            logger.warning("prefix index lookup failed: %r", exc)
            return (), {}
        if self.index.degraded:
            return (), {}
        return hashes, matches

    # ---------------------------------------------------------------- top level

    async def run(self, st: RequestState) -> None:
        """Drive `st` to its end; the last item put on st.out is a final Chunk or RequestFailed
        (nothing when the client went away)."""
        try:
            async with asyncio.timeout(st.deadline - time.monotonic()):
                await self._attempts(st)
        except TimeoutError:
            self._put(st, RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"deadline exceeded after {st.assembler.delivered} tokens"))
        except asyncio.CancelledError:
            if not st.aborted:
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            self._emit(st, st.assembler.finish("abort", "aborted by request"))
        except RequestFailed as exc:
            self._put(st, exc)
        except Exception as exc:
            logger.exception("request %s failed", st.request_id)
            self._put(st, RequestFailed(grpc.StatusCode.INTERNAL, f"gateway error: {exc!r}"))
        finally:
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
                await self._attempt(st, worker)
                return
            except _NoRoom as exc:
                logger.debug("request %s: %s has no room (%s)", st.request_id, worker.name, exc)
                backoff = RESERVE_BACKOFF_S[min(no_room, len(RESERVE_BACKOFF_S) - 1)]
                no_room += 1
            except _Retry as exc:
                failures += 1
                self.metrics.retries.labels(exc.stage).inc()
                st.ticket.item.avoid.add((exc.worker or worker).name)
                logger.warning("request %s attempt %d failed on %s: %s", st.request_id, st.attempts,
                               (exc.worker or worker).name, exc.cause)
                if failures > self.max_retries:
                    if st.assembler.delivered:
                        self._emit(st, st.assembler.finish("error", f"gave up after {failures} attempts: {exc.cause}"))
                        return
                    raise RequestFailed(grpc.StatusCode.UNAVAILABLE,
                                        f"no worker could serve the request ({failures} attempts): {exc.cause}")
            finally:
                self.dispatcher.release(worker)
                self.router.release(st.request_id)
                self._abort_holders(st)
            if backoff:  # D had no free blocks: give running requests a moment, slot released
                await asyncio.sleep(backoff)

    async def _attempt(self, st: RequestState, d: WorkerHandle) -> None:
        st.attempts += 1
        wrid = st.request_id if st.attempts == 1 else f"{st.request_id}#{st.attempts - 1}"
        tokens = list(st.admitted.prompt_ids) + st.assembler.output_ids
        n_out = st.assembler.delivered
        prefill = [h for h in self.registry.prefill_workers() if h.routable]
        if d.role == "both" or not prefill or self._prefill_locally(st, d, len(tokens)):
            reason = "colocated"
            if d.role != "both":
                reason = "local"
                self.metrics.routing.labels(reason).inc()
                self.router.remember(d.name, st.ticket.item.hashes if st.ticket is not None else ())
            self._note_prefill(st, wrid, d, reason)
            req = adapters.generate_on_worker_request(wrid, tokens, st.admitted.params, st.admitted.tier,
                                                      st.remaining(), n_out)
            call = d.stub.PrefillAndDecode(req, timeout=st.remaining())
            self._hold(st, d, wrid)
            await self._consume(st, d, wrid, call)
        else:
            await self._disaggregated(st, d, wrid, tokens, n_out, prefill)

    def _prefill_locally(self, st: RequestState, d: WorkerHandle, num_tokens: int) -> bool:
        """Conditional disaggregation: the decode worker prefills the prompt itself when what it
        lacks of it (the prompt minus the prefix the index says it holds) is at most
        `local_prefill_tokens`, as a remote prefill plus KV transfer would cost more."""
        if self.local_prefill_tokens <= 0:
            return False
        held = st.ticket.item.matches.get(d.name, 0) if st.ticket is not None else 0
        uncached = num_tokens - min(held * self.block_size, num_tokens - 1)
        return uncached <= self.local_prefill_tokens

    def _note_prefill(self, st: RequestState, wrid: str, w: WorkerHandle, reason: str) -> None:
        self.metrics.prefill_requests.labels(w.name).inc()
        self.dispatcher.note_prefill(wrid, st.admitted.tier, w, reason)

    async def _disaggregated(self, st: RequestState, d: WorkerHandle, wrid: str, tokens: list[int], n_out: int,
                             prefill: list[WorkerHandle]) -> None:
        params = st.admitted.params
        # 1. D reserves blocks. Shielded: if we are cancelled meanwhile, the cleanup waits for
        # the answer before aborting, so a late reservation cannot leak.
        reserve = asyncio.ensure_future(d.stub.Reserve(
            adapters.reserve_request(wrid, tokens, params.max_tokens - n_out, st.admitted.tier, st.remaining(), n_out),
            timeout=st.remaining()))
        self._hold(st, d, wrid, reserve)
        try:
            resv = adapters.reservation_from_proto(await asyncio.shield(reserve))
        except grpc.RpcError as exc:
            raise self._classify(exc, d, "reserve", st) from None
        if not resv.ok:
            self._unhold(st, d, wrid)
            raise _NoRoom(resv.reason or "reservation refused")
        # 2. P prefills and pushes the KV into D's reserved blocks.
        p, hashes, reason = await self._route_prefill(st, wrid, tokens, prefill)
        self.router.remember(d.name, hashes)  # D keeps the prompt's blocks once it decodes
        self._note_prefill(st, wrid, p, reason)
        self._hold(st, p, wrid)
        try:
            reply = await p.stub.Prefill(
                adapters.prefill_request(wrid, tokens, params, st.admitted.tier, d.name, resv, st.remaining(), n_out),
                timeout=st.remaining())
        except grpc.RpcError as exc:
            raise self._classify(exc, p, "prefill", st) from None
        finally:
            self.router.release(wrid)
        self._unhold(st, p, wrid)  # P released its blocks once the KV was handed to the sender
        first = adapters.prefill_result_from_proto(reply)
        st.cached_tokens = max(st.cached_tokens, first.cached_tokens, resv.num_cached_blocks * self.block_size)
        self._emit(st, st.assembler.add([first.first_token_id], [first.first_logprob]))
        if st.assembler.finished or first.finish_reason is not None:
            if not st.assembler.finished:
                self._emit(st, st.assembler.finish(first.finish_reason or "stop", first.stop_reason))
            self._unhold(st, d, wrid)
            self._spawn(self._call_quietly(d.stub.Release(adapters.release_request(wrid, resv.reservation_id),
                                                          timeout=ABORT_TIMEOUT_S)))
            return
        # 3. D decodes the tokens after the first one.
        call = d.stub.Decode(adapters.decode_request(wrid, resv.reservation_id, first.first_token_id, params,
                                                     st.remaining()), timeout=st.remaining())
        await self._consume(st, d, wrid, call)

    async def _route_prefill(self, st: RequestState, wrid: str, tokens: list[int],
                             prefill: list[WorkerHandle]) -> tuple[WorkerHandle, tuple[int, ...], str]:
        """The prefill worker for `tokens`, the prompt's block hashes (() when routing is
        load-only) and the routing reason."""
        waiter = st.ticket.item if st.ticket is not None else None
        avoid = waiter.avoid if waiter is not None else set()
        cands = [h for h in prefill if h.name not in avoid] or prefill
        # The admission-time match covers the prompt; a resumed request has more tokens.
        if waiter is not None and not st.assembler.delivered:
            hashes, matches = waiter.hashes, waiter.matches
        else:
            hashes, matches = await self.prefix_lookup(tokens)
        # Requests sharing a prefix may have been routed since the match was made.
        matches = self.router.with_recent(matches, hashes)
        decision = self.router.route([h.name for h in cands], len(tokens), matches if hashes else None,
                                     request_id=wrid)
        self.router.remember(decision.worker_id, hashes)
        self.metrics.routing.labels(decision.reason).inc()
        return next(h for h in cands if h.name == decision.worker_id), hashes, decision.reason

    async def _consume(self, st: RequestState, w: WorkerHandle, wrid: str, call: Any) -> None:
        """Relay a DecodeChunk stream until the request ends; raises _Retry on failure."""
        got_first = False
        try:
            async for msg in call:
                chunk: WorkerChunk = adapters.worker_chunk_from_proto(msg)
                if not got_first:
                    got_first = True
                    st.cached_tokens = max(st.cached_tokens, chunk.cached_tokens)
                    self.router.release(st.request_id)
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
                    raise _Retry("stream", f"worker ended it with {chunk.finish_reason}: {chunk.stop_reason}", w)
        except grpc.RpcError as exc:
            raise self._classify(exc, w, "decode", st) from None
        finally:
            call.cancel()
        raise _Retry("stream", "ended without a final chunk", w)

    # ---------------------------------------------------------------- failures and cleanup

    def _classify(self, exc: grpc.RpcError, w: WorkerHandle, what: str, st: RequestState) -> Exception:
        code = exc.code()
        details = exc.details() or ""
        if code in _FINAL_CODES:
            return RequestFailed(_FINAL_CODES[code], f"{details} (from {what} on worker {w.name})")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and st.deadline - time.monotonic() <= 0.05:
            return RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"deadline exceeded after {st.assembler.delivered} tokens")
        # Not marked down here: a failed transfer is UNAVAILABLE too while the worker is fine.
        # A dead worker is caught by the next Stats poll; until then `avoid` steers retries away.
        return _Retry(what, f"{code.name}: {details}", w)

    def _hold(self, st: RequestState, w: WorkerHandle, wrid: str, pending: asyncio.Future[Any] | None = None) -> None:
        st.holders[(w.address, wrid)] = (w, pending)

    def _unhold(self, st: RequestState, w: WorkerHandle, wrid: str) -> None:
        st.holders.pop((w.address, wrid), None)

    def _abort_holders(self, st: RequestState) -> None:
        """Tell every worker that may hold the request to drop it (in the background)."""
        holders, st.holders = st.holders, {}
        for (_, wrid), (w, pending) in holders.items():
            self._spawn(self._abort_on(w, wrid, pending))

    async def _abort_on(self, w: WorkerHandle, wrid: str, pending: asyncio.Future[Any] | None) -> None:
        if pending is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(pending), ABORT_TIMEOUT_S)
        await self._call_quietly(w.stub.Abort(adapters.abort_request(wrid), timeout=ABORT_TIMEOUT_S))

    @staticmethod
    async def _call_quietly(call: Any) -> None:
        try:
            await call
        except grpc.RpcError as exc:
            logger.debug("cleanup call failed: %s", exc.code().name)

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
                self.metrics.itl.observe(now - st.last_token_at)
            st.last_token_at = now
            self.metrics.tokens_out.inc(len(em.token_ids))
        chunk = Chunk(token_ids=em.token_ids, text=em.text, logprobs=em.logprobs, finish_reason=em.finish_reason,
                      stop_reason=em.stop_reason, matched_stop=em.matched_stop)
        if em.finish_reason is not None:
            chunk.usage = st.assembler.usage(st.cached_tokens)
        self._put(st, chunk)

    @staticmethod
    def _put(st: RequestState, item: Chunk | RequestFailed) -> None:
        st.out.put_nowait(item)


async def drain_output(st: RequestState) -> AsyncIterator[Chunk | RequestFailed]:
    """Items of st.out until the final one."""
    while True:
        item = await st.out.get()
        yield item
        if isinstance(item, RequestFailed) or item.finish_reason is not None:
            return

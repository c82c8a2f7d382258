"""Admission and output of one request, whatever transport it came by: the gRPC servicer
(gateway/service.py) and the OpenAI-compatible HTTP API (gateway/http/) both call this, so
there is one validation, one queue and one routing.

Order for one request: `admit(inp, ...)` validates (gateway/validate.py), checks the request
fits a decode worker, registers it (from here on `abort(request_id)` finds it, whatever happens
next), matches its prompt against the prefix index, puts it in its tier queue and starts its
runner (`RequestRunner.start`); it raises `Rejected` (status code + '<field>: why') instead.
Then `outputs(st)` yields the request's chunks until the final Chunk or a RequestFailed;
leaving it early (client gone) cancels the runner, which frees what the request holds on every
worker, or withdraws its ticket if it never ran. `abort(request_id)` ends a request with finish
reason "abort" at any point after its id is known.

Overload: a transport counts each call it holds with `call()`; past `max_calls` (from
`LivenessConfig.call_bound`) admission answers RESOURCE_EXHAUSTED naming the tier, so the
RPC library's own limits (set far above it, gateway.server.overload_options) never cancel a
call silently. Everything runs in the gateway's event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
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
from gateway.validate import InvalidRequest, validate_request
from gateway.workers import WorkerRegistry
from tandem.rules import blocks_needed
from tandem.wire import Chunk, GenerateInput

logger = logging.getLogger(__name__)

# How long admission waits for a decode worker to be up before answering UNAVAILABLE (covers
# the gateway's first Stats poll and a worker's brief restart; the registry polls every 0.1 s).
NO_WORKER_WAIT_S = 2.0


class Rejected(Exception):
    """Admission refused the request: `code` is the status to answer, `details` the message
    ('<field>: why' for INVALID_ARGUMENT, `field` then names it)."""

    def __init__(self, code: grpc.StatusCode, details: str, field: str | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.field = field


class Admission:
    """The transport-neutral submit path, one per gateway. `running` maps request ids to the
    requests admitted and not yet ended; `draining` (set by Gateway.stop) refuses new ones."""

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
        self.calls = 0  # calls the transports hold, admitted or not
        self.calls_peak = 0  # the most held at once (tests and fault runs read it)
        metrics.calls_inflight.set_function(lambda: self.calls)

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Count one call for as long as the transport holds it (the overload bound)."""
        self.calls += 1
        self.calls_peak = max(self.calls_peak, self.calls)
        try:
            yield
        finally:
            self.calls -= 1

    async def admit(self, inp: GenerateInput, *, max_tokens_set: bool, arrival: float,
                    time_remaining: float | None = None) -> RequestState:
        """Validate and queue `inp`; its runner task is started. Raises Rejected.

        `time_remaining` is the caller's own deadline in seconds (None: the tier's default)."""
        try:
            return await self._admit(inp, max_tokens_set, arrival, time_remaining)
        except Rejected as exc:
            self.metrics.errors.labels(exc.code.name).inc()
            if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                logger.info("rejected request: %s", exc.details)
            raise

    async def _admit(self, inp: GenerateInput, max_tokens_set: bool, arrival: float,
                     time_remaining: float | None) -> RequestState:
        try:
            admitted = validate_request(inp, self.model, max_tokens_set=max_tokens_set,
                                        stream_interval=self.config.stream_interval)
        except InvalidRequest as exc:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field) from None
        except ValueError as exc:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc), str(exc).partition(":")[0]) from None
        if self.calls > self.max_calls:
            self.metrics.calls_refused.labels(admitted.tier.name.lower(), "max_inflight_calls").inc()
            raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"tier: {admitted.tier.name} request refused: the gateway holds {self.max_calls} calls "
                           f"(max_inflight_calls); retry later", "tier")
        if self.draining:
            raise Rejected(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down")
        request_id = admitted.request_id or uuid.uuid4().hex
        if request_id in self.running:
            raise Rejected(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {request_id!r} is already running",
                           "request_id")
        budget = self.config.tiers[admitted.tier].default_deadline_s
        if time_remaining is not None:
            budget = min(budget, time_remaining)
        deadline = arrival + budget
        # Capped by the context like the engine's; validation already keeps prompt + max_tokens
        # within max_context, so the cap changes no outcome here.
        needed = blocks_needed(len(admitted.prompt_ids), admitted.params.max_tokens, self.model.max_context,
                               self.config.block_size)
        largest = max((h.stats.total_kv_blocks for h in self.registry.decode_workers() if h.stats is not None),
                      default=None)
        if largest is not None and needed > largest:
            raise Rejected(grpc.StatusCode.INVALID_ARGUMENT,
                           f"max_tokens: prompt plus max_tokens needs {needed} KV blocks; the largest decode "
                           f"worker holds {largest}", "max_tokens")
        needs = PlacementNeeds(request_id, len(admitted.prompt_ids), needed)
        assembler = OutputAssembler(self.model.tokenizer, admitted.prompt_ids, admitted.params,
                                    self.model.eos_token_ids, self.model.max_context, admitted.stream_text)
        st = RequestState(request_id, admitted, assembler, arrival, deadline, needs)
        self.running[request_id] = st  # Abort finds it from here on
        try:
            await self._wait_for_decode_worker()
            await self.placer.match_prompt(needs, admitted.prompt_ids)
            if st.ended:  # an Abort came meanwhile: its chunk waits on st.out, nothing to run
                return st
            try:
                st.ticket = self.dispatcher.enqueue(needs, admitted.tier, deadline)
            except QueueFull as exc:
                self.metrics.calls_refused.labels(admitted.tier.name.lower(), "queue_full").inc()
                raise Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), "tier") from None
        except BaseException:
            if self.running.get(request_id) is st:
                del self.running[request_id]
            raise
        self.metrics.tokens_in.inc(len(admitted.prompt_ids))
        self.runner.start(st)
        return st

    async def _wait_for_decode_worker(self) -> None:
        """UNAVAILABLE when no decode-capable worker is up within NO_WORKER_WAIT_S."""
        workers = self.registry.decode_workers()
        deadline = time.monotonic() + NO_WORKER_WAIT_S
        while not any(h.routable for h in workers):
            if time.monotonic() >= deadline:
                why = "; ".join(f"{h.name}: {h.last_error or 'not up yet'}" for h in workers)
                raise Rejected(grpc.StatusCode.UNAVAILABLE,
                               f"no decode worker is up ({len(workers)} configured{': ' + why if why else ''})")
            await asyncio.sleep(self.config.workers.stats_interval_s)

    async def outputs(self, st: RequestState) -> AsyncIterator[Chunk | RequestFailed]:
        """The chunks of `st` after admission, ending with the final Chunk or a RequestFailed.
        Closing the generator early (the client went away) cancels the request; either way the
        request leaves `running` and its outcome is counted. Use it under contextlib.aclosing."""
        status = None
        try:
            async for item in drain_output(st):
                if isinstance(item, RequestFailed):
                    status = item.code.name
                    self.metrics.errors.labels(item.code.name).inc()
                elif item.finish_reason is not None:
                    status = item.finish_reason
                yield item
        finally:
            self.runner.cancel(st)  # no-op once it ended; else it stops and frees what it holds
            if self.running.get(st.request_id) is st:
                del self.running[st.request_id]
            self.metrics.requests.labels(status or "cancelled").inc()
            self.metrics.e2e.labels(st.admitted.tier.name.lower()).observe(time.monotonic() - st.arrival)

    def cancel(self, st: RequestState) -> None:
        """Drop an admitted request whose outputs() will not be read to its end (the client
        went away). Idempotent; a no-op once outputs() has let the request go."""
        if self.running.get(st.request_id) is not st:
            return
        del self.running[st.request_id]
        self.runner.cancel(st)  # it stops and frees what it holds on the workers
        self.metrics.requests.labels("cancelled").inc()

    def abort(self, request_id: str) -> bool:
        """End a running request with finish reason "abort"; False when none is running."""
        st = self.running.get(request_id)
        return st is not None and self.runner.abort(st)

    def stats(self) -> dict[str, Any]:
        """Queue depths and running count (for logs and tests)."""
        return {"running": len(self.running),
                "queued": {t.name.lower(): self.dispatcher.queues.depth(t) for t in self.config.tiers}}

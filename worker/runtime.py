"""What every worker service shares at run time: the engine loop, identity, drain state, and
the RPCs both services answer the same way (Stats, KvEvents), plus error-to-status mapping."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import grpc

from engine.engine import Engine
from engine.outputs import DuplicateRequestError
from kvtransfer import KVTransferError
from tandem._proto.tandem.v1 import worker_pb2
from worker import adapters
from worker.config import WorkerConfig
from worker.engine_loop import EngineLoop, LoopStopped
from worker.events import KvEventBatch
from worker.metrics import WorkerMetrics
from worker.streams import AsyncBridge, ItemStream
from worker.transfer import KvPairingError

logger = logging.getLogger(__name__)

T = TypeVar("T")
MAX_PENDING_EVENT_BATCHES = 4096  # a KvEvents subscriber further behind is cut off (it reconnects)


class WorkerRuntime:
    """Shared state of one worker process. `bridge` is set once the event loop runs."""

    def __init__(self, config: WorkerConfig, engine: Engine, loop: EngineLoop, worker_id: str) -> None:
        self.config = config
        self.role = config.role
        self.engine = engine
        self.loop = loop
        self.worker_id = worker_id
        self.bridge: AsyncBridge | None = None
        self.metrics: WorkerMetrics | None = None
        self.draining = False
        self.in_flight = 0
        self.kv_stats: Callable[[], dict[str, dict[str, float]]] = dict

    async def run(self, fn: Callable[[Engine], T], in_hold: bool = False) -> T:
        """Run `fn(engine)` on the engine thread and await its result (`in_hold`: see
        `EngineLoop.submit`)."""
        return await asyncio.wrap_future(self.loop.submit(fn, in_hold))

    @contextlib.contextmanager
    def tracked(self) -> Iterator[None]:
        """Count an in-flight request (graceful drain waits for the count to reach 0)."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def stats_proto(self) -> worker_pb2.WorkerStats:
        kv = self.kv_stats()
        msg = adapters.stats_to_proto(
            self.loop.stats, self.worker_id, self.role,
            kv.get("sent", {}).get("bytes_sent", 0), kv.get("received", {}).get("bytes_received", 0), self.draining,
        )
        msg.metrics_port = (self.metrics.port or 0) if self.metrics is not None else 0
        return msg

    async def kv_events(self, context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.KvEventBatch]:
        """Reset batch, then deltas, until the client leaves or falls too far behind."""
        assert self.bridge is not None
        stream = ItemStream(self.bridge)
        overflow = object()
        # posted is written by the engine thread only, taken by the event loop only.
        counts = {"posted": 0, "taken": 0, "sub_id": 0}

        def on_batch(batch: KvEventBatch) -> None:  # engine thread
            counts["posted"] += 1
            if counts["posted"] - counts["taken"] > MAX_PENDING_EVENT_BATCHES:
                self.loop.events.unsubscribe(counts["sub_id"])
                stream.put(overflow)
            else:
                stream.put(batch)

        def subscribe(_engine: Engine) -> None:
            counts["sub_id"] = self.loop.events.subscribe(on_batch)

        await self.run(subscribe)
        try:
            while True:
                for item in await stream.get_batch():
                    counts["taken"] += 1
                    if item is overflow:
                        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                            "kv events subscriber fell behind; reconnect for a reset batch")
                    yield adapters.events_to_proto(item, self.worker_id)
        finally:
            with contextlib.suppress(LoopStopped):
                self.loop.submit(lambda _e: self.loop.events.unsubscribe(counts["sub_id"]))


_STATUS = (
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (KvPairingError, grpc.StatusCode.FAILED_PRECONDITION),  # this pair of workers cannot work together
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
    (LookupError, grpc.StatusCode.NOT_FOUND),
    (LoopStopped, grpc.StatusCode.UNAVAILABLE),
    (KVTransferError, grpc.StatusCode.UNAVAILABLE),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def caller_gone(context: grpc.aio.ServicerContext, exc: BaseException) -> bool:
    """Whether `exc` only says the RPC is already over on the caller's side (cancelled, or its
    deadline passed while the handler was sending its status): nothing to log or send."""
    if type(exc).__name__ in ("ExecuteBatchError", "UsageError"):  # grpc's cython internals
        return True
    with contextlib.suppress(Exception):
        return bool(context.cancelled())
    return False


def rpc(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a servicer method (coroutine or async generator): map escaping exceptions to
    a gRPC status (ValueError -> INVALID_ARGUMENT, ...) and count outcomes in the metrics."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        def finish(self: Any, context: grpc.aio.ServicerContext, code: grpc.StatusCode | None) -> None:
            metrics = self.runtime.metrics
            if metrics is not None:
                metrics.count_rpc(method, (code or context.code() or grpc.StatusCode.OK).name)

        async def fail(self: Any, context: grpc.aio.ServicerContext, exc: Exception) -> None:
            if caller_gone(context, exc):  # e.g. the status could not be sent: nobody to tell
                logger.debug("%s: the caller went away (%r)", method, exc)
                finish(self, context, grpc.StatusCode.CANCELLED)
                raise asyncio.CancelledError  # what gRPC expects of a handler whose call is over
            code = status_for(exc)
            if code is grpc.StatusCode.INTERNAL:
                logger.exception("%s failed", method)
            finish(self, context, code)
            await context.abort(code, f"{exc}")

        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def gen_wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    async for item in fn(self, request, context):
                        yield item
                except grpc.aio.AbortError:
                    finish(self, context, None)
                    raise
                except asyncio.CancelledError:
                    finish(self, context, grpc.StatusCode.CANCELLED)
                    raise
                except Exception as exc:
                    await fail(self, context, exc)
                else:
                    finish(self, context, grpc.StatusCode.OK)

            return gen_wrapper

        @functools.wraps(fn)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                result = await fn(self, request, context)
            except grpc.aio.AbortError:
                finish(self, context, None)
                raise
            except asyncio.CancelledError:
                finish(self, context, grpc.StatusCode.CANCELLED)
                raise
            except Exception as exc:
                await fail(self, context, exc)
            finish(self, context, grpc.StatusCode.OK)
            return result

        return wrapper

    return deco


class SharedRpcs:
    """The RPCs every worker service answers the same way, from its `runtime`: a service class
    lists this before its servicer base."""

    runtime: WorkerRuntime

    @rpc("Stats")
    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> worker_pb2.WorkerStats:
        return self.runtime.stats_proto()

    @rpc("KvEvents")
    async def KvEvents(self, request: worker_pb2.KvEventsRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.KvEventBatch]:
        async for batch in self.runtime.kv_events(context):
            yield batch

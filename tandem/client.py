"""Tandem client SDK: `Client` (blocking) and `AsyncClient` (asyncio) for tandem.v1.Tandem.

    with Client("localhost:50051") as c:
        print(c.generate("Hello", max_tokens=16, temperature=0).text)
        for chunk in c.stream("Tell me a story", tier=Tier.INTERACTIVE):
            print(chunk.text, end="")

Sampling keywords (max_tokens, temperature, ...) override the fields of `params=`; they are
validated before anything is sent (ValueError naming the field). Every failed RPC raises
TandemError carrying the gRPC status code.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypedDict

import grpc

from tandem import security, wire
from tandem.errors import TandemError
from tandem.types import SamplingParams, Tier
from tandem.wire import Chunk, ModelInfo, TokenLogprob, Usage

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from tandem._proto.tandem.v1 import tandem_pb2 as pb

logger = logging.getLogger(__name__)

_SAMPLING_KEYS = frozenset(f.name for f in fields(SamplingParams))


class SamplingKeywords(TypedDict, total=False):
    """Keywords accepted by generate/stream/submit_batch; None (or absent) keeps params' value."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    min_tokens: int | None
    ignore_eos: bool | None
    logprobs: int | None
    skip_special_tokens: bool | None


@dataclass
class Completion:
    """A finished generation. finish_reason is "stop", "length", "abort" or "error";
    logprobs is None unless requested (then one entry per token id)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    request_id: str
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str = ""
    matched_stop: str | int | None = None


@dataclass
class _Collector:
    """Folds the chunks of one stream into a Completion."""

    want_logprobs: bool
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    request_id: str = ""
    last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.texts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.request_id = self.request_id or chunk.request_id
        self.last = chunk

    def result(self) -> Completion:
        last = self.last
        if last is None or last.finish_reason is None:
            raise TandemError(grpc.StatusCode.INTERNAL, "the stream ended without a final chunk")
        return Completion(
            text="".join(self.texts), token_ids=self.token_ids, finish_reason=last.finish_reason,
            usage=last.usage or Usage(completion_tokens=len(self.token_ids)),
            request_id=self.request_id, logprobs=self.logprobs if self.want_logprobs else None,
            stop_reason=last.stop_reason, matched_stop=last.matched_stop,
        )


def merge_params(params: SamplingParams | None, sampling: dict[str, Any]) -> SamplingParams:
    """`params` (or the defaults) with every non-None keyword applied, validated.

    Raises ValueError naming the field for a bad value, TypeError for an unknown keyword.
    """
    unknown = sorted(set(sampling) - _SAMPLING_KEYS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(unknown)}")
    if params is None:
        params = SamplingParams()
    elif not isinstance(params, SamplingParams):
        raise ValueError(f"params: must be a tandem.SamplingParams, got {type(params).__name__}")
    changes = {k: v for k, v in sampling.items() if v is not None}
    return (params.replace(**changes) if changes else params).validate()


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: must not be empty")
        return
    if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise ValueError(f"prompt: must be a str or a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("prompt: must not be empty")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**32 for t in prompt):
        raise ValueError("prompt: token ids must be integers in [0, 2**32)")


def build_request(prompt: str | Sequence[int], *, params: SamplingParams | None = None,
                  tier: Tier | int | str = Tier.STANDARD, request_id: str | None = None,
                  stream_interval: int | None = None, **sampling: Any) -> pb.GenerateRequest:
    """Merge keywords over `params`, validate everything, and build the GenerateRequest.
    stream_interval: new tokens per chunk (None or 1: every step; 0: only the last chunk).

    Raises ValueError naming the field for any bad value, TypeError for an unknown keyword.
    """
    merged = merge_params(params, sampling)
    _check_prompt(prompt)
    if request_id is not None and not isinstance(request_id, str):
        raise ValueError(f"request_id: must be a str, got {type(request_id).__name__}")
    return wire.generate_request_to_proto(prompt, merged, Tier.parse(tier), request_id or "",
                                          stream_interval=stream_interval)


def _check_timeout(timeout: float | None, name: str = "timeout") -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{name}: must be a positive number of seconds or None, got {timeout!r}")
    return float(timeout)


def _channel_options(max_message_mb: float) -> list[tuple[str, int]]:
    if isinstance(max_message_mb, bool) or not isinstance(max_message_mb, (int, float)) or not max_message_mb > 0:
        raise ValueError(f"max_message_mb: must be a positive number, got {max_message_mb!r}")
    size = int(max_message_mb * 1024 * 1024)
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


def _abort_request(request_id: str) -> pb.AbortRequest:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id: must be a non-empty str, got {request_id!r}")
    return wire.pb.AbortRequest(request_id=request_id)


def _batch_requests(prompts: Iterable[str | Sequence[int]], concurrency: int,
                    kw: dict[str, Any]) -> list[pb.GenerateRequest]:
    """Validate everything before sending anything; the keywords are shared by all prompts."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency: must be an integer >= 1, got {concurrency!r}")
    if kw.pop("request_id", None) is not None:
        raise ValueError("request_id: not accepted by submit_batch (each prompt gets its own id)")
    tier = Tier.parse(kw.pop("tier", Tier.BATCH))
    params = merge_params(kw.pop("params", None), kw)
    requests = []
    for i, prompt in enumerate(prompts):
        try:
            _check_prompt(prompt)
        except ValueError as exc:
            raise ValueError(f"prompts[{i}]: {exc}") from None
        requests.append(wire.generate_request_to_proto(prompt, params, tier))
    return requests


class ChunkStream(Iterator[Chunk]):
    """The chunks of one Generate call. close() (or leaving a `with` block, or dropping the
    stream) cancels the RPC, which aborts the request on the server."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._done = False
        self.request_id = ""  # known once the first chunk arrived

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        try:
            msg = next(self._call)
        except StopIteration:
            self._done = True
            raise
        except grpc.RpcError as exc:
            self._done = True
            raise TandemError.from_rpc_error(exc) from None
        chunk = wire.chunk_from_proto(msg)
        self.request_id = self.request_id or chunk.request_id
        return chunk

    def close(self) -> None:
        """Cancel the RPC if it is still running; idempotent."""
        if not self._done:
            self._done = True
            self._call.cancel()

    cancel = close

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown; nothing left to cancel
            pass


class Client:
    """Blocking client. `timeout` (seconds) is the default deadline of every call; None = none.
    Thread-safe: one Client may serve many threads (submit_batch does).

    api_key: sent as `authorization: Bearer <key>` on every call (a gateway started with
    --api-key needs it). tls_ca: a PEM CA file to verify the gateway's certificate; tls=True
    uses TLS with the system's roots. Without either, the channel is plaintext."""

    def __init__(self, target: str, *, timeout: float | None = None, max_message_mb: float = 64,
                 api_key: str | None = None, tls_ca: str | None = None, tls: bool = False) -> None:
        self.target = target
        self.timeout = _check_timeout(timeout)
        self._md = security.bearer_metadata(api_key)
        self._channel = security.channel(target, tls_ca=tls_ca, tls=tls, options=_channel_options(max_message_mb))
        self._stub = wire.TandemStub(self._channel)

    def stream(self, prompt: str | Sequence[int], *, params: SamplingParams | None = None,
               tier: Tier | int | str = Tier.STANDARD, request_id: str | None = None,
               timeout: float | None = None, stream_interval: int | None = None,
               **sampling: Unpack[SamplingKeywords]) -> ChunkStream:
        """Start a generation and return its chunks as they arrive (the RPC starts now).
        stream_interval: new tokens per chunk (None or 1: every step's; N: the first token at
        once, then N at a time; fewer messages for a reader that does not need every step)."""
        request = build_request(prompt, params=params, tier=tier, request_id=request_id,
                                stream_interval=stream_interval, **sampling)
        return self._start(request, timeout)

    def generate(self, prompt: str | Sequence[int], *, params: SamplingParams | None = None,
                 tier: Tier | int | str = Tier.STANDARD, request_id: str | None = None,
                 timeout: float | None = None, **sampling: Unpack[SamplingKeywords]) -> Completion:
        """Generate a completion for one prompt and wait for it."""
        request = build_request(prompt, params=params, tier=tier, request_id=request_id, **sampling)
        return self._complete(request, timeout)

    def submit_batch(self, prompts: Iterable[str | Sequence[int]], *, concurrency: int = 8,
                     return_exceptions: bool = False, timeout: float | None = None,
                     **kw: Any) -> list[Completion | TandemError]:
        """Generate for many prompts, at most `concurrency` in flight, on Tier.BATCH unless
        `tier=` says otherwise. Results come in input order. On the first TandemError, the
        requests not yet sent are dropped and the error is raised (requests in flight run
        to their end); with return_exceptions=True the error takes that prompt's place."""
        requests = _batch_requests(prompts, concurrency, kw)
        timeout = _check_timeout(timeout)
        if not requests:
            return []
        results: list[Completion | TandemError] = []
        with ThreadPoolExecutor(max_workers=min(concurrency, len(requests)),
                                thread_name_prefix="tandem-batch") as pool:
            futures = [pool.submit(self._complete, r, timeout) for r in requests]
            for fut in futures:
                try:
                    results.append(fut.result())
                except TandemError as exc:
                    if not return_exceptions:
                        for other in futures:
                            other.cancel()
                        raise
                    results.append(exc)
        return results

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Abort a running request; False when the server knew no running request by that id."""
        return self._unary(self._stub.Abort, _abort_request(request_id), timeout).found

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        reply = self._unary(self._stub.GetModelInfo, wire.pb.ModelInfoRequest(), timeout)
        return wire.model_info_from_proto(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return _check_timeout(timeout) if timeout is not None else self.timeout

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=self._deadline(timeout), metadata=self._md)
        except grpc.RpcError as exc:
            raise TandemError.from_rpc_error(exc) from None

    def _start(self, request: pb.GenerateRequest, timeout: float | None) -> ChunkStream:
        return ChunkStream(self._stub.Generate(request, timeout=self._deadline(timeout), metadata=self._md))

    def _complete(self, request: pb.GenerateRequest, timeout: float | None) -> Completion:
        request.stream_interval = 0  # the whole output in the last chunk: one message, not one a token
        collector = _Collector(want_logprobs=request.params.HasField("logprobs"))
        with self._start(request, timeout) as chunks:
            for chunk in chunks:
                collector.add(chunk)
        return collector.result()


class AsyncChunkStream(AsyncIterator[Chunk]):
    """Async counterpart of ChunkStream: aclose() / leaving `async with` / cancelling the task
    that iterates cancels the RPC."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._done = False
        self.request_id = ""

    async def __anext__(self) -> Chunk:
        if self._done:
            raise StopAsyncIteration
        try:
            msg = await self._call.read()
        except grpc.RpcError as exc:
            self._done = True
            raise TandemError.from_rpc_error(exc) from None
        except asyncio.CancelledError:
            if self._done:  # cancel() was called while this read was pending
                raise TandemError(grpc.StatusCode.CANCELLED, "cancelled by the client") from None
            self.cancel()  # the iterating task was cancelled: take the RPC with it
            raise
        if msg is grpc.aio.EOF:
            self._done = True
            raise StopAsyncIteration
        chunk = wire.chunk_from_proto(msg)
        self.request_id = self.request_id or chunk.request_id
        return chunk

    def cancel(self) -> None:
        """Cancel the RPC if it is still running; idempotent."""
        if not self._done:
            self._done = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class AsyncClient:
    """asyncio client with the same methods as Client (coroutines, and `stream` returning an
    async iterator). The channel is opened on first use, inside the running event loop.
    api_key, tls_ca, tls: as Client's."""

    def __init__(self, target: str, *, timeout: float | None = None, max_message_mb: float = 64,
                 api_key: str | None = None, tls_ca: str | None = None, tls: bool = False) -> None:
        self.target = target
        self.timeout = _check_timeout(timeout)
        self._options = _channel_options(max_message_mb)
        self._md = security.bearer_metadata(api_key)
        self._tls_ca, self._tls = tls_ca, tls
        self._channel: grpc.aio.Channel | None = None
        self._stub_obj: Any = None

    def stream(self, prompt: str | Sequence[int], *, params: SamplingParams | None = None,
               tier: Tier | int | str = Tier.STANDARD, request_id: str | None = None,
               timeout: float | None = None, stream_interval: int | None = None,
               **sampling: Unpack[SamplingKeywords]) -> AsyncChunkStream:
        """Start a generation (call from a running loop); `async for` over the result.
        stream_interval: as Client.stream's."""
        request = build_request(prompt, params=params, tier=tier, request_id=request_id,
                                stream_interval=stream_interval, **sampling)
        return self._start(request, timeout)

    async def generate(self, prompt: str | Sequence[int], *, params: SamplingParams | None = None,
                       tier: Tier | int | str = Tier.STANDARD, request_id: str | None = None,
                       timeout: float | None = None, **sampling: Unpack[SamplingKeywords]) -> Completion:
        request = build_request(prompt, params=params, tier=tier, request_id=request_id, **sampling)
        return await self._complete(request, timeout)

    async def submit_batch(self, prompts: Iterable[str | Sequence[int]], *, concurrency: int = 8,
                           return_exceptions: bool = False, timeout: float | None = None,
                           **kw: Any) -> list[Completion | TandemError]:
        """As Client.submit_batch; on the first error every other request is cancelled."""
        requests = _batch_requests(prompts, concurrency, kw)
        timeout = _check_timeout(timeout)
        gate = asyncio.Semaphore(concurrency)

        async def one(request: pb.GenerateRequest) -> Completion:
            async with gate:
                return await self._complete(request, timeout)

        tasks = [asyncio.ensure_future(one(r)) for r in requests]
        try:
            if not return_exceptions:
                return list(await asyncio.gather(*tasks))
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for result in results:
                if isinstance(result, BaseException) and not isinstance(result, TandemError):
                    raise result
            return list(results)
        finally:
            for task in tasks:  # after an error: cancel the rest (their RPCs with them)
                task.cancel()

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        return (await self._unary("Abort", _abort_request(request_id), timeout)).found

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return wire.model_info_from_proto(await self._unary("GetModelInfo", wire.pb.ModelInfoRequest(), timeout))

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub_obj = self._channel, None, None
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _stub(self) -> Any:
        if self._stub_obj is None:
            self._channel = security.channel(self.target, tls_ca=self._tls_ca, tls=self._tls, options=self._options,
                                             aio=True)
            self._stub_obj = wire.TandemStub(self._channel)
        return self._stub_obj

    def _deadline(self, timeout: float | None) -> float | None:
        return _check_timeout(timeout) if timeout is not None else self.timeout

    async def _unary(self, method: str, request: Any, timeout: float | None) -> Any:
        try:
            return await getattr(self._stub(), method)(request, timeout=self._deadline(timeout), metadata=self._md)
        except grpc.RpcError as exc:
            raise TandemError.from_rpc_error(exc) from None

    def _start(self, request: pb.GenerateRequest, timeout: float | None) -> AsyncChunkStream:
        return AsyncChunkStream(self._stub().Generate(request, timeout=self._deadline(timeout), metadata=self._md))

    async def _complete(self, request: pb.GenerateRequest, timeout: float | None) -> Completion:
        request.stream_interval = 0  # as Client._complete
        collector = _Collector(want_logprobs=request.params.HasField("logprobs"))
        async with self._start(request, timeout) as chunks:
            async for chunk in chunks:
                collector.add(chunk)
        return collector.result()


__all__ = ["Client", "AsyncClient", "Completion", "Chunk", "ChunkStream", "AsyncChunkStream",
           "ModelInfo", "SamplingKeywords", "TokenLogprob", "Usage", "build_request"]

"""The OpenAI-compatible HTTP API of the gateway (FastAPI), served by uvicorn in the gateway's
own event loop next to grpc.aio, so both reach one `Admission` (one validation, one queue, one
routing):

    GET  /v1/models                 the served model
    POST /v1/completions            text or token-id prompts (a batch of them), n, stream
    POST /v1/chat/completions       messages rendered by the model's chat template
    GET  /health                    200 while a decode worker is up and the gateway not draining
    GET  /metrics                   the gateway's Prometheus registry

An HTTP request becomes one gateway request per choice (gateway.http.adapters). Admission
errors are answered before any byte of a stream (400 naming the field, 404 unknown model, 429
full tier, 503 no worker / draining); an error after a stream started is sent as an SSE event
with OpenAI's error body, then `data: [DONE]`. A client that disconnects, streaming or not,
ends its requests: the gateway aborts them on every worker.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.admission import Admission, Rejected
from gateway.http import adapters
from gateway.http.adapters import Choice, ChoiceOutput
from gateway.http.auth import ApiKeyMiddleware
from gateway.http.errors import HttpError
from gateway.http.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk,
                                  ChatCompletionRequest, ChatDelta, Completion, CompletionChoice, CompletionRequest,
                                  ModelCard, ModelList)
from gateway.http.sse import DONE, ClientGone, EventStreamResponse, event, until_disconnect
from gateway.request import RequestFailed, RequestState
from tandem.wire import Chunk, Usage

logger = logging.getLogger(__name__)

Admitted = list[tuple[Choice, RequestState]]


def build_app(admission: Admission, api_key: str | None = None) -> FastAPI:
    """The FastAPI app over `admission` (its model, registry and metrics); with `api_key`,
    /v1/... requires it as a bearer token (gateway.http.auth)."""
    app = FastAPI(title="Tandem", summary="OpenAI-compatible API of a Tandem gateway", docs_url=None,
                  redoc_url=None)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    model = admission.model
    created = int(time.time())

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, exc: HttpError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = [p for p in err.get("loc", ()) if p != "body"]
        if err.get("type") == "json_invalid":
            return HttpError(400, f"body: not valid JSON ({err.get('msg', '')})").response()
        param = _param(loc)
        return HttpError.invalid(param or "body", err.get("msg", "invalid")).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("HTTP %s %s failed", request.method, request.url.path)
        return HttpError(500, f"gateway error: {exc!r}", type="server_error").response()

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model.name, created=created, max_model_len=model.max_context)])

    @app.get("/v1/models/{name}")
    async def model_card(name: str) -> ModelCard:
        adapters.check_model(name, model)
        return ModelCard(id=model.name, created=created, max_model_len=model.max_context)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        adapters.check_model(body.model, model)
        http_id = f"cmpl-{uuid.uuid4().hex}"
        return await _respond(request, _CompletionStream(
            admission, await _admit(admission, adapters.completion_choices(body, model, http_id)), http_id, body))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        adapters.check_model(body.model, model)
        http_id = f"chatcmpl-{uuid.uuid4().hex}"
        return await _respond(request, _ChatStream(
            admission, await _admit(admission, adapters.chat_choices(body, model, http_id)), http_id, body))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = admission.registry.ready() and not admission.draining
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(admission.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _param(loc: Sequence[Any]) -> str:
    """A pydantic error location as a field path: ('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = str(part)
        elif "[" in str(part) or "-" in str(part):  # a union member's name, not a field
            continue
        else:
            out += f".{part}"
    return out


async def _unary(request: Request, work: Any) -> Response:
    try:
        return JSONResponse((await until_disconnect(request, work)).model_dump())
    except ClientGone:
        logger.info("client disconnected before its response; requests aborted")
        return Response(status_code=499)


async def _admit(admission: Admission, choices: Sequence[Choice]) -> Admitted:
    """Admit every choice, or none: a refusal cancels those already admitted."""
    arrival = time.monotonic()
    admitted: Admitted = []
    try:
        for c in choices:
            st = await admission.admit(c.inp, max_tokens_set=c.max_tokens_set, arrival=arrival)
            admitted.append((c, st))
    except Rejected as exc:
        _cancel(admission, admitted)
        param = exc.field
        if param == "tier":
            param = "priority"
        raise HttpError.from_status(exc.code, exc.details, param) from None
    except BaseException:
        _cancel(admission, admitted)
        raise
    return admitted


def _cancel(admission: Admission, admitted: Admitted) -> None:
    for _, st in admitted:
        admission.cancel(st)


async def _merged(admission: Admission, admitted: Admitted) -> AsyncIterator[tuple[Choice, Chunk | RequestFailed]]:
    """Every choice's items as they come. Closing this ends every choice still running."""
    queue: asyncio.Queue[tuple[Choice, Chunk | RequestFailed | None]] = asyncio.Queue()

    async def pump(c: Choice, st: RequestState) -> None:
        try:
            async with contextlib.aclosing(admission.outputs(st)) as items:
                async for item in items:
                    queue.put_nowait((c, item))
        finally:
            queue.put_nowait((c, None))

    tasks = [asyncio.create_task(pump(c, st), name=f"http:{st.request_id}") for c, st in admitted]
    try:
        remaining = len(tasks)
        while remaining:
            c, item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield c, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        _cancel(admission, admitted)  # a pump cancelled before it started never opened its outputs


async def _respond(request: Request, generation: _Generation) -> Response:
    """SSE events when the body asked to stream, else the whole response once every choice ended."""
    if generation.body.stream:
        return EventStreamResponse(generation.events())
    return await _unary(request, generation.response())


class _Generation(ABC):
    """One HTTP request's choices, read once: as a unary response or as SSE events. Subclasses
    (completions, chat) say how a chunk and the final usage look on the wire."""

    def __init__(self, admission: Admission, admitted: Admitted, http_id: str,
                 body: CompletionRequest | ChatCompletionRequest) -> None:
        self.admission = admission
        self.admitted = admitted
        self.tokenizer = admission.model.tokenizer
        self.model_name = admission.model.name
        self.http_id = http_id
        self.created = int(time.time())
        self.body = body
        self.choices = [c for c, _ in admitted]
        self.usages: dict[int, Usage] = {}
        # per choice: the token before the next one to send (logprob token texts decode with it)
        self.last: dict[int, int | None] = {c.index: (st.admitted.prompt_ids[-1] if st.admitted.prompt_ids else None)
                                            for c, st in admitted}

    def logprob_context(self, c: Choice, item: Chunk | ChoiceOutput) -> int | None:
        """The token before `item`'s first; remembers `item`'s last for the next chunk."""
        prev = self.last[c.index]
        if item.token_ids:
            self.last[c.index] = item.token_ids[-1]
        return prev

    async def collect(self) -> dict[int, ChoiceOutput]:
        outs = {c.index: ChoiceOutput() for c in self.choices}
        async with contextlib.aclosing(_merged(self.admission, self.admitted)) as items:
            async for c, item in items:
                if isinstance(item, RequestFailed):
                    raise HttpError.from_status(item.code, item.details)
                outs[c.index].add(item)
                if item.usage is not None:
                    self.usages[c.index] = item.usage
        return outs

    async def events(self) -> AsyncIterator[str]:
        try:
            async for text in self._events():
                yield text
        finally:
            _cancel(self.admission, self.admitted)

    async def _events(self) -> AsyncIterator[str]:
        for payload in self.opening():
            yield event(payload)
        async with contextlib.aclosing(_merged(self.admission, self.admitted)) as items:
            async for c, item in items:
                if isinstance(item, RequestFailed):
                    yield event(HttpError.from_status(item.code, item.details).body)
                    yield DONE
                    return
                if item.usage is not None:
                    self.usages[c.index] = item.usage
                if item.token_ids or item.text or item.finish_reason is not None:
                    yield event(self.chunk(c, item))
        options = self.body.stream_options
        if options is not None and options.include_usage:
            yield event(self.usage_chunk())
        yield DONE

    def opening(self) -> list[Any]:
        return []

    @abstractmethod
    async def response(self) -> Any:
        """The unary response: every choice collected."""

    @abstractmethod
    def chunk(self, c: Choice, item: Chunk) -> Any:
        """The SSE payload for one choice's chunk."""

    @abstractmethod
    def usage_chunk(self) -> Any:
        """The SSE payload carrying the usage of every choice (stream_options.include_usage)."""


class _CompletionStream(_Generation):
    body: CompletionRequest

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.offsets: dict[int, int] = {}
        self.want_logprobs = self.body.logprobs is not None

    async def response(self) -> Completion:
        outs = await self.collect()
        choices = []
        for c in self.choices:
            out = outs[c.index]
            prev = self.logprob_context(c, out)
            lps = adapters.completion_logprobs(self.tokenizer, out.logprobs, prev) if self.want_logprobs else None
            choices.append(CompletionChoice(index=c.index, text="".join(out.text), logprobs=lps,
                                            finish_reason=out.finish_reason))
        return Completion(id=self.http_id, created=self.created, model=self.model_name, choices=choices,
                          usage=adapters.usage_info(self.choices, self.usages))

    def chunk(self, c: Choice, item: Chunk) -> Completion:
        lps = None
        if self.want_logprobs:
            offset = self.offsets.get(c.index, 0)
            lps = adapters.completion_logprobs(self.tokenizer, item.logprobs, self.logprob_context(c, item), offset)
            self.offsets[c.index] = offset + sum(len(t) for t in lps.tokens)
        return Completion(id=self.http_id, created=self.created, model=self.model_name,
                          choices=[CompletionChoice(index=c.index, text=item.text, logprobs=lps,
                                                    finish_reason=item.finish_reason)])

    def usage_chunk(self) -> Completion:
        return Completion(id=self.http_id, created=self.created, model=self.model_name, choices=[],
                          usage=adapters.usage_info(self.choices, self.usages))


class _ChatStream(_Generation):
    body: ChatCompletionRequest

    async def response(self) -> ChatCompletion:
        outs = await self.collect()
        choices = []
        for c in self.choices:
            out = outs[c.index]
            prev = self.logprob_context(c, out)
            lps = adapters.chat_logprobs(self.tokenizer, out.logprobs, prev) if self.body.logprobs else None
            choices.append(ChatChoice(index=c.index, message=AssistantMessage(content="".join(out.text)),
                                      logprobs=lps, finish_reason=out.finish_reason))
        return ChatCompletion(id=self.http_id, created=self.created, model=self.model_name, choices=choices,
                              usage=adapters.usage_info(self.choices, self.usages))

    def opening(self) -> list[ChatCompletionChunk]:
        """OpenAI's first chunk of each choice: the assistant role, empty content."""
        return [ChatCompletionChunk(id=self.http_id, created=self.created, model=self.model_name,
                                    choices=[ChatChunkChoice(index=c.index,
                                                             delta=ChatDelta(role="assistant", content=""))])
                for c in self.choices]

    def chunk(self, c: Choice, item: Chunk) -> ChatCompletionChunk:
        prev = self.logprob_context(c, item)
        lps = adapters.chat_logprobs(self.tokenizer, item.logprobs, prev) if self.body.logprobs else None
        delta = ChatDelta(content=item.text) if item.text or item.finish_reason is None else ChatDelta()
        return ChatCompletionChunk(id=self.http_id, created=self.created, model=self.model_name,
                                   choices=[ChatChunkChoice(index=c.index, delta=delta, logprobs=lps,
                                                            finish_reason=item.finish_reason)])

    def usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.http_id, created=self.created, model=self.model_name, choices=[],
                                   usage=adapters.usage_info(self.choices, self.usages))


class HttpServer:
    """uvicorn serving `build_app(admission)` as a task of the running event loop (the
    gateway's, shared with grpc.aio). `await start()` binds (raises RuntimeError naming
    http_port when it cannot) and returns the port; `await stop()` lets responses in progress
    finish for up to `grace_s`, then ends them. The gateway process owns the signals."""

    def __init__(self, admission: Admission, host: str, port: int, grace_s: float = 10.0, *,
                 api_key: str | None = None, tls_cert: str | None = None, tls_key: str | None = None) -> None:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the gateway's own handlers stay in place
                yield

        self.host, self.port, self.grace_s = host, port, grace_s
        config = uvicorn.Config(build_app(admission, api_key), host=host, port=port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=max(1, int(grace_s)), access_log=False,
                                ssl_certfile=tls_cert, ssl_keyfile=tls_key)
        self._server = _Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"http_port: cannot bind {self.host}:{self.port}: {exc}") from None
        sock.set_inheritable(True)
        self.port = int(sock.getsockname()[1])
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="http-server")
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"http_port: the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(1, math.ceil(self.grace_s))
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self.grace_s + 5)
        except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - stopping must not fail the drain
            logger.warning("HTTP server did not stop cleanly: %r", exc)
            self._task.cancel()

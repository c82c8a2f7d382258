"""What `tandem bench` drives: a Tandem gateway over gRPC (`GrpcBackend`, the SDK) or any
OpenAI-compatible server over HTTP (`OpenAIBackend`, the official `openai` package, streaming
/v1/completions), behind one interface, so the same run can measure Tandem against another
server (or Tandem's own HTTP port against its gRPC port).

`stream(...)` is an async context manager yielding an async iterator of `tandem.wire.Chunk`s
(text deltas; token ids where the protocol carries them; finish_reason and usage on the last);
a request that fails raises `BackendError` with a short status (a gRPC code name, or HTTP_<n>).
Use a backend as `async with backend:` inside the running event loop.
"""
from __future__ import annotations

import contextlib
import logging
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tandem.types import Tier
from tandem.wire import Chunk, Usage

logger = logging.getLogger(__name__)

BACKENDS = ("grpc", "openai")


class BackendError(Exception):
    """A request failed: `status` (UNAVAILABLE, HTTP_429, ...) and the server's detail."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True)
class ServerInfo:
    """What the bench records about the server: the model name and, where known, the
    vocabulary size and EOS ids (for token-id prompts)."""

    model: str
    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()


class GrpcBackend:
    """A Tandem gateway at `target` (HOST:PORT) through tandem.AsyncClient (or through
    `client`, an AsyncClient the caller owns)."""

    name = "grpc"

    def __init__(self, target: str | None = None, client: Any = None) -> None:
        from tandem.client import AsyncClient

        if client is None and target is None:
            raise ValueError("target: give a target or a client")
        self.client = client if client is not None else AsyncClient(str(target))
        self.target = target or self.client.target

    async def __aenter__(self) -> GrpcBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

    async def info(self, timeout: float) -> ServerInfo:
        from tandem.errors import TandemError

        try:
            mi = await self.client.model_info(timeout=timeout)
        except TandemError as exc:
            raise BackendError(exc.code.name, exc.details) from None
        return ServerInfo(mi.model, mi.vocab_size, tuple(mi.eos_token_ids))

    @contextlib.asynccontextmanager
    async def stream(self, prompt: str | tuple[int, ...], *, max_tokens: int, temperature: float, ignore_eos: bool,
                     seed: int | None, tier: Tier, request_id: str,
                     timeout: float | None) -> AsyncIterator[AsyncIterator[Chunk]]:
        from tandem.errors import TandemError

        try:
            async with self.client.stream(prompt, max_tokens=max_tokens, temperature=temperature,
                                          ignore_eos=ignore_eos, seed=seed, tier=tier, request_id=request_id,
                                          timeout=timeout) as chunks:
                yield chunks
        except TandemError as exc:
            raise BackendError(exc.code.name, exc.details) from None


class OpenAIBackend:
    """An OpenAI-compatible server at `target` (a base URL such as http://host:8000/v1, or
    HOST:PORT meaning http://HOST:PORT/v1): streaming /v1/completions with
    stream_options.include_usage; `ignore_eos` and the tier (`priority`) go in the body as the
    extensions Tandem and vLLM accept. `model` None: the first model /v1/models lists."""

    name = "openai"

    def __init__(self, target: str, model: str | None = None, api_key: str = "EMPTY") -> None:
        try:
            import openai
        except ImportError:
            raise BackendError("CLIENT_ERROR", "--backend openai needs the openai package "
                                               "(pip install 'tandem[bench]')") from None
        self._openai = openai
        self.base_url = openai_base_url(target)
        self.model = model
        self.client = openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, max_retries=0)

    async def __aenter__(self) -> OpenAIBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

    async def info(self, timeout: float) -> ServerInfo:
        if self.model is None:
            try:
                models = (await self.client.models.list(timeout=timeout)).data
            except self._openai.APIError as exc:
                raise BackendError(_status(exc), str(exc)) from None
            if not models:
                raise BackendError("NO_MODEL", f"{self.base_url}/models lists no model")
            self.model = models[0].id
        return ServerInfo(self.model)

    @contextlib.asynccontextmanager
    async def stream(self, prompt: str | tuple[int, ...], *, max_tokens: int, temperature: float, ignore_eos: bool,
                     seed: int | None, tier: Tier, request_id: str,
                     timeout: float | None) -> AsyncIterator[AsyncIterator[Chunk]]:
        assert self.model is not None, "info() first"
        # Extensions only when they differ from the default: a server without them may refuse them.
        extra: dict[str, Any] = {"ignore_eos": True} if ignore_eos else {}
        if tier != Tier.STANDARD:
            extra["priority"] = tier.name.lower()
        try:
            events = await self.client.completions.create(
                model=self.model, prompt=prompt if isinstance(prompt, str) else list(prompt), max_tokens=max_tokens,
                temperature=temperature, seed=seed, stream=True, stream_options={"include_usage": True},
                extra_body=extra, extra_headers={"X-Request-Id": request_id}, timeout=timeout)
        except self._openai.APIError as exc:
            raise BackendError(_status(exc), _detail(exc)) from None
        chunks = _translate_openai(events, self._openai)
        try:
            yield chunks
        finally:
            # Our generator first (a reader may stop before its end), so that no suspended
            # iteration over the event stream is left for the collector to finalize.
            await chunks.aclose()
            await events.close()


async def _translate_openai(events: Any, openai: Any) -> AsyncIterator[Chunk]:
    """OpenAI completion chunks as Chunks; the usage-only last event becomes the final Chunk."""
    finish: str | None = None
    try:
        async for ev in events:
            if getattr(ev, "error", None):
                raise BackendError("STREAM_ERROR", str(ev.error))
            if ev.choices:
                choice = ev.choices[0]
                finish = choice.finish_reason or finish
                if choice.text:
                    yield Chunk(text=choice.text)
            if ev.usage is not None:
                details = getattr(ev.usage, "prompt_tokens_details", None)
                cached = getattr(details, "cached_tokens", 0) or 0
                yield Chunk(finish_reason=finish or "stop",
                            usage=Usage(ev.usage.prompt_tokens, ev.usage.completion_tokens, cached))
                return
        if finish is not None:  # a server that sends no usage
            yield Chunk(finish_reason=finish)
    except openai.APIError as exc:
        raise BackendError(_status(exc), _detail(exc)) from None


def openai_base_url(target: str) -> str:
    """'HOST:PORT' and 'http://HOST:PORT' -> 'http://HOST:PORT/v1'; a URL with a path is kept
    (without a trailing slash)."""
    url = target.rstrip("/") if "://" in target else f"http://{target.rstrip('/')}"
    return url if urllib.parse.urlsplit(url).path else f"{url}/v1"


def _status(exc: Any) -> str:
    code = getattr(exc, "status_code", None)
    return f"HTTP_{code}" if code is not None else type(exc).__name__


def _detail(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return str(exc)


def make_backend(kind: str, target: str, model: str | None = None, api_key: str | None = None,
                 tls_ca: str | None = None) -> GrpcBackend | OpenAIBackend:
    """api_key: the server's API key (a bearer token on both backends); tls_ca: grpc: verify the
    gateway's TLS certificate with this CA."""
    if kind == "grpc":
        from tandem.client import AsyncClient

        return GrpcBackend(target, AsyncClient(str(target), api_key=api_key, tls_ca=tls_ca))
    if kind == "openai":
        return OpenAIBackend(target, model, api_key=api_key or "EMPTY")
    raise ValueError(f"backend: must be one of {', '.join(BACKENDS)}, got {kind!r}")

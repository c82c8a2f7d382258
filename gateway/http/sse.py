"""Server-sent events as OpenAI streams them (`data: {json}\\n\\n` ... `data: [DONE]\\n\\n`), and a
response that notices a client disconnect at any moment, also while the request still waits in
its tier queue and nothing is being sent.

`EventStreamResponse` runs the body and a watcher of the ASGI receive channel side by side;
when the client goes away the body is cancelled and its generator closed, whose `finally`
(gateway.http.app) cancels the requests, and the gateway aborts them on every worker.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)
T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def event(payload: BaseModel | dict[str, Any]) -> str:
    """One SSE event carrying `payload` as JSON."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """text/event-stream whose body is cancelled and closed as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, **kwargs: Any) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **kwargs.pop("headers", {})}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def body() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(body)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return

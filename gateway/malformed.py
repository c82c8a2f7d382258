"""Malformed request messages answered INVALID_ARGUMENT instead of the library's UNKNOWN.

gRPC parses a request before the servicer runs; a message that does not parse (bad UTF-8 in a
string field, a truncated or garbled body) makes the library end the call with UNKNOWN and log
a traceback. `add_servicer(add_fn, servicer, server)` registers a servicer through its generated
`add_*Servicer_to_server` function with request parsers that never raise: a message that fails
to parse reaches the servicer as a `MalformedMessage`, which the servicer answers with
INVALID_ARGUMENT and the message's text (`tandem_gateway_errors{status="INVALID_ARGUMENT"}`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

logger = logging.getLogger(__name__)


class MalformedMessage:
    """Stands for a request message that did not parse; str() says which and why."""

    def __init__(self, message_type: str, error: str) -> None:
        self.message_type = message_type
        self.error = error

    def __str__(self) -> str:
        return f"request: not a valid {self.message_type} message (bad UTF-8 in a string field, or truncated): " \
               f"{self.error}"


def tolerant_parser(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`parse`, returning a MalformedMessage where it would raise."""
    owner = getattr(parse, "__self__", None)
    name = getattr(owner, "__name__", "request")

    def parse_or_flag(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # DecodeError, or anything the parser throws on garbage
            logger.info("malformed %s (%d bytes): %s", name, len(data), exc)
            return MalformedMessage(name, str(exc) or type(exc).__name__)

    return parse_or_flag


class _Capture:
    """Takes the method handlers a generated add_*_to_server function registers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, dict(handlers)


def add_servicer(add_fn: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server) -> None:
    """Register `servicer` on `server` as `add_fn` would, with tolerant request parsers."""
    capture = _Capture()
    add_fn(servicer, capture)
    if not capture.handlers:
        raise ValueError(f"add_fn: {add_fn!r} registered no method handlers")
    handlers = {name: h._replace(request_deserializer=tolerant_parser(h.request_deserializer))
                for name, h in capture.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)

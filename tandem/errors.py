"""The SDK's one exception type for failed RPCs, carrying the gRPC status code and details."""
from __future__ import annotations

import grpc


class TandemError(Exception):
    """An RPC to a Tandem server failed.

    `code` is the `grpc.StatusCode` the server (or the channel) answered, e.g.
    INVALID_ARGUMENT for a request the gateway rejected, RESOURCE_EXHAUSTED for a full tier,
    UNAVAILABLE when no worker could serve it, DEADLINE_EXCEEDED, CANCELLED.
    `details` is the server's message (for INVALID_ARGUMENT it names the field).
    """

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> TandemError:
        """Wrap a grpc / grpc.aio RpcError (both expose code() and details())."""
        code_fn = getattr(error, "code", None)
        details_fn = getattr(error, "details", None)
        code = code_fn() if callable(code_fn) else None
        details = details_fn() if callable(details_fn) else None
        return cls(code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN,
                   details if details is not None else str(error))

    def __reduce__(self):  # keep code/details across pickling (e.g. from worker processes)
        return (type(self), (self.code, self.details))


__all__ = ["TandemError"]

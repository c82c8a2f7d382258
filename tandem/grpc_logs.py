"""gRPC's own log records that only say a caller is gone.

When a unary handler returns after its caller's deadline has passed (or the caller cancelled),
gRPC's core cannot send the response, and its Cython layer logs "ExecuteBatchError raised in core
by servicer method [...]" at ERROR, with a traceback. The caller already has its
DEADLINE_EXCEEDED or CANCELLED, and the handler's work is undone as for any caller that leaves (a
decode worker's reservation expires), so nothing is lost and nobody is to be told. Streaming
handlers avoid the record by writing their messages themselves (gateway/service.py,
worker/runtime.py `caller_gone`); a unary one cannot, so servers filter it here: the record is
kept, as DEBUG, only where that logger shows DEBUG. Torch-free: the gateway installs it too.
"""
from __future__ import annotations

import logging

GRPC_CORE_LOGGER = "grpc._cython.cygrpc"
CALLER_GONE = "ExecuteBatchError raised in core by servicer method"


class CallerGone(logging.Filter):
    """Demotes gRPC core's caller-gone ERROR to DEBUG, or drops it where DEBUG is not shown."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.getMessage().startswith(CALLER_GONE):
            return True
        if not logging.getLogger(record.name).isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return True


def quiet_caller_gone() -> None:
    """Install CallerGone on gRPC core's logger (once; a second call changes nothing)."""
    core = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(f, CallerGone) for f in core.filters):
        core.addFilter(CallerGone())

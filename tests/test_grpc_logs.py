"""tandem.grpc_logs: gRPC core's ERROR for a unary answer whose caller is gone is kept only as a
DEBUG record (where DEBUG shows), and nothing else changes."""
from __future__ import annotations

import logging

import pytest

from tandem.grpc_logs import CALLER_GONE, GRPC_CORE_LOGGER, CallerGone, quiet_caller_gone


class _Seen(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def core():
    logger = logging.getLogger(GRPC_CORE_LOGGER)
    seen, level, filters, propagate = _Seen(), logger.level, list(logger.filters), logger.propagate
    logger.addHandler(seen)
    logger.propagate = False  # this test's ERRORs reach its own handler only, not the process's
    quiet_caller_gone()
    quiet_caller_gone()  # once is enough: a second call adds nothing
    assert sum(isinstance(f, CallerGone) for f in logger.filters) == 1
    yield logger, seen.records
    logger.removeHandler(seen)
    logger.propagate = propagate
    logger.setLevel(level)
    logger.filters[:] = filters


def _gone(logger: logging.Logger) -> None:
    try:
        raise RuntimeError("ExecuteBatchError")
    except RuntimeError:
        logger.exception(CALLER_GONE + " [%s]", "/tandem.v1.DecodeWorker/Reserve")


def test_dropped_where_debug_is_not_shown(core) -> None:
    logger, records = core
    logger.setLevel(logging.INFO)
    _gone(logger)
    assert records == []
    logger.error("another failure in core")  # any other ERROR stays an ERROR
    logger.warning(CALLER_GONE + " (a warning is left alone)")
    assert [(r.levelname, r.getMessage()[:24]) for r in records] == [
        ("ERROR", "another failure in core"), ("WARNING", CALLER_GONE[:24])]


def test_kept_as_debug_where_debug_is_shown(core) -> None:
    logger, records = core
    logger.setLevel(logging.DEBUG)
    _gone(logger)
    (record,) = records
    assert record.levelno == logging.DEBUG and record.levelname == "DEBUG"
    assert record.getMessage() == CALLER_GONE + " [/tandem.v1.DecodeWorker/Reserve]"

"""How workers use kvtransfer: the transfer id both sides agree on, and building the
sender (prefill) and the receiver over the engine's paged cache (decode)."""
from __future__ import annotations

import logging
from typing import Any

from engine.engine import Engine
from kvtransfer import KVReceiver, KVSender, get_transport
from kvtransfer.base import OnComplete

logger = logging.getLogger(__name__)


def transfer_id(request_id: str, reservation_id: int) -> str:
    """The kvtransfer id of one reservation's push. A retry of the same request gets a new
    reservation id, so frames of a stale push never land in the new blocks."""
    return f"{request_id}#r{reservation_id}"


def make_sender(transport: str, options: dict[str, Any] | None = None) -> KVSender:
    return get_transport(transport).create_sender(**(options or {}))


def make_receiver(transport: str, engine: Engine, bind: str, on_complete: OnComplete) -> KVReceiver:
    """A receiver writing verified layers straight into `engine.kv_cache.layers`.

    The sink copies host bytes into the cache; on CUDA that copy completes before `write`
    returns, on the default stream the engine also uses, so activating the request after the
    transfer's result needs no further synchronization.
    """
    from kvtransfer.sinks import TensorKVSink

    layers = engine.kv_cache.layers
    sink = TensorKVSink([k for k, _ in layers], [v for _, v in layers])
    return get_transport(transport).create_receiver(sink, bind=bind, on_complete=on_complete)

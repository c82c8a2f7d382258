"""How workers use kvtransfer: the transfer id both sides agree on, the address a decode
worker advertises, and building the sender (prefill) and the receiver over the engine's paged
cache (decode).

A tensor-parallel decode worker runs one receiver per rank, each over that rank's cache shard,
and advertises them as one kv_address: the ranks' endpoints in rank order, joined by commas
("tcp://h:5001,tcp://h:5002"). The gateway passes it on unchanged; a prefill worker pushes
rank r's KV heads to the r-th endpoint, and refuses an address whose endpoint count differs
from its own tensor-parallel size.
"""
from __future__ import annotations

import logging
from typing import Any

from engine.engine import Engine
from kvtransfer import KVReceiver, KVSender, get_transport
from kvtransfer.base import OnComplete

logger = logging.getLogger(__name__)


class KvPairingError(Exception):
    """A prefill worker and the decode worker it should push to cannot exchange KV (different
    tensor-parallel degrees); the gateway may try another pair."""


def transfer_id(request_id: str, reservation_id: int) -> str:
    """The kvtransfer id of one reservation's push. A retry of the same request gets a new
    reservation id, so frames of a stale push never land in the new blocks."""
    return f"{request_id}#r{reservation_id}"


def join_kv_addresses(addresses: list[str]) -> str:
    """The kv_address a decode worker advertises for its ranks' receivers (rank order)."""
    return ",".join(addresses)


def split_kv_addresses(kv_address: str) -> list[str]:
    """One endpoint per decode rank, in rank order (the caller checks each one)."""
    return [p.strip() for p in kv_address.split(",")]


def make_sender(transport: str, options: dict[str, Any] | None = None, auth_token: str | None = None) -> KVSender:
    """A sender presenting `auth_token` (the cluster token) in each connection's handshake."""
    return get_transport(transport).create_sender(**{**(options or {}), "auth_token": auth_token})


def make_receiver(transport: str, engine: Engine, bind: str, on_complete: OnComplete,
                  auth_token: str | None = None) -> KVReceiver:
    """A receiver writing verified layers straight into `engine.kv_cache.layers`; with
    `auth_token`, only senders presenting it may connect (`kvtransfer.auth`).

    The sink copies host bytes into the cache; on CUDA that copy completes before `write`
    returns, on the default stream the engine also uses, so activating the request after the
    transfer's result needs no further synchronization.
    """
    from kvtransfer.sinks import TensorKVSink

    layers = engine.kv_cache.layers
    sink = TensorKVSink([k for k, _ in layers], [v for _, v in layers])
    return get_transport(transport).create_receiver(sink, bind=bind, on_complete=on_complete, auth_token=auth_token)

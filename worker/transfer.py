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


STAGING_SLOT_BYTES = 1 << 20
STAGING_SPARE_SLOTS = 8  # per layer: the last, partly filled slot of that many prompts in a step
STAGING_MAX_BYTES = 2 << 30
STAGED_TRANSPORTS = ("cuda_ipc",)  # the transports whose sender stages into a pool of slots


def staging_options(engine: Engine) -> dict[str, int]:
    """The staging pool of a prefill worker's ipc sender: room for one whole step
    (max_batched_tokens) of every layer's K and V, in 1 MiB slots, plus a partly filled slot for
    a few prompts a layer, at most STAGING_MAX_BYTES. With less, a step that pushes several
    prompts at once (`--kv-push step`) waits mid-push for the decode worker to release slots
    (the transport's default, 64 slots of 4 MiB, holds two 1,024-token prompts of an 8B model)."""
    k, _ = engine.kv_cache.layers[0]
    block_bytes = k[0].numel() * k.element_size()  # one block of K in one layer (this rank's heads)
    blocks = -(-engine.config.max_batched_tokens // engine.config.block_size)
    per_layer = -(-2 * blocks * block_bytes // STAGING_SLOT_BYTES) + STAGING_SPARE_SLOTS
    slots = min(len(engine.kv_cache.layers) * per_layer, STAGING_MAX_BYTES // STAGING_SLOT_BYTES)
    return {"slots": slots, "slot_bytes": STAGING_SLOT_BYTES}


def make_sender(transport: str, options: dict[str, Any] | None = None, auth_token: str | None = None,
                engine: Engine | None = None) -> KVSender:
    """A sender presenting `auth_token` (the cluster token) in each connection's handshake;
    with `engine`, a staging transport's pool is sized from its steps (`staging_options`), and
    `options` may still override it."""
    sized = staging_options(engine) if engine is not None and transport in STAGED_TRANSPORTS else {}
    return get_transport(transport).create_sender(**{**sized, **(options or {}), "auth_token": auth_token})


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

"""Prefill side of the NCCL transport: validate and stage each layer, hand it to the channel of
its receiver (`kvtransfer.nccl_send_channel`), which announces it over ZMQ and sends it through
the pair process group.

See `kvtransfer.nccl_transport` for the protocol and how ranks are assigned.
"""
from __future__ import annotations

import itertools
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from kvtransfer import nccl_group as ng
from kvtransfer.base import KVSender
from kvtransfer.frames import KIND_LAYER
from kvtransfer.nccl_send_channel import Channel, stage
from kvtransfer.outgoing import Item, Outgoing, OutgoingTransfers
from kvtransfer.staging import PairPool

logger = logging.getLogger(__name__)

_SCHEMES = ("tcp://", "ipc://")


class NcclSender(OutgoingTransfers, KVSender):
    """Prefill-side NCCL transport (contract: `KVSender`); thread-safe across requests.

    send_timeout_s: bound on every wait (handshake, a header send, a payload, backpressure).
    max_staged_bytes: gathered-but-unsent bytes (device memory for CUDA caches) before
      `send_layer` waits.
    backend: "nccl" or "gloo" to insist on one; None takes what the receiver announces.
    device: the CUDA device NCCL payloads leave from (default: the current device).
    max_inflight_layers: messages (each of one or more layers: layers already queued together
      travel as one, `nccl_send_channel.COALESCE_MAX_BYTES`) whose payloads may be posted before
      the oldest is waited for, so one completion wait overlaps the next transfers.
    """

    schemes = _SCHEMES
    transport_name = "nccl"

    def __init__(
        self,
        *,
        send_timeout_s: float = 10.0,
        max_staged_bytes: int = 1 << 30,
        backend: str | None = None,
        device: str | torch.device | None = None,
        max_inflight_layers: int = 4,
        linger_s: float = 1.0,
        context: zmq.Context | None = None,
        auth_token: str | None = None,
    ) -> None:
        if not send_timeout_s > 0:
            raise ValueError(f"send_timeout_s: must be > 0, got {send_timeout_s}")
        if max_staged_bytes <= 0:
            raise ValueError(f"max_staged_bytes: must be > 0, got {max_staged_bytes}")
        self.backend = None if backend is None else ng.check_backend(backend)
        if device is not None:
            self.device = torch.device(device)
        else:
            self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if self.backend == "nccl":
            ng.ensure_nccl_env()
        if isinstance(max_inflight_layers, bool) or not isinstance(max_inflight_layers, int) or max_inflight_layers < 1:
            raise ValueError(f"max_inflight_layers: must be an integer >= 1, got {max_inflight_layers!r}")
        self.max_inflight_layers = max_inflight_layers
        self.send_timeout_s = float(send_timeout_s)
        self.max_staged_bytes = int(max_staged_bytes)
        self.linger_s = float(linger_s)
        self.auth_token = auth_token or None  # presented in every connection's handshake (kvtransfer.auth)
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._id = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._requests: dict[str, Outgoing] = {}
        self._channels: dict[str, Channel] = {}
        self._retired: list[Channel] = []
        self._staged_cond = threading.Condition()
        self._pair_pool = PairPool()
        self._stats_lock = threading.Lock()
        self._closed = False
        self.staged_bytes = 0
        self.bytes_sent = self.frames_sent = self.payload_messages = 0
        self.transfers_committed = self.transfers_aborted = self.transfers_failed = 0
        self.send_seconds = 0.0

    def _channel_for(self, peer_address: str) -> Channel:
        return self._retiring_channel_for(peer_address, Channel)

    def send_layer(
        self, request_id: str, layer: int, src_k: Any, src_v: Any,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        state = self._state(request_id)
        src, dst, nbytes = state.check_layer(layer, src_k, src_v, src_block_ids, dst_block_ids)
        self._reserve(nbytes)
        try:
            staged = stage(src_k, src_v, src, self._pair_pool, state)
        except BaseException:
            self._release(nbytes)
            raise
        state.layers.add(layer)
        state.channel.put(Item(state, KIND_LAYER, layer=layer, staged=staged, src=src, dst=dst))

    def stats(self) -> dict[str, float]:
        return {
            "bytes_sent": self.bytes_sent,
            "frames_sent": self.frames_sent,
            "payload_messages": self.payload_messages,  # layers queued together share one
            "transfers_committed": self.transfers_committed,
            "transfers_aborted": self.transfers_aborted,
            "transfers_failed": self.transfers_failed,
            "send_seconds": self.send_seconds,
            "staged_bytes": self.staged_bytes,
            "open_transfers": len(self._requests),
            "broken_channels": sum(c.broken is not None for c in [*self._channels.values(), *self._retired]),
        }

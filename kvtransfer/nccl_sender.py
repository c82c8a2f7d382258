"""Prefill side of the NCCL transport: validate and stage each layer, hand it to the channel of
its receiver (`kvtransfer.nccl_send_channel`), which announces it over ZMQ and sends it through
the pair process group.

See `kvtransfer.nccl_transport` for the protocol and how ranks are assigned.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from kvtransfer import nccl_group as ng
from kvtransfer.base import KVSender
from kvtransfer.frames import KIND_LAYER
from kvtransfer.nccl_send_channel import Channel, stage
from kvtransfer.outgoing import Item, OutgoingTransfers

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
        self._init_outgoing(send_timeout_s=send_timeout_s, linger_s=linger_s, context=context, auth_token=auth_token,
                            max_staged_bytes=max_staged_bytes)
        self.payload_messages = 0

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
        return {**self._send_stats(), "payload_messages": self.payload_messages}  # layers queued together share one

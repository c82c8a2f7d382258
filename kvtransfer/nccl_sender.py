"""Prefill side of the NCCL transport: validate and stage each layer, hand it to the channel of
its receiver (`kvtransfer.nccl_send_channel`), which announces it over ZMQ and sends it through
the pair process group.

See `kvtransfer.nccl_transport` for the protocol and how ranks are assigned.
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch
import zmq

from kvtransfer import nccl_group as ng
from kvtransfer.base import KVSender, KVTransferError, SendResult
from kvtransfer.frames import KIND_ABORT, KIND_COMMIT, KIND_LAYER
from kvtransfer.nccl_send_channel import Channel, Transfer, stage
from kvtransfer.outgoing import Item, check_open_args
from kvtransfer.staging import PairPool

logger = logging.getLogger(__name__)

_SCHEMES = ("tcp://", "ipc://")


class NcclSender(KVSender):
    """Prefill-side NCCL transport (contract: `KVSender`); thread-safe across requests.

    send_timeout_s: bound on every wait (handshake, a header send, a payload, backpressure).
    max_staged_bytes: gathered-but-unsent bytes (device memory for CUDA caches) before
      `send_layer` waits.
    backend: "nccl" or "gloo" to insist on one; None takes what the receiver announces.
    device: the CUDA device NCCL payloads leave from (default: the current device).
    max_inflight_layers: layers whose payloads may be posted before the oldest is waited for,
      so one layer's completion wait overlaps the next layers' transfers.
    """

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
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._id = uuid.uuid4().hex[:12]
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._requests: dict[str, Transfer] = {}
        self._channels: dict[str, Channel] = {}
        self._retired: list[Channel] = []
        self._staged_cond = threading.Condition()
        self._stage_pool = PairPool()
        self._stats_lock = threading.Lock()
        self._closed = False
        self.staged_bytes = 0
        self.bytes_sent = self.frames_sent = 0
        self.transfers_committed = self.transfers_aborted = self.transfers_failed = 0
        self.send_seconds = 0.0

    def open(self, request_id: str, peer_address: str, num_layers: int) -> None:
        check_open_args(request_id, peer_address, num_layers, _SCHEMES)
        with self._lock:
            if self._closed:
                raise KVTransferError("sender is closed")
            if request_id in self._requests:
                raise ValueError(f"request_id: transfer {request_id!r} is already open")
            channel = self._channels.get(peer_address)
            if channel is None or channel.broken is not None:
                if channel is not None:
                    channel.close()
                    self._retired.append(channel)
                channel = Channel(self, peer_address, f"{self._id}-{next(self._serial)}")
                self._channels[peer_address] = channel
            self._requests[request_id] = Transfer(request_id, peer_address, num_layers, channel=channel)

    def _state(self, request_id: str) -> Transfer:
        with self._lock:
            if self._closed:
                raise KVTransferError("sender is closed")
            state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"request_id: no open transfer {request_id!r}")
        if state.error is not None:
            raise KVTransferError(f"request {request_id}: transfer failed: {state.error}")
        return state

    def send_layer(
        self, request_id: str, layer: int, src_k: Any, src_v: Any,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        state = self._state(request_id)
        src, dst, nbytes = state.check_layer(layer, src_k, src_v, src_block_ids, dst_block_ids)
        self._reserve(nbytes)
        try:
            staged = stage(src_k, src_v, src, self._stage_pool)
        except BaseException:
            self._release(nbytes)
            raise
        state.layers.add(layer)
        state.channel.put(Item(state, KIND_LAYER, layer=layer, staged=staged, src=src, dst=dst))

    def commit(self, request_id: str, meta: dict[str, Any]) -> Future[SendResult]:
        state = self._state(request_id)
        if len(state.layers) != state.num_layers:
            raise ValueError(f"request_id: {request_id!r} sent {len(state.layers)} of {state.num_layers} layers")
        if not isinstance(meta, dict):
            raise ValueError(f"meta: expected a dict, got {type(meta).__name__}")
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"meta: not JSON-serializable ({exc})") from None
        with self._lock:
            self._requests.pop(request_id, None)
        state.channel.put(Item(state, KIND_COMMIT, meta=meta))
        return state.future

    def abort(self, request_id: str, reason: str = "aborted by sender") -> bool:
        with self._lock:
            state = None if self._closed else self._requests.pop(request_id, None)
        if state is None:
            return False
        state.aborted = True  # the channel thread skips this request's queued layers
        state.channel.put(Item(state, KIND_ABORT, reason=str(reason)))
        return True

    def _reserve(self, nbytes: int) -> None:
        with self._staged_cond:
            ok = self._staged_cond.wait_for(
                lambda: self.staged_bytes == 0 or self.staged_bytes + nbytes <= self.max_staged_bytes,
                timeout=self.send_timeout_s,
            )
            if not ok:
                raise KVTransferError(f"send queue full: {self.staged_bytes} bytes staged for {self.send_timeout_s:g}s")
            self.staged_bytes += nbytes

    def _release(self, nbytes: int) -> None:
        with self._staged_cond:
            self.staged_bytes -= nbytes
            self._staged_cond.notify_all()

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def stats(self) -> dict[str, float]:
        return {
            "bytes_sent": self.bytes_sent,
            "frames_sent": self.frames_sent,
            "transfers_committed": self.transfers_committed,
            "transfers_aborted": self.transfers_aborted,
            "transfers_failed": self.transfers_failed,
            "send_seconds": self.send_seconds,
            "staged_bytes": self.staged_bytes,
            "open_transfers": len(self._requests),
            "broken_channels": sum(c.broken is not None for c in [*self._channels.values(), *self._retired]),
        }

    def close(self, drain_timeout_s: float = 5.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels = [*self._channels.values(), *self._retired]
        for channel in channels:
            channel.close()
        end = time.monotonic() + drain_timeout_s
        for channel in channels:
            channel.thread.join(max(0.0, end - time.monotonic()) + self.linger_s)
        self._stage_pool.close()
        if any(c.thread.is_alive() for c in channels):
            logger.warning("kv nccl sender closed with sends still in flight; leaving its ZMQ context open")
        elif self._own_ctx:
            self._ctx.term()

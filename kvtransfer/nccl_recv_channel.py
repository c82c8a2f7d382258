"""The decode side's end of one channel: the sender's headers in order, the receives of each
layer's payload through the pair process group, and the thread that drives them.

Used by `kvtransfer.nccl_receiver`, which owns the transfers these layers belong to.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvtransfer import nccl_group as ng
from kvtransfer.base import KVTransferError
from kvtransfer.frames import KIND_LAYER, FrameError, FrameHeader
from tandem.native import set_thread_name

if TYPE_CHECKING:
    from kvtransfer.nccl_receiver import NcclReceiver

logger = logging.getLogger(__name__)


class ChannelBroken(Exception):
    """The pair's stream of payloads can no longer be matched to headers."""


@dataclass
class _Posted:
    """A message of layer headers whose payload receive is posted, in header order: the payload
    holds each layer's K bytes then V bytes, in the order of the headers."""

    layers: list[tuple[FrameHeader, torch.Tensor, torch.Tensor]]
    works: list[Any]


class RecvChannel:
    """One sender's channel: its headers in arrival order, and the thread that receives payloads.

    Up to `max_inflight_layers` layers have their receives posted at once (the sender runs as
    far ahead); they are completed, checked and written strictly in header order.
    """

    def __init__(self, receiver: NcclReceiver, channel_id: str, prefix: str) -> None:
        self.channel_id, self.prefix = channel_id, prefix
        self.group: Any = None
        self.broken = False
        self.payloads = 0  # layers whose receives were posted; numbers the point-to-point tags
        self.headers: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()  # a FRAME message's header parts
        self._receiver = receiver
        self.thread = threading.Thread(target=self._run, name=f"kv-nccl-recv {channel_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        set_thread_name(threading.current_thread().name)
        r = self._receiver
        inflight: collections.deque[_Posted] = collections.deque()
        try:
            if r.backend == "nccl":  # receives and cache writes on a stream of their own, off the engine's
                torch.cuda.set_device(r.device)
                torch.cuda.set_stream(torch.cuda.Stream(r.device))
            self.group = ng.pair_group(r._store, self.prefix, ng.RECEIVER_RANK, r.backend, r.recv_timeout_s)
            while True:
                try:
                    data = self.headers.get(block=not inflight)
                except queue.Empty:  # nothing new: finish the oldest layer while the rest arrive
                    self._complete(inflight.popleft())
                    continue
                if data is None:
                    break
                headers = [self._decode(part) for part in data]
                if headers[0].kind == KIND_LAYER:
                    inflight.append(self._post(headers))
                    while len(inflight) > r.max_inflight_layers:
                        self._complete(inflight.popleft())
                else:
                    while inflight:
                        self._complete(inflight.popleft())
                    for header in headers:
                        r._apply(header, None, None)
            while inflight:
                self._complete(inflight.popleft())
        except Exception as exc:  # ChannelBroken, a failed rendezvous, a payload timeout
            self.broken = True
            logger.warning("kv nccl channel %s closed: %s", self.channel_id, exc)
        finally:
            ng.close_group(self.group, broken=self.broken)
            r._forget(self)

    def _decode(self, data: bytes) -> FrameHeader:
        try:
            header = FrameHeader.decode(data)
        except FrameError as exc:  # its payload size is unknown, so the stream cannot be followed
            raise ChannelBroken(f"malformed header: {exc}") from None
        self._receiver._count(frames_received=1)
        return header

    def _post(self, headers: list[FrameHeader]) -> _Posted:
        """Post the receive of the layers' one payload (each layer's K then V), whatever becomes
        of the layers (the sender sends it regardless, and the pair's stream must stay matched)."""
        r = self._receiver
        if any(h.kind != KIND_LAYER for h in headers):
            raise ChannelBroken("a message of layers holds a header of another kind")
        sizes = [h.payload_nbytes for h in headers]
        if max(sizes) > r.max_frame_bytes:
            raise ChannelBroken(f"layer of {max(sizes)} bytes exceeds max_frame_bytes={r.max_frame_bytes}")
        payload = torch.empty(2 * sum(sizes), dtype=torch.uint8, device=r.device)
        layers, offset = [], 0
        for header, n in zip(headers, sizes):
            layers.append((header, payload[offset:offset + n], payload[offset + n:offset + 2 * n]))
            offset += 2 * n
        works = []
        if offset:
            tag = self.payloads % (1 << 30)
            self.payloads += 1
            works = [self.group.recv([payload], ng.SENDER_RANK, tag)]
        return _Posted(layers, works)

    def _complete(self, posted: _Posted) -> None:
        r = self._receiver
        try:
            for work in posted.works:
                ng.wait_work(work, r.backend, r.recv_timeout_s,
                             f"payload of layers {[h.layer for h, _, _ in posted.layers]}")
        except KVTransferError as exc:
            raise ChannelBroken(str(exc)) from None
        r._count(bytes_received=sum(k.numel() + v.numel() for _, k, v in posted.layers))
        for header, k, v in posted.layers:
            r._apply(header, k, v)

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

if TYPE_CHECKING:
    from kvtransfer.nccl_receiver import NcclReceiver

logger = logging.getLogger(__name__)


class ChannelBroken(Exception):
    """The pair's stream of payloads can no longer be matched to headers."""


@dataclass
class _Posted:
    """A layer header whose payload receive (K's bytes, then V's) is posted, in header order."""

    header: FrameHeader
    k: torch.Tensor
    v: torch.Tensor
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
        self.headers: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._receiver = receiver
        self.thread = threading.Thread(target=self._run, name=f"kv-nccl-recv {channel_id}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
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
                header = self._decode(data)
                if header.kind == KIND_LAYER:
                    inflight.append(self._post(header))
                    while len(inflight) > r.max_inflight_layers:
                        self._complete(inflight.popleft())
                else:
                    while inflight:
                        self._complete(inflight.popleft())
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

    def _post(self, header: FrameHeader) -> _Posted:
        """Post the receive of a layer's payload (K and V in one message), whatever becomes of
        the layer (the sender sends it regardless, and the pair's stream must stay matched)."""
        r = self._receiver
        nbytes = header.payload_nbytes
        if nbytes > r.max_frame_bytes:
            raise ChannelBroken(f"layer of {nbytes} bytes exceeds max_frame_bytes={r.max_frame_bytes}")
        payload = torch.empty(2 * nbytes, dtype=torch.uint8, device=r.device)
        works = []
        if nbytes:
            tag = self.payloads % (1 << 30)
            self.payloads += 1
            works = [self.group.recv([payload], ng.SENDER_RANK, tag)]
        return _Posted(header, payload[:nbytes], payload[nbytes:], works)

    def _complete(self, posted: _Posted) -> None:
        r = self._receiver
        try:
            for work in posted.works:
                ng.wait_work(work, r.backend, r.recv_timeout_s, f"payload of layer {posted.header.layer}")
        except KVTransferError as exc:
            raise ChannelBroken(str(exc)) from None
        r._count(bytes_received=posted.k.numel() + posted.v.numel())
        r._apply(posted.header, posted.k, posted.v)

"""The prefill side's channel to one decode receiver: handshake, then layer headers over a ZMQ
DEALER and payloads through the pair process group, driven by one thread per channel.

Used by `kvtransfer.nccl_sender`; the protocol is described in `kvtransfer.nccl_transport`.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import zmq

from kvtransfer import nccl_group as ng
from kvtransfer.auth import secure_client
from kvtransfer.base import KVTransferError
from kvtransfer.frames import KIND_COMMIT, KIND_LAYER, FrameHeader
from kvtransfer.staging import PairPool, check_cache_pair, stage_layer
from kvtransfer.outgoing import Item, ItemQueue, Outgoing
from tandem.native import set_thread_name
from tandem.netaddr import is_wildcard

if TYPE_CHECKING:
    from kvtransfer.nccl_sender import NcclSender

logger = logging.getLogger(__name__)


@dataclass
class _Staged:
    """One layer's gathered blocks as one payload: K's bytes, then V's. CUDA sources stay on the
    device; `ready` marks the gather."""

    payload: torch.Tensor  # flat uint8, K then V (one point-to-point message per layer)
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # K plus V
    ready: Any = None  # torch.cuda.Event recorded after the gather on the caller's stream


@dataclass
class _InFlight:
    """A message of one or more layers whose payload send is posted but not yet known to be
    complete. `keep` holds every tensor the device may still read for it."""

    state: Outgoing
    nbytes: int
    layers: list[int]
    works: list[Any]
    t0: float
    keep: list[torch.Tensor]


# Layers of one transfer already queued when the channel thread gets to them travel as one
# message (one header part each, one payload), up to these bounds: a message costs a fixed
# ~0.4 ms of host work on both ends, against ~22 us of NVLink time for a 2k-token layer of an 8B
# model. Larger layers go alone (their payloads would be copied into one buffer to travel).
COALESCE_MAX_BYTES = 256 << 20
COALESCE_MAX_LAYERS = 64


def take_batch(items: collections.deque[Item]) -> list[Item]:
    """Pop the next item and, when it is a layer, the layers of the same transfer queued right
    behind it, within COALESCE_MAX_BYTES and COALESCE_MAX_LAYERS ([] when `items` is empty)."""
    if not items:
        return []
    batch = [items.popleft()]
    if batch[0].kind != KIND_LAYER:
        return batch
    nbytes = batch[0].staged.nbytes
    while items and len(batch) < COALESCE_MAX_LAYERS:
        nxt = items[0]
        if nxt.kind != KIND_LAYER or nxt.state is not batch[0].state or nbytes + nxt.staged.nbytes > COALESCE_MAX_BYTES:
            break
        batch.append(items.popleft())
        nbytes += nxt.staged.nbytes
    return batch


def stage(src_k: Any, src_v: Any, src: tuple[int, ...], pool: PairPool, state: Outgoing) -> _Staged:
    dtype, shape = check_cache_pair(src_k, src_v)
    out_shape = (len(src), *shape[1:])
    if isinstance(src_k, torch.Tensor) and src_k.device.type == "cuda":
        idx = state.src_index(src, src_k.device)
        pair = torch.empty((2, *out_shape), dtype=src_k.dtype, device=src_k.device)
        torch.index_select(src_k, 0, idx, out=pair[0])
        torch.index_select(src_v, 0, idx, out=pair[1])
        ready = torch.cuda.Event()
        ready.record()
        payload = ng.as_bytes(pair)
        return _Staged(payload, dtype, out_shape, payload.numel(), ready)
    host = stage_layer(src_k, src_v, src, pool)  # byte rows, one memcpy per block
    payload = torch.cat([torch.from_numpy(host.k_bytes()).view(-1), torch.from_numpy(host.v_bytes()).view(-1)])
    return _Staged(payload, dtype, out_shape, payload.numel())


class Channel(ItemQueue):
    """A DEALER socket and a pair group to one receiver, driven by one thread.

    The channel is the unit of failure: a payload that does not complete in time leaves the
    pair's stream of sends in an unknown state, so the channel is marked broken, every transfer
    on it fails, and the next `open` to that peer builds a fresh channel (a new group).
    """

    def __init__(self, sender: NcclSender, peer: str, channel_id: str) -> None:
        self.peer, self.channel_id = peer, channel_id
        self.broken: str | None = None
        self._sender = sender
        super().__init__()
        self.backend = ""
        self._group: Any = None
        self._inflight: collections.deque[_InFlight] = collections.deque()
        self._payloads = 0  # layers whose payloads were posted; numbers the point-to-point tags
        self.thread = threading.Thread(target=self._run, name=f"kv-nccl-send {peer}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        set_thread_name(threading.current_thread().name)
        sender = self._sender
        sock = sender._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.channel_id.encode())
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, int(sender.send_timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, int(sender.linger_s * 1000))
        secure_client(sock, sender.auth_token)
        sock.connect(self.peer)
        try:
            try:
                self._handshake(sock)
            except Exception as exc:
                self._break(f"handshake with {self.peer} failed: {exc}")
            while True:
                with self._cond:
                    if not self._inflight:
                        self._cond.wait_for(lambda: self._items or self._closing)
                    batch = take_batch(self._items)
                if not batch:
                    if not self._inflight:
                        break
                    self._settle(0)  # idle: finish what is in flight, free its staging
                    continue
                item = batch[0]
                try:
                    self._process(sock, batch)
                except Exception as exc:  # a broken channel fails its transfers, never the thread
                    logger.exception("kv nccl send of %s to %s failed", item.state.request_id, self.peer)
                    self._break(f"send failed: {exc!r}")
                    item.state.error = item.state.error or self.broken
            self._settle(0)
            if self.broken is None:  # a receiver that is gone needs no goodbye: don't wait for it
                send_parts(sock, [ng.BYE, b"{}"], zmq.NOBLOCK)
        finally:
            ng.close_group(self._group, broken=self.broken is not None)
            sock.close()

    def _handshake(self, sock: zmq.Socket) -> None:
        sender = self._sender
        hello = {"v": ng.CONTROL_VERSION, "channel": self.channel_id, "backend": sender.backend}
        sock.send_multipart([ng.HELLO, ng.encode(hello)])
        if not sock.poll(int(sender.send_timeout_s * 1000)):
            raise KVTransferError(f"no answer within {sender.send_timeout_s:g}s")
        tag, body = sock.recv_multipart()
        doc = ng.decode(body)
        if tag != ng.WELCOME:
            raise KVTransferError(f"refused: {doc.get('error', tag)!r}")
        backend = ng.check_backend(doc.get("backend"), "backend (announced by the receiver)")
        if sender.backend is not None and backend != sender.backend:
            raise KVTransferError(f"receiver uses backend {backend!r}, this sender {sender.backend!r}")
        if backend == "nccl":
            # Sends wait on this thread's current stream; a stream of its own waits only for each
            # layer's gather, not for the compute queued behind it, so transfer overlaps compute.
            torch.cuda.set_device(sender.device)
            torch.cuda.set_stream(torch.cuda.Stream(sender.device))
        self.backend = backend
        store_host = doc.get("store_host") or ""
        if is_wildcard(store_host):
            store_host = _peer_host(self.peer)
        store = ng.connect_store(f"{store_host}:{int(doc['store_port'])}", sender.send_timeout_s)
        self._group = ng.pair_group(store, str(doc["prefix"]), ng.SENDER_RANK, backend, sender.send_timeout_s)

    def _break(self, error: str) -> None:
        if self.broken is None:
            self.broken = error
            logger.warning("kv nccl channel to %s broken: %s", self.peer, error)

    def _process(self, sock: zmq.Socket, batch: list[Item]) -> None:
        """One item, or several layers of one transfer (`take_batch`)."""
        item, sender = batch[0], self._sender
        state = item.state
        if self.broken is not None and state.error is None:
            state.error = f"channel to {self.peer} broken: {self.broken}"
        if item.kind == KIND_LAYER:
            if state.error is None and not state.aborted:
                self._send_layers(sock, batch)  # the staging is released once the send completes
            else:
                sender._release(sum(it.staged.nbytes for it in batch))
        else:
            if item.kind == KIND_COMMIT:
                self._settle(0)  # the result reports payloads that completed, not just posted
            sender._end_transfer(item, lambda header: self._send_headers(sock, state, [header]))

    def _send_layers(self, sock: zmq.Socket, batch: list[Item]) -> None:
        """Announce the layers in one message (a header part each) and send their payloads as
        one: each layer's K then V, in header order."""
        sender, state = self._sender, batch[0].state
        nbytes = sum(it.staged.nbytes for it in batch)
        try:
            parts = [self._on_backend_device(it.staged.payload, it.staged.ready) for it in batch]
            payload = parts[0] if len(parts) == 1 else torch.cat(parts)
            headers = [
                FrameHeader(
                    KIND_LAYER, state.request_id, state.seq + i, layer=it.layer, src_block_ids=it.src,
                    dst_block_ids=it.dst, dtype=it.staged.dtype, shape=it.staged.shape,
                )  # checksums stay 0: NCCL and TCP deliver intact bytes, and hashing device memory would cost a copy
                for i, it in enumerate(batch)
            ]
            t0 = time.perf_counter()
            sent = self._send_headers(sock, state, headers)
        except BaseException:
            sender._release(nbytes)
            raise
        if not sent:
            sender._release(nbytes)
            return
        works = []
        if nbytes:
            tag = self._payloads % (1 << 30)
            self._payloads += 1
            works = [self._group.send([payload], ng.RECEIVER_RANK, tag)]
        sender._count(payload_messages=1)
        # The parts stay referenced until the send completes: the concatenation reads them on
        # this thread's stream, while they were allocated on the caller's.
        self._inflight.append(_InFlight(state, nbytes, [it.layer for it in batch], works, t0, [payload, *parts]))
        self._settle(sender.max_inflight_layers)

    def _settle(self, limit: int) -> None:
        """Wait for the oldest layers in flight until at most `limit` remain; a payload that does
        not complete in time breaks the channel and fails every transfer still in flight."""
        sender = self._sender
        while len(self._inflight) > limit:
            entry = self._inflight.popleft()
            try:
                if self.broken is None:
                    for work in entry.works:
                        ng.wait_work(work, self.backend, sender.send_timeout_s, f"payload of layers {entry.layers}")
                    entry.state.bytes_sent += entry.nbytes
                    sender._count(bytes_sent=entry.nbytes, send_seconds=time.perf_counter() - entry.t0)
            except KVTransferError as exc:
                self._break(str(exc))
            finally:
                sender._release(entry.nbytes)
            if self.broken is not None and entry.state.error is None:
                entry.state.error = f"channel to {self.peer} broken: {self.broken}"

    def _on_backend_device(self, t: torch.Tensor, ready: Any) -> torch.Tensor:
        if ready is not None:  # the gather ran on the caller's stream: order after it
            if self.backend == "nccl" and t.device == self._sender.device:
                torch.cuda.current_stream(t.device).wait_event(ready)
            else:
                ready.synchronize()
        target = self._sender.device if self.backend == "nccl" else torch.device("cpu")
        return t if t.device == target else t.to(target)

    def _send_headers(self, sock: zmq.Socket, state: Outgoing, headers: list[FrameHeader]) -> bool:
        """One FRAME message carrying `headers` (consecutive sequence numbers from `state.seq`)."""
        error = send_parts(sock, [ng.FRAME, *(h.encode() for h in headers)])
        if error is not None:
            state.error = f"send to {self.peer} {error}"
            self._break(state.error)
            return False
        state.seq += len(headers)
        self._sender._count(frames_sent=len(headers))
        return True


def send_parts(sock: zmq.Socket, parts: list[bytes], flags: int = 0) -> str | None:
    """Send `parts`; None on success, else why not (SNDTIMEO bounds the wait)."""
    try:
        sock.send_multipart(parts, flags=flags)
        return None
    except zmq.Again:
        return "timed out"
    except zmq.ZMQError as exc:
        return f"failed: {exc}"


def _peer_host(peer: str) -> str:
    if peer.startswith("tcp://"):
        host = peer.removeprefix("tcp://").rpartition(":")[0]
        return host.strip("[]")
    return "127.0.0.1"  # ipc:// peers share this host

"""Decode side of the ipc transport: a ROUTER socket for the senders' channels, their mapped
pools, and one thread that checks each layer, copies it from its slot into the sink and
releases the slot.

See `kvtransfer.ipc_transport` for the protocol; the per-transfer checks live in
`kvtransfer.assembly`.
"""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from kvtransfer import ipc_wire as wire
from kvtransfer.assembly import IncomingTransfer
from kvtransfer.base import KVReceiver, KVSink, OnComplete, TransferResult
from kvtransfer.frames import KIND_LAYER, FrameError, FrameHeader
from kvtransfer.ipc_pool import CUDA, MappedPool
from kvtransfer.pending import PendingTransfers, sink_device
from kvtransfer.staging import PairPool

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    """One sender channel as this receiver sees it."""

    identity: bytes
    pool: MappedPool | None = None
    releases: list[int] = field(default_factory=list)  # leases read, not yet reported


class IpcReceiver(PendingTransfers, KVReceiver):
    """Decode-side ipc transport (contract: `KVReceiver`).

    sink: the decode cache (`KVSink`). Host pools hand it CPU tensors viewing shared memory;
      GPU pools hand it tensors on the sender's GPU, written on this receiver's own stream, with
      the default stream (the decode engine's) ordered after each write.
    bind: ZMQ endpoint for the control link; "tcp://127.0.0.1:*" picks a free port, and
      "ipc:///path" suits one host best; `address` tells the real one.
    device: where the cache lives; None: the sink's `k_caches` device, else CPU. A GPU pool is
      refused unless this is a GPU.
    max_pool_bytes: the largest pool a sender may ask this receiver to map.
    on_complete, poll_interval_s: as for the zmq receiver.
    """

    def __init__(
        self,
        sink: KVSink,
        bind: str = "tcp://127.0.0.1:*",
        *,
        on_complete: OnComplete | None = None,
        device: str | torch.device | None = None,
        max_pool_bytes: int = 1 << 36,
        poll_interval_s: float = 0.02,
        context: zmq.Context | None = None,
        auth_token: str | None = None,
    ) -> None:
        self._init_pending(sink, on_complete, poll_interval_s)
        if not wire.is_int(max_pool_bytes) or max_pool_bytes <= 0:
            raise ValueError(f"max_pool_bytes: must be a positive integer, got {max_pool_bytes!r}")
        self.device = sink_device(sink, device)
        self.max_pool_bytes = max_pool_bytes
        self._bind_socket(zmq.ROUTER, bind, context, auth_token)
        self._peers: dict[bytes, _Peer] = {}
        self._device_reads: collections.deque[tuple[Any, _Peer, int]] = collections.deque()  # GPU pools
        self._stream: Any = None  # this receiver's CUDA stream, made with the first GPU pool
        self._pair = PairPool()
        self.channels_opened = self.channels_refused = 0
        # The socket moves to the receiver thread here; Thread.start() is the memory barrier
        # ZMQ asks for, and no other thread touches it afterwards.
        self._thread = threading.Thread(target=self._run, name="kv-ipc-recv", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, float]:
        return {
            **self._transfer_stats(),
            "checksum_failures": self.checksum_failures,
            "channels": len(self._peers),
            "channels_opened": self.channels_opened,
            "channels_refused": self.channels_refused,
        }

    def close(self) -> None:
        if not self._stop_thread(self._thread):  # closed already, or stuck: keep its ZMQ context
            return
        self._pair.close()
        if self._own_ctx:
            self._ctx.term()

    # -- receiver thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            # GPU reads in flight are polled for completion, so the loop looks again soon (busy).
            self._serve(lambda parts: self._on_message([p.buffer for p in parts]), copy=False,
                        busy=lambda: bool(self._device_reads), each_turn=self._send_releases)
        finally:
            self._send_releases(wait=True)
            for peer in list(self._peers.values()):  # senders break their channels at once
                self._reply(peer.identity, wire.BYE, {})
                if peer.pool is not None:
                    peer.pool.close()
            self._peers.clear()
            self._sock.close(linger=200)  # long enough for the goodbyes to leave

    def _on_message(self, parts: list[memoryview]) -> None:
        if len(parts) < 2:
            logger.warning("dropping kv ipc message of %d parts", len(parts))
            return
        identity, tag, body = bytes(parts[0]), bytes(parts[1]), parts[2:]
        peer = self._peers.get(identity)
        try:
            if tag == wire.HELLO:
                self._hello(identity, body)
            elif peer is None:
                if tag == wire.FRAME:
                    self.frames_received += 1
                    self.frames_dropped += 1
                if tag != wire.BYE:
                    self._refuse(identity, "channel: not open on this receiver (did it restart?); open a new one")
            elif tag == wire.POOL:
                self._map(peer, body)
            elif tag == wire.FRAME:
                self._frame(peer, body)
            elif tag == wire.BYE:
                self._forget(peer)
            else:
                logger.warning("dropping kv ipc message with unknown tag %r", tag)
        except Exception:  # one bad message must not take the receiver down
            logger.exception("kv ipc: failed to handle a %r message", tag)

    def _hello(self, identity: bytes, body: list[memoryview]) -> None:
        try:
            doc = wire.decode(body[0] if body else b"", "hello")
            if doc.get("v") != wire.IPC_VERSION:
                raise ValueError(f"v: unsupported ipc transport version {doc.get('v')!r}")
            if identity in self._peers:
                raise ValueError(f"channel: {identity!r} is already open")
        except ValueError as exc:
            self._refuse(identity, str(exc))
            return
        self._peers[identity] = _Peer(identity)
        self.channels_opened += 1

    def _map(self, peer: _Peer, body: list[memoryview]) -> None:
        try:
            if peer.pool is not None:
                raise ValueError("pool: this channel already announced its pool")
            pool = MappedPool.open(wire.decode(body[0] if body else b"", "pool"), self.device, self.max_pool_bytes)
        except ValueError as exc:
            self._refuse(peer.identity, str(exc))
            return
        if pool.kind == CUDA and self._stream is None:
            from kvtransfer import ipc_cuda

            self._stream = ipc_cuda.new_stream(self.device)
        peer.pool = pool
        self._reply(peer.identity, wire.MAPPED, {})
        logger.info("kv ipc channel %s mapped a %s pool of %d x %d bytes", peer.identity.decode(errors="replace"),
                    pool.kind, pool.slots, pool.slot_bytes)

    def _forget(self, peer: _Peer) -> None:
        """The sender closed its channel: finish reading its slots, then unmap its pool."""
        self._send_releases(wait=True)
        self._peers.pop(peer.identity, None)
        if peer.pool is not None:
            peer.pool.close()

    def _frame(self, peer: _Peer, body: list[memoryview]) -> None:
        self.frames_received += 1
        try:
            header = FrameHeader.decode(body[0]) if body else None
        except FrameError as exc:
            header = None
            logger.warning("dropping malformed kv ipc frame: %s", exc)
        if header is None:  # its request is unknown; its lease, if any, can still go back
            self.frames_dropped += 1
            self._release(peer, wire.lease_of(body[1]) if len(body) == 2 else None)
            return
        lease, k, v, error = None, None, None, None
        if header.kind == KIND_LAYER:
            lease = wire.lease_of(body[1]) if len(body) == 2 else None
            try:
                k, v = self._extent(peer, header, body)
            except ValueError as exc:
                error = f"bad extent in layer {header.layer}: {exc}"
        elif len(body) != 1:
            error = f"malformed {header.kind} message: {len(body)} parts, expected 1"
        device_read = isinstance(k, torch.Tensor)  # a GPU pool's slot, with the stream already waiting on it
        result = None
        with self._lock:
            transfer = self._pending.get(header.request_id)
        if transfer is None:
            self.frames_dropped += 1
            logger.debug("dropping kv %s message for unknown request %s", header.kind, header.request_id)
        else:
            with transfer.lock:
                if transfer.done:
                    self.frames_dropped += 1
                elif error is not None:
                    result = transfer.fail(error)
                elif device_read:
                    result = self._write_device(transfer, header, k, v)
                else:  # host pools: the shared checks, checksums included, then the sink's copy
                    result = transfer.on_message(header, k, v, self._sink, self._pair)
                if result is not None:
                    result = self._retire(transfer, result)
        if device_read:
            self._end_device_read(peer, lease)
        else:
            self._release(peer, lease)
        if result is not None:
            self._deliver(result)

    def _extent(self, peer: _Peer, header: FrameHeader, body: list[memoryview]) -> tuple[Any, Any]:
        """K and V of a layer message inside the channel's pool; ValueError naming the bad field."""
        if len(body) != 2:
            raise ValueError(f"extent: layer message of {len(body)} parts, expected header and extent")
        extent = wire.Extent.decode(body[1])
        payload = header.payload_nbytes
        if extent.slots == 0:
            if payload:
                raise ValueError(f"slots: 0 slots for {payload} bytes of K and V")
            return memoryview(b""), memoryview(b"")
        pool = peer.pool
        if pool is None:
            raise ValueError("pool: no staging pool is mapped on this channel")
        pool.check_lease(extent.slot, extent.slots, payload)
        self.bytes_received += 2 * payload
        if pool.kind == CUDA:
            from kvtransfer import ipc_cuda

            ipc_cuda.begin_read(self._stream, pool.events[extent.slot])  # after the sender's gather
        return pool.views(extent.slot, payload)

    def _write_device(self, transfer: IncomingTransfer, header: FrameHeader, k: torch.Tensor,
                      v: torch.Tensor) -> TransferResult | None:
        """Check a layer in GPU memory and queue its copy into the sink on this receiver's stream."""
        error = transfer.device_layer_error(header)
        if error is not None:
            return transfer.fail(error)
        dtype = getattr(torch, header.dtype)
        try:
            with torch.cuda.stream(self._stream):
                self._sink.write(header.layer, list(header.dst_block_ids), k.view(dtype).view(header.shape),
                                 v.view(dtype).view(header.shape))
        except Exception as exc:  # the sink is the decode worker's code; report, don't crash the thread
            logger.exception("kv sink write failed for request %s layer %d", transfer.request_id, header.layer)
            return transfer.fail(f"sink write failed for layer {header.layer}: {exc!r}")
        transfer.layers.add(header.layer)
        transfer.bytes_received += 2 * header.payload_nbytes
        return None

    def _end_device_read(self, peer: _Peer, lease: int | None) -> None:
        from kvtransfer import ipc_cuda

        done = ipc_cuda.end_read(self._stream, self.device)
        if lease is not None:
            self._device_reads.append((done, peer, lease))

    def _release(self, peer: _Peer, lease: int | None) -> None:
        if lease is not None:
            peer.releases.append(lease)

    def _send_releases(self, wait: bool = False) -> None:
        """Report leases whose reads are complete (all of them with `wait`)."""
        while self._device_reads and (wait or self._device_reads[0][0].query()):
            done, peer, lease = self._device_reads.popleft()  # one stream: they complete in order
            if wait:
                done.synchronize()
            peer.releases.append(lease)
        for peer in self._peers.values():
            if peer.releases:
                self._reply(peer.identity, wire.RELEASE, {"leases": peer.releases})
                peer.releases = []

    def _reply(self, identity: bytes, tag: bytes, doc: dict[str, Any]) -> None:
        try:  # ROUTER drops messages for peers that are gone; it never blocks
            self._sock.send_multipart([identity, tag, wire.encode(doc)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("kv ipc reply %r to %r not sent: %s", tag, identity, exc)

    def _refuse(self, identity: bytes, error: str) -> None:
        self.channels_refused += 1
        logger.warning("kv ipc: refusing channel %r: %s", identity, error)
        self._reply(identity, wire.REFUSE, {"error": error})

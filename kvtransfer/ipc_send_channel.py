"""The prefill side's channel to one ipc receiver: the staging pool, a ZMQ DEALER for headers
and the receiver's replies, and the thread that drives them.

Used by `kvtransfer.ipc_sender`; the protocol is described in `kvtransfer.ipc_transport`.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtransfer import ipc_wire as wire
from kvtransfer.auth import secure_client
from kvtransfer.base import KVTransferError, SendResult
from kvtransfer.frames import DTYPE_ITEMSIZE, KIND_COMMIT, KIND_LAYER, FrameHeader, checksum
from kvtransfer.ipc_pool import CUDA, Lease, SendPool
from kvtransfer.outgoing import Item, Outgoing
from kvtransfer.staging import PairPool
from tandem.native import set_thread_name

if TYPE_CHECKING:
    from kvtransfer.ipc_sender import IpcSender

logger = logging.getLogger(__name__)

CORRUPT_ENV = "TANDEM_KV_CORRUPT_ONCE"


@dataclass
class LayerItem(Item):
    lease: Lease | None = None  # None for a layer without blocks
    dtype: str = ""
    shape: tuple[int, ...] = ()

    @property
    def payload(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


_ANNOUNCE = object()  # queue entry: send the pool's description


class Channel:
    """One receiver: a DEALER socket, the staging pool (made on the first layer), one thread.

    The channel is the unit of failure: a header that cannot be sent, a refusal or a goodbye
    from the receiver, or its connection closing breaks it; its transfers fail and the next
    `open` to that receiver builds a new channel with a new pool. (ZMQ drops what a closed
    connection still held, releases and goodbye included, so the connection's end is watched
    itself.) The thread also reads the receiver's releases, so a wake-up pipe tells it about
    queued entries while it waits on the socket.
    """

    def __init__(self, sender: IpcSender, peer: str, channel_id: str) -> None:
        self.peer, self.channel_id = peer, channel_id
        self.broken: str | None = None
        self.pool: SendPool | None = None
        self._sender = sender
        self._entries: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._finished = False
        self._pool_lock = threading.Lock()
        self._pair = PairPool()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.thread = threading.Thread(target=self._run, name=f"kv-ipc-send {peer}", daemon=True)
        self.thread.start()

    # -- caller threads ---------------------------------------------------------------------------

    def put(self, entry: Any) -> None:
        with self._cond:
            self._entries.append(entry)
            self._wake()

    def put_all(self, entries: list[Any]) -> None:
        with self._cond:
            self._entries.extend(entries)
            self._wake()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._wake()

    def _wake(self) -> None:  # caller holds _cond, which also guards the pipe's lifetime
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups already
            pass

    def stopped(self) -> str | None:
        if self.broken is not None:
            return f"channel to {self.peer} broken: {self.broken}"
        return "sender is closed" if self._closing else None

    def ensure_pool(self, src_k: Any) -> SendPool:
        """The channel's pool, made on the first layer where that layer's cache lives."""
        with self._pool_lock:
            if self.pool is None:
                if self._finished or self.stopped():
                    raise KVTransferError(self.stopped() or f"channel to {self.peer} is closed")
                s = self._sender
                self.pool = SendPool.create(src_k, s.slots, s.slot_bytes, s.shm_dir)
                self.put(_ANNOUNCE)
            self.pool.check_source(src_k)
            return self.pool

    # -- channel thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        set_thread_name(threading.current_thread().name)
        s = self._sender
        sock = s._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.channel_id.encode())
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no receiver connected: sends wait (and time out) instead of queueing
        sock.setsockopt(zmq.SNDTIMEO, int(s.send_timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, int(s.linger_s * 1000))
        secure_client(sock, s.auth_token)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            try:
                sock.connect(self.peer)
            except zmq.ZMQError as exc:
                self._break(f"cannot connect to {self.peer}: {exc}")
            else:
                self._send(sock, [wire.HELLO, wire.encode({"v": wire.IPC_VERSION, "channel": self.channel_id})])
            while True:
                self._pump(sock, poller, monitor, 1000)
                closing = self._process_entries(sock)
                self._read_replies(sock)
                if closing:
                    break
            self._await_reads(sock, poller, monitor, time.monotonic() + s.linger_s)
            if self.broken is None:  # a receiver that is gone needs no goodbye: don't wait for it
                try:
                    sock.send_multipart([wire.BYE, b"{}"], flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        except Exception as exc:  # never leave callers waiting on a dead thread
            logger.exception("kv ipc channel to %s crashed", self.peer)
            self._break(f"channel thread failed: {exc!r}")
            self._fail_queued()
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close()
            with self._cond:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1
            with self._pool_lock:
                self._finished = True
                if self.pool is not None:
                    self.pool.close()
            self._pair.close()

    def _await_reads(self, sock: zmq.Socket, poller: zmq.Poller, monitor: zmq.Socket, deadline: float) -> None:
        """Closing: until `deadline`, wait for the receiver to release every lease it was sent,
        i.e. to have read it (it may not even have mapped the pool yet), so that the pool is
        not unlinked or freed under a transfer that was reported sent."""
        while self.broken is None and self.pool is not None and self.pool.in_use and time.monotonic() < deadline:
            self._pump(sock, poller, monitor, min(50, max(1, int((deadline - time.monotonic()) * 1000))))

    def _pump(self, sock: zmq.Socket, poller: zmq.Poller, monitor: zmq.Socket, timeout_ms: int) -> None:
        """One wait of up to `timeout_ms` on the channel's sockets: wake-ups drained, the
        receiver's replies read, a lost connection noticed."""
        ready = dict(poller.poll(timeout_ms))
        if self._wake_r in ready:
            self._drain_wakeups()
        self._read_replies(sock)  # a goodbye names the reason better than the disconnect
        if monitor in ready:
            recv_monitor_message(monitor)
            self._break(f"receiver at {self.peer} went away (connection closed)")

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _process_entries(self, sock: zmq.Socket) -> bool:
        """Handle everything queued; True when the channel is closing and nothing is left."""
        while True:
            with self._cond:
                if not self._entries:
                    return self._closing
                entry = self._entries.popleft()
            try:
                self._process(sock, entry)
            except Exception as exc:  # a broken channel fails its transfers, never the thread
                logger.exception("kv ipc send to %s failed", self.peer)
                self._break(f"send failed: {exc!r}")
                if isinstance(entry, Item):
                    self._finish(entry)
            self._read_replies(sock)  # slots released meanwhile go back to waiting callers at once

    def _fail_queued(self) -> None:
        with self._cond:
            entries, self._entries = list(self._entries), collections.deque()
        for entry in entries:
            if isinstance(entry, Item):
                self._finish(entry)

    def _finish(self, item: Item) -> None:
        """Settle an item that will not be sent (aborted, or the channel broke): free its lease,
        resolve its commit as failed."""
        state = item.state
        if self.broken is not None and state.error is None:
            state.error = self.stopped()
        if isinstance(item, LayerItem) and item.lease is not None and self.pool is not None:
            self.pool.release(item.lease.lease_id)
        if item.kind == KIND_COMMIT and not state.future.done():
            state.error = state.error or "channel closed before the commit was sent"
            self._sender._count(transfers_failed=1)
            state.future.set_result(
                SendResult(state.request_id, False, state.error, state.bytes_sent, time.monotonic() - state.started)
            )

    def _process(self, sock: zmq.Socket, entry: Any) -> None:
        s = self._sender
        if entry is _ANNOUNCE:
            if self.broken is None and self.pool is not None:
                self._send(sock, [wire.POOL, wire.encode(self.pool.description)])
            return
        item: Item = entry
        state = item.state
        if self.broken is not None and state.error is None:
            state.error = self.stopped()
        if item.kind == KIND_LAYER:
            assert isinstance(item, LayerItem)
            if state.error is None and not state.aborted:
                self._send_layer(sock, item)
            else:
                self._finish(item)
        else:
            s._end_transfer(item, lambda header: self._send_header(sock, state, header))

    def _send_layer(self, sock: zmq.Socket, item: LayerItem) -> None:
        s, state, lease, pool = self._sender, item.state, item.lease, self.pool
        payload = item.payload
        sum_k = sum_v = checksum(b"", s.checksum_algorithm)  # a layer without blocks is checked like any
        if lease is not None and pool is not None and pool.kind != CUDA:
            # Host pools are hashed like the zmq transport's frames, so a receiver that reads the
            # wrong slot, or bytes a peer scribbled over, rejects the layer instead of writing it.
            # Device memory is not hashed: it never leaves the GPU, and hashing needs a host copy.
            k, v = pool.views(lease, payload)
            kb, vb = k.numpy(), v.numpy()
            sum_k, sum_v = self._pair.run(lambda b: checksum(b, s.checksum_algorithm), kb, vb, payload)
            if payload and s._take_corruption():
                kb[payload // 2] ^= 0xFF  # after the checksum: the receiver must catch it
                logger.warning("%s set: corrupted layer %d of %s", CORRUPT_ENV, item.layer, state.request_id)
        header = FrameHeader(
            KIND_LAYER, state.request_id, state.seq, layer=item.layer, src_block_ids=item.src, dst_block_ids=item.dst,
            dtype=item.dtype, shape=item.shape, checksum_k=sum_k, checksum_v=sum_v, checksum_alg=s.checksum_algorithm,
        )
        extent = wire.Extent(lease.lease_id, lease.slot, lease.slots) if lease else wire.Extent(-1, 0, 0)
        t0 = time.perf_counter()
        if not self._send_header(sock, state, header, extent.encode()):
            self._finish(item)  # not queued in ZMQ, so the receiver will never release it
            return
        state.bytes_sent += 2 * payload
        s._count(bytes_sent=2 * payload, send_seconds=time.perf_counter() - t0)

    def _send_header(self, sock: zmq.Socket, state: Outgoing, header: FrameHeader, *extra: bytes) -> bool:
        if not self._send(sock, [wire.FRAME, header.encode(), *extra]):
            state.error = state.error or self.stopped()
            return False
        state.seq += 1
        self._sender._count(frames_sent=1)
        return True

    def _send(self, sock: zmq.Socket, parts: list[bytes]) -> bool:
        """Send `parts` (SNDTIMEO bounds the wait); a failure breaks the channel."""
        try:
            sock.send_multipart(parts)
            return True
        except zmq.Again:
            self._break(f"send to {self.peer} timed out after {self._sender.send_timeout_s:g}s")
        except zmq.ZMQError as exc:
            self._break(f"send to {self.peer} failed: {exc}")
        return False

    def _read_replies(self, sock: zmq.Socket) -> None:
        while True:
            try:
                parts = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            tag = parts[0]
            try:
                doc = wire.decode(parts[1], "reply") if len(parts) == 2 else {}
            except ValueError as exc:
                logger.warning("kv ipc: malformed %r reply from %s: %s", tag, self.peer, exc)
                continue
            if tag == wire.RELEASE and self.pool is not None:
                leases = doc.get("leases")
                for lease_id in leases if isinstance(leases, list) else []:
                    if wire.is_int(lease_id):
                        self.pool.release(lease_id)
            elif tag == wire.MAPPED and self.pool is not None:
                self.pool.unlink()
            elif tag == wire.REFUSE:
                self._break(f"refused by {self.peer}: {doc.get('error', 'no reason given')}")
            elif tag == wire.BYE:
                self._break(f"receiver at {self.peer} closed")

    def _break(self, error: str) -> None:
        if self.broken is None:
            self.broken = error
            logger.warning("kv ipc channel to %s broken: %s", self.peer, error)
        if self.pool is not None:
            self.pool.wake()  # callers waiting for a slot give up now

"""Prefill side of the ZMQ transport: stage layers, then PUSH them from one thread per peer.

See `kvtransfer.zmq_transport` for the socket pattern and the test hook.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import zmq

from kvtransfer.auth import secure_client
from kvtransfer.base import KVSender
from kvtransfer.frames import (
    DEFAULT_CHECKSUM,
    KIND_LAYER,
    FrameHeader,
    check_checksum_algorithm,
    checksum,
)
from kvtransfer.outgoing import Item, ItemQueue, Outgoing, OutgoingTransfers
from kvtransfer.staging import PairPool, StagedLayer, stage_layer
from tandem.native import set_thread_name

logger = logging.getLogger(__name__)

CORRUPT_ENV = "TANDEM_KV_CORRUPT_ONCE"
_SCHEMES = ("tcp://", "ipc://", "inproc://")


class _PeerChannel(ItemQueue):
    """One PUSH socket to one receiver, driven by its own thread: a slow or dead peer delays
    only the transfers bound for it. It outlives its errors (a PUSH socket reconnects), so it
    never counts as broken."""

    broken: str | None = None

    def __init__(self, sender: ZmqSender, peer: str) -> None:
        self.peer = peer
        self._sender = sender
        super().__init__()
        self.pool = PairPool()
        self.thread = threading.Thread(target=self._run, name=f"kv-send {peer}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        set_thread_name(threading.current_thread().name)
        sender = self._sender
        sock = sender._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, sender.sndhwm)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, int(sender.send_timeout_s * 1000))
        secure_client(sock, sender.auth_token)
        sock.connect(self.peer)
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._items or self._closing)
                    if not self._items:
                        return
                    item = self._items.popleft()
                try:
                    sender._process(sock, item, self.pool)
                except Exception as exc:  # keep the channel alive for other requests
                    logger.exception("kv send of %s to %s failed", item.state.request_id, self.peer)
                    item.state.error = item.state.error or f"send failed: {exc!r}"
        finally:
            sock.close(linger=int(sender.linger_s * 1000))
            self.pool.close()


class ZmqSender(OutgoingTransfers, KVSender):
    """Prefill-side ZMQ transport (contract: `KVSender`).

    Thread-safe across requests; the calls for one request come from one thread.

    send_timeout_s: bound on every wait (a send to a full or unconnected peer, backpressure).
    max_staged_bytes: staged-but-unsent bytes before `send_layer` waits; memory held by the
      transfer is at most this plus `sndhwm` messages queued inside ZMQ per peer.
    checksum_algorithm: "xxh64" (default) or "xxh3_64" (faster); named in every header.
    corrupt_once: test hook (see `kvtransfer.zmq_transport`); None reads TANDEM_KV_CORRUPT_ONCE.
    """

    schemes = _SCHEMES
    transport_name = "zmq"

    def __init__(
        self,
        *,
        send_timeout_s: float = 10.0,
        max_staged_bytes: int = 1 << 30,
        sndhwm: int = 64,
        linger_s: float = 1.0,
        checksum_algorithm: str = DEFAULT_CHECKSUM,
        corrupt_once: bool | None = None,
        context: zmq.Context | None = None,
        auth_token: str | None = None,
    ) -> None:
        self.checksum_algorithm = check_checksum_algorithm(checksum_algorithm)
        self.sndhwm = int(sndhwm)
        self._corrupt_pending = os.environ.get(CORRUPT_ENV) == "1" if corrupt_once is None else bool(corrupt_once)
        # A peer's channel outlives its errors: `_retired` stays empty.
        self._init_outgoing(send_timeout_s=send_timeout_s, linger_s=linger_s, context=context, auth_token=auth_token,
                            max_staged_bytes=max_staged_bytes)

    # -- caller side --------------------------------------------------------------------------

    def _channel_for(self, peer_address: str) -> _PeerChannel:
        channel = self._channels.get(peer_address)
        if channel is None:
            channel = self._channels[peer_address] = _PeerChannel(self, peer_address)
        return channel

    def send_layer(
        self,
        request_id: str,
        layer: int,
        src_k: Any,
        src_v: Any,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        state = self._state(request_id)
        src, dst, nbytes = state.check_layer(layer, src_k, src_v, src_block_ids, dst_block_ids)
        self._reserve(nbytes)
        try:
            staged = stage_layer(src_k, src_v, src, self._pair_pool)
        except BaseException:
            self._release(nbytes)
            raise
        state.layers.add(layer)
        state.channel.put(Item(state, KIND_LAYER, layer=layer, staged=staged, src=src, dst=dst))

    # -- peer threads ---------------------------------------------------------------------------

    def _process(self, sock: zmq.Socket, item: Item, pool: PairPool) -> None:
        state = item.state
        if item.kind == KIND_LAYER:
            assert item.staged is not None
            try:
                if state.error is None and not state.aborted:
                    self._send_layer(sock, item, item.staged, pool)
            finally:
                self._release(item.staged.nbytes)
        else:
            self._end_transfer(item, lambda header: self._send(sock, state, [header.encode()]))

    def _send_layer(self, sock: zmq.Socket, item: Item, staged: StagedLayer, pool: PairPool) -> None:
        staged.wait()
        k, v = staged.k_bytes(), staged.v_bytes()
        alg = self.checksum_algorithm
        sum_k, sum_v = pool.run(lambda buf: checksum(buf, alg), k, v, k.nbytes)
        header = FrameHeader(
            KIND_LAYER,
            item.state.request_id,
            item.state.seq,
            layer=item.layer,
            src_block_ids=item.src,
            dst_block_ids=item.dst,
            dtype=staged.dtype,
            shape=staged.shape,
            checksum_k=sum_k,
            checksum_v=sum_v,
            checksum_alg=self.checksum_algorithm,
        )
        if k.nbytes and self._take_corruption():
            k[k.nbytes // 2] ^= 0xFF  # after the checksum: the receiver must catch it
            logger.warning("%s set: corrupted layer %d of %s", CORRUPT_ENV, item.layer, item.state.request_id)
        self._send(sock, item.state, [header.encode(), k, v])

    def _send(self, sock: zmq.Socket, state: Outgoing, parts: list[Any]) -> None:
        t0 = time.perf_counter()
        try:
            sock.send_multipart(parts, copy=False)
        except zmq.Again:
            state.error = f"send to {state.peer} timed out after {self.send_timeout_s:g}s"
        except zmq.ZMQError as exc:
            state.error = f"send to {state.peer} failed: {exc}"
        if state.error is not None:
            logger.warning("kv transfer %s: %s", state.request_id, state.error)
            return
        nbytes = sum(p.nbytes for p in parts[1:])  # payload only, like the receiver counts
        state.seq += 1
        state.bytes_sent += nbytes
        self._count(bytes_sent=nbytes, frames_sent=1, send_seconds=time.perf_counter() - t0)

    def stats(self) -> dict[str, float]:
        return self._send_stats()

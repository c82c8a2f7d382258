"""Decode side of the ZMQ transport: one PULL socket and one thread that verifies and writes.

See `kvtransfer.zmq_transport` for the socket pattern; the per-transfer checks live in
`kvtransfer.assembly`.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from kvtransfer.base import KVReceiver, KVSink, OnComplete
from kvtransfer.frames import KIND_LAYER, FrameError, FrameHeader
from kvtransfer.pending import PendingTransfers
from kvtransfer.staging import PairPool

logger = logging.getLogger(__name__)


class ZmqReceiver(PendingTransfers, KVReceiver):
    """Decode-side ZMQ transport (contract: `KVReceiver`).

    sink: the decode cache (`KVSink`); its `block_shape` and `dtype` are what frames must carry.
    bind: endpoint to bind; "tcp://HOST:*" picks a free port; `address` tells the real one.
      Binding 0.0.0.0 gives an address other hosts must rewrite with this host's name.
    on_complete: called with each TransferResult on the receiver thread (instead of queueing
      results for `poll_completed`); it must return quickly.
    poll_interval_s: how often deadlines are checked, so a timeout is reported at most this
      late.
    """

    def __init__(
        self,
        sink: KVSink,
        bind: str = "tcp://127.0.0.1:*",
        *,
        on_complete: OnComplete | None = None,
        rcvhwm: int = 256,
        poll_interval_s: float = 0.02,
        context: zmq.Context | None = None,
        auth_token: str | None = None,
    ) -> None:
        self._init_pending(sink, on_complete, poll_interval_s)
        self._bind_socket(zmq.PULL, bind, context, auth_token, RCVHWM=rcvhwm)
        self._pool = PairPool()
        # The socket moves to the receiver thread here; Thread.start() is the memory barrier
        # ZMQ asks for, and no other thread touches it afterwards.
        self._thread = threading.Thread(target=self._run, name="kv-recv", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def stats(self) -> dict[str, float]:
        return {**self._transfer_stats(), "checksum_failures": self.checksum_failures}

    def close(self) -> None:
        if not self._stop_thread(self._thread):  # closed already, or stuck: keep its ZMQ context
            return
        self._pool.close()
        if self._own_ctx:
            self._ctx.term()

    # -- receiver thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve(self._handle, copy=False)
        finally:
            self._sock.close(linger=0)

    def _handle(self, parts: list[Any]) -> None:
        self.frames_received += 1
        self.bytes_received += sum(len(p.buffer) for p in parts[1:])
        try:
            header = FrameHeader.decode(parts[0].buffer)
        except FrameError as exc:
            self.frames_dropped += 1
            logger.warning("dropping malformed kv message: %s", exc)
            return
        with self._lock:
            transfer = self._pending.get(header.request_id)
        if transfer is None:
            self.frames_dropped += 1
            logger.debug("dropping kv %s message for unknown request %s", header.kind, header.request_id)
            return
        want_parts = 3 if header.kind == KIND_LAYER else 1
        with transfer.lock:
            if transfer.done:
                self.frames_dropped += 1
                return
            if len(parts) != want_parts:
                result = transfer.fail(f"malformed {header.kind} message: {len(parts)} parts, expected {want_parts}")
            else:
                k_buf = parts[1].buffer if want_parts == 3 else None
                v_buf = parts[2].buffer if want_parts == 3 else None
                result = transfer.on_message(header, k_buf, v_buf, self._sink, self._pool)
            if result is not None:
                result = self._retire(transfer, result)
        if result is not None:
            self._deliver(result)

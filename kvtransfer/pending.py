"""The receiver-side bookkeeping every transport shares: expected transfers, cancel, results.

A receiver class mixes this in, calls `_init_pending(sink, on_complete, poll_interval_s)` and
`_bind_socket(...)` (its ZMQ socket, `address`) in its constructor, and runs `_serve` on its own
thread, which does the I/O: `_serve` drains the socket into the receiver's handler and calls
`_expire` every poll interval. The handler hands each finished transfer to `_retire` then
`_deliver`. `_tally` counts a retired transfer in the receiver's stats (transfers_ok,
transfer_seconds, transfers_failed, checksum_failures).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import zmq

from kvtransfer.assembly import IncomingTransfer
from kvtransfer.auth import secure_server
from kvtransfer.base import KVSink, KVTransferError, OnComplete, TransferResult
from kvtransfer.frames import dtype_name
from kvtransfer.outgoing import check_request_id
from tandem.native import set_thread_name

logger = logging.getLogger(__name__)

DRAIN_BURST = 64  # messages handled per wake before deadlines are looked at again


def sink_device(sink: KVSink, device: str | torch.device | None) -> torch.device:
    """Where a receiver's payloads land: `device`; None: the sink's cache device (its `k_caches`),
    else CPU. ValueError naming `device` when it is not a torch device."""
    if device is None:
        caches = getattr(sink, "k_caches", None)
        return caches[0].device if caches is not None and len(caches) else torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: not a torch device: {device!r}") from None


class PendingTransfers:
    """`expect`, `cancel` and `poll_completed` of the KVReceiver contract (kvtransfer/base.py)."""

    def _init_pending(self, sink: KVSink, on_complete: OnComplete | None, poll_interval_s: float) -> None:
        """Check and keep the sink (its `block_shape` and `dtype` are what frames must carry) and
        the poll interval (how late a deadline may be noticed); zero the shared counters.
        ValueError naming `sink` or `poll_interval_s`."""
        block_shape = getattr(sink, "block_shape", None)
        if (
            not callable(getattr(sink, "write", None))
            or not isinstance(block_shape, (tuple, list))
            or len(block_shape) != 3
            or not all(isinstance(d, int) and d > 0 for d in block_shape)
        ):
            raise ValueError("sink: expected a KVSink with write() and block_shape (block_size, kv_heads, head_dim)")
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s: must be > 0, got {poll_interval_s}")
        self._sink = sink
        self._on_complete = on_complete
        self._block_shape = tuple(block_shape)
        self._dtype = dtype_name(getattr(sink, "dtype", None))
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self.bytes_received = self.frames_received = self.frames_dropped = 0
        self.transfers_ok = self.transfers_failed = self.checksum_failures = 0
        self.transfer_seconds = 0.0
        self._lock = threading.Lock()
        self._pending: dict[str, IncomingTransfer] = {}
        self._results: collections.deque[TransferResult] = collections.deque()
        self._results_cond = threading.Condition()
        self._stop = threading.Event()

    def _bind_socket(self, socket_type: int, bind: str, context: zmq.Context | None,
                     auth_token: str | None = None, **options: int) -> None:
        """This receiver's socket (`_sock`, in `_ctx`; options by zmq name) bound to `bind`;
        ValueError naming `bind` when it cannot bind. `address` tells the bound endpoint. With
        `auth_token`, only senders presenting it connect (`kvtransfer.auth`; `_auth.refused`)."""
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._sock = self._ctx.socket(socket_type)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._auth = secure_server(self._sock, auth_token)
        for name, value in options.items():
            self._sock.setsockopt(getattr(zmq, name), value)
        try:
            self._sock.bind(bind)
        except zmq.ZMQError as exc:
            self._drop_socket()
            raise ValueError(f"bind: cannot bind {bind!r}: {exc}") from None
        self._address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _drop_socket(self) -> None:
        """Undo `_bind_socket` when the constructor fails after it."""
        self._sock.close()
        if self._own_ctx:
            self._ctx.term()

    @property
    def address(self) -> str:
        return self._address

    def _serve(self, handle: Callable[[list[Any]], None], *, copy: bool = True,
               busy: Callable[[], bool] | None = None, each_turn: Callable[[], None] | None = None) -> None:
        """The receiver thread's loop until `close`: wait for the socket (the poll interval, or 1 ms
        while `busy()`), hand each message's parts to `handle` (up to DRAIN_BURST a wake; frames
        copied out of ZMQ or not, per `copy`), call `each_turn` every wake, and fail the transfers
        whose deadline passed once a poll interval. A crash is logged and raised; the caller
        closes the socket."""
        set_thread_name(threading.current_thread().name)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        next_check = 0.0
        try:
            while not self._stop.is_set():
                if poller.poll(1 if busy is not None and busy() else self._poll_ms):
                    for _ in range(DRAIN_BURST):
                        try:
                            parts = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=copy)
                        except zmq.Again:
                            break
                        handle(parts)
                if each_turn is not None:
                    each_turn()
                now = time.monotonic()
                if now >= next_check:
                    self._expire(now)
                    next_check = now + self._poll_ms / 1000
        except Exception:
            logger.exception("kv receiver thread %s crashed", threading.current_thread().name)
            raise

    def _transfer_stats(self) -> dict[str, float]:
        """The counters every receiver reports (a receiver adds its own to them)."""
        return {
            "bytes_received": self.bytes_received,
            "frames_received": self.frames_received,
            "frames_dropped": self.frames_dropped,
            "transfers_ok": self.transfers_ok,
            "transfers_failed": self.transfers_failed,
            "transfer_seconds": self.transfer_seconds,
            "pending": len(self._pending),
            "connections_refused": self._auth.refused,  # senders with a wrong cluster token
        }

    def _stop_thread(self, thread: threading.Thread, timeout_s: float = 10.0) -> bool:
        """Tell the receiver thread to stop and wait for it; False (logged) if it did not stop,
        or if the receiver was closed already."""
        if self._stop.is_set():
            return False
        with self._lock:
            self._stop.set()
        thread.join(timeout=timeout_s)
        if thread.is_alive():
            logger.warning("kv receiver thread %s did not stop within %gs", thread.name, timeout_s)
            return False
        return True

    def expect(self, request_id: str, dst_block_ids: Sequence[int], num_layers: int, deadline_s: float) -> None:
        check_request_id(request_id)
        try:
            dst = [int(x) for x in dst_block_ids]
        except (TypeError, ValueError):
            raise ValueError("dst_block_ids: expected a sequence of integers") from None
        if any(b < 0 for b in dst) or len(set(dst)) != len(dst):
            raise ValueError("dst_block_ids: ids must be distinct and non-negative")
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers: must be a positive integer, got {num_layers!r}")
        if not isinstance(deadline_s, (int, float)) or not (deadline_s > 0 and math.isfinite(deadline_s)):
            raise ValueError(f"deadline_s: must be a positive number of seconds, got {deadline_s!r}")
        transfer = IncomingTransfer(request_id, dst, num_layers, float(deadline_s), self._block_shape, self._dtype)
        with self._lock:
            if self._stop.is_set():
                raise KVTransferError("receiver is closed")
            if request_id in self._pending:
                raise ValueError(f"request_id: transfer {request_id!r} is already expected")
            self._pending[request_id] = transfer

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            transfer = self._pending.pop(request_id, None)
        if transfer is None:
            return False
        with transfer.lock:  # waits for a write in progress; none follows
            transfer.done = True
        self._wait_written()  # the caller may free the blocks now: no upload may land after
        return True

    def _wait_written(self) -> None:
        """Block until the sink's asynchronous writes so far have landed (a CUDA sink uploads
        host memory on its own stream; see TensorKVSink.wait_written). Every transfer that ends,
        done or not, passes here before its blocks may be read or freed."""
        wait_written = getattr(getattr(self, "_sink", None), "wait_written", None)
        if wait_written is not None:
            wait_written()

    def poll_completed(self, timeout_s: float = 0.0) -> list[TransferResult]:
        with self._results_cond:
            if not self._results and timeout_s > 0:
                self._results_cond.wait_for(lambda: bool(self._results), timeout=timeout_s)
            out = list(self._results)
            self._results.clear()
        return out

    def _expire(self, now: float) -> None:
        """Fail every transfer whose deadline passed."""
        with self._lock:
            late = [t for t in self._pending.values() if now >= t.deadline]
        for transfer in late:
            with transfer.lock:
                result = None if transfer.done else transfer.expire(now)
                if result is not None:
                    result = self._retire(transfer, result)
            if result is not None:
                self._deliver(result)

    def _retire(self, transfer: IncomingTransfer, result: TransferResult) -> TransferResult | None:
        """Drop a finished transfer from the pending set; None if it was cancelled meanwhile."""
        with self._lock:
            if self._pending.get(transfer.request_id) is not transfer:
                return None
            del self._pending[transfer.request_id]
        self._tally(transfer, result)
        return result

    def _tally(self, transfer: IncomingTransfer, result: TransferResult) -> None:
        if result.ok:
            self.transfers_ok += 1
            self.transfer_seconds += result.seconds
        else:
            self.transfers_failed += 1
            self.checksum_failures += transfer.checksum_failed

    def _deliver(self, result: TransferResult) -> None:
        """To the on_complete callback, or to `poll_completed`, once the sink's asynchronous
        writes have landed (for a failed transfer too: its blocks are freed next)."""
        try:
            self._wait_written()
        except Exception as exc:  # a failed upload fails the transfer
            logger.exception("kv sink upload failed for %s", result.request_id)
            if result.ok:
                result = dataclasses.replace(result, ok=False, error=f"sink upload failed: {exc!r}")
        if self._on_complete is not None:
            try:
                self._on_complete(result)
            except Exception:
                logger.exception("kv on_complete callback failed for %s", result.request_id)
            return
        with self._results_cond:
            self._results.append(result)
            self._results_cond.notify_all()

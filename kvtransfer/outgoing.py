"""Sender-side pieces every KV transport shares: argument checks, one transfer's state, and the
caller-side calls of `KVSender` (`OutgoingTransfers`)."""
from __future__ import annotations

import collections
import itertools
import json
import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvtransfer.base import KVTransferError, SendResult
from kvtransfer.frames import KIND_ABORT, KIND_COMMIT, MAX_BLOCK_ID, FrameHeader
from kvtransfer.staging import PairPool, StagedLayer, check_cache_pair, device_index

logger = logging.getLogger(__name__)


def check_open_args(request_id: Any, peer_address: Any, num_layers: Any, schemes: tuple[str, ...]) -> None:
    """ValueError naming the field for a bad `KVSender.open` argument."""
    check_request_id(request_id)
    if not isinstance(peer_address, str) or not peer_address.startswith(schemes):
        raise ValueError(f"peer_address: expected an endpoint starting with one of {schemes}, got {peer_address!r}")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"num_layers: must be a positive integer, got {num_layers!r}")


def check_request_id(request_id: Any) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")


def parse_block_ids(value: Any, field_name: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in value)
    except (TypeError, ValueError):
        raise ValueError(f"{field_name}: expected a sequence of integers") from None
    if any(not 0 <= i <= MAX_BLOCK_ID for i in ids):
        raise ValueError(f"{field_name}: block ids must be in [0, {MAX_BLOCK_ID}]")
    return ids


@dataclass(eq=False)
class Outgoing:
    """Sender-side state of one transfer. `seq`, `bytes_sent` belong to the peer thread."""

    request_id: str
    peer: str
    num_layers: int
    started: float = field(default_factory=time.monotonic)
    layers: set[int] = field(default_factory=set)
    dst_sorted: list[int] | None = None
    layout: tuple[str, tuple[int, ...]] | None = None  # (dtype, block shape) fixed by layer one
    future: Future[SendResult] = field(default_factory=Future)
    seq: int = 0
    bytes_sent: int = 0
    error: str | None = None
    aborted: bool = False
    channel: Any = None  # what carries it: put(Item) queues work for the transport's own thread
    # The last layer's block ids as given and as checked, and the source ids on a device: the
    # layers of a transfer carry the same ids, so they are validated (and uploaded) once.
    _checked: tuple[tuple, tuple, int, tuple[int, ...], tuple[int, ...]] | None = None
    _index: tuple[tuple[int, ...], Any, Any] | None = None

    def check_layer(self, layer: Any, src_k: Any, src_v: Any, src_block_ids: Any,
                    dst_block_ids: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """Validate one `send_layer` call against this transfer (ValueError naming the field);
        fix the layout and destination blocks on the first layer. Returns (src, dst, bytes of K+V)."""
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: must be an integer in [0, {self.num_layers}), got {layer!r}")
        if layer in self.layers:
            raise ValueError(f"layer: layer {layer} of {self.request_id!r} was already sent")
        dtype, shape = check_cache_pair(src_k, src_v)
        layout = (dtype, shape[1:])
        if self.layout is not None and layout != self.layout:
            raise ValueError(f"src_k: dtype/block shape {layout} differs from earlier layers {self.layout}")
        try:
            given = (tuple(src_block_ids), tuple(dst_block_ids), shape[0])
        except TypeError:
            given = None  # not sequences: parse_block_ids names the field
        if given is not None and self._checked is not None and self._checked[:3] == given:
            src, dst = self._checked[3], self._checked[4]  # the same ids as the layer before
        else:
            src, dst = self._check_ids(src_block_ids, dst_block_ids, shape[0])
            if given is not None:
                self._checked = (*given, src, dst)
        if self.layout is None:
            self.layout, self.dst_sorted = layout, sorted(dst)
        block_bytes = src_k[:1].nbytes if shape[0] else 0  # bytes of one block, numpy or torch
        return src, dst, 2 * len(src) * block_bytes

    def _check_ids(self, src_block_ids: Any, dst_block_ids: Any,
                   num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        src = parse_block_ids(src_block_ids, "src_block_ids")
        dst = parse_block_ids(dst_block_ids, "dst_block_ids")
        if len(src) != len(dst):
            raise ValueError(f"dst_block_ids: {len(dst)} ids for {len(src)} src_block_ids")
        if len(set(dst)) != len(dst):
            raise ValueError("dst_block_ids: ids must be distinct")
        if any(i >= num_blocks for i in src):
            raise ValueError(f"src_block_ids: ids must be below num_blocks={num_blocks}")
        if self.dst_sorted is not None and sorted(dst) != self.dst_sorted:
            raise ValueError("dst_block_ids: every layer must carry the same destination blocks")
        return src, dst

    def src_index(self, src: tuple[int, ...], device: Any) -> Any:
        """`src` (as `check_layer` returned it) as an int64 tensor on `device`, uploaded once for
        as long as the layers carry the same source blocks."""
        if self._index is None or self._index[0] is not src or self._index[1] != device:
            self._index = (src, device, device_index(src, device))
        return self._index[2]


@dataclass
class Item:
    state: Outgoing
    kind: str
    layer: int = -1
    staged: StagedLayer | None = None
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()
    meta: dict[str, Any] | None = None
    reason: str = ""


class ItemQueue:
    """A channel's items in order, for the one thread that sends them: callers `put`; `close`
    asks the thread to end once it has drained the queue. `_cond` guards `_items` and `_closing`."""

    def __init__(self) -> None:
        self._items: collections.deque[Item] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False

    def put(self, item: Item) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()


class OutgoingTransfers(ABC):
    """The caller-side calls every sender shares: looking up an open transfer, `commit`,
    `abort`, `close`, the staging budget (`_reserve` / `_release`), the stats counters and the
    corruption test hook.

    A sender calls `_init_outgoing` in its constructor, names the address schemes it accepts
    (`schemes`) and its `transport_name`, and implements `_channel_for`: a channel has `put`,
    `close()`, a `thread` and `broken` (None while it works). One with the corruption test hook
    sets `_corrupt_pending`.
    """

    schemes: tuple[str, ...]
    transport_name: str

    def _init_outgoing(self, *, send_timeout_s: float, linger_s: float, context: zmq.Context | None,
                       auth_token: str | None, max_staged_bytes: int | None = None) -> None:
        """The state every sender shares: ValueError naming `send_timeout_s` or `max_staged_bytes`
        (the staging budget of a sender that stages copies; None: one that does not)."""
        if not send_timeout_s > 0:
            raise ValueError(f"send_timeout_s: must be > 0, got {send_timeout_s}")
        if max_staged_bytes is not None and max_staged_bytes <= 0:
            raise ValueError(f"max_staged_bytes: must be > 0, got {max_staged_bytes}")
        self.send_timeout_s = float(send_timeout_s)
        self.max_staged_bytes = None if max_staged_bytes is None else int(max_staged_bytes)
        self.linger_s = float(linger_s)
        self.auth_token = auth_token or None  # presented in every connection's handshake (kvtransfer.auth)
        self._own_ctx = context is None
        self._ctx = context or zmq.Context()
        self._id = uuid.uuid4().hex[:12]  # names this sender's channels (`_retiring_channel_for`)
        self._serial = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._requests: dict[str, Outgoing] = {}  # request id -> its state, with its `channel`
        self._channels: dict[str, Any] = {}  # peer address -> its channel
        self._retired: list[Any] = []  # channels replaced after they broke
        self._staged_cond = threading.Condition()
        self._pair_pool = PairPool()
        self._stats_lock = threading.Lock()
        self.staged_bytes = 0
        self.bytes_sent = self.frames_sent = 0
        self.transfers_committed = self.transfers_aborted = self.transfers_failed = 0
        self.send_seconds = 0.0

    def open(self, request_id: str, peer_address: str, num_layers: int) -> None:
        check_open_args(request_id, peer_address, num_layers, self.schemes)
        with self._lock:
            if self._closed:
                raise KVTransferError("sender is closed")
            if request_id in self._requests:
                raise ValueError(f"request_id: transfer {request_id!r} is already open")
            channel = self._channel_for(peer_address)
            self._requests[request_id] = Outgoing(request_id, peer_address, num_layers, channel=channel)

    @abstractmethod
    def _channel_for(self, peer_address: str) -> Any:
        """The channel a new transfer to `peer_address` goes through (called under `_lock`)."""

    def _retiring_channel_for(self, peer_address: str, make: Callable[[Any, str, str], Any]) -> Any:
        """The channel to `peer_address`, or a new one, `make(self, peer, channel id)`, when
        there is none or it broke: a broken channel is retired (closed), never reused."""
        channel = self._channels.get(peer_address)
        if channel is None or channel.broken is not None:
            if channel is not None:
                channel.close()
                self._retired.append(channel)
            channel = make(self, peer_address, f"{self._id}-{next(self._serial)}")
            self._channels[peer_address] = channel
        return channel

    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Close every channel, give their threads `drain_timeout_s` (plus the linger) to send
        what is queued, and release the context unless a thread is still sending."""
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
        self._pair_pool.close()
        if any(c.thread.is_alive() for c in channels):
            logger.warning("kv %s sender closed with sends still in flight; leaving its ZMQ context open",
                           self.transport_name)
        elif self._own_ctx:
            self._ctx.term()

    def _state(self, request_id: str) -> Any:
        with self._lock:
            if self._closed:
                raise KVTransferError("sender is closed")
            state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"request_id: no open transfer {request_id!r}")
        if state.error is not None:
            raise KVTransferError(f"request {request_id}: transfer failed: {state.error}")
        return state

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
        state.aborted = True  # the channel thread skips (and frees) this request's queued layers
        state.channel.put(Item(state, KIND_ABORT, reason=str(reason)))
        return True

    def _end_transfer(self, item: Item, send_header: Callable[[FrameHeader], object]) -> None:
        """A worker thread's handling of a commit or abort item: a commit sends its header (unless
        the transfer failed) and reports the result; an abort sends its header, except after a
        failure (the receiver then times out on its own)."""
        state = item.state
        if item.kind == KIND_COMMIT:
            if state.error is None:
                send_header(FrameHeader(KIND_COMMIT, state.request_id, state.seq, meta=item.meta or {}))
            ok = state.error is None
            self._count(transfers_committed=int(ok), transfers_failed=int(not ok))
            state.future.set_result(
                SendResult(state.request_id, ok, state.error, state.bytes_sent, time.monotonic() - state.started)
            )
        elif state.error is None:
            send_header(FrameHeader(KIND_ABORT, state.request_id, state.seq, reason=item.reason))
            self._count(transfers_aborted=1)

    def _reserve(self, nbytes: int) -> None:
        """Wait until `nbytes` more staged bytes fit the budget (one layer always fits)."""
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

    def _send_stats(self) -> dict[str, float]:
        """The counters every sender reports (a sender adds its own, or replaces `staged_bytes`)."""
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

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:  # the channel threads update the same counters
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def _take_corruption(self) -> bool:
        """True once, for the first layer sent after the corruption hook was armed."""
        with self._stats_lock:
            pending, self._corrupt_pending = self._corrupt_pending, False
        return pending

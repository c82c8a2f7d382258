"""Decode side of the NCCL transport: a ROUTER socket for headers, a store for rendezvous, one
channel per sender (`kvtransfer.nccl_recv_channel`) that receives each announced layer, and
the checks and writes of each transfer (bookkeeping in `kvtransfer.assembly`).

See `kvtransfer.nccl_transport` for the protocol.
"""
from __future__ import annotations

import logging
import threading

import torch
import zmq

from kvtransfer import nccl_group as ng
from kvtransfer.assembly import IncomingTransfer
from kvtransfer.base import KVReceiver, KVSink, OnComplete, TransferResult
from kvtransfer.frames import KIND_LAYER, FrameHeader
from kvtransfer.pending import PendingTransfers, sink_device
from kvtransfer.nccl_recv_channel import RecvChannel

logger = logging.getLogger(__name__)


class NcclReceiver(PendingTransfers, KVReceiver):
    """Decode-side NCCL transport (contract: `KVReceiver`).

    sink: the decode cache (`KVSink`). NCCL payloads are received on `device` and handed to
      `sink.write` as CUDA tensors (which `TensorKVSink` copies in place); the write's device
      work goes on this channel's stream or the default stream, and the default stream (the
      decode engine's) is ordered after it. Gloo payloads arrive in host memory.
    bind: ZMQ endpoint for headers; "tcp://HOST:*" picks a free port; `address` tells it.
    backend: "nccl" or "gloo"; None: nccl when `device` is CUDA, else gloo.
    device: where payloads land; None: the sink's cache device (`k_caches`), else CPU.
    store_address: HOST:PORT of the TCPStore this receiver hosts for the senders' rendezvous
      (PORT 0: a free one); None: the bind host, a free port.
    recv_timeout_s: bound on a channel's rendezvous and on each payload after its header.
    max_frame_bytes: a header announcing more than this breaks the channel (its payload
      cannot be received, so the rest of the stream could not be matched).
    max_inflight_layers: messages (each of one or more layers) of one channel whose receives
      may be posted ahead.
    """

    def __init__(
        self,
        sink: KVSink,
        bind: str = "tcp://127.0.0.1:*",
        *,
        on_complete: OnComplete | None = None,
        backend: str | None = None,
        device: str | torch.device | None = None,
        store_address: str | None = None,
        recv_timeout_s: float = 10.0,
        max_frame_bytes: int = 1 << 32,
        max_inflight_layers: int = 4,
        poll_interval_s: float = 0.02,
        context: zmq.Context | None = None,
        auth_token: str | None = None,
    ) -> None:
        self._init_pending(sink, on_complete, poll_interval_s)
        if not recv_timeout_s > 0:
            raise ValueError(f"recv_timeout_s: must be > 0, got {recv_timeout_s}")
        want = sink_device(sink, device)
        self.backend = ng.check_backend(backend or ("nccl" if want.type == "cuda" else "gloo"))
        self.device = want if self.backend == "nccl" else torch.device("cpu")  # gloo moves host memory
        if self.backend == "nccl":
            ng.ensure_nccl_env()
        self.recv_timeout_s = float(recv_timeout_s)
        self.max_frame_bytes = int(max_frame_bytes)
        if isinstance(max_inflight_layers, bool) or not isinstance(max_inflight_layers, int) or max_inflight_layers < 1:
            raise ValueError(f"max_inflight_layers: must be an integer >= 1, got {max_inflight_layers!r}")
        self.max_inflight_layers = max_inflight_layers
        self._bind_socket(zmq.ROUTER, bind, context, auth_token)
        default_host = self._address.removeprefix("tcp://").rpartition(":")[0] if bind.startswith("tcp://") else ""
        try:
            store_host, store_port = ng.split_host_port(store_address, "store_address") if store_address else (
                default_host or "127.0.0.1", 0)
            self._store = ng.host_store(store_host, store_port, self.recv_timeout_s)
        except (ValueError, RuntimeError) as exc:  # torch reports a port in use as a RuntimeError
            self._drop_socket()
            raise ValueError(f"store_address: cannot host the rendezvous store: {exc}") from None
        self._store_host, self.store_port = store_host, int(self._store.port)
        self._stats_lock = threading.Lock()
        self._channels: dict[bytes, RecvChannel] = {}
        self.channels_opened = self.channels_broken = 0
        self._thread = threading.Thread(target=self._run, name="kv-nccl-recv", daemon=True)
        self._thread.start()

    def stats(self) -> dict[str, float]:
        return {
            **self._transfer_stats(),
            "channels_opened": self.channels_opened,
            "channels_broken": self.channels_broken,
            "channels": len(self._channels),
        }

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop_thread(self._thread)  # the channels below are closed even if it is stuck
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            channel.headers.put(None)
            ng.close_group(channel.group, broken=True)  # wakes a thread blocked on a payload
        for channel in channels:
            channel.thread.join(timeout=self.recv_timeout_s)
        self._store = None  # stops the rendezvous server once no channel holds it
        if self._own_ctx and not self._thread.is_alive():
            self._ctx.term()

    # -- socket thread: control messages, headers to their channel, deadlines -------------------

    def _run(self) -> None:
        try:
            self._serve(self._on_control)
        finally:
            self._sock.close(linger=0)

    def _on_control(self, parts: list[bytes]) -> None:
        if len(parts) < 3 or (len(parts) > 3 and parts[1] != ng.FRAME):
            logger.warning("dropping malformed kv control message of %d parts", len(parts))
            return
        identity, tag, body = parts[0], parts[1], parts[2]
        with self._lock:
            channel = self._channels.get(identity)
        if tag == ng.FRAME:  # one header, or several layers' headers sharing one payload
            if channel is None:
                self._count(frames_dropped=len(parts) - 2)  # a channel this receiver never saw, or already closed
            else:
                channel.headers.put(parts[2:])
        elif tag == ng.HELLO:
            self._hello(identity, body)
        elif tag == ng.BYE and channel is not None:
            channel.headers.put(None)

    def _hello(self, identity: bytes, body: bytes) -> None:
        try:
            doc = ng.decode(body)
            if doc.get("v") != ng.CONTROL_VERSION:
                raise ValueError(f"v: unsupported control version {doc.get('v')!r}")
            wanted = doc.get("backend")
            if wanted is not None and wanted != self.backend:
                raise ValueError(f"backend: this receiver uses {self.backend!r}, the sender wants {wanted!r}")
            if identity in self._channels:
                raise ValueError(f"channel: {identity!r} is already open")
        except ValueError as exc:
            self._sock.send_multipart([identity, ng.REFUSE, ng.encode({"error": str(exc)})])
            return
        prefix = f"tandem-kv/{identity.decode(errors='replace')}"
        with self._lock:
            self._channels[identity] = RecvChannel(self, identity.decode(errors="replace"), prefix)
        self._count(channels_opened=1)
        logger.info("kv nccl channel %s opened (%s, store %s:%d)", identity.decode(errors="replace"), self.backend,
                    self._store_host, self.store_port)
        welcome = {"backend": self.backend, "store_host": self._store_host, "store_port": self.store_port, "prefix": prefix}
        self._sock.send_multipart([identity, ng.WELCOME, ng.encode(welcome)])

    def _forget(self, channel: RecvChannel) -> None:
        with self._lock:
            for key, value in list(self._channels.items()):
                if value is channel:
                    del self._channels[key]
        if channel.broken:
            self._count(channels_broken=1)

    def _apply(self, header: FrameHeader, k: torch.Tensor | None, v: torch.Tensor | None) -> None:
        """Hand a complete message to its transfer; count it dropped when nobody expects it."""
        with self._lock:
            transfer = self._pending.get(header.request_id)
        if transfer is None:
            self._count(frames_dropped=1)
            return
        with transfer.lock:
            if transfer.done:
                self._count(frames_dropped=1)
                return
            if header.kind == KIND_LAYER:
                result = self._apply_layer(transfer, header, k, v)
            else:
                result = transfer.on_message(header, None, None, self._sink)
            if result is not None:
                result = self._retire(transfer, result)
        if result is not None:
            self._deliver(result)

    def _apply_layer(
        self, transfer: IncomingTransfer, header: FrameHeader, k: torch.Tensor, v: torch.Tensor
    ) -> TransferResult | None:
        """The layer checks of `IncomingTransfer` minus checksums (caller holds the lock)."""
        error = transfer.device_layer_error(header)
        if error is not None:
            return transfer.fail(error)
        want_shape = transfer.layer_shape
        dtype = getattr(torch, header.dtype)
        try:
            self._sink.write(header.layer, list(header.dst_block_ids), k.view(dtype).view(want_shape),
                             v.view(dtype).view(want_shape))
            if k.is_cuda:
                # The copies ran on this channel's stream (and, for a sink that copies V from a
                # helper thread, on the default stream). Order the default stream, which the
                # decode engine runs on, after them, and keep the buffers from being reused
                # before it got there; no host wait, so a busy decode step never stalls receiving.
                default = torch.cuda.default_stream(k.device)
                default.wait_event(torch.cuda.current_stream(k.device).record_event())
                k.record_stream(default)
                v.record_stream(default)
        except Exception as exc:
            logger.exception("kv sink write failed for request %s layer %d", transfer.request_id, header.layer)
            return transfer.fail(f"sink write failed for layer {header.layer}: {exc!r}")
        transfer.layers.add(header.layer)
        transfer.bytes_received += k.numel() + v.numel()
        return None

    def _tally(self, transfer: IncomingTransfer, result: TransferResult) -> None:
        if result.ok:
            self._count(transfers_ok=1, transfer_seconds=result.seconds)
        else:
            self._count(transfers_failed=1)

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

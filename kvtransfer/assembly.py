"""Receiver-side state of one incoming transfer: check each message, then write it to the sink.

Transport-independent: a transport decodes a message's header, hands header and payload
buffers to `IncomingTransfer.on_message`, and reports the `TransferResult` it returns.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvtransfer.base import KVSink, TransferResult
from kvtransfer.frames import KIND_ABORT, KIND_COMMIT, KIND_LAYER, FrameHeader, checksum
from kvtransfer.staging import PairPool, tensor_from_buffer

logger = logging.getLogger(__name__)


class IncomingTransfer:
    """One expected transfer: which blocks, how many layers, until when.

    `lock` is held while a message is applied; `cancel` and result delivery take it too, so a
    write never races with the caller freeing the blocks. Once `done` is set (result produced
    or cancelled) no further message is applied.
    """

    def __init__(
        self,
        request_id: str,
        dst_block_ids: Sequence[int],
        num_layers: int,
        deadline_s: float,
        block_shape: tuple[int, ...],
        dtype: str,
    ) -> None:
        self.request_id = request_id
        self.dst_block_ids = tuple(dst_block_ids)
        self._dst_sorted = sorted(self.dst_block_ids)
        self.num_layers = num_layers
        self.deadline_s = deadline_s
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.started = time.monotonic()
        self.deadline = self.started + deadline_s
        self.next_seq = 0
        self.layers: set[int] = set()
        self.bytes_received = 0
        self.checksum_failed = False
        self.done = False
        self.lock = threading.Lock()

    def on_message(
        self,
        header: FrameHeader,
        k_buf: memoryview | None,
        v_buf: memoryview | None,
        sink: KVSink,
        pool: PairPool | None = None,
    ) -> TransferResult | None:
        """Apply one message (caller holds `lock`); the result if the transfer ended, else None.

        With a `pool`, the K and V checksums are computed in parallel.
        """
        if header.seq != self.next_seq:
            return self.fail(f"sequence gap: expected seq {self.next_seq}, got {header.seq} (a message was lost)")
        self.next_seq += 1
        if header.kind == KIND_ABORT:
            return self.fail(f"aborted by sender: {header.reason}")
        if header.kind == KIND_COMMIT:
            if k_buf is not None:
                return self.fail("malformed commit: unexpected payload")
            if len(self.layers) != self.num_layers:
                return self.fail(f"commit before all layers: received {len(self.layers)} of {self.num_layers}")
            return self._finish(ok=True, meta=header.meta)
        if header.kind != KIND_LAYER:
            return self.fail(f"unknown message kind {header.kind!r}")
        error = self._check_layer(header, k_buf, v_buf, pool)
        if error is not None or k_buf is None or v_buf is None:
            return self.fail(error or "malformed layer message")
        k = tensor_from_buffer(k_buf, header.dtype, header.shape)
        v = tensor_from_buffer(v_buf, header.dtype, header.shape)
        try:
            sink.write(header.layer, list(header.dst_block_ids), k, v)
        except Exception as exc:  # the sink is the decode worker's code; report, don't crash the thread
            logger.exception("kv sink write failed for request %s layer %d", self.request_id, header.layer)
            return self.fail(f"sink write failed for layer {header.layer}: {exc!r}")
        self.layers.add(header.layer)
        self.bytes_received += len(k_buf) + len(v_buf)
        return None

    @property
    def layer_shape(self) -> tuple[int, ...]:
        """The shape of one layer's K (or V) payload: [len(dst_block_ids), *block_shape]."""
        return (len(self.dst_block_ids), *self.block_shape)

    def header_error(self, header: FrameHeader) -> str | None:
        """Why a layer header does not fit this transfer (layer index, repeat, dtype, shape,
        destination blocks), or None."""
        if not 0 <= header.layer < self.num_layers:
            return f"layer {header.layer} out of range [0, {self.num_layers})"
        if header.layer in self.layers:
            return f"duplicate layer {header.layer}"
        if header.dtype != self.dtype:
            return f"dtype mismatch in layer {header.layer}: got {header.dtype}, cache is {self.dtype}"
        want_shape = self.layer_shape
        if header.shape != want_shape:
            return f"shape mismatch in layer {header.layer}: got {list(header.shape)}, expected {list(want_shape)}"
        if len(header.src_block_ids) != want_shape[0] or sorted(header.dst_block_ids) != self._dst_sorted:
            return f"destination blocks mismatch in layer {header.layer}: got {list(header.dst_block_ids)}"
        return None

    def device_layer_error(self, header: FrameHeader) -> str | None:
        """Why a layer that arrived in device memory must not be written, or None: the checks of
        `on_message` bar the payload's size and checksum (device memory never crossed a wire, and
        hashing it would need a host copy). Advances the sequence like `on_message`."""
        if header.seq != self.next_seq:
            return f"sequence gap: expected seq {self.next_seq}, got {header.seq} (a message was lost)"
        self.next_seq += 1
        return self.header_error(header)

    def _check_layer(
        self,
        header: FrameHeader,
        k_buf: memoryview | None,
        v_buf: memoryview | None,
        pool: PairPool | None,
    ) -> str | None:
        """Why this layer message must not be written, or None when it is sound."""
        if k_buf is None or v_buf is None:
            return "malformed layer message: missing K or V payload"
        error = self.header_error(header)
        if error is not None:
            return error
        if len(k_buf) != header.payload_nbytes or len(v_buf) != header.payload_nbytes:
            return (
                f"payload size mismatch in layer {header.layer}: got {len(k_buf)}/{len(v_buf)} bytes, "
                f"expected {header.payload_nbytes}"
            )
        # Both buffers are verified before either is written, so a bad V never leaves a K behind.
        alg = header.checksum_alg

        def digest(buf: memoryview) -> int:
            return checksum(buf, alg)

        sums = pool.run(digest, k_buf, v_buf, len(k_buf)) if pool else (digest(k_buf), digest(v_buf))
        if sums != (header.checksum_k, header.checksum_v):
            self.checksum_failed = True
            return f"checksum mismatch in layer {header.layer}"
        return None

    def expire(self, now: float) -> TransferResult | None:
        """A timeout result if the deadline has passed (caller holds `lock`), else None."""
        if now < self.deadline:
            return None
        return self.fail(
            f"timed out after {self.deadline_s:g}s: received {len(self.layers)} of {self.num_layers} layers"
            + (", no commit" if len(self.layers) == self.num_layers else "")
        )

    def fail(self, error: str) -> TransferResult:
        logger.warning("kv transfer %s failed: %s", self.request_id, error)
        return self._finish(ok=False, error=error)

    def _finish(self, ok: bool, error: str | None = None, meta: dict | None = None) -> TransferResult:
        self.done = True
        return TransferResult(
            request_id=self.request_id,
            ok=ok,
            error=error,
            meta=meta if ok else None,
            layers_received=len(self.layers),
            bytes_received=self.bytes_received,
            seconds=time.monotonic() - self.started,
        )

"""A `KVSink` over torch cache tensors, the usual way a decode worker receives KV blocks."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtransfer.frames import dtype_name
from kvtransfer.staging import PairPool, block_rows, device_index

logger = logging.getLogger(__name__)


class TensorKVSink:
    """Writes received blocks into per-layer K/V caches of shape [num_blocks, block_size, kv_heads, head_dim].

    k_caches, v_caches: one tensor per layer (a list), or one stacked tensor
    [num_layers, num_blocks, ...]; CPU or CUDA, all of the same dtype and block shape.
    CUDA caches: a source on the device is copied on the caller's current stream (where the
    transport made it ready, and which its next use of the buffer follows). A source in host
    memory is first copied into pinned memory, so the network buffer may be released when `write`
    returns, then uploaded on the sink's own stream: a pageable upload, or one queued on the
    stream the decode loop computes on, would wait for the loop's queued steps. `wait_written`
    blocks until those uploads have landed; receivers call it before reporting a transfer done.
    """

    def __init__(
        self, k_caches: Sequence[torch.Tensor] | torch.Tensor, v_caches: Sequence[torch.Tensor] | torch.Tensor
    ) -> None:
        if len(k_caches) != len(v_caches) or len(k_caches) == 0:
            raise ValueError(f"v_caches: {len(v_caches)} layers for {len(k_caches)} K layers (need as many, > 0)")
        first = k_caches[0]
        if first.dim() != 4:
            raise ValueError(
                f"k_caches: a layer must be [num_blocks, block_size, kv_heads, head_dim], got {tuple(first.shape)}"
            )
        for name, caches in (("k_caches", k_caches), ("v_caches", v_caches)):
            for layer, cache in enumerate(caches):
                if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
                    raise ValueError(
                        f"{name}: layer {layer} is {tuple(cache.shape)} {cache.dtype} on {cache.device}, "
                        f"expected {tuple(first.shape)} {first.dtype} on {first.device}"
                    )
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.num_layers = len(k_caches)
        self.num_blocks = int(first.shape[0])
        self.block_shape: tuple[int, int, int] = tuple(int(d) for d in first.shape[1:])  # type: ignore[assignment]
        self.dtype = dtype_name(first.dtype)
        self._pool = PairPool()
        self._upload_stream: torch.cuda.Stream | None = None

    def write(self, layer: int, dst_block_ids: Sequence[int], k: Any, v: Any) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: {layer} out of range [0, {self.num_layers})")
        if any(not 0 <= b < self.num_blocks for b in dst_block_ids):
            raise ValueError(f"dst_block_ids: ids must be in [0, {self.num_blocks})")
        k_cache, v_cache = self.k_caches[layer], self.v_caches[layer]
        nbytes = k.numel() * k.element_size()
        if k_cache.device.type == "cpu" and k_cache.is_contiguous() and v_cache.is_contiguous():
            # Byte rows through numpy: one memcpy per block, no torch intra-op thread pool, and
            # K and V copied in parallel (numpy drops the GIL while copying).
            rows = np.asarray(dst_block_ids, dtype=np.int64)

            def put(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
                cache, src = pair
                block_rows(cache)[rows] = block_rows(src)

            self._pool.run(put, (k_cache, k), (v_cache, v), nbytes)
            return
        dev = k_cache.device
        if k.device.type == "cpu" and dev.type == "cuda":
            if self._upload_stream is None:
                self._upload_stream = torch.cuda.Stream(dev)
            with torch.cuda.stream(self._upload_stream):  # index, uploads and writes on one stream
                self._index_copy(k_cache, v_cache, dst_block_ids, _pinned_copy(k), _pinned_copy(v))
            return
        # Device sources (or a host cache not stored in index order, e.g. head-major): both copies
        # on the caller's stream, where the index is made too. (A helper thread would run on
        # another stream and could read the index, or reuse its memory, before this stream wrote it.)
        self._index_copy(k_cache, v_cache, dst_block_ids, k, v)

    @staticmethod
    def _index_copy(k_cache: torch.Tensor, v_cache: torch.Tensor, dst_block_ids: Sequence[int], k: torch.Tensor,
                    v: torch.Tensor) -> None:
        dev = k_cache.device
        idx = device_index(dst_block_ids, dev)
        for cache, src in ((k_cache, k), (v_cache, v)):
            _copyable(cache).index_copy_(0, idx, _copyable(src.to(dev, non_blocking=True)))

    def wait_written(self) -> None:
        """Block until every upload from host memory queued so far has reached the cache."""
        if self._upload_stream is not None:
            self._upload_stream.synchronize()

    def close(self) -> None:
        """Stop the helper thread (it also ends with the process)."""
        self._pool.close()


def _copyable(t: torch.Tensor) -> torch.Tensor:
    """`t`, or for a one-byte float tensor (an FP8 cache) its bytes as uint8 of the same shape:
    torch has no index_copy_ for FP8 dtypes, on the CPU or CUDA."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.dtype.itemsize == 1 else t


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of host tensor `t` in pinned memory (a new one even when `t` is pinned: the caller's
    buffer may be reused as soon as `write` returns, before the upload has read it)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out

"""Host buffers on both ends of a transfer: gather blocks into staging, view bytes as tensors.

Sender side: `stage_layer` copies the listed blocks of a layer's K/V cache into one contiguous
host buffer each (pinned, via an async copy, for CUDA caches). Receiver side:
`tensor_from_buffer` views a received buffer as a torch tensor without copying.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from kvtransfer.frames import dtype_name

logger = logging.getLogger(__name__)

T = TypeVar("T")


class PairPool:
    """Runs one function on a K and on a V buffer at once: V on a helper thread, K on the caller's.

    Hashing (xxhash) and numpy copies release the GIL, so the two halves of a layer proceed in
    parallel; buffers under `min_bytes` are handled inline, where a thread hop costs more.
    """

    def __init__(self, min_bytes: int = 256 * 1024) -> None:
        self.min_bytes = min_bytes
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-pair")

    def run(self, fn: Callable[[Any], T], k: Any, v: Any, nbytes: int) -> tuple[T, T]:
        """(fn(k), fn(v)); `nbytes` is the size of one of the two, deciding inline or parallel."""
        if nbytes < self.min_bytes:
            return fn(k), fn(v)
        v_result = self._pool.submit(fn, v)
        return fn(k), v_result.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class StagedLayer:
    """One layer's gathered K and V blocks in host memory, owned by the transfer.

    k, v: contiguous host buffers holding `shape` ([n, block_size, kv_heads, head_dim]) elements
    of `dtype` (for CPU sources a uint8 array of the raw bytes, since numpy has no bfloat16).
    `ready` is set for CUDA sources: the device-to-host copy is async and must be waited on
    (`wait()`) before the bytes are read.
    """

    k: torch.Tensor | np.ndarray  # raw bytes [n, block_bytes] for CPU sources
    v: torch.Tensor | np.ndarray
    dtype: str
    shape: tuple[int, ...]
    ready: Any = None  # torch.cuda.Event for CUDA sources

    @property
    def nbytes(self) -> int:
        """Bytes of K plus V."""
        return 2 * _as_bytes(self.k).nbytes

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None

    def k_bytes(self) -> np.ndarray:
        return _as_bytes(self.k)

    def v_bytes(self) -> np.ndarray:
        return _as_bytes(self.v)


def _as_bytes(x: torch.Tensor | np.ndarray) -> np.ndarray:
    """Flat uint8 view of a contiguous host array (zero-copy; works for bfloat16 and float8)."""
    if isinstance(x, np.ndarray):
        return x.reshape(-1).view(np.uint8)
    return x.reshape(-1).view(torch.uint8).numpy()


def block_rows(cache: torch.Tensor | np.ndarray) -> np.ndarray:
    """[num_blocks, block_bytes] uint8 view of a CPU cache (a copy if it is not contiguous)."""
    rows, row_elems = int(cache.shape[0]), math.prod(int(d) for d in cache.shape[1:])
    if isinstance(cache, torch.Tensor):
        return cache.contiguous().view(rows, row_elems).view(torch.uint8).numpy()
    return np.ascontiguousarray(cache).reshape(rows, row_elems).view(np.uint8)


def check_cache_pair(src_k: Any, src_v: Any) -> tuple[str, tuple[int, ...]]:
    """Validate a layer's K and V cache; return (dtype name, shape). ValueError naming the field."""
    for field_name, x in (("src_k", src_k), ("src_v", src_v)):
        if not isinstance(x, (torch.Tensor, np.ndarray)):
            raise ValueError(f"{field_name}: expected a torch tensor or numpy array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(
                f"{field_name}: expected [num_blocks, block_size, num_kv_heads, head_dim], got shape {tuple(x.shape)}"
            )
    if type(src_k) is not type(src_v) or tuple(src_k.shape) != tuple(src_v.shape):
        raise ValueError(f"src_v: shape {tuple(src_v.shape)} or type differs from src_k {tuple(src_k.shape)}")
    name = dtype_name(src_k.dtype)
    if dtype_name(src_v.dtype) != name:
        raise ValueError(f"src_v: dtype {src_v.dtype} differs from src_k dtype {src_k.dtype}")
    if isinstance(src_k, torch.Tensor) and src_k.device != src_v.device:
        raise ValueError(f"src_v: device {src_v.device} differs from src_k device {src_k.device}")
    return name, tuple(int(d) for d in src_k.shape)


def stage_layer(
    src_k: Any, src_v: Any, src_block_ids: Sequence[int], pool: PairPool | None = None
) -> StagedLayer:
    """Copy blocks `src_block_ids` of K and V into fresh host buffers (ids already validated).

    CPU sources are gathered synchronously (one memcpy per block; K and V in parallel when a
    `pool` is given). CUDA sources are gathered on the device and copied to pinned host memory
    on the current stream without waiting; the returned layer's `wait()` blocks until that
    copy is done.
    """
    name, shape = check_cache_pair(src_k, src_v)
    out_shape = (len(src_block_ids), *shape[1:])
    if isinstance(src_k, np.ndarray) or src_k.device.type == "cpu":
        # A byte-level take is one memcpy per block; torch's index_select on bfloat16 goes
        # through its intra-op thread pool, which stalls badly on a busy host.
        idx = np.asarray(src_block_ids, dtype=np.int64)
        k_rows, v_rows = block_rows(src_k), block_rows(src_v)

        def take(rows: np.ndarray) -> np.ndarray:
            return np.take(rows, idx, axis=0)

        if pool is None:
            return StagedLayer(take(k_rows), take(v_rows), name, out_shape)
        k, v = pool.run(take, k_rows, v_rows, len(idx) * k_rows.shape[1])
        return StagedLayer(k, v, name, out_shape)
    if src_k.device.type != "cuda":
        raise ValueError(f"src_k: device {src_k.device} is not supported (cpu or cuda)")
    idx = device_index(src_block_ids, src_k.device)
    # torch's caching host allocator recycles pinned buffers once they are freed, so a
    # steady stream of layers does not pay cudaHostAlloc each time.
    host_k = torch.empty(out_shape, dtype=src_k.dtype, pin_memory=True)
    host_v = torch.empty(out_shape, dtype=src_v.dtype, pin_memory=True)
    host_k.copy_(src_k.index_select(0, idx), non_blocking=True)
    host_v.copy_(src_v.index_select(0, idx), non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return StagedLayer(host_k, host_v, name, out_shape, ready)


def device_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """`block_ids` as an int64 tensor on `device`, queued on the current stream.

    The ids go up from pinned memory: a copy from pageable memory makes the host wait for
    everything already queued on the stream (on the prefill side, the layer being computed),
    which would take the launch queue away from the engine at every pushed layer.
    """
    if torch.device(device).type == "cpu":
        return torch.tensor(list(block_ids), dtype=torch.long)
    return torch.tensor(list(block_ids), dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


def tensor_from_buffer(buf: memoryview | bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A CPU tensor of `dtype`/`shape` viewing `buf` (no copy; valid while `buf` lives)."""
    torch_dtype = getattr(torch, dtype)
    if len(buf) == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype).view(tuple(shape))

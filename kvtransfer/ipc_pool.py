"""Staging pools of the ipc transport: memory both processes map, cut into equal slots.

The sender owns one pool per channel (`SendPool`): a shared-memory file for host caches, or one
device buffer exported with CUDA IPC for GPU caches (`kvtransfer.ipc_cuda`). Each layer's K and
V go into a lease, a run of consecutive slots that stays the sender's until the receiver
releases it; a pool with no free run is backpressure. The receiver maps the same memory from
the pool's description (`MappedPool.open`), checking every field first.
"""
from __future__ import annotations

import logging
import mmap
import os
import stat
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtransfer.base import KVTransferError
from kvtransfer.ipc_wire import ALIGN, is_int, v_offset
from kvtransfer.staging import PairPool, block_rows

logger = logging.getLogger(__name__)

SHM = "shm"
CUDA = "cuda"
POOL_PREFIX, POOL_SUFFIX = "tandem-kv-", ".pool"  # the only files a receiver agrees to map
MAX_SLOTS = 1 << 16


def default_shm_dir() -> str:
    """/dev/shm (memory-backed) where it exists, else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True)
class Lease:
    lease_id: int
    slot: int
    slots: int


class SendPool:
    """The sender's pool for one channel: `slots` slots of `slot_bytes`, leased in runs.

    `description` is what the receiver needs to map it (sent once per channel). For CUDA pools
    `events[i]` is the interprocess event recorded after a gather into a lease starting at slot i.
    """

    def __init__(self, kind: str, buffer: torch.Tensor, slots: int, slot_bytes: int, description: dict[str, Any],
                 events: list[Any] | None = None, path: str | None = None) -> None:
        self.kind, self.buffer, self.events = kind, buffer, events
        self.slots, self.slot_bytes = slots, slot_bytes
        self.description = {"kind": kind, "slots": slots, "slot_bytes": slot_bytes, **description}
        self.device = buffer.device
        self.path = path
        self.closed = False
        # A crash between creating the file and the receiver mapping it must not leave it behind.
        self._unlinker = weakref.finalize(self, _unlink, path) if path else None
        self._cond = threading.Condition()
        self._free = [True] * slots
        self._cursor = 0  # where the next search for a free run starts (`_find_run`)
        self._leases: dict[int, Lease] = {}
        self._next_id = 0
        self.waits = 0  # acquires that had to wait for a release (backpressure)

    @classmethod
    def create(cls, src_k: Any, slots: int, slot_bytes: int, shm_dir: str | None) -> SendPool:
        """A pool where `src_k`'s blocks can be staged: on its GPU, or in a shared-memory file."""
        nbytes = slots * slot_bytes
        if isinstance(src_k, torch.Tensor) and src_k.device.type == "cuda":
            from kvtransfer import ipc_cuda

            buffer, events, description = ipc_cuda.export_pool(src_k.device, nbytes, slots)
            return cls(CUDA, buffer, slots, slot_bytes, description, events=events)
        if isinstance(src_k, torch.Tensor) and src_k.device.type != "cpu":
            raise ValueError(f"src_k: device {src_k.device} is not supported (cpu or cuda)")
        path = os.path.join(shm_dir or default_shm_dir(), f"{POOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}{POOL_SUFFIX}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            buffer = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)  # the tensor keeps the map alive
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(SHM, buffer, slots, slot_bytes, {"path": path}, path=path)

    def check_source(self, src_k: Any) -> None:
        """ValueError naming src_k when a layer's cache cannot be staged into this pool."""
        device = src_k.device if isinstance(src_k, torch.Tensor) else torch.device("cpu")
        if device != self.device:
            raise ValueError(f"src_k: cache on {device}, but this channel's staging pool is on {self.device}")

    # -- leases --------------------------------------------------------------------------------

    def acquire(self, nslots: int, timeout_s: float, stopped: Callable[[], str | None]) -> Lease:
        """A run of `nslots` free slots; waits up to `timeout_s` for releases, then KVTransferError.

        `stopped()` returning a reason (channel broken, sender closed) ends the wait at once.
        """
        end = time.monotonic() + timeout_s
        waited = False
        with self._cond:
            while True:
                reason = stopped()
                if reason is not None:
                    raise KVTransferError(reason)
                first = self._find_run(nslots)
                if first is not None:
                    break
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise KVTransferError(
                        f"staging pool full: no {nslots} free slots of {self.slot_bytes} bytes within {timeout_s:g}s "
                        f"({self.in_use} of {self.slots} in use; the receiver has not released them)"
                    )
                if not waited:
                    waited, self.waits = True, self.waits + 1
                self._cond.wait(remaining)
            for i in range(first, first + nslots):
                self._free[i] = False
            lease = Lease(self._next_id, first, nslots)
            self._next_id += 1
            self._leases[lease.lease_id] = lease
            return lease

    def acquire_layers(self, nslots: int, count: int, timeout_s: float,
                       stopped: Callable[[], str | None]) -> list[Lease]:
        """`count` leases of `nslots` slots each, back to back in one run (one search and at
        most one wait for all of them); each is released on its own. Errors as `acquire`."""
        run = self.acquire(nslots * count, timeout_s, stopped)
        with self._cond:
            del self._leases[run.lease_id]
            leases = [Lease(self._next_id + i, run.slot + i * nslots, nslots) for i in range(count)]
            self._next_id += count
            self._leases.update((lease.lease_id, lease) for lease in leases)
        return leases

    def _find_run(self, nslots: int) -> int | None:
        """The first slot of a free run of `nslots`, looking from where the last lease ended
        (next fit): leases are released about in the order they were taken, so the pool fills
        like a ring and the run is usually right there, whatever the pool's size."""
        start = self._cursor if self._cursor + nslots <= self.slots else 0
        for lo, hi in ((start, self.slots), (0, min(start + nslots - 1, self.slots))):
            run = 0
            for i in range(lo, hi):
                run = run + 1 if self._free[i] else 0
                if run == nslots:
                    self._cursor = (i + 1) % self.slots
                    return i - nslots + 1
        return None

    def release(self, lease_id: int) -> bool:
        """Return a lease's slots; False for an id that is not leased (already released, or never)."""
        with self._cond:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            for i in range(lease.slot, lease.slot + lease.slots):
                self._free[i] = True
            self._cond.notify_all()
        return True

    def wake(self) -> None:
        """Let waiting acquires look at `stopped()` again."""
        with self._cond:
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        return self.slots - sum(self._free)

    # -- staging ---------------------------------------------------------------------------------

    def views(self, lease: Lease, payload: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat uint8 views of the K and V bytes inside a lease."""
        return lease_views(self.buffer, lease.slot * self.slot_bytes, payload)

    def stage(self, lease: Lease, src_k: Any, src_v: Any, src_block_ids: Sequence[int], payload: int,
              pair: PairPool) -> None:
        """Copy blocks `src_block_ids` of K and V into the lease (ids already validated).

        Host caches: synchronous, one memcpy per block, K and V in parallel. GPU caches: queued
        on the caller's stream, followed by the lease's event; nothing waits.
        """
        if self.closed:
            raise KVTransferError("the channel's staging pool is closed")
        k_out, v_out = self.views(lease, payload)
        n = len(src_block_ids)
        if self.kind == CUDA:
            from kvtransfer import ipc_cuda

            shape = (n, *src_k.shape[1:])
            ipc_cuda.gather(src_k, src_v, src_block_ids, k_out.view(src_k.dtype).view(shape),
                            v_out.view(src_v.dtype).view(shape), self.events[lease.slot])
            return
        idx = np.asarray(src_block_ids, dtype=np.int64)

        def take(job: tuple[np.ndarray, torch.Tensor]) -> None:
            rows, out = job
            np.take(rows, idx, axis=0, out=out.numpy().reshape(n, -1), mode="clip")  # ids are in range

        pair.run(take, (block_rows(src_k), k_out), (block_rows(src_v), v_out), payload)

    def unlink(self) -> None:
        """Remove the shared-memory file's name; mappings stay valid (the receiver has mapped it)."""
        if self._unlinker is not None:
            self._unlinker()

    def close(self) -> None:
        """Forget the memory. A receiver that still maps it keeps it alive until it unmaps."""
        self.unlink()
        if self.kind == CUDA:
            from kvtransfer import ipc_cuda

            ipc_cuda.forget_export(self.description)
        self.closed = True
        self.buffer, self.events = torch.empty(0, dtype=torch.uint8), None  # a retired channel holds no memory
        self.wake()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def lease_views(buffer: torch.Tensor, offset: int, payload: int) -> tuple[torch.Tensor, torch.Tensor]:
    v_start = offset + v_offset(payload)
    return buffer[offset:offset + payload], buffer[v_start:v_start + payload]


class MappedPool:
    """The receiver's mapping of one sender's pool (read only by the receiver thread)."""

    def __init__(self, kind: str, buffer: torch.Tensor, slots: int, slot_bytes: int, events: list[Any] | None) -> None:
        self.kind, self.buffer, self.events = kind, buffer, events
        self.slots, self.slot_bytes = slots, slot_bytes
        self._bytes = memoryview(buffer.numpy()) if kind == SHM else None

    @classmethod
    def open(cls, doc: dict[str, Any], device: torch.device, max_bytes: int) -> MappedPool:
        """Map the pool `doc` describes; ValueError naming the field that is wrong or cannot be mapped.

        device: where this receiver's cache lives; a GPU pool needs a GPU cache.
        """
        kind = doc.get("kind")
        if kind not in (SHM, CUDA):
            raise ValueError(f"kind: unknown staging pool kind {kind!r}; expected {SHM!r} or {CUDA!r}")
        slots, slot_bytes = doc.get("slots"), doc.get("slot_bytes")
        if not is_int(slots) or not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots: must be an integer in [1, {MAX_SLOTS}], got {slots!r}")
        if not is_int(slot_bytes) or slot_bytes <= 0 or slot_bytes % ALIGN:
            raise ValueError(f"slot_bytes: must be a positive multiple of {ALIGN}, got {slot_bytes!r}")
        nbytes = slots * slot_bytes
        if nbytes > max_bytes:
            raise ValueError(f"slots: a pool of {nbytes} bytes exceeds this receiver's max_pool_bytes={max_bytes}")
        if kind == SHM:
            return cls(SHM, map_shm_file(doc.get("path"), nbytes), slots, slot_bytes, None)
        if device.type != "cuda":
            raise ValueError(
                f"kind: the sender stages KV in GPU memory but this receiver's device is {device} "
                "(its cache's device, or the receiver's device= option); use the zmq transport between "
                "a GPU and a host cache"
            )
        from kvtransfer import ipc_cuda

        buffer, events = ipc_cuda.import_pool(doc, nbytes, slots)
        return cls(CUDA, buffer, slots, slot_bytes, events)

    def check_lease(self, slot: int, slots: int, payload: int) -> None:
        """ValueError naming the field when a layer's extent does not lie inside this pool."""
        if slot + slots > self.slots:
            raise ValueError(f"slot: slots [{slot}, {slot + slots}) are outside the pool's {self.slots} slots")
        need = v_offset(payload) + payload
        if need > slots * self.slot_bytes:
            raise ValueError(
                f"slots: {slots} slots of {self.slot_bytes} bytes cannot hold K and V of {payload} bytes each"
            )

    def views(self, slot: int, payload: int) -> tuple[Any, Any]:
        """K and V of a checked extent: memoryviews for a shared-memory pool, uint8 tensors on a GPU."""
        offset = slot * self.slot_bytes
        if self._bytes is None:
            return lease_views(self.buffer, offset, payload)
        v_start = offset + v_offset(payload)
        return self._bytes[offset:offset + payload], self._bytes[v_start:v_start + payload]

    def close(self) -> None:
        """Drop the mapping (unmapped once the last view of it is gone)."""
        self._bytes = None
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.events = None


def map_shm_file(path: Any, nbytes: int) -> torch.Tensor:
    """Map a sender's pool file of exactly `nbytes`; ValueError naming `path` for anything else."""
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError(f"path: expected an absolute path to the pool file, got {path!r}")
    name = os.path.basename(path)
    if not (name.startswith(POOL_PREFIX) and name.endswith(POOL_SUFFIX)):
        raise ValueError(f"path: {path!r} is not a staging pool file ({POOL_PREFIX}*{POOL_SUFFIX})")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # never creates: a vanished file is an error
    except FileNotFoundError:
        raise ValueError(f"path: {path} does not exist on this host (is the sender on another machine?)") from None
    except OSError as exc:
        raise ValueError(f"path: cannot open {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"path: {path} is not a regular file")
        if info.st_uid != os.getuid():
            raise ValueError(f"path: {path} belongs to another user")
        if info.st_size != nbytes:
            raise ValueError(f"path: {path} holds {info.st_size} bytes, the pool description says {nbytes}")
        return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    finally:
        os.close(fd)

"""The tensor-parallel group of one model replica and the three collectives the sharded model needs.

Ranks of a group run the same forward in lockstep (SPMD): each holds 1/world of the heads and
of the MLP, and `all_reduce` sums their partial outputs after each row-parallel layer.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.nccl_group import ensure_nccl_env

logger = logging.getLogger(__name__)

# Newer torch deprecates all_gather_into_tensor (with a warning in every process) for
# all_gather_single, which takes the same arguments; older torch has only the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

WAIT_SPIN_S = 0.002  # await_broadcast: poll without sleeping this long
WAIT_MAX_PAUSE_S = 0.001  # then sleep up to this long between polls


@dataclass(frozen=True)
class TPGroup:
    """Rank `rank` of `world_size` ranks in process group `group` (None: the default group).

    With world_size 1 every collective is a no-op, so a TP=1 model needs no process group.
    """

    rank: int
    world_size: int
    group: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size: must be an integer >= 1, got {self.world_size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank: must be an integer in [0, {self.world_size}), got {self.rank!r}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns `x`."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world * rows, ...]: every rank's `x` stacked along dim 0 in rank order."""
        if self.world_size == 1:
            return x
        out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def min_ints(self, values: list[int], device: torch.device) -> list[int]:
        """The element-wise minimum of every rank's `values` (same length on every rank)."""
        x = torch.tensor(values, dtype=torch.int64, device=device)
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return x.tolist()

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `x` on every rank (in place); returns `x`."""
        if self.world_size > 1:
            dist.broadcast(x, group=self.group, group_src=src)
        return x

    def await_broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`broadcast` for a rank that may wait long (a follower between bursts of work): the
        result is waited for by polling with short sleeps, not by a device synchronize, which on
        CUDA spins a core for as long as rank `src` stays idle and holds the GIL meanwhile.
        The first WAIT_SPIN_S poll without sleeping (back-to-back steps keep their latency),
        then the sleeps grow to WAIT_MAX_PAUSE_S."""
        if self.world_size == 1:
            return x
        work = dist.broadcast(x, group=self.group, group_src=src, async_op=True)
        start = time.monotonic()
        pause = 0.0
        while not work.is_completed():
            if time.monotonic() - start > WAIT_SPIN_S:
                pause = min(WAIT_MAX_PAUSE_S, pause + 0.00005)
            time.sleep(pause)
        work.wait()  # surfaces an error, and orders the current stream after the collective
        return x


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str | None = None,
    backend: str | None = None,
    device: torch.device | None = None,
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
) -> TPGroup:
    """Join the default process group as rank `rank` of `world_size` and return it as a TPGroup.

    init_method: "tcp://HOST:PORT" (rank 0 hosts the store there) or "file:///path".
    store: instead of init_method, a store every rank reaches (e.g. a TCPStore rank 0 hosts on
      a free port, which avoids picking a port before binding it).
    backend: "nccl" or "gloo"; None picks nccl when CUDA is available. With NCCL, `device`
      (default cuda:`rank`) becomes this process's current device and NVLink multicast is
      turned off before the communicator exists.
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend: must be 'nccl' or 'gloo', got {backend!r}")
    device_id = None
    if backend == "nccl":
        ensure_nccl_env()
        device_id = device or torch.device("cuda", rank)
        torch.cuda.set_device(device_id)
    if (init_method is None) == (store is None):
        raise ValueError("init_method: give exactly one of init_method and store")
    tp = TPGroup(rank, world_size)  # validates rank and world_size before anything connects
    dist.init_process_group(backend, init_method=init_method, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=device_id)
    logger.info("tensor parallel rank %d of %d joined (%s)", rank, world_size, backend)
    return tp

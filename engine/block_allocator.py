"""Reference-counted allocator of paged-KV block ids.

A block is free when its reference count is 0 and in use otherwise. Sequences (through their
block tables) and the radix prefix cache each hold references; see engine/radix_cache.py for
who holds what.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

logger = logging.getLogger(__name__)


class OutOfBlocks(Exception):
    """Raised by `BlockAllocator.allocate` when fewer blocks are free than requested."""

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"requested {requested} KV blocks, only {free} free")
        self.requested = requested
        self.free = free


class BlockAllocator:
    """Hands out block ids 0..num_blocks-1 and counts references to each.

    Contract:
    - `allocate(n)` returns n distinct free ids, each with refcount 1, or raises OutOfBlocks and
      allocates nothing.
    - `incref` / `decref` add or drop one reference per listed id (an id listed twice counts
      twice). Both reject ids that are out of range or not allocated with ValueError, and check
      the whole list before changing anything.
    - A block whose count drops to 0 goes back on the free list (LIFO: the most recently freed
      block is handed out first).
    Every operation is O(1) per block.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self._refcounts = [0] * num_blocks
        # Reversed so that a fresh allocator hands out 0, 1, 2, ... in order.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_total(self) -> int:
        return len(self._refcounts)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refcounts) - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n free blocks, each with refcount 1. Raises OutOfBlocks if fewer than n are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        for b in out:
            self._refcounts[b] = 1
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each listed block; every block must already be allocated."""
        ids = list(block_ids)
        for b in ids:
            self._check_allocated(b, "incref")
        for b in ids:
            self._refcounts[b] += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each listed block; blocks reaching 0 become free.

        Raises ValueError (changing nothing) if a block is free or would drop below 0.
        """
        ids = list(block_ids)
        for b in ids:
            self._check_allocated(b, "decref")
        if len(ids) > 1:
            for b, times in Counter(ids).items():
                if times > self._refcounts[b]:
                    raise ValueError(
                        f"decref of block {b} {times} times, but its refcount is {self._refcounts[b]}"
                    )
        for b in ids:
            rc = self._refcounts[b] - 1
            self._refcounts[b] = rc
            if rc == 0:
                self._free.append(b)

    def refcount(self, block_id: int) -> int:
        """Current number of references to `block_id` (0 means free)."""
        self._check_range(block_id)
        return self._refcounts[block_id]

    def _check_range(self, b: int) -> None:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < len(self._refcounts):
            raise ValueError(f"block_id must be an int in [0, {len(self._refcounts)}), got {b!r}")

    def _check_allocated(self, b: int, op: str) -> None:
        self._check_range(b)
        if self._refcounts[b] == 0:
            raise ValueError(f"{op} of block {b}, which is free")

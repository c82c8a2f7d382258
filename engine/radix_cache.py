"""Block-granular radix prefix cache over token ids: lock counts, LRU eviction, KV events.

One tree node per full KV block; a node's children are keyed by the tuple of their block's
tokens, so a root-to-node path spells a prompt prefix of whole blocks. Each node carries the
chained block hash of `tandem.hashing`, which is what BlockStored / BlockRemoved events publish
to the global prefix index.

Ownership model
---------------
- Every block has a reference count in the `BlockAllocator`.
- A sequence holds exactly one reference on each block in its block table.
- The tree holds one reference on each block it caches (one node per cached block).
- A node's `lock_count` is the number of live sequences whose locked path contains it. Locking
  a node locks its ancestors, so a locked node and its ancestors are never evicted.
- Unlocked nodes are evicted least-recently-used leaf first; evicting drops the tree's
  reference, and the block becomes free once no sequence holds it either.

Sequence lifecycle
------------------
    m = cache.match_prefix(prompt)       # full blocks only, never the whole prompt
    cache.lock(m)                        # sequence now holds a reference on m.block_ids
    table = m.block_ids + allocator.allocate(blocks_needed - len(m.block_ids))
    ... prefill writes KV for prompt[m.num_tokens:] ...
    m2 = cache.insert(prompt, table)     # tree takes its own reference on each new block
    cache.relock(m, m2); m = m2          # lock moves to the deeper path; refcounts unchanged
    ... decode; whenever more blocks fill up, with `computed` = tokens whose KV is written:
    m2 = cache.insert(computed, table); cache.relock(m, m2); m = m2
    m = cache.extend(m, computed[m.num_tokens:], table)   # the same, in time for the new blocks
    cache.unlock(m, table)               # finish / abort / preempt: unlock the path and drop
                                         # the sequence's reference on every block of `table`
If `insert` finds a block's tokens already cached under another block id (computed twice),
the tree keeps its own block; the sequence's duplicate stays in its table and is freed by
`unlock` like any other block. With `enabled=False` the same calls work: matches are empty,
`insert` and `relock` do nothing and `unlock` just releases the table.
"""
from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

from engine.block_allocator import BlockAllocator
from tandem.hashing import next_hash

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockStored:
    """Blocks newly cached, in chain order; `parent_hash` is None when the first one is a root."""

    block_hashes: list[int]
    parent_hash: int | None
    token_ids: list[int]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no longer cached."""

    block_hashes: list[int]


KvEvent = Union[BlockStored, BlockRemoved]


@dataclass(eq=False, slots=True)
class _Node:
    parent: _Node | None
    key: tuple[int, ...]  # this block's tokens
    block_id: int
    hash: int
    serial: int  # creation order; breaks LRU ties deterministically
    last_access: int = 0
    lock_count: int = 0
    removed: bool = False
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefixMatch:
    """A cached path: `block_ids` (the tree's blocks, root first), `num_tokens` it covers, and
    `query_tokens` (length of the token list it was made for). `last_node` is an opaque handle."""

    block_ids: list[int]
    num_tokens: int
    last_node: _Node = field(repr=False, compare=False)
    query_tokens: int = 0


@dataclass(frozen=True)
class CacheStats:
    hit_tokens: int
    query_tokens: int
    hit_ratio: float
    cached_blocks: int
    evictable_blocks: int


class RadixCache:
    """Prefix cache of full KV blocks. Not thread-safe: call it from the scheduler's thread.

    Hit statistics count locked lookups (`lock`), so a request retried by the scheduler before
    it is admitted is counted once.

    `record_events`: whether blocks stored and removed are recorded for `drain_events` (the
    worker's KV-event publisher drains them after every step). An owner that never drains them
    (`engine.LLM`) sets it False: otherwise they grow by one per prompt and per output block for
    as long as the cache lives.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, hash_seed: int, enabled: bool = True) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if isinstance(hash_seed, bool) or not isinstance(hash_seed, int) or not 0 <= hash_seed < 2**64:
            raise ValueError(f"hash_seed must be an int in [0, 2**64), got {hash_seed!r}")
        self.allocator = allocator
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.enabled = bool(enabled)
        self._root = _Node(None, (), -1, hash_seed, serial=0)
        self._by_block: dict[int, _Node] = {}
        self._heap: list[tuple[int, int, _Node]] = []  # (last_access, serial, node); lazy deletion
        self._clock = self._serial = self._num_unlocked = 0
        self._hit_tokens = self._query_tokens = 0
        self._events: list[KvEvent] = []
        self._record_events = True

    # ----------------------------------------------------------------- lookups
    @property
    def cached_blocks(self) -> int:
        return len(self._by_block)

    @property
    def evictable_blocks(self) -> int:
        """Cached blocks not locked by any sequence: what `evict` could remove now. It frees all of
        them unless a sequence references a cached block without holding its lock."""
        return self._num_unlocked

    def cached_block_ids(self) -> list[int]:
        """Every block id the tree holds a reference on (for inspection and accounting)."""
        return list(self._by_block)

    def stats(self) -> CacheStats:
        hit, q = self._hit_tokens, self._query_tokens
        return CacheStats(hit, q, hit / q if q else 0.0, len(self._by_block), self._num_unlocked)

    @property
    def record_events(self) -> bool:
        return self._record_events

    @record_events.setter
    def record_events(self, on: bool) -> None:
        """Turning recording off drops the events not yet drained."""
        self._record_events = bool(on)
        if not on:
            self._events.clear()

    def drain_events(self) -> list[KvEvent]:
        """Return the pending BlockStored / BlockRemoved events, oldest first, and clear them."""
        out, self._events = self._events, []
        return out

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached run of full blocks at the start of `token_ids`, capped at
        (len(token_ids) - 1) // block_size blocks so the last token is always computed.
        Changes nothing (no LRU update, no counters) until `lock`."""
        bs = self.block_size
        node, ids = self._root, []
        if self.enabled:
            for i in range(max(0, (len(token_ids) - 1) // bs)):
                child = node.children.get(tuple(token_ids[i * bs : (i + 1) * bs]))
                if child is None:
                    break
                ids.append(child.block_id)
                node = child
        return PrefixMatch(ids, len(ids) * bs, node, len(token_ids))

    # ----------------------------------------------------------------- sequence side
    def lock(self, match: PrefixMatch) -> None:
        """Admit a sequence on `match`: incref its blocks (the sequence's references; put them at
        the head of its block table), lock its path, mark it used, count the hit. Call it before
        anything can evict (right after `match_prefix`); a stale match raises ValueError."""
        node = match.last_node
        if node.removed:
            raise ValueError("match is stale: its blocks were evicted; call match_prefix again")
        self.allocator.incref(match.block_ids)
        self._hit_tokens += match.num_tokens
        self._query_tokens += match.query_tokens
        self._lock_path(node)

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> PrefixMatch:
        """Cache every full block of `token_ids` (tokens whose KV is written in `block_ids`, the
        sequence's block table) that the tree lacks; the tree increfs each block it adds. Where
        the tree already holds those tokens, its block is kept. Returns the match for the whole
        inserted path (for `relock`); the sequence's references are not changed."""
        bs = self.block_size
        n_full = len(token_ids) // bs
        if not self.enabled:
            return PrefixMatch([], 0, self._root, len(token_ids))
        if len(block_ids) < n_full:
            raise ValueError(f"block_ids has {len(block_ids)} blocks, token_ids fill {n_full}")
        node, ids = self._grow(self._root, [], token_ids, block_ids, 0)
        path = node
        while path is not self._root:
            path.last_access = self._clock
            path = path.parent
        self._maybe_push(node)
        return PrefixMatch(ids, n_full * bs, node, len(token_ids))

    def extend(self, match: PrefixMatch, token_ids: Sequence[int], block_ids: Sequence[int]) -> PrefixMatch:
        """`insert` and `relock` for a sequence that holds `match` locked and has filled more
        blocks, in time proportional to the new blocks rather than to the whole path: cache the
        full blocks of `token_ids`, the tokens that follow match's (their KV written in
        `block_ids`, the sequence's whole block table), below match's path, and move the lock to
        the deeper path. Returns the new match, which the sequence holds locked instead of `match`.
        Tree, references, locks and events end as `insert(all tokens)` + `relock` leave them; the
        path above `match` is not marked used again (it is locked, and `unlock` marks it)."""
        self._check_locked(match)
        if not self.enabled:
            return match
        bs = self.block_size
        first, n_new = len(match.block_ids), len(token_ids) // bs
        if len(block_ids) < first + n_new:
            raise ValueError(f"block_ids has {len(block_ids)} blocks, the tokens fill {first + n_new}")
        top = match.last_node
        node, ids = self._grow(top, list(match.block_ids), token_ids, block_ids, first)
        below = node  # lock the path's new part: the nodes from the deepest up to match's
        while below is not top:
            if below.lock_count == 0:
                self._num_unlocked -= 1
            below.lock_count += 1
            below.last_access = self._clock
            below = below.parent
        return PrefixMatch(ids, (first + n_new) * bs, node, match.num_tokens + len(token_ids))

    def relock(self, old: PrefixMatch, new: PrefixMatch) -> None:
        """Move a sequence's lock from `old`'s path to `new`'s (e.g. the match `insert` returned).
        Reference counts do not change."""
        self._check_locked(old)
        if new.last_node.removed:
            raise ValueError("new match is stale")
        self._lock_path(new.last_node)
        self._unlock_path(old.last_node)

    def unlock(self, match: PrefixMatch, block_table: Sequence[int]) -> None:
        """End a sequence: unlock its path (`match`, the one it holds locked), mark it used, and
        drop its reference on every block of `block_table`. Its cached blocks stay in the tree."""
        self._check_locked(match)
        self.allocator.decref(block_table)  # validates before changing anything
        self._unlock_path(match.last_node)

    # ----------------------------------------------------------------- eviction
    def evict(self, num_blocks: int) -> int:
        """Remove least-recently-used unlocked leaves (a parent left childless becomes a leaf)
        until `num_blocks` blocks have become free in the allocator or nothing is evictable.
        Returns how many blocks became free."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        freed, removed = 0, []
        while freed < num_blocks and self._heap:
            entry = heapq.heappop(self._heap)
            if not self._is_current(entry):
                continue
            node = entry[2]
            parent = node.parent
            freed += self._remove(node, removed)
            self._maybe_push(parent)
        if removed:
            self._record(BlockRemoved(removed))
            logger.debug("evicted %d cached blocks, %d freed", len(removed), freed)
        return freed

    def reset(self) -> int:
        """Drop every unlocked node (worker start / clear); returns how many blocks became free.
        Locked paths stay. Hit counters are kept (they are monotonic)."""
        freed, removed, stack = 0, [], [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self._root and not node.lock_count:
                freed += self._remove(node, removed)
        self._heap.clear()  # every remaining node is locked
        if removed:
            self._record(BlockRemoved(removed))
        return freed

    # ----------------------------------------------------------------- internals
    def _grow(self, node: _Node, ids: list[int], token_ids: Sequence[int], block_ids: Sequence[int],
              first: int) -> tuple[_Node, list[int]]:
        """Below `node`, the path of the full blocks of `token_ids`, whose KV is in
        `block_ids[first:]`: children the tree holds are followed (their blocks kept), the rest
        are added (the tree increfs their blocks, a BlockStored event names them) with this
        operation's clock, which it advances. Returns the deepest node and `ids` extended by the
        path's block ids. ValueError, before any change, for a block cached for other tokens or
        given twice."""
        bs = self.block_size
        n, i = len(token_ids) // bs, 0
        while i < n:
            child = node.children.get(tuple(token_ids[i * bs : (i + 1) * bs]))
            if child is None:
                break
            other = self._by_block.get(block_ids[first + i])
            if other is not None and other is not child:
                raise ValueError(f"block_ids[{first + i}]={block_ids[first + i]} is cached for other tokens")
            ids.append(child.block_id)
            node = child
            i += 1
        new_ids = list(block_ids[first + i : first + n])
        if any(b in self._by_block for b in new_ids) or len(set(new_ids)) != len(new_ids):
            raise ValueError("block_ids reuses a block that is already cached or listed twice")
        self.allocator.incref(new_ids)  # validates before any tree change
        self._clock += 1
        if new_ids:
            parent_hash = None if node is self._root else node.hash
            hashes = []
            for j in range(i, n):
                key = tuple(token_ids[j * bs : (j + 1) * bs])
                self._serial += 1
                child = _Node(node, key, block_ids[first + j], next_hash(node.hash, key), self._serial, self._clock)
                node.children[key] = child
                self._by_block[child.block_id] = child
                self._num_unlocked += 1
                hashes.append(child.hash)
                ids.append(child.block_id)
                node = child
            if self._record_events:
                self._events.append(BlockStored(hashes, parent_hash, list(token_ids[i * bs : n * bs]), bs))
        return node, ids

    def _record(self, event: KvEvent) -> None:
        if self._record_events:
            self._events.append(event)

    def _remove(self, node: _Node, removed: list[int]) -> int:
        """Detach `node` (its children are detached by the caller), drop the tree's reference;
        return 1 if the block became free."""
        node.removed = True
        parent = node.parent
        if parent is not None and parent.children.get(node.key) is node:
            del parent.children[node.key]
        del self._by_block[node.block_id]
        self._num_unlocked -= 1
        removed.append(node.hash)
        self.allocator.decref([node.block_id])
        return 1 if self.allocator.refcount(node.block_id) == 0 else 0

    def _lock_path(self, node: _Node) -> None:
        # A locked node's ancestors are locked too, so lock_count never grows toward the leaves.
        self._clock += 1
        while node is not self._root:
            if node.lock_count == 0:
                self._num_unlocked -= 1
            node.lock_count += 1
            node.last_access = self._clock
            node = node.parent

    def _unlock_path(self, node: _Node) -> None:
        # Used until now: a long-running request's prefix counts as recent when it finishes.
        self._clock += 1
        while node is not self._root:
            node.last_access = self._clock
            node.lock_count -= 1
            if node.lock_count == 0:
                self._num_unlocked += 1
                self._maybe_push(node)
            node = node.parent

    def _maybe_push(self, node: _Node) -> None:
        if node is self._root or node.removed or node.children or node.lock_count:
            return
        heapq.heappush(self._heap, (node.last_access, node.serial, node))
        if len(self._heap) > 2 * len(self._by_block) + 64:
            self._heap = [e for e in self._heap if self._is_current(e)]
            heapq.heapify(self._heap)

    @staticmethod
    def _is_current(entry: tuple[int, int, _Node]) -> bool:
        stamp, _, n = entry
        return not (n.removed or n.children or n.lock_count or stamp != n.last_access)

    def _check_locked(self, match: PrefixMatch) -> None:
        node = match.last_node
        if node is not self._root and (node.removed or node.lock_count < 1):
            raise ValueError("match is not locked")

"""A point-in-time view of a worker's engine, refreshed by the engine thread after each step.

gRPC handlers and the metrics endpoint read `StatsSnapshot`s (immutable, swapped atomically),
so they never touch the engine, which is not thread-safe.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.engine import Engine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StatsSnapshot:
    """Engine counters at one instant.

    free_blocks: blocks on the allocator's free list. evictable_blocks: blocks only the prefix
    cache holds (unlocked), which it gives up on demand; `available_blocks` adds the two and is
    what a new request can get without preempting anyone. Once every request has ended,
    `available_blocks == total_blocks` (the leak invariant the tests check).
    held: reserved (decode) or prefilled-and-awaiting-release (prefill) requests.
    max_running: the sequences the engine runs at once (Engine.max_running, after any lowering).
    max_model_len: the longest prompt + output the engine takes (Engine.max_model_len).
    """

    total_blocks: int = 0
    max_running: int = 0
    max_model_len: int = 0
    free_blocks: int = 0
    evictable_blocks: int = 0
    cached_blocks: int = 0
    running: int = 0
    waiting: int = 0
    swapped: int = 0
    held: int = 0
    queued_prefill_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    scheduled_tokens: int = 0
    steps: int = 0
    generated_tokens: int = 0
    taken_at: float = 0.0

    @property
    def available_blocks(self) -> int:
        return self.free_blocks + self.evictable_blocks

    @property
    def used_blocks(self) -> int:
        return self.total_blocks - self.free_blocks

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0


def take_snapshot(engine: Engine, steps: int, generated_tokens: int) -> StatsSnapshot:
    """Read the counters (engine thread only)."""
    s = engine.stats()
    cache = engine.cache.stats()
    return StatsSnapshot(
        total_blocks=engine.num_total_blocks,
        max_running=engine.max_running,
        max_model_len=engine.max_model_len,
        free_blocks=engine.num_free_blocks,
        evictable_blocks=cache.evictable_blocks,
        cached_blocks=cache.cached_blocks,
        running=s.running,
        waiting=s.waiting,
        swapped=s.swapped,
        held=s.held,
        queued_prefill_tokens=s.queued_prefill_tokens,
        prefix_query_tokens=cache.query_tokens,
        prefix_hit_tokens=cache.hit_tokens,
        preemptions=s.num_preemptions,
        scheduled_tokens=s.num_scheduled_tokens,
        steps=steps,
        generated_tokens=generated_tokens,
        taken_at=time.monotonic(),
    )

"""What load a run offers: `LoadSpec` (fixed concurrency or Poisson arrivals, with caps), the
arrival times a rate gives, and the conversations a request budget takes.

Pure and synchronous: nothing here sends a request or sleeps; `loadgen.run.LoadRun` follows it.
"""
from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from loadgen.datasets import Conversation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSpec:
    """How load is offered. Exactly one of `concurrency` (that many requests kept in flight)
    or `request_rate` (Poisson arrivals of conversations per second; inf = all at once, at
    most `max_concurrency` in flight when set). `num_requests` caps the requests sent and
    `duration_s` is a hard limit: at it, requests in flight are cancelled."""

    concurrency: int | None = None
    request_rate: float | None = None
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.request_rate is None):
            raise ValueError("concurrency / request_rate: set exactly one of them")
        if self.concurrency is not None and (isinstance(self.concurrency, bool) or self.concurrency < 1):
            raise ValueError(f"concurrency: must be an integer >= 1, got {self.concurrency!r}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate: must be > 0 (or inf), got {self.request_rate!r}")
        for name in ("max_concurrency", "num_requests"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s: must be > 0, got {self.duration_s!r}")

    @property
    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency={self.concurrency}"
        cap = f" max={self.max_concurrency}" if self.max_concurrency else ""
        return f"rate={self.request_rate:g}/s{cap}"


def poisson_offsets(rate: float, n: int, rng: random.Random) -> list[float]:
    """n arrival times (seconds from the start) of a Poisson process of `rate` per second:
    the first at 0, then i.i.d. exponential gaps of mean 1/rate; all 0 when rate is inf."""
    if not rate > 0:
        raise ValueError(f"request_rate: must be > 0, got {rate!r}")
    offsets, t = [], 0.0
    for i in range(n):
        if i and math.isfinite(rate):
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def truncate(convs: Sequence[Conversation], num_requests: int | None) -> list[Conversation]:
    """The shortest prefix of `convs` holding at least num_requests turns (all of them when None)."""
    if num_requests is None:
        return list(convs)
    out, turns = [], 0
    for conv in convs:
        if turns >= num_requests:
            break
        out.append(conv)
        turns += len(conv.turns)
    return out

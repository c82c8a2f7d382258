"""Multi-level thresholds with confirmation: one noisy sample never makes the agent act.

A `Confirmer` watches one detector's samples for one worker. A sample at or above `warn` is a
warning (logged, never acted on); a decision needs every sample at or above `act` for at least
`window_s` (an unbroken run: a sample below `act`, or a missing sample, starts over), and then
the detector stays quiet for `cooldown_s`. `RollingBaseline` gives the regression detectors
their reference: the median of recent normal values. Pure logic: callers pass the time, so
tests run without sleeping (like gateway/tiers.py).
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

logger = logging.getLogger(__name__)

MAX_EVIDENCE = 64  # samples kept per run (the window's samples, as evidence)


class Level(str, Enum):
    OK = "ok"
    WARN = "warn"
    ACT = "act"


@dataclass(frozen=True)
class Thresholds:
    """One detector's levels. `window_s` 0: the first sample at `act` decides (for samples that
    are already confirmed, such as a count of restarts over a minute)."""

    warn: float
    act: float
    window_s: float
    cooldown_s: float

    def __post_init__(self) -> None:
        if not self.warn <= self.act:
            raise ValueError(f"thresholds: warn ({self.warn}) must be <= act ({self.act})")
        if self.window_s < 0 or self.cooldown_s < 0:
            raise ValueError("thresholds: window_s and cooldown_s must be >= 0")


@dataclass(frozen=True)
class Verdict:
    """What one sample led to. `samples`: (time, value) of the run that confirmed it (ACT) or
    of the current run (WARN), oldest first."""

    level: Level
    value: float
    samples: tuple[tuple[float, float], ...]
    held_s: float  # how long the act threshold has held (0 below it)


@dataclass
class Confirmer:
    """Feed one detector's samples for one worker, in time order, with `observe`."""

    thresholds: Thresholds
    _run: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_EVIDENCE))
    _run_start: float | None = None
    _warn_run: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_EVIDENCE))
    _quiet_until: float = float("-inf")
    last_level: Level = Level.OK

    def observe(self, now: float, value: float | None) -> Verdict | None:
        """None: no sample this round (the run starts over) or nothing to report; else the verdict."""
        t = self.thresholds
        if value is None:
            self._reset()
            self.last_level = Level.OK
            return None
        if value >= t.warn:
            self._warn_run.append((now, value))
        else:
            self._warn_run.clear()
        if value < t.act:
            self._reset()
            self.last_level = Level.WARN if value >= t.warn else Level.OK
            return Verdict(Level.WARN, value, tuple(self._warn_run), 0.0) if value >= t.warn else None
        if self._run_start is None:
            self._run_start = now
        self._run.append((now, value))
        held = now - self._run_start
        if held >= t.window_s and now >= self._quiet_until:
            verdict = Verdict(Level.ACT, value, tuple(self._run), held)
            self._quiet_until = now + t.cooldown_s
            self._reset()
            self._warn_run.clear()
            self.last_level = Level.ACT
            return verdict
        self.last_level = Level.WARN
        return Verdict(Level.WARN, value, tuple(self._run), held)

    def in_cooldown(self, now: float) -> bool:
        return now < self._quiet_until

    def _reset(self) -> None:
        self._run.clear()
        self._run_start = None


class RollingBaseline:
    """Median of the last `size` values accepted as normal; None until `min_count` were."""

    def __init__(self, size: int = 60, min_count: int = 5) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self.min_count = min_count

    def value(self) -> float | None:
        return statistics.median(self._values) if len(self._values) >= self.min_count else None

    def add(self, value: float) -> None:
        self._values.append(value)

    def __len__(self) -> int:
        return len(self._values)

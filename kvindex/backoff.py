"""Degraded-state tracking with exponential backoff, so a client of an unreachable service
answers at once between attempts instead of hammering it."""
from __future__ import annotations

import random
import threading
import time


class Backoff:
    """Healthy until `failed()`; then `ready()` is False until a jittered delay has passed
    (initial_s, doubling per further failure up to max_s). `succeeded()` resets. Thread-safe."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s = initial_s
        self.max_s = max(max_s, initial_s)
        self._lock = threading.Lock()
        self._degraded = False
        self._delay = 0.0
        self._retry_at = 0.0
        self.errors = 0
        self.recoveries = 0

    @property
    def degraded(self) -> bool:
        return self._degraded

    def ready(self) -> bool:
        """May a call be attempted now? (Always while healthy; once per delay while degraded.)"""
        return not self._degraded or time.monotonic() >= self._retry_at

    def failed(self) -> bool:
        """Record a failed call; True when it turned a healthy state degraded."""
        with self._lock:
            self.errors += 1
            first = not self._degraded
            self._degraded = True
            self._delay = self.initial_s if first else min(self.max_s, self._delay * 2)
            self._retry_at = time.monotonic() + self._delay * random.uniform(0.5, 1.0)
            return first

    def succeeded(self) -> bool:
        """Record a successful call; True when it ended a degraded state."""
        if not self._degraded:
            return False
        with self._lock:
            if not self._degraded:
                return False
            self._degraded = False
            self._delay = 0.0
            self.recoveries += 1
            return True

"""How long a GPU waits for the host between engine steps.

A step's kernels are queued by the host; when the host queues the next step's forward only after
the device has finished everything before it (a slow schedule, a held launch waiting for the
GIL or for the turn of a prefill on the same GPU), the device sits idle in between. CUDA events
with timing, recorded on the step's stream after the step's last kernel and right before the
next forward, measure that gap on the device's own clock: the time from one step's end to the
next forward's start, which is idle time plus the few copies queued between them (swaps, a
decode graph's staged inputs).

Only the waits while the engine has work count: once a step queues nothing (every request has
ended, or none can run), or a synchronous step leaves the engine nothing to run (a prefill
worker's last prompt handed over), the device's wait for the next request is not the host's,
and `nothing_to_run` drops the gap that began at the last step's end.

`DeviceIdleClock` is called on the engine thread only: `forward_starts` right before a forward
is queued, `step_ends` after the step's last kernel is queued, `nothing_to_run` when a step queued
nothing, `take_gaps` (each gap) or `take` (their sum and number) whenever the caller wants the gaps
completed since the last take (it never waits for the device: a gap is counted once its second
event has been reached). Events are reused.
"""
from __future__ import annotations

from collections import deque

import torch


class DeviceIdleClock:
    """Seconds the current CUDA stream of `device` spent between one step's end and the next
    forward's start (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"DeviceIdleClock needs a CUDA device, got {device}")
        self._end: torch.cuda.Event | None = None  # the last step's end, not yet paired
        self._pairs: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._free: list[torch.cuda.Event] = []

    def _event(self) -> torch.cuda.Event:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward_starts(self) -> None:
        """Right before a step's forward is queued: the end of the gap that began at the step
        before's end (none before the first step)."""
        if self._end is None:
            return
        self._pairs.append((self._end, self._event()))
        self._end = None

    def step_ends(self) -> None:
        """After the step's last kernel is queued: a gap begins."""
        self._drop_gap()  # a step whose forward start was not marked: no gap
        self._end = self._event()

    def nothing_to_run(self) -> None:
        """A step queued nothing: the gap that began at the last step's end (if any) waits for
        work, not for the host, and is not counted."""
        self._drop_gap()

    def _drop_gap(self) -> None:
        """Forget the gap begun at the last step's end, if one is open; its event is reused."""
        if self._end is not None:
            self._free.append(self._end)
            self._end = None

    def take_gaps(self) -> list[float]:
        """The seconds of each gap the device has passed since the last take, in order."""
        gaps = []
        while self._pairs and self._pairs[0][1].query():
            end, start = self._pairs.popleft()
            gaps.append(end.elapsed_time(start) / 1e3)
            self._free += (end, start)
        return gaps

    def take(self) -> tuple[float, int]:
        """(seconds, gaps): the sum and number of `take_gaps`."""
        gaps = self.take_gaps()
        return sum(gaps), len(gaps)


__all__ = ["DeviceIdleClock"]

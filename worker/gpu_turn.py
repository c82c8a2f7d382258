"""Turns on a GPU that a prefill worker and a decode worker share (`--gpu-turn`).

Two processes on one GPU do not run kernels side by side: the GPU time-slices between them.
A prompt's forward that starts while the decode worker is stepping then takes turns with
those steps and its first token comes about twice as late (BENCHMARKS §11). So, as a
single engine would (SGLang runs a waiting prompt's prefill before the next decode step), the
decode worker lets the prompt go first:

- the prefill worker marks each engine step in its turn file: the step's start
  (CLOCK_MONOTONIC, nanoseconds, which every process on the machine reads alike) before it,
  0 after it (`PrefillTurn`);
- before each of its own steps, the decode worker waits while any prefill worker on its GPU is
  inside a step, for at most `MAX_WAIT_S` (its running streams never wait longer than that for
  a token on a prefill's account), and ignores a mark older than `STALE_S` (a prefill worker
  killed mid-step) (`DecodeTurn`). The engine loop waits through its `pause`, which runs the
  commands that arrive meanwhile (a Reserve for the next prompt, an abort), so only the step
  waits, not the worker;
- and while it holds a reservation or answers a Reserve (a prompt's prefill is coming or
  running: the gateway sends the Prefill with the Reserve), it holds each
  step's launch (`DecodeTurn.before_forward`, `Engine.step`'s hold): a step is prepared while
  the one before runs, but its forward is queued on the device only once that one's forward is
  done, after a second look at the marks. Queued ahead, a decode worker keeps up to two steps on
  the GPU, and the prompt shares the GPU with both; held, with at most the rest of one. The
  host's reaction to the forward before (waking, the look, the graph's launch) runs while that
  step's LM head and sampling do, so holding costs the device little idle time (it idled
  through that reaction when the hold waited for the step's samples). `--gpu-turn-hold` says when
  to hold (`HOLD_MODES`): `always` (the default: a Reserve reaches the decode worker only ~2 ms
  before its prompt's forward starts, too late to keep a step from being queued ahead, so only
  holding every step lets the prompt go first: on an H100 at 2 req/s TTFT P50 31.4 ms against
  `reserving`'s 37.3, TPOT P50 the same 6.57, BENCHMARKS §35), `reserving` (only while a
  prefill is known to be near), `off`. Reserve commands run during a held wait
  (`EngineLoop.submit(in_hold=True)`);
- `--gpu-turn-max-batch N`: the decode worker waits and holds only while it runs at most N
  sequences. A small batch loses little by letting the prompt go first; a large one (the GPU
  under load) loses the waits on every step (3-4 ms a step at 22-26 req/s on an H100, BENCHMARKS
  §44-45), and under MPS (entrypoints/mps.py) its steps can run beside the prompt's forward
  instead. Default: no bound; `tandem up` passes MPS_MAX_BATCH to a decode worker under MPS.

A turn file is 8 bytes, made by `tandem up` in its private run directory, one per prefill
worker; nothing else is shared and either side may restart at any time.
"""
from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable, Sequence

__all__ = ["DEFAULT_HOLD", "DecodeTurn", "GpuTurn", "HOLD_MODES", "MAX_WAIT_S", "MPS_MAX_BATCH", "PrefillTurn", "STALE_S",
           "check_hold", "check_max_batch", "check_max_wait_ms", "create_turn_file", "make_turn", "turn_paths"]

MAX_WAIT_S = 0.05  # the longest a decode step waits for prefill steps (--gpu-turn-max-wait-ms)
# Under MPS a decode worker takes turns only while it runs at most this many sequences: prompts go
# first at low load (the turns' TTFT), beside the decode steps under load (MPS's rate within the
# SLO); on an H100 this beat both turns and MPS alone on every online row (BENCHMARKS.md §46).
MPS_MAX_BATCH = 16
# When a decode worker holds a step's launch until the step before's forward has finished and the
# turn is free: every step, only while a prefill for it is near (a reservation held or a Reserve
# arriving), or never (steps are queued ahead).
HOLD_MODES = ("always", "reserving", "off")
DEFAULT_HOLD = "always"
MAX_WAIT_LIMIT_MS = 1000.0  # the largest --gpu-turn-max-wait-ms accepted
STALE_S = 2.0  # a mark older than this is a prefill worker that died inside a step
POLL_S = 0.0002
_MARK = struct.Struct("<q")


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return True


def check_hold(mode: str, field: str) -> None:
    """ValueError naming `field` unless `mode` is one of HOLD_MODES."""
    if mode not in HOLD_MODES:
        raise ValueError(f"{field}: must be one of {', '.join(HOLD_MODES)}, got {mode!r}")


def check_max_wait_ms(ms: float, field: str) -> None:
    """ValueError naming `field` unless `ms` is a wait bound this module takes: (0, 1000] ms."""
    if not 0 < ms <= MAX_WAIT_LIMIT_MS:
        raise ValueError(f"{field}: must be in (0, {MAX_WAIT_LIMIT_MS:g}], got {ms:g}")


def check_max_batch(n: int | None, field: str) -> None:
    """ValueError naming `field` unless `n` is None (no bound) or a batch size >= 1."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{field}: must be a number of sequences >= 1, got {n!r}")


def create_turn_file(path: str | os.PathLike) -> None:
    """An idle turn file (8 zero bytes), readable and writable by this user only."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, bytes(_MARK.size))
    finally:
        os.close(fd)


def _map(path: str) -> mmap.mmap:
    """The turn file's 8 bytes, mapped shared; ValueError naming gpu_turn if it is not one."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"gpu_turn: cannot open {path}: {exc.strerror}") from None
    try:
        if os.fstat(fd).st_size != _MARK.size:
            raise ValueError(f"gpu_turn: {path} is not a turn file ({_MARK.size} bytes, made by tandem up)")
        return mmap.mmap(fd, _MARK.size)
    finally:
        os.close(fd)


class GpuTurn:
    """What the engine loop calls around each step; the base class does nothing (no shared GPU)."""

    holds_launch = False  # whether the loop calls `before_forward` (through Engine.step's hold)
    hold_always = False  # hold every step, not only while a prefill is near

    max_batch: int | None = None  # wait and hold only while running at most this many sequences

    def takes_turns(self, running: int) -> bool:
        """Whether a worker running `running` sequences waits for the turn (and may hold)."""
        return self.max_batch is None or running <= self.max_batch

    def holds(self, reserving: bool, running: int = 0) -> bool:
        """Whether the next step's launch is held; `reserving`: the worker holds a reservation
        or answers a Reserve (a prefill for it is coming or running); `running`: the sequences
        it runs."""
        return self.holds_launch and (reserving or self.hold_always) and self.takes_turns(running)

    def before_step(self, pause: Callable[[float], bool] = _sleep, running: int = 0) -> float:
        """Called before a step of `running` sequences; returns the seconds it waited. A wait
        goes through `pause(s)`, which returns within about `s` seconds, and False to end the
        wait at once (the loop is stopping)."""
        return 0.0

    def before_forward(self, pause: Callable[[float], bool] = _sleep) -> float:
        """Called inside a step, once the device has finished the forward of the step before
        (its LM head and sampling may still run) and right before this one's forward is queued
        (only when `holds_launch`); returns the seconds it waited, through `pause` as
        `before_step` (the engine loop's runs only the commands that may run while a step is
        prepared: its batch is fixed by then)."""
        return 0.0

    def after_step(self) -> None:
        """Called after a step (also one that failed)."""

    def close(self) -> None:
        """Release the mapping (idle first, for a prefill worker)."""


class PrefillTurn(GpuTurn):
    """A prefill worker's side: marks its steps in its own turn file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._mark = _map(path)
        self.after_step()  # a restarted worker clears what its predecessor left

    def before_step(self, pause: Callable[[float], bool] = _sleep, running: int = 0) -> float:
        _MARK.pack_into(self._mark, 0, time.monotonic_ns() or 1)
        return 0.0

    def after_step(self) -> None:
        _MARK.pack_into(self._mark, 0, 0)

    def close(self) -> None:
        if not self._mark.closed:
            self.after_step()
            self._mark.close()


class DecodeTurn(GpuTurn):
    """A decode worker's side: waits, before each step, for the prefill workers' marks."""

    def __init__(self, paths: Sequence[str], max_wait_s: float = MAX_WAIT_S, stale_s: float = STALE_S,
                 hold: str = DEFAULT_HOLD, max_batch: int | None = None) -> None:
        if not paths:
            raise ValueError("gpu_turn: no turn file given")
        check_hold(hold, "gpu_turn_hold")
        check_max_batch(max_batch, "gpu_turn_max_batch")
        self.max_batch = max_batch
        self.paths = list(paths)
        self._marks = [_map(p) for p in self.paths]
        self.max_wait_s, self.stale_ns = max_wait_s, int(stale_s * 1e9)
        self.holds_launch, self.hold_always = hold != "off", hold == "always"
        self.waits = 0  # waits (before a step or its forward)
        self.waited_s = 0.0

    def busy(self) -> bool:
        """Whether some prefill worker is inside a step (begun less than `stale_s` ago)."""
        now = time.monotonic_ns()
        for mark in self._marks:
            since = _MARK.unpack_from(mark, 0)[0]
            if since and now - since < self.stale_ns:
                return True
        return False

    def before_step(self, pause: Callable[[float], bool] = _sleep, running: int = 0) -> float:
        if not self.takes_turns(running) or not self.busy():
            return 0.0
        start = time.monotonic()
        end = start + self.max_wait_s
        while time.monotonic() < end and self.busy():
            if not pause(POLL_S):
                break
        waited = time.monotonic() - start
        self.waits += 1
        self.waited_s += waited
        return waited

    def before_forward(self, pause: Callable[[float], bool] = _sleep) -> float:
        return self.before_step(pause) if self.holds_launch else 0.0  # held: holds() checked the batch

    def close(self) -> None:
        for mark in self._marks:
            if not mark.closed:
                mark.close()


def turn_paths(role: str, spec: str | None) -> list[str]:
    """The turn files of a worker of `role` from its --gpu-turn value (ValueError naming gpu_turn
    for a value that role cannot use): one for a prefill worker, one or more for a decode worker."""
    if spec is None:
        return []
    paths = [p.strip() for p in spec.split(",") if p.strip()]
    if not paths:
        raise ValueError(f"gpu_turn: expected FILE[,FILE...], got {spec!r}")
    if role == "prefill" and len(paths) != 1:
        raise ValueError(f"gpu_turn: a prefill worker marks one turn file, got {len(paths)}: {spec!r}")
    if role not in ("prefill", "decode"):
        raise ValueError(f"gpu_turn: only prefill and decode workers take turns, not a {role} worker")
    return paths


def make_turn(role: str, spec: str | None, max_wait_s: float = MAX_WAIT_S, hold: str = DEFAULT_HOLD,
              max_batch: int | None = None) -> GpuTurn:
    """The turn of a worker of `role` from its --gpu-turn value: the prefill worker marks its
    file, a decode worker waits on its files (at most `max_wait_s` a step, while it runs at most
    `max_batch` sequences) and holds its launches as `hold` says; None: no shared GPU, nothing
    to do."""
    paths = turn_paths(role, spec)
    if not paths:
        return GpuTurn()
    return PrefillTurn(paths[0]) if role == "prefill" else DecodeTurn(paths, max_wait_s, hold=hold, max_batch=max_batch)

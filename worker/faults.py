"""Fault injection for tests and drills (test-only hooks, off unless their env var is set).

`TANDEM_FAULT_STEP_DELAY`: extra seconds every engine step takes, as a slow or throttled device
would. Either a number (from start-up on), or `@PATH`: a file holding the number, re-read at
most every 0.1 s, so a test can make a running worker slow, spike it once, or heal it (a
missing or empty file means no delay). Read once at worker start; the delay is slept on the
engine thread right after the step and counted in that step's duration, so every stream on the
worker sees it and `tandem_engine_step_seconds` shows it. `{worker_id}` in the value is replaced
by the worker's id, so one setting for a whole cluster gives each worker its own file.

`TANDEM_FAULT_DEVICE_LOST=@PATH` (`{worker_id}` likewise): once PATH exists, the next engine
step loses the device (worker/device_fault.py says what the worker then does). On a GPU it runs
an out-of-bounds index, whose device-side assert is a real sticky CUDA error that the worker's
real check then finds; on the CPU, which has no such state, the step raises InjectedDeviceLoss.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV_STEP_DELAY = "TANDEM_FAULT_STEP_DELAY"
ENV_DEVICE_LOST = "TANDEM_FAULT_DEVICE_LOST"
_REREAD_S = 0.1


def _env_spec(name: str, worker_id: str | None) -> str:
    """The fault variable `name`'s value for this worker ({worker_id} filled in); "" when unset."""
    return os.environ.get(name, "").strip().replace("{worker_id}", worker_id or "")


class StepDelay:
    """`after_step()` sleeps the configured delay and returns it (engine thread only)."""

    def __init__(self, spec: str) -> None:
        self._path: Path | None = None
        self._delay = 0.0
        self._read_at = -1e9
        if spec.startswith("@"):
            self._path = Path(spec[1:])
        else:
            try:
                self._delay = float(spec)
            except ValueError:
                raise ValueError(f"{ENV_STEP_DELAY}: expected seconds or @FILE, got {spec!r}") from None
        logger.warning("fault injection on: %s=%s", ENV_STEP_DELAY, spec)

    @classmethod
    def from_env(cls, worker_id: str | None = "") -> StepDelay | None:
        spec = _env_spec(ENV_STEP_DELAY, worker_id)
        return cls(spec) if spec else None

    def current(self) -> float:
        if self._path is not None and time.monotonic() - self._read_at >= _REREAD_S:
            self._read_at = time.monotonic()
            try:
                text = self._path.read_text().strip()
                self._delay = max(0.0, float(text)) if text else 0.0
            except (OSError, ValueError):
                self._delay = 0.0
        return self._delay

    def after_step(self) -> float:
        delay = self.current()
        if delay > 0:
            time.sleep(delay)
        return delay


class InjectedDeviceLoss(RuntimeError):
    """TANDEM_FAULT_DEVICE_LOST's fault on a device that has no sticky errors (the CPU)."""


class DeviceLossInjection:
    """TANDEM_FAULT_DEVICE_LOST: `before_step()` loses the device once the file exists."""

    def __init__(self, path: Path, device: Any) -> None:
        self.path, self.device = path, device
        logger.warning("fault injection on: %s=@%s", ENV_DEVICE_LOST, path)

    @classmethod
    def from_env(cls, device: Any, worker_id: str | None = "") -> DeviceLossInjection | None:
        spec = _env_spec(ENV_DEVICE_LOST, worker_id)
        if not spec:
            return None
        if not spec.startswith("@") or len(spec) < 2:
            raise ValueError(f"{ENV_DEVICE_LOST}: expected @FILE, got {spec!r}")
        return cls(Path(spec[1:]), device)

    def before_step(self) -> None:
        if not self.path.exists():
            return
        if self.device.type != "cuda":
            raise InjectedDeviceLoss(f"{ENV_DEVICE_LOST}: {self.path} exists")
        import torch

        x = torch.zeros(1, device=self.device)
        x[torch.tensor([1 << 30], device=self.device)] += 1  # out of bounds: the index kernel's device assert
        torch.cuda.synchronize(self.device)

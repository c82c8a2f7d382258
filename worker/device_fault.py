"""A step that failed because the device is gone, told apart from a step that failed alone.

Some CUDA errors are sticky: an illegal address, a device-side assert, an uncorrectable ECC
error, or under MPS a fatal fault of another client on the same GPU (NVIDIA reports it to every
client there) leave the process's CUDA context unusable, and every later call fails the same
way. A worker in that state would fail every request it takes while still answering its health
checks. So after a failed step the engine loop asks `device_lost`; where the device no longer
synchronizes, the worker exits at once with DEVICE_LOST_EXIT, as a SIGKILL would leave it: the
gateway resumes its streams on another worker (each token delivered once, as for kill -9) and
the supervisor starts a new process, with a new CUDA context. An error the device survives (an
out-of-memory, a bad input) fails that step's requests and the worker goes on, as before.

`TANDEM_FAULT_DEVICE_LOST` (worker/faults.py) injects the fault: a real sticky error on a GPU,
`InjectedDeviceLoss` on the CPU, which has no such state and which `device_lost` takes as lost.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from worker.faults import InjectedDeviceLoss

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEVICE_LOST_EXIT = 75  # sysexits' EX_TEMPFAIL: a new process may well succeed


def device_lost(device: torch.device, exc: BaseException) -> str | None:
    """Why `device` is unusable after a step failed with `exc` (the error it now raises), or
    None where it still works."""
    if isinstance(exc, InjectedDeviceLoss):
        return str(exc)
    if device.type != "cuda":
        return None
    import torch  # here: tandem up reads DEVICE_LOST_EXIT without loading torch

    try:
        torch.cuda.synchronize(device)
    except Exception as probe:  # a sticky error comes back from every call
        text = str(probe).strip()
        return f"{type(probe).__name__}: {text.splitlines()[0] if text else '(no message)'}"
    return None


def exit_device_lost(reason: str, exc: BaseException | None = None) -> None:
    """Log why (with the step's error) and leave the process now: no drain and no clean-up, which
    the lost context could not run."""
    logger.critical("the device is lost (%s); exiting with code %d so that a new process takes over",
                    reason, DEVICE_LOST_EXIT, exc_info=exc)
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    sys.stderr.flush()
    os._exit(DEVICE_LOST_EXIT)


__all__ = ["DEVICE_LOST_EXIT", "device_lost", "exit_device_lost"]

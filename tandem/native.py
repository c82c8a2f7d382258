"""Linux process controls through prctl(2); where they cannot be had (another OS, no libc),
each is a no-op that says so in its return value."""
from __future__ import annotations

import ctypes
import ctypes.util

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _prctl(option: int, arg: int | bytes) -> bool:
    global _libc
    if _libc is False:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:
            _libc = None
    if _libc is None or not hasattr(_libc, "prctl"):
        return False
    return _libc.prctl(option, arg, 0, 0, 0) == 0


def set_thread_name(name: str) -> bool:
    """Name the calling OS thread (its first 15 bytes), as `top -H`, `ps -L` and
    /proc/PID/task/TID/comm show it. Whether it was set."""
    return _prctl(_PR_SET_NAME, name.encode()[:15])


def parent_death_signal(signum: int) -> bool:
    """Have the kernel send `signum` to this process when the thread that started it dies.
    Whether it was set."""
    return _prctl(_PR_SET_PDEATHSIG, signum)

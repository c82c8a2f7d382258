"""Reports Triton kernels compiled after warm-up: each one stalled the step that needed it.

Warm-up (engine/warm_up.py) runs the kinds of step a server meets so that Triton's JIT has
compiled every specialization before the first request. A specialization it missed (another
token count's divisibility, a new constexpr) compiles inside a request's step, and that step
takes the compile's time, around a second on a GPU host. `LateCompileWatch` hooks Triton's JIT
(`triton.knobs.runtime`'s cache and post-compile hooks, chained to any already set) and logs a
warning naming the kernel, its specialization and the seconds the compile took, so the shape
can be added to warm-up.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Hook = Callable[..., Any]


class LateCompileWatch:
    """Counts and logs the Triton compiles that happen while installed. `install()` chains the
    hooks (False where this Triton has no JIT hooks); `uninstall()` restores the previous ones.
    `on_compile(name, seconds)`, when given, is called for each compile too."""

    def __init__(self, on_compile: Callable[[str, float], None] | None = None) -> None:
        self.on_compile = on_compile
        self.compiles: list[tuple[str, float]] = []  # (kernel and specialization, seconds)
        self._started: dict[Any, float] = {}
        self._lock = threading.Lock()
        self._knobs: Any = None
        self._previous: tuple[Hook | None, Hook | None] = (None, None)

    def install(self) -> bool:
        try:
            from triton import knobs
        except ImportError:  # no Triton, or one without JIT hooks
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        self._knobs = runtime
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self.before_compile
        runtime.jit_post_compile_hook = self.after_compile
        return True

    def uninstall(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._previous
            self._knobs = None

    # ---- Triton's hooks (keyword arguments as triton.runtime.jit passes them) -----------------
    def before_compile(self, *args: Any, **kwargs: Any) -> bool | None:
        """Triton's `jit_cache_hook`: called before a kernel compiles; a true result would skip
        the compile, so this only returns what a previous hook returns."""
        with self._lock:
            self._started[_key(kwargs)] = time.perf_counter()
        previous = self._previous[0]
        return previous(*args, **kwargs) if previous is not None else None

    def after_compile(self, *args: Any, **kwargs: Any) -> Any:
        """Triton's `jit_post_compile_hook`: the compile is done."""
        with self._lock:
            started = self._started.pop(_key(kwargs), None)
        seconds = time.perf_counter() - started if started is not None else 0.0
        name = str(kwargs.get("repr") or getattr(kwargs.get("fn"), "name", "a Triton kernel"))
        self.compiles.append((name, seconds))
        logger.warning("Triton compiled %s after warm-up (%.2f s): the step that needed it waited that long; "
                       "warm-up (engine/warm_up.py) does not cover this shape (specialization key %.1500s)",
                       name, seconds, kwargs.get("key"))
        if self.on_compile is not None:
            self.on_compile(name, seconds)
        previous = self._previous[1]
        return previous(*args, **kwargs) if previous is not None else None


def _key(kwargs: dict[str, Any]) -> Any:
    key = kwargs.get("key")
    try:
        hash(key)
    except TypeError:
        key = repr(key)
    return key


__all__ = ["LateCompileWatch"]

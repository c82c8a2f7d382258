"""A sender in its own spawned process, driven by commands: what the transport tests use as
the prefill side (the transports' peers must be separate processes)."""
from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


class Prefill:
    """Runs `target(commands, replies, *args)` in a spawned process; calling the object sends
    one (op, kwargs) command and returns the value of its ("ok", value) reply."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=target, args=(self.commands, self.replies, *args), daemon=True)
        self.proc.start()

    def __call__(self, op: str, **kw: Any) -> Any:
        self.commands.put((op, kw))
        status, value = self.replies.get(timeout=120.0)  # the first call waits for torch to import
        assert status == "ok", value
        return value

    def close(self) -> int | None:
        """Stop the process; its exit code."""
        self.commands.put(None)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        return self.proc.exitcode

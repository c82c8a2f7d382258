"""How every long-running process runs its asyncio main: on uvloop where it is installed (a
faster event loop, as the serving stacks use), else on asyncio's own."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)

"""Small host values onto the device without making the host wait for it.

A copy from pageable host memory to a GPU (`torch.tensor(values).to("cuda")`,
`torch.tensor(values, device="cuda")`) is synchronous with respect to the host: torch waits for
the stream to finish everything queued before the copy. On an engine step's path that wait takes
away the host's lead: the step before has been queued so that the device never waits between
steps (`Engine.step`'s overlap), and a sampler that uploads its rows' temperatures that way makes
the host wait for that whole step, after which the device idles while the host prepares the next
one. Everything the step path uploads goes through pinned memory and an asynchronous copy here
(torch's pinned-memory cache keeps a buffer until the copy queued from it has run).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["to_device", "upload"]


def upload(values: Sequence[Any], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype)` on `device`, queued on the current stream without
    waiting for it (on a CPU device, just the tensor)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor `host` on `device`, as `upload` (a copy of it is pinned first; `host` may be
    reused at once)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)

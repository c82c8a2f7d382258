"""Two forwards of one step from the same KV cache, for tests that compare a step's output and
cache writes between two ways of running it (a padded prefill graph, overlapped decode halves)."""
from __future__ import annotations

from collections.abc import Callable

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]


def from_the_same_cache(layers: KV, first: Callable[[], torch.Tensor], second: Callable[[], torch.Tensor]):
    """-> (first's output, the cache after it, second's output, the cache before both): `second`
    runs on the cache as it was before `first` (under inference mode), and leaves it as it writes it."""
    before = [(k.clone(), v.clone()) for k, v in layers]
    with torch.inference_mode():
        want = first()
        want_kv = [(k.clone(), v.clone()) for k, v in layers]
        for (k, v), (k0, v0) in zip(layers, before):
            k.copy_(k0)
            v.copy_(v0)
        got = second()
    return want, want_kv, got, before


def assert_same_writes(layers: KV, want_kv: KV, before: KV, slots: torch.Tensor, tol: float) -> None:
    """The cache holds what `want_kv` holds (to `tol`), and every slot but `slots` as `before` had it."""
    untouched = torch.ones(layers[0][0].flatten(0, 1).shape[0], dtype=torch.bool)
    untouched[slots] = False
    for (k, v), (wk, wv), (k0, _) in zip(layers, want_kv, before):
        torch.testing.assert_close(k.float(), wk.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(v.float(), wv.float(), atol=tol, rtol=tol)
        assert torch.equal(k.flatten(0, 1)[untouched].float(), k0.flatten(0, 1)[untouched].float())

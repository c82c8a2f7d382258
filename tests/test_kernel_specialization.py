"""Triton kernels compile once per specialization of their arguments; a specialization that
varies from step to step compiles inside a serving step (seconds). A mixed step hands extend
attention the rows after its decodes (engine/attention.py), views whose 16-byte alignment
depends on how many decodes lead the batch: the kernel must not specialize on it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.attention import AttentionMetadata  # noqa: E402
from tandem_kernels.extend_attention import _extend_kernel  # noqa: E402


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def test_mixed_step_views_vary_in_alignment_and_extend_does_not_specialize_on_it() -> None:
    block_tables = torch.zeros(8, 5, dtype=torch.int32)  # a width that is not a multiple of 4
    seq_lens = torch.zeros(8, dtype=torch.int32)
    seen = {(_aligned(block_tables[n:]), _aligned(seq_lens[n:])) for n in range(1, 8)}
    assert len(seen) > 1, "the decode count changes the views' alignment"
    assert "num_decode_seqs" in AttentionMetadata.__dataclass_fields__  # the mixed step that slices them
    flags = {p.name: p.do_not_specialize_on_alignment for p in _extend_kernel.params}
    for name in ("bt_ptr", "qsl_ptr", "seq_lens_ptr"):
        assert flags[name], f"{name} is specialized on its alignment"
    assert not flags["q_ptr"]  # the rows of q and out are whole and aligned: keep those fast

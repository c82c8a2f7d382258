"""The step's profile on a GPU (engine.memory.profile_step): taken once at the device's ceiling of
sampled rows, its peak for fewer rows (what a derived max_running plans, `fitted_batch`) is
no less than a profile taken at those rows, and no more than a little above it."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch's allocator stats)")


def test_the_ceilings_profile_scaled_to_fewer_rows_bounds_a_profile_at_those_rows(tmp_path) -> None:
    from bench.h200_bench import LLAMA31_8B, write_model
    from engine.llm import LLM
    from engine.memory import MAX_RUNNING_CEILING_CUDA, profile_step

    # Two of Llama-3.1-8B's layers and its whole vocabulary: the logits rows weigh as they do there.
    model_dir = write_model(tmp_path / "m", {**LLAMA31_8B, "num_hidden_layers": 2})
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", device="cuda", num_kv_blocks=64,
              cuda_graphs=False)
    eng = llm.engine
    device = torch.device("cuda")

    def profile(rows: int):
        return profile_step(eng.model, eng.model_config, 16, torch.bfloat16, device, 4096, 4096, rows)

    ceiling = profile(MAX_RUNNING_CEILING_CUDA)
    assert ceiling.per_row >= eng.model_config.vocab_size * 2  # at least the bf16 logits of a row
    assert ceiling.forward > 0 and 0 < ceiling.held <= ceiling.forward
    # 512 rows' logits outweigh this model's forward, so fewer rows reserve less.
    assert ceiling.peak(64) < ceiling.peak(MAX_RUNNING_CEILING_CUDA)
    for rows in (1, 64, 160, 300):
        direct = profile(rows).peak(rows)
        scaled = ceiling.peak(rows)
        print(f"rows {rows}: profiled {direct / 2**20:.1f} MiB, the ceiling's scaled {scaled / 2**20:.1f} MiB")
        # A fixed part of the sampling (none is expected: softmax and sort scale with the rows)
        # would make the scaled figure short of the direct one; 32 MiB of it is in the margins.
        assert direct - (32 << 20) <= scaled <= direct * 1.15 + (32 << 20), (rows, direct, scaled)
    assert torch.cuda.memory_allocated(device) > 0  # the model is still there; the profile left nothing else

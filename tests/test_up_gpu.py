"""`tandem up` on a GPU with its FP8 flags: a prefill and a decode worker sharing the GPU (one
copy of the weights, KV over CUDA IPC), FP8 weights quantized at load and an FP8 KV cache, serve
the demo model. (The CPU tests take the host paths; a decode worker's sink once could not write
an FP8 cache on a GPU, BENCHMARKS.md §42.)"""
from __future__ import annotations

import pytest
import torch

from tandem import Client
from tests.test_launcher import start_up, stop

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU that holds e4m3 (compute capability 8.9+)")


def test_up_on_a_gpu_serves_fp8_weights_and_an_fp8_kv_cache(tmp_path) -> None:
    proc, port, log_dir = start_up(tmp_path, "--dtype", "bfloat16", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
                                   "--no-agent")  # bf16, as models are served (the demo model is float32)
    try:
        assert "KV transport: cuda_ipc" in proc.printed  # the prompt's KV crosses to the decode worker
        assert "FP8 (e4m3): weights (quantized at load) and KV cache" in proc.printed
        with Client(f"127.0.0.1:{port}") as client:
            a = client.generate("Once upon a time", max_tokens=16, temperature=0.0, ignore_eos=True)
            b = client.generate("Once upon a time", max_tokens=16, temperature=0.0, ignore_eos=True)
        assert len(a.token_ids) == 16 and a.token_ids == b.token_ids
    finally:
        assert stop(proc) == 0
    # A worker quantized the weights it loaded (with one shared copy, the other maps it).
    assert any("FP8 weights:" in (log_dir / f"{w}.log").read_text() for w in ("prefill-0", "decode-0"))

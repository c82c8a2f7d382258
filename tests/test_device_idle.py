"""engine/device_idle.py: the GPU's waits for the host between steps, on the device's clock."""
from __future__ import annotations

import time

import pytest
import torch

from engine.device_idle import DeviceIdleClock


def test_the_clock_needs_a_gpu_and_a_cpu_engine_has_none(tiny_models) -> None:
    from engine.llm import LLM

    with pytest.raises(ValueError, match="needs a CUDA device"):
        DeviceIdleClock(torch.device("cpu"))
    llm = LLM(str(tiny_models["llama"]), dtype="float32", device="cpu", num_kv_blocks=16)
    assert llm.engine.measure_device_idle() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_host_pause_between_steps_is_counted_and_queued_work_is_not() -> None:
    """Steps queued back to back leave no gap; a host sleep after the device has drained is
    counted within its length (the device's clock), each gap once."""
    clock = DeviceIdleClock(torch.device("cuda"))
    a = torch.randn(2048, 2048, device="cuda")

    def step() -> None:
        clock.forward_starts()
        for _ in range(20):
            a.copy_(torch.tanh(a @ a) / 64)
        clock.step_ends()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    busy, gaps = clock.take()
    assert gaps == 2 and busy < 0.002
    pauses = []
    for _ in range(3):
        step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        time.sleep(0.02)
        pauses.append(time.perf_counter() - t)
    step()
    torch.cuda.synchronize()
    idle, gaps = clock.take()
    assert gaps == 4  # the gap after the first run's last step, and the three pauses
    assert sum(pauses) - 0.001 < idle < sum(pauses) + 0.01
    assert clock.take() == (0.0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_the_wait_for_the_next_request_is_not_counted(tiny_models, overlap: bool) -> None:
    """An engine with nothing to run waits for work, not for its host: the pause between two
    requests is no gap, while the steps of each still are. Overlapped steps end with one that
    queues nothing; synchronous ones (a prefill worker's) with the step that ends the last
    request, after which the engine is not stepped until work comes."""
    from engine.llm import LLM
    from tandem.types import SamplingParams

    llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", device="cuda", num_kv_blocks=64,
              overlap_schedule=overlap)
    clock = llm.engine.measure_device_idle()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    llm.generate([1, 2, 3, 4], params)
    torch.cuda.synchronize()
    clock.take()
    pause = 0.2
    llm.generate([5, 6, 7, 8], params)
    time.sleep(pause)
    llm.generate([9, 10, 11, 12], params)
    torch.cuda.synchronize()
    gaps = clock.take_gaps()
    assert len(gaps) >= 2 * (16 - 2)  # each request's steps after its first are still measured
    assert max(gaps) < pause / 2, gaps

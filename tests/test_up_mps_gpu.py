"""`tandem up` on a GPU with NVIDIA's MPS tools: by default tandem up's own daemon, the prefill
and decode workers its clients (their kernels side by side), the same greedy tokens as with
`--no-mps` (turns, no daemon),
a decode worker killed with SIGKILL restarted under the same daemon, and no daemon left after
the stop; a device lost under MPS restarts the GPU's workers and loses no request.
(tests/test_mps.py checks the plumbing on the CPU with a stand-in daemon.)"""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import time

import pytest
import torch

from tandem import Client
from tests.test_launcher import alive, cmdline, processes_with, start_up, stop

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or shutil.which("nvidia-cuda-mps-control") is None,
                                reason="needs a CUDA GPU and nvidia-cuda-mps-control")

PROMPT = "Once upon a time"


def _greedy(port: int) -> list[int]:
    with Client(f"127.0.0.1:{port}") as client:
        return client.generate(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True, timeout=60).token_ids


def _greedy_within(port: int, seconds: float) -> list[int]:
    """_greedy, retried until it answers (workers restarting) or `seconds` pass."""
    deadline = time.time() + seconds
    while True:
        try:
            return _greedy(port)
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(1)


def _mps_processes() -> list[int]:
    return [p for p in processes_with("nvidia-cuda-mps") if "nvidia-cuda-mps" in cmdline(p).split(" ")[0]]


def test_up_with_mps_serves_recovers_and_leaves_no_daemon(tmp_path) -> None:
    before = set(_mps_processes())
    plain, port, _ = start_up(tmp_path / "plain", "--dtype", "bfloat16", "--no-agent", "--no-mps")
    try:
        assert "MPS on GPU" not in plain.printed and set(_mps_processes()) == before
        expected = _greedy(port)
    finally:
        assert stop(plain) == 0
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or os.path.exists("/tmp/nvidia-mps/control"):
        pytest.skip("an MPS daemon of the user's is in effect: tandem up leaves MPS off by default")
    proc, port, log_dir = start_up(tmp_path / "mps", "--dtype", "bfloat16", "--no-agent")  # MPS by default
    try:
        assert "MPS on GPU" in proc.printed and "KV transport: cuda_ipc" in proc.printed
        assert _greedy(port) == expected  # the same kernels, side by side or not
        ours = set(_mps_processes()) - before
        assert ours, "no MPS daemon of tandem up's is running"
        decode = [p for p in processes_with(str(tmp_path / "mps")) if " -m entrypoints decode " in cmdline(p)]
        assert len(decode) == 1
        env = open(f"/proc/{decode[0]}/environ", "rb").read().split(b"\0")
        assert any(e.startswith(b"CUDA_MPS_PIPE_DIRECTORY=") for e in env)
        os.kill(decode[0], signal.SIGKILL)
        deadline, tokens = time.time() + 180, None
        while tokens is None and time.time() < deadline:
            try:
                tokens = _greedy(port)
            except Exception:
                time.sleep(1)
        assert tokens == expected  # served again, by the restarted worker under the same daemon
    finally:
        assert stop(proc) == 0
    deadline = time.time() + 15
    while time.time() < deadline and alive(sorted(ours)):
        time.sleep(0.2)
    assert alive(sorted(ours)) == []


def test_a_device_lost_under_mps_restarts_the_gpus_workers_and_serves_the_same_tokens(tmp_path, monkeypatch) -> None:
    """The prefill worker trips a device-side assert (TANDEM_FAULT_DEVICE_LOST, a real sticky CUDA
    error): it exits with DEVICE_LOST_EXIT, tandem up restarts the decode worker on its MPS daemon
    with it (worker/device_fault.py, entrypoints/mps.py), and the cluster serves the fault-free
    tokens again, the request in flight included."""
    from worker.device_fault import DEVICE_LOST_EXIT

    arm = tmp_path / "lose-prefill-0"
    monkeypatch.setenv("TANDEM_FAULT_DEVICE_LOST", f"@{tmp_path}/lose-{{worker_id}}")
    proc, port, log_dir = start_up(tmp_path / "mps", "--dtype", "bfloat16", "--no-agent", "--mps")
    try:
        expected = _greedy(port)
        decode_before = [p for p in processes_with(str(tmp_path / "mps")) if " -m entrypoints decode " in cmdline(p)]
        arm.touch()
        in_flight = concurrent.futures.ThreadPoolExecutor(1).submit(_greedy_within, port, 240)
        log = log_dir / "prefill-0.log"  # its prefill steps, loses the device, and exits
        deadline = time.time() + 60
        while time.time() < deadline and "the device is lost" not in log.read_text():
            time.sleep(0.05)
        arm.unlink()  # the restarted prefill worker keeps its device
        assert f"exiting with code {DEVICE_LOST_EXIT}" in log.read_text()
        assert in_flight.result(300) == expected  # retried by the gateway on the restarted workers
        assert _greedy_within(port, 60) == expected
        decode_after = [p for p in processes_with(str(tmp_path / "mps")) if " -m entrypoints decode " in cmdline(p)]
        assert decode_after and set(decode_after).isdisjoint(decode_before)  # restarted with the prefill worker
    finally:
        assert stop(proc) == 0

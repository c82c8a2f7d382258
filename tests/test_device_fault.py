"""worker/device_fault.py: a failed step whose device no longer works is told apart from one
that failed alone. The whole path on a cluster (the worker exits, its streams resume elsewhere)
is tests/test_reliability.py's; on a GPU a real sticky CUDA error is made in a child process
(it poisons the process's CUDA context for good)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from worker.device_fault import device_lost
from worker.faults import ENV_DEVICE_LOST, DeviceLossInjection, InjectedDeviceLoss

REPO = Path(__file__).resolve().parents[1]


def test_on_the_cpu_only_the_injected_loss_is_a_lost_device() -> None:
    cpu = torch.device("cpu")
    assert device_lost(cpu, RuntimeError("a step's own error")) is None
    assert device_lost(cpu, InjectedDeviceLoss("the reason")) == "the reason"


def test_the_injection_fires_once_its_file_exists(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_DEVICE_LOST, f"@{tmp_path}/lose-{{worker_id}}")
    injection = DeviceLossInjection.from_env(torch.device("cpu"), "decode-0")
    assert injection is not None and injection.path == tmp_path / "lose-decode-0"
    injection.before_step()  # not armed: nothing happens
    injection.path.touch()
    with pytest.raises(InjectedDeviceLoss, match=ENV_DEVICE_LOST):
        injection.before_step()
    monkeypatch.delenv(ENV_DEVICE_LOST)
    assert DeviceLossInjection.from_env(torch.device("cpu"), "decode-0") is None
    monkeypatch.setenv(ENV_DEVICE_LOST, "lose-now")
    with pytest.raises(ValueError, match=ENV_DEVICE_LOST):
        DeviceLossInjection.from_env(torch.device("cpu"))


PROBE = textwrap.dedent('''\
    import json, sys, torch
    from pathlib import Path
    from worker.device_fault import device_lost
    from worker.faults import DeviceLossInjection
    gpu = torch.device("cuda")
    out = {}
    try:  # an error the device survives
        torch.empty(1 << 50, dtype=torch.uint8, device=gpu)
    except torch.cuda.OutOfMemoryError as exc:
        out["oom"] = device_lost(gpu, exc)
    x = torch.ones(4, device=gpu)
    out["after_oom"] = float(x.sum())
    arm = Path(sys.argv[1])
    arm.touch()
    try:
        DeviceLossInjection(arm, gpu).before_step()
        out["raised"] = False
    except Exception as exc:
        out["raised"] = True
        out["lost"] = device_lost(gpu, exc)
    print(json.dumps(out))
''')


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: a sticky CUDA error is a GPU's")
def test_a_sticky_cuda_error_is_a_lost_device_and_an_oom_is_not(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "arm")], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["oom"] is None and out["after_oom"] == 4.0  # the device still works after an OOM
    assert out["raised"] and out["lost"], out  # the device-side assert is sticky: the probe fails too

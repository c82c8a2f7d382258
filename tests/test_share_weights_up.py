"""`tandem up --share-weights`: the workers on one device keep one copy of the weights, charged
to one of them, and a killed worker's replacement maps the survivor's copy."""
from __future__ import annotations

import os
import signal
import time

import pytest

from tandem import Client
from tests.test_launcher import cmdline, processes_with, start_up, stop


def test_workers_on_one_device_get_one_rendezvous_and_one_charge(tmp_path, monkeypatch) -> None:
    from entrypoints import launcher
    from entrypoints.launcher import build_children, placement_for
    from entrypoints.up_flags import parse_args

    monkeypatch.setattr(launcher, "gpu_can_share_memory", lambda gpu: True)  # these GPUs are placed, not real

    def flags(*argv: str, visible: int = 1) -> dict[str, list[str]]:
        a = parse_args(["--share-weights", *argv])
        out = {}
        for c in build_children(a, "/models/m", placement=placement_for(a, visible=visible), ready_dir=tmp_path):
            i = c.argv.index("--shared-weights-dir") if "--shared-weights-dir" in c.argv else None
            out[c.name] = [] if i is None else c.argv[i + 1:i + 3 if "--shared-weights-uncharged" in c.argv else i + 2]
        return out

    gpu0 = str(tmp_path / "weights-gpu0")
    assert flags() == {"prefill-0": [gpu0, "--shared-weights-uncharged"], "decode-0": [gpu0], "gateway": []}
    assert flags(visible=2) == {"prefill-0": [], "decode-0": [], "gateway": []}  # a GPU each: nothing shared
    cpu = str(tmp_path / "weights-cpu")
    assert flags(visible=0) == {"prefill-0": [cpu, "--shared-weights-uncharged"], "decode-0": [cpu], "gateway": []}
    both = flags("--colocated", "--decode-workers", "2")
    assert both == {"worker-0": [gpu0], "worker-1": [gpu0, "--shared-weights-uncharged"], "gateway": []}
    two = flags("--prefill-workers", "2", "--decode-workers", "2", visible=2)
    assert sorted(len(v) for v in two.values()) == [0, 1, 1, 2, 2]  # per GPU: one charged, one not
    with pytest.raises(SystemExit):
        parse_args(["--share-weights", "--tp", "2"])

    def default(*argv: str, visible: int) -> list[str]:  # the workers given a rendezvous, without --share-weights
        a = parse_args(list(argv))
        children = build_children(a, "/models/m", placement=placement_for(a, visible=visible), ready_dir=tmp_path)
        return [c.name for c in children if "--shared-weights-dir" in c.argv]

    assert default(visible=1) == ["prefill-0", "decode-0"]  # on by default where workers share a GPU
    assert default("--colocated", "--decode-workers", "2", visible=1) == ["worker-0", "worker-1"]
    assert default(visible=2) == [] and default(visible=0) == []  # a GPU each; the CPU only when asked
    assert default("--tp", "2", visible=2) == []  # split weights are not shared
    assert default("--no-share-weights", visible=1) == []
    monkeypatch.setattr(launcher, "gpu_can_share_memory", lambda gpu: False)  # no cuMem file descriptors there
    assert default(visible=1) == [] and flags()["decode-0"] == [gpu0]  # asked for, it is still tried


def shared_log_line(path) -> str:
    lines = [line for line in path.read_text().splitlines() if "shared weights:" in line]
    assert lines, f"{path.name}: no shared-weights line"
    return lines[-1]


def test_up_shares_the_weights_and_a_killed_loader_is_replaced_from_the_survivor(tmp_path) -> None:
    proc, port, log_dir = start_up(tmp_path, "--share-weights", "--gpus", "")  # the CPU path, on a GPU box too
    try:
        assert "prefill-0  CPU, weights shared:" in proc.printed and "decode-0   CPU, weights shared:" in proc.printed
        logs = {name: shared_log_line(log_dir / f"{name}.log") for name in ("prefill-0", "decode-0")}
        loader = next(n for n, line in logs.items() if "loaded here" in line)
        mapper = next(n for n, line in logs.items() if "mapped from" in line)
        assert loader != mapper
        with Client(f"127.0.0.1:{port}") as client:
            before = client.generate("Once upon a time", max_tokens=12, temperature=0.0)
        assert len(before.token_ids) == 12
        role = loader.split("-")[0]
        victims = [p for p in processes_with(str(tmp_path)) if f" -m entrypoints {role} " in cmdline(p)
                   and f"--worker-id {loader}" in cmdline(p)]
        assert len(victims) == 1
        os.kill(victims[0], signal.SIGKILL)
        deadline, after = time.time() + 120, None
        while after is None and time.time() < deadline:
            restarted = [p for p in processes_with(str(tmp_path)) if f"--worker-id {loader}" in cmdline(p)
                         and p != victims[0]]
            try:
                if restarted and "mapped from" in shared_log_line(log_dir / f"{loader}.log"):
                    with Client(f"127.0.0.1:{port}") as client:
                        after = client.generate("Once upon a time", max_tokens=12, temperature=0.0, timeout=10)
            except Exception:
                pass
            if after is None:
                time.sleep(1)
        assert after is not None, "the killed worker's replacement did not serve"
        assert after.token_ids == before.token_ids  # the same weights, mapped from the survivor
    finally:
        assert stop(proc) == 0

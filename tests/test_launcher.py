"""`tandem up`: a real local cluster of OS processes, served through the SDK, stopped without leftovers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem import Client
from entrypoints.cluster import free_port


def processes_with(marker: str) -> list[int]:
    """PIDs whose command line contains `marker` (the cluster's unique log dir)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and int(p.name) != os.getpid():
            pids.append(int(p.name))
    return pids


def start_up(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    log_dir = tmp_path / "logs"
    env = {**os.environ, "HOME": str(tmp_path)}  # the demo model is made under this HOME
    proc = subprocess.Popen(
        [sys.executable, "-m", "entrypoints", "up", "--port", str(port), "--log-dir", str(log_dir), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    deadline = time.time() + 240
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Tandem is up" in line:
            return proc, port, log_dir
        if time.time() > deadline:
            break
    proc.kill()
    raise AssertionError("cluster did not come up:\n" + "".join(lines[-30:]))


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def test_up_serves_demo_model_and_sigterm_leaves_nothing(tmp_path):
    proc, port, log_dir = start_up(tmp_path, "--prefill-workers", "1", "--decode-workers", "1")
    try:
        # Every child serves the demo model made under this test's HOME, so its path marks our processes.
        ours = [p for p in processes_with(str(tmp_path)) if p != proc.pid]
        roles = sorted(cmdline(p).split(" -m entrypoints ")[1].split()[0] for p in ours if " -m entrypoints " in cmdline(p))
        assert roles == ["agent", "decode", "gateway", "prefill"]  # tandem up starts the infra agent too
        with Client(f"127.0.0.1:{port}") as client:
            a = client.generate("Once upon a time", max_tokens=12, temperature=0.0)
            b = client.generate("Once upon a time", max_tokens=12, temperature=0.0)
        assert a.finish_reason in ("length", "stop") and a.token_ids
        assert a.token_ids == b.token_ids  # greedy is deterministic across requests
        assert a.usage.prompt_tokens > 0 and a.usage.completion_tokens == len(a.token_ids)
    finally:
        code = stop(proc)
    assert code == 0
    deadline = time.time() + 10
    while time.time() < deadline and alive(ours):
        time.sleep(0.2)
    assert alive(ours) == []


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if "zombie" not in Path(f"/proc/{pid}/status").read_text().lower():
                out.append(pid)
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_up_restarts_a_crashed_worker(tmp_path):
    proc, port, log_dir = start_up(tmp_path, "--colocated", "--decode-workers", "1")
    try:
        gateway = [p for p in processes_with(f"--port {port}") if " gateway " in cmdline(p)]
        assert len(gateway) == 1
        argv = cmdline(gateway[0]).split()
        worker_port = argv[argv.index("--worker") + 1].rsplit(":", 1)[1]
        victims = [p for p in processes_with(f"--port {worker_port}") if " worker " in cmdline(p)]
        assert len(victims) == 1
        os.kill(victims[0], signal.SIGKILL)
        deadline = time.time() + 120
        result = None
        while result is None and time.time() < deadline:
            try:
                with Client(f"127.0.0.1:{port}") as client:
                    result = client.generate("hello", max_tokens=4, temperature=0.0, timeout=10)
            except Exception:
                time.sleep(1)
        assert result is not None and len(result.token_ids) == 4
        restarted = [p for p in processes_with(f"--port {worker_port}") if " worker " in cmdline(p)]
        assert restarted and victims[0] not in restarted
    finally:
        assert stop(proc) == 0
    rest = proc.stdout.read()
    assert "restarting" in rest


def test_kv_transport_reaches_both_sides_of_every_transfer() -> None:
    """`--kv-transport` goes to every prefill and decode worker (both ends must agree); auto picks
    CUDA IPC on a GPU host and ZMQ elsewhere; colocated workers move no KV and get none."""
    import torch

    from entrypoints.launcher import build_children, parse_args

    def transports(*argv: str) -> dict[str, str | None]:
        children = build_children(parse_args(list(argv)), "/models/m")
        found = {}
        for c in children:
            found[c.name] = c.argv[c.argv.index("--kv-transport") + 1] if "--kv-transport" in c.argv else None
        return found

    auto = "cuda_ipc" if torch.cuda.is_available() else "zmq"
    assert transports("--prefill-workers", "2") == {"prefill-0": auto, "prefill-1": auto, "decode-0": auto,
                                                    "gateway": None}
    assert set(transports("--kv-transport", "nccl").values()) == {"nccl", None}
    assert transports("--colocated", "--kv-transport", "zmq") == {"worker-0": None, "gateway": None}
    with pytest.raises(SystemExit):
        parse_args(["--kv-transport", "carrier-pigeon"])

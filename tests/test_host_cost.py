"""bench/host_cost.py on the CPU: a real `tandem up` on a tiny model, CPU time per output token
by process and thread, the engine thread under its own name."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads per-thread CPU time from Linux /proc")
def test_host_cost_reports_each_process_and_the_engine_thread(tiny_models, tmp_path):
    out = tmp_path / "cost.json"
    r = subprocess.run([sys.executable, "bench/host_cost.py", "--model", str(tiny_models["llama"]), "--prompts", "32",
                        "--input-len", "16", "--output-len", "32", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    # Enough tokens that the engine thread runs for many clock ticks (CPU time is counted in 10 ms).
    assert res["mode"] == "disagg" and res["output_tokens"] == 32 * 32
    rows = res["cpu_us_per_token"]
    roles = {name.split()[0] for name in rows}
    assert {"client", "gateway", "prefill", "decode"} <= roles
    decode = next(row for name, row in rows.items() if name.startswith("decode"))
    assert decode.get("engine-decode", 0) > 0  # the engine thread names itself
    assert decode["total"] == pytest.approx(sum(v for k, v in decode.items() if k != "total"), abs=0.2)
    assert "CPU us per output token" in r.stdout


def test_bad_flags_name_the_flag():
    r = subprocess.run([sys.executable, "bench/host_cost.py", "--model", "x", "--prompts", "0"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "--prompts" in r.stderr

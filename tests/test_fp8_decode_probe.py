"""bench/fp8_decode_probe.py on the CPU (Triton's interpreter): its `full` variant computes what
the reference does, so the GPU figures of the variants with parts taken out are measured against
the engine's own work; every variant runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_full_variant_matches_the_reference_and_all_run():
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "bench/fp8_decode_probe.py", "--cpu-check"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = dict(line.split(":", 1) for line in r.stdout.splitlines() if ":" in line)
    assert lines.keys() == {"full", "no_softmax", "no_pv", "no_dots", "loads_raw"}, r.stdout
    assert lines["full"].strip().endswith("ok"), r.stdout


def test_cpu_check_needs_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "bench/fp8_decode_probe.py", "--cpu-check"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 2 and "TRITON_INTERPRET" in r.stderr

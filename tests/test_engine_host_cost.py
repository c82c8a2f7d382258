"""bench/engine_host_cost.py on the CPU: a row a round at the asked batch, every phase timed, the
host share smaller than the step and no smaller than the phases it sums; bad flags name the flag."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
PHASES = ("schedule", "prepare", "rows", "sample", "process", "postprocess")


def test_rows_per_round_with_every_phase():
    r = subprocess.run([sys.executable, "bench/engine_host_cost.py", "--batch", "6", "--ctx", "20", "--steps", "4",
                        "--rounds", "2"], cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(row["round"], row["batch"], row["ctx"]) for row in rows] == [(0, 6, 20), (1, 6, 20)]
    for row in rows:
        assert all(row[p] > 0 for p in PHASES + ("forward", "logits")), row
        assert sum(row[p] for p in PHASES) <= row["host"] + 1e-3 < row["step"], row


def test_bad_flags_name_the_flag():
    r = subprocess.run([sys.executable, "bench/engine_host_cost.py", "--steps", "0"], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env=ENV)
    assert r.returncode == 2 and "--steps" in r.stderr

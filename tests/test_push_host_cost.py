"""bench/push_host_cost.py on the CPU: both ways of pushing a step through the real ipc transport
land the same blocks, and the bench reports each one's host time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def test_reports_both_modes_per_round():
    r = subprocess.run([sys.executable, "bench/push_host_cost.py", "--layers", "4", "--transfers", "3", "--rounds", "2"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(row["round"], row["mode"]) for row in rows] == [
        (0, "send_layer"), (0, "send_layers"), (1, "send_layer"), (1, "send_layers")]
    for row in rows:
        assert 0 < row["call_ms"] <= row["commit_handed_over_ms"]


def test_bad_flags_name_the_flag():
    r = subprocess.run([sys.executable, "bench/push_host_cost.py", "--layers", "0"], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env=ENV)
    assert r.returncode == 2 and "--layers" in r.stderr

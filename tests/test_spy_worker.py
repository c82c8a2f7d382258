"""bench/spy_worker.py: finding a worker by its --worker-id, and the summary of a py-spy raw file."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.spy_worker import summarize, worker_pids  # noqa: E402


def test_worker_found_by_its_id_and_not_by_a_prefix(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--worker-id", "decode-10"])
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in worker_pids("decode-10") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.pid in worker_pids("decode-10")
        assert proc.pid not in worker_pids("decode-1")
    finally:
        proc.kill()
        proc.wait()


def test_summary_splits_threads_and_ranks_the_engine_threads_frames(tmp_path):
    raw = tmp_path / "spy.txt"
    raw.write_text(
        "thread (0x1);_run (worker/engine_loop.py:200);step (engine/engine.py:400);synchronize (torch/cuda/streams.py:10) 30\n"
        "thread (0x1);_run (worker/engine_loop.py:200);_step (worker/engine_loop.py:310);deliver (worker/engine_loop.py:180) 10\n"
        "thread (0x2);run (grpc/aio.py:1) 5\n"
        "not a sample line\n")
    s = summarize(raw, top=5)
    assert s["threads"] == [("thread (0x1)", 40), ("thread (0x2)", 5)]
    assert s["engine_samples"] == 40
    assert s["engine_top"] == [(0.75, "_run;step;synchronize"), (0.25, "_run;_step;deliver")]

"""bench/step_gaps.py on the CPU: a real disaggregated `tandem up` on a tiny model, the client's
timings beside the workers' step times and each stage of a request, and the offline engine's
reference rows; bad flags name the flag."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def test_step_gaps_reports_steps_stages_and_the_offline_reference(tiny_models, tmp_path):
    out = tmp_path / "gaps.json"
    r = subprocess.run([sys.executable, "bench/step_gaps.py", "--model", str(tiny_models["llama"]), "--modes", "disagg",
                        "--concurrency", "1,2", "--requests", "4", "--input-len", "40", "--output-len", "12",
                        "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    served = [row for row in rows if row["mode"] == "disagg"]
    offline = [row for row in rows if row["mode"] == "offline"]
    assert [row["concurrency"] for row in served] == [1, 2] and [row["concurrency"] for row in offline] == [1, 2]
    for row in served:
        assert row["requests"] == 4 and row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0
        assert row["prefill_steps"] >= 1 and row["decode_steps"] >= 11  # every token after the first is a step
        # Each stage of a disaggregated request was observed, and the Prefill call holds its parts.
        for key in ("gw_reserve_mean_ms", "gw_prefill_mean_ms", "gw_first_chunk_mean_ms", "prefill_compute_mean_ms",
                    "prefill_handover_mean_ms", "decode_step_mean_ms", "prefill_step_mean_ms"):
            assert row[key] > 0, key
        assert row["gw_prefill_mean_ms"] >= row["prefill_compute_mean_ms"]
        # The parts of compute: the hop to the engine thread, and from the first token to the call.
        assert 0 < row["prefill_queue_mean_ms"] < row["prefill_compute_mean_ms"]
        assert 0 < row["prefill_finish_mean_ms"] < row["prefill_compute_mean_ms"]
        assert 0 < row["prefill_commit_mean_ms"] < row["prefill_finish_mean_ms"]  # the engine thread's part
        assert row["kv_ms_per_request"] > 0  # the KV counters are read under the workers' own label
        assert abs(row["outside_step_ms"] - (row["itl_mean_ms"] - row["decode_step_mean_ms"])) <= 0.002  # rounded
        assert row["decode_turn_wait_ms_per_step"] == 0  # on the CPU no GPU is shared: no turns
    for row in offline:
        assert row["prefill_ms"] > 0 and row["step_ms"] > 0


def test_bad_flags_name_the_flag():
    for argv, flag in ((["--concurrency", "1,x"], "--concurrency"), (["--modes", "both"], "--modes"),
                       (["--output-len", "0"], "--output-len")):
        r = subprocess.run([sys.executable, "bench/step_gaps.py", "--model", "x", *argv], cwd=REPO,
                           capture_output=True, text=True, timeout=60, env=ENV)
        assert r.returncode == 2 and flag in r.stderr, (argv, r.stderr[-500:])


def test_device_idle_gaps_scraped_from_a_worker_endpoint_split_short_from_long():
    """A worker's idle-gap histogram, served over HTTP and read back as step_gaps reads it: the
    idle time per step, and the gaps over 1 ms counted apart from the short ones."""
    sys.path.insert(0, str(REPO))
    from bench.step_gaps import scrape, stage_means
    from worker.metrics import WorkerMetrics
    from worker.stats import StatsSnapshot

    metrics = WorkerMetrics("decode-0", "decode", StatsSnapshot, lambda: {}, lambda: False)
    port = metrics.serve("127.0.0.1", 0)
    before = {"decode-0": scrape(port)}
    for _ in range(10):
        metrics.observe_step(0.005)
    short = [0.00002 * (i + 1) for i in range(8)]
    metrics.observe_device_idle(short + [0.004, 0.012])
    means = stage_means(before, {"decode-0": scrape(port)})
    assert means["decode-0 step"] == 5.0
    assert means["decode-0 device_idle_per_step"] == round((sum(short) + 0.016) / 10 * 1e3, 3)
    assert means["decode-0 long_idle_gaps_per_1k_steps"] == 200.0  # 2 long gaps in 10 steps
    assert 8.0 <= means["decode-0 long_idle_gap_mean"] <= 8.0 + sum(short) / 2 * 1e3

"""bench/throughput_standing.py: the issue's goals per results file, each with the day of the run
that measured it, recomputed by the bench's own summary rule."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import throughput_standing as standing
from bench import throughput_summary as summary

REPO = Path(__file__).resolve().parents[1]
RESULTS = [REPO / "bench/results/h200_throughput.json", REPO / "bench/results/h100_throughput.json"]


def _results() -> dict:
    """Three runs: the offline pair, then services with its own offline_subset, then online alone
    (whose TPOT misses), and the ceilings merged from a file without a run record."""
    sections = {"offline_bf16": {"output_tok_s": 11_500.0}, "offline_fp8kv": {"output_tok_s": 13_800.0},
                "services": {"output_tok_s": 9_000.0}, "offline_subset": {"output_tok_s": 10_000.0},
                "online": {"ttft_p50_ms": 30.123, "tpot_p50_ms": 4.75},
                "ceilings": {"device": "NVIDIA H200", "copy_GBps": 4_300.0}}
    runs = [{"date": "2026-12-01T10:00:00+00:00", "sections": ["offline_bf16", "offline_fp8kv"],
             "ratios": summary.run_ratios(sections, ["offline_bf16", "offline_fp8kv"])},
            {"date": "2026-12-02T11:00:00+00:00", "sections": ["services", "offline_subset"],
             "ratios": summary.run_ratios(sections, ["services", "offline_subset"])},
            {"date": "2026-12-03T12:00:00+00:00", "sections": ["online"], "ratios": {}}]
    return {"sections": sections, "runs": runs}


def test_each_goal_with_its_value_verdict_and_measuring_run():
    got = standing.standing(_results())
    assert set(got) == {key for key, (op, _) in summary.GOALS.items() if op}
    assert got["offline_bf16_out_tok_s"] == {"value": 11_500.0, "met": True, "date": "2026-12-01"}
    assert got["fp8kv_over_bf16"] == {"value": 1.2, "met": False, "date": "2026-12-01"}
    assert got["services_vs_offline"] == {"value": 0.9, "met": True, "date": "2026-12-02"}
    assert got["online_ttft_p50_ms"] == {"value": 30.12, "met": True, "date": "2026-12-03"}
    assert got["online_tpot_p50_ms"]["met"] is False
    assert got["max_rate_within_slo"] == {"value": None, "met": None, "date": None}  # never measured
    assert summary.measured_by("colocated_vs_offline", _results()["runs"]) is None


def test_the_table_bolds_what_is_met_and_names_each_gpu():
    table = standing.format_markdown([(standing.gpu_name(_results()), _results())])
    lines = table.splitlines()
    assert "NVIDIA H200" in lines[0] and len(lines) == 2 + len(standing.standing(_results()))
    row = next(line for line in lines if "`offline_bf16_out_tok_s`" in line)
    assert "**11,500**" in row and "2026-12-01" in row
    assert "| 1.2 |" in next(line for line in lines if "`fp8kv_over_bf16`" in line)  # a miss: not bold


def test_the_committed_results_read_as_the_bench_summarized_them():
    """The figures recomputed from each file's sections and runs are those the bench wrote at
    its top level when it last merged the file."""
    for path in RESULTS:
        results = json.loads(path.read_text())
        for key, row in standing.standing(results).items():
            assert row["value"] == results.get(key), (path.name, key)
            assert row["value"] is None or row["date"] is not None, (path.name, key)
    done = subprocess.run([sys.executable, "bench/throughput_standing.py", *map(str, RESULTS)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "NVIDIA H200" in done.stdout.splitlines()[0] and "`online_tpot_p50_ms`" in done.stdout


def test_an_unreadable_file_is_an_error_naming_it(tmp_path: Path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    done = subprocess.run([sys.executable, "bench/throughput_standing.py", str(bad)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "bad.json" in done.stderr and "results" in done.stderr

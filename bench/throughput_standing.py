"""Where the throughput issue stands: each goal of its table, for each results file that
bench/throughput_bench.py wrote (one a GPU), with the day of the run that measured it.

    python3 bench/throughput_standing.py bench/results/h200_throughput.json bench/results/h100_throughput.json

prints a Markdown table: a row per goal, for each file the figure (bold where met) and the date of
the latest run that measured its sections (throughput_summary.measured_by). The figures are
recomputed from the files' sections and run records (throughput_summary.summarize), the rule the
bench itself summarizes by. BENCHMARKS.md's "Where the throughput issue stands" is its output.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput_summary import GOALS, goal_text, measured_by, meets, summarize  # noqa: E402


def standing(results: dict) -> dict[str, dict]:
    """{key: {"value", "met", "date"}} for each goal key of one results file; "date" is the
    measuring run's day (YYYY-MM-DD), None where no run record names the sections."""
    runs = results.get("runs", [])
    summary = summarize(results.get("sections", {}), runs)
    out = {}
    for key, (op, _) in GOALS.items():
        if not op:
            continue
        run = measured_by(key, runs)
        out[key] = {"value": summary[key], "met": meets(key, summary[key]),
                    "date": run["date"][:10] if run and run.get("date") else None}
    return out


def gpu_name(results: dict) -> str:
    """The GPU the file's ceilings were measured on ("NVIDIA H200"), or "?"."""
    ceilings = results.get("sections", {}).get("ceilings")
    return ceilings.get("device", "?") if isinstance(ceilings, dict) else "?"


def format_markdown(files: list[tuple[str, dict]]) -> str:
    """The table for `files` ((label, results) pairs), a column pair per file."""
    tables = [(label, standing(results)) for label, results in files]
    head = ["key", "goal"] + [c for label, _ in tables for c in (label, "measured")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|---|" * len(tables)]
    for key in tables[0][1] if tables else ():
        cells = [f"`{key}`", goal_text(key)]
        for _, table in tables:
            row = table[key]
            value = "-" if row["value"] is None else f"{row['value']:,g}"
            cells += [f"**{value}**" if row["met"] else value, row["date"] or "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="throughput_bench results files (JSON), one column pair each")
    a = p.parse_args(argv)
    files = []
    for path in a.results:
        try:
            results = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            p.error(f"results: cannot read {path} as JSON ({exc})")
        files.append((gpu_name(results), results))
    print(format_markdown(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())

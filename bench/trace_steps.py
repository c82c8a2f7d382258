"""Where each profiled engine step's time goes, from a worker's step trace (worker.step_profiler).

    TANDEM_PROFILE_DIR=/tmp/prof TANDEM_PROFILE_STEPS=4:3 TANDEM_PROFILE_WORKERS=prefill-0 tandem up ...
    python bench/trace_steps.py /tmp/prof/prefill-0-steps4-6.json [--out steps.json]

A step is a `tandem_step` range on the engine thread; its kernels are those its host code
launched (matched by the launch's correlation id, so a CUDA graph's kernels go with the step
that replayed it, and copies on a side stream with the step that queued them). Per step:

- `host_ms`: the step on the host, from its start to its return;
- `to_first_kernel_ms`: from the step's start to its first kernel's start (the host's
  preparation, and whatever the GPU was still doing for someone else);
- `device_span_ms`, `device_busy_ms`: first kernel's start to last kernel's end, and the union
  of the step's kernels over it; `gaps_over_50us_ms`: the idle stretches longer than 50 µs in
  the span (launch-bound or waiting stretches, or, on a shared GPU, another process's turn);
- `after_last_kernel_ms`: from the last kernel's end to the step's return (sampling's copy back,
  the host's bookkeeping; negative when the step returned before its kernels ended, as an
  overlapped engine's step does);
- `top_kernels`: the longest kernels by total time, with their counts;
- `other_threads_ms`: how long each other thread of the worker ran recorded work during the
  step (the union of its spans the profiler saw: torch ops, CUDA calls such as a KV sender's
  copies), busiest first: threads the step's own thread may wait for the GIL behind;
- `late_launch_ms`: of the gaps, the part before the next kernel was even launched (the host
  was late: launch-bound, or stalled), and `largest_gaps`: the longest few, each with what the
  step's thread was inside meanwhile (the CPU ranges overlapping the wait, longest first).

A kernel's time in a trace runs from its start to its end on the device; on a GPU that two
processes share, it includes the stretches the GPU gave the other process, so the same kernels
read longer under load than alone.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from worker.step_profiler import STEP_RANGE  # noqa: E402

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
GAP_US = 50.0
TOP = 12
TOP_GAPS = 5


def _union_us(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(covered, gaps longer than GAP_US) of `intervals` over their span, in µs."""
    covered = gaps = 0.0
    end = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None and s - end > GAP_US:
                gaps += s - end
            covered += e - s
            end = e
        elif e > end:
            covered += e - end
            end = e
    return covered, gaps


def _inside(host: list[dict[str, Any]], tid: Any, start: float, end: float) -> list[str]:
    """Names of the CPU ranges on thread `tid` overlapping [start, end], most overlap first."""
    overlap: dict[str, float] = defaultdict(float)
    for e in host:
        if e.get("tid") != tid:
            continue
        s, d = float(e["ts"]), float(e.get("dur", 0.0))
        o = min(end, s + d) - max(start, s)
        if o > 0 and e.get("name") != STEP_RANGE:
            overlap[e["name"][:60]] += o
    return [f"{n} {o / 1e3:.3f}" for n, o in sorted(overlap.items(), key=lambda kv: -kv[1])[:4]]


def _threads(events: list[dict[str, Any]]) -> dict[Any, str]:
    """tid -> thread name, from the trace's metadata events."""
    return {e.get("tid"): e.get("args", {}).get("name", "?") for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


def _other_threads(host: list[dict[str, Any]], names: dict[Any, str], tid: Any, start: float,
                   end: float) -> dict[str, float]:
    """ms each thread but `tid` ran inside [start, end] (the union of its spans), busiest first."""
    spans: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for e in host:
        if e.get("tid") == tid:
            continue
        s, f = max(start, float(e["ts"])), min(end, float(e["ts"]) + float(e.get("dur", 0.0)))
        if f > s:
            spans[e.get("tid")].append((s, f))
    busy = {f"{names.get(t, '?')} ({t})": _union_us(v)[0] / 1e3 for t, v in spans.items()}
    return {k: round(v, 3) for k, v in sorted(busy.items(), key=lambda kv: -kv[1])[:TOP_GAPS]}


def _gaps(kernels: list[tuple[float, float, float]], host: list[dict[str, Any]], tid: Any) -> tuple[float, list[dict[str, Any]]]:
    """(late-launch µs, the largest gaps) of a step's kernels, each (start, end, launched at)."""
    late = 0.0
    found = []
    end = None
    for s, e, launched in sorted(kernels):
        if end is not None and s - end > GAP_US:
            late_by = max(0.0, min(s, launched) - end)
            late += late_by
            found.append((s - end, end, s, late_by))
        end = e if end is None else max(end, e)
    found.sort(reverse=True)
    return late, [{"ms": round(g / 1e3, 3), "late_launch_ms": round(lb / 1e3, 3), "host": _inside(host, tid, a, b)}
                  for g, a, b, lb in found[:TOP_GAPS]]


def analyze(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per `tandem_step` range of a Chrome trace written by torch.profiler, in order."""
    events = trace.get("traceEvents", [])
    steps = sorted((e for e in events if e.get("name") == STEP_RANGE and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    launches: dict[int, float] = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = float(e["ts"])
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function", *LAUNCH_CATS)
            and "ts" in e]
    names = _threads(events)
    per_step: list[list[dict[str, Any]]] = [[] for _ in steps]
    bounds = [(float(s["ts"]), float(s["ts"]) + float(s.get("dur", 0.0))) for s in steps]
    for e in events:
        if e.get("cat") not in DEVICE_CATS:
            continue
        launched = launches.get(e.get("args", {}).get("correlation"))
        if launched is None:
            continue
        for i, (s, end) in enumerate(bounds):
            if s <= launched <= end:
                per_step[i].append(e)
                break
    rows = []
    for step, (start, end), kernels in zip(steps, bounds, per_step):
        row: dict[str, Any] = {"host_ms": round((end - start) / 1e3, 3), "kernels": len(kernels)}
        others = _other_threads(host, names, step.get("tid"), start, end)
        if others:
            row["other_threads_ms"] = others
        if kernels:
            spans = [(float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0.0))) for k in kernels]
            first, last = min(s for s, _ in spans), max(e for _, e in spans)
            busy, gaps = _union_us(spans)
            late, largest = _gaps([(s, e, launches[k["args"]["correlation"]]) for k, (s, e) in zip(kernels, spans)],
                                  host, step.get("tid"))
            totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            for k, (s, e) in zip(kernels, spans):
                t = totals[k.get("name", "?")[:80]]
                t[0] += e - s
                t[1] += 1
            row.update({
                "to_first_kernel_ms": round((first - start) / 1e3, 3),
                "device_span_ms": round((last - first) / 1e3, 3),
                "device_busy_ms": round(busy / 1e3, 3),
                "gaps_over_50us_ms": round(gaps / 1e3, 3),
                "after_last_kernel_ms": round((end - last) / 1e3, 3),
                "late_launch_ms": round(late / 1e3, 3),
                "largest_gaps": largest,
                "top_kernels": [{"name": n, "ms": round(t / 1e3, 3), "count": c}
                                for n, (t, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:TOP]],
            })
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Chrome traces written by TANDEM_PROFILE_DIR")
    p.add_argument("--out", default=None, help="write {trace name: rows} here as JSON too")
    a = p.parse_args()
    result = {}
    for path in a.traces:
        try:
            trace = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"traces: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        rows = analyze(trace)
        result[Path(path).name] = rows
        print(f"{Path(path).name}: {len(rows)} steps")
        for i, r in enumerate(rows):
            brief = {k: v for k, v in r.items() if k not in ("top_kernels", "largest_gaps", "other_threads_ms")}
            print(f"  step {i}: {brief}")
            for k in r.get("top_kernels", [])[:5]:
                print(f"      {k['ms']:8.3f} ms  x{k['count']:<4} {k['name']}")
            if r.get("other_threads_ms"):
                print(f"      other threads: {r['other_threads_ms']}")
            for g in r.get("largest_gaps", [])[:3]:
                print(f"      gap {g['ms']:.3f} ms (launched late by {g['late_launch_ms']:.3f}): {'; '.join(g['host'])}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

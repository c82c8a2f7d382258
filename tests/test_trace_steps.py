"""bench/trace_steps.py: a step trace's kernels go to the step that launched them, and the busy
time and gaps are the union of the kernels' intervals (checked against a brute-force count on
random intervals)."""
from __future__ import annotations

import random

from bench import trace_steps
from worker.step_profiler import STEP_RANGE


def _brute(intervals: list[tuple[int, int]]) -> tuple[int, int]:
    """Covered µs and the gaps longer than GAP_US between the intervals, counted µs by µs."""
    covered = sorted({t for s, e in intervals for t in range(s, e)})
    gaps = sum(b - a - 1 for a, b in zip(covered, covered[1:]) if b - a - 1 > trace_steps.GAP_US)
    return len(covered), gaps


def test_the_union_matches_a_brute_force_count() -> None:
    rng = random.Random()
    for _ in range(200):
        spans = []
        for _ in range(rng.randint(1, 12)):
            s = rng.randint(0, 600)
            spans.append((s, s + rng.randint(1, 120)))
        assert trace_steps._union_us([(float(s), float(e)) for s, e in spans]) == _brute(spans)


def test_kernels_go_to_the_step_that_launched_them() -> None:
    assert trace_steps.STEP_RANGE == STEP_RANGE
    rng = random.Random()
    events, expected = [], []
    t, corr = 0.0, 0
    for _step in range(3):
        start = t
        n = rng.randint(1, 5)
        kernels = []
        for _ in range(n):
            corr += 1
            t += rng.randint(5, 30)
            events.append({"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": t, "dur": 3,
                           "args": {"correlation": corr}})
            k0 = t + rng.randint(10, 200)
            kernels.append((k0, k0 + rng.randint(5, 90)))
            events.append({"cat": "kernel", "name": f"k{corr % 2}", "ts": k0, "dur": kernels[-1][1] - k0,
                           "args": {"correlation": corr}})
        t += rng.randint(5, 20)
        events.append({"cat": "user_annotation", "name": STEP_RANGE, "ts": start, "dur": t - start})
        first, last = min(s for s, _ in kernels), max(e for _, e in kernels)
        expected.append((t - start, n, first - start, last - first, t - last))
        t = max(t, last) + rng.randint(1, 50)
    events.append({"cat": "kernel", "name": "stray", "ts": 0, "dur": 5, "args": {"correlation": 10_000}})
    rng.shuffle(events)
    rows = trace_steps.analyze({"traceEvents": events})
    assert len(rows) == 3
    for row, (host, n, to_first, span, after) in zip(rows, expected):
        assert row["kernels"] == n
        assert row["host_ms"] == round(host / 1e3, 3)
        assert row["to_first_kernel_ms"] == round(to_first / 1e3, 3)
        assert row["device_span_ms"] == round(span / 1e3, 3)
        assert row["after_last_kernel_ms"] == round(after / 1e3, 3)
        assert row["device_busy_ms"] <= row["device_span_ms"]
        assert sum(k["count"] for k in row["top_kernels"]) == n


def test_a_gap_the_host_caused_is_told_from_one_it_did_not() -> None:
    rng = random.Random()
    late, wait = rng.randint(100, 900), rng.randint(100, 900)
    wait += wait == late + 10  # two gaps of one length would be one key below
    # kernel 1 runs [100, 200); kernel 2 is launched `late` µs after it ended and starts 10 µs
    # later; kernel 3 was launched long before and starts `wait` µs after kernel 2 ends.
    k2 = 200 + late + 10
    k3 = k2 + 50 + wait
    events = [
        {"cat": "user_annotation", "name": STEP_RANGE, "ts": 0, "dur": k3 + 100, "tid": 1},
        {"cat": "cpu_op", "name": "aten::busy_host", "ts": 150, "dur": late + 60, "tid": 1},
        {"cat": "cpu_op", "name": "aten::other_thread", "ts": 150, "dur": 5000, "tid": 2},
    ]
    for corr, (launched, start, dur) in enumerate([(50, 100, 100), (200 + late, k2, 50), (60, k3, 20)]):
        events += [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launched, "dur": 2, "tid": 1,
                    "args": {"correlation": corr}},
                   {"cat": "kernel", "name": f"k{corr}", "ts": start, "dur": dur, "args": {"correlation": corr}}]
    (row,) = trace_steps.analyze({"traceEvents": events})
    assert row["late_launch_ms"] == round(late / 1e3, 3)
    assert row["gaps_over_50us_ms"] == round((late + 10 + wait) / 1e3, 3)
    gaps = {g["ms"]: g for g in row["largest_gaps"]}
    assert gaps[round((late + 10) / 1e3, 3)]["late_launch_ms"] == round(late / 1e3, 3)
    assert gaps[round(wait / 1e3, 3)]["late_launch_ms"] == 0
    host = gaps[round((late + 10) / 1e3, 3)]["host"]
    assert host and host[0].startswith("aten::busy_host") and not any("other_thread" in h for h in host)


def test_other_threads_time_inside_the_step_is_their_union() -> None:
    rng = random.Random()
    step_end = 1000
    spans = []
    for _ in range(rng.randint(2, 8)):
        s = rng.randint(-200, 1100)
        spans.append((s, s + rng.randint(1, 300)))
    events = [{"cat": "user_annotation", "name": STEP_RANGE, "ts": 0, "dur": step_end, "tid": 1},
              {"ph": "M", "name": "thread_name", "tid": 7, "args": {"name": "kv-ipc-send"}},
              {"cat": "cpu_op", "name": "aten::on_the_step_thread", "ts": 10, "dur": 500, "tid": 1}]
    events += [{"cat": "python_function", "name": "send", "ts": s, "dur": e - s, "tid": 7} for s, e in spans]
    (row,) = trace_steps.analyze({"traceEvents": events})
    inside = [(max(0, s), min(step_end, e)) for s, e in spans if min(step_end, e) > max(0, s)]
    want = _brute(inside)[0] / 1e3 if inside else None
    assert row.get("other_threads_ms", {}).get("kv-ipc-send (7)") == (round(want, 3) if inside else None)
    assert not any("(1)" in k for k in row.get("other_threads_ms", {}))  # the step's own thread is not "other"

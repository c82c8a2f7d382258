"""`tandem bench --baseline FILE`: compare a run with a saved one and name every metric that
regressed beyond the tolerance, so a change can be checked on a fixed request set.

Compared per run (matched by label, else by position), each relative to the baseline's value:
request and output-token throughput and the cache hit rate (a drop is a regression), TTFT and
TPOT P50 / P99 (a rise is a regression). A metric the baseline lacks (None, 0) is skipped.
This module compares `runs` lists; loadgen.results reads and writes the files they come from.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_TOLERANCE_PCT = 10.0

# (name, path in a run's summary, True when higher is better)
METRICS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("request_throughput", ("request_throughput",), True),
    ("output_token_throughput", ("output_token_throughput",), True),
    ("ttft_p50_ms", ("ttft_ms", "p50"), False),
    ("ttft_p99_ms", ("ttft_ms", "p99"), False),
    ("tpot_p50_ms", ("tpot_ms", "p50"), False),
    ("tpot_p99_ms", ("tpot_ms", "p99"), False),
    ("cache_hit_rate", ("cache_hit_rate",), True),
)


@dataclass(frozen=True)
class Comparison:
    """One metric of one run: `worse_pct` > 0 means worse than the baseline by that much."""

    run: str
    metric: str
    baseline: float
    current: float
    worse_pct: float
    regressed: bool

    def line(self, tolerance_pct: float) -> str:
        verdict = "REGRESSED" if self.regressed else "ok"
        return (f"{verdict:>9}  {self.run}  {self.metric}: baseline {self.baseline:.4g}, now {self.current:.4g} "
                f"({self.worse_pct:+.1f}% worse; tolerance {tolerance_pct:g}%)")


def compare(current: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]],
            tolerance_pct: float = DEFAULT_TOLERANCE_PCT) -> list[Comparison]:
    """Every comparable metric of every run of `current` against `baseline` (lists of the
    `runs` entries of bench results)."""
    if not tolerance_pct >= 0:
        raise ValueError(f"tolerance: must be >= 0, got {tolerance_pct}")
    by_label = {r.get("label"): r for r in baseline}
    out: list[Comparison] = []
    for i, run in enumerate(current):
        base = by_label.get(run.get("label"))
        if base is None and i < len(baseline):
            base = baseline[i]
        if base is None:
            logger.warning("baseline has no run %r: not compared", run.get("label"))
            continue
        for name, path, higher_better in METRICS:
            b, c = _get(base["summary"], path), _get(run["summary"], path)
            if b is None or c is None or b == 0:
                continue
            worse = (b - c) / b if higher_better else (c - b) / b
            out.append(Comparison(str(run.get("label")), name, b, c, 100.0 * worse,
                                  100.0 * worse > tolerance_pct))
    return out


def _get(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = summary
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def report(comparisons: Sequence[Comparison], tolerance_pct: float, baseline_path: str) -> tuple[str, bool]:
    """(text to print, whether every metric is within the tolerance)."""
    bad = [c for c in comparisons if c.regressed]
    lines = [f"=== against baseline {baseline_path} (tolerance {tolerance_pct:g}%) ==="]
    lines += [c.line(tolerance_pct) for c in comparisons]
    if not comparisons:
        lines.append("nothing comparable (no matching runs or metrics)")
    if bad:
        lines.append("regression: " + ", ".join(f"{c.metric} ({c.run}) {c.worse_pct:+.1f}%" for c in bad))
    return "\n".join(lines), not bad

"""Statistics, tables and plots for `tandem bench`: one summary dict per run, from per-request
timings; PNG plots only when matplotlib can be imported.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 95, 99)
OK = "OK"


@dataclass
class RequestResult:
    """What one request did. Times are seconds; `start_s` is the send time relative to the
    run's start. `status` is OK or the failure: a gRPC status code name (UNAVAILABLE, ...),
    FINISH_ERROR / FINISH_ABORT (the stream ended with that finish reason) or NO_FINAL_CHUNK.
    `ttft_s` is the time to the first chunk carrying output (None if none came);
    `itl_s` holds the gaps between successive output-carrying chunks. CLIENT_ERROR marks a
    fault on the client side (detail says which)."""

    conversation: int
    turn: int
    request_id: str
    start_s: float
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    status: str = OK
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "conversation": self.conversation, "turn": self.turn, "request_id": self.request_id,
            "start_s": self.start_s, "e2e_s": self.e2e_s, "ttft_s": self.ttft_s, "tpot_s": self.tpot_s,
            "itl_s": self.itl_s, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
            "status": self.status, "detail": self.detail,
        }


@dataclass(frozen=True)
class SLO:
    """Goodput targets in milliseconds; None leaves that dimension unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def active(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met_by(self, r: RequestResult) -> bool:
        """A completed request meets the SLO when its TTFT and TPOT are within the targets;
        a request with fewer than two output tokens has no TPOT and passes that half."""
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1e3 > self.ttft_ms):
            return False
        tpot = r.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's
    default method). Raises ValueError for an empty input or q outside [0, 100]."""
    if not values:
        raise ValueError("percentile: no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values_s: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean, P50/P90/P95/P99 and max of second-valued samples, in milliseconds
    (None for every statistic when there are no samples)."""
    ms = [v * 1e3 for v in values_s]
    out: dict[str, float | int | None] = {"count": len(ms)}
    out["mean"] = sum(ms) / len(ms) if ms else None
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(ms, q) if ms else None
    out["max"] = max(ms) if ms else None
    return out


def summarize(results: Sequence[RequestResult], wall_s: float, slo: SLO = SLO(), *,
              cancelled: int = 0, skipped: int = 0, max_in_flight: int = 0) -> dict[str, Any]:
    """One run's summary. Throughputs divide by `wall_s` (first send to last end); token
    counts and the cache hit rate (sum cached / sum prompt tokens) come from the usage of
    completed requests. Goodput counts completed requests meeting the SLO over all measured
    requests (completed + failed); requests cancelled at the --duration limit are neither."""
    if not wall_s > 0:
        raise ValueError(f"wall_s: must be > 0, got {wall_s}")
    done = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    completion = sum(r.completion_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    summary: dict[str, Any] = {
        "requests": {"measured": len(results), "completed": len(done), "failed": len(results) - len(done),
                     "cancelled_at_deadline": cancelled, "skipped": skipped},
        "duration_s": wall_s,
        "max_in_flight": max_in_flight,
        "request_throughput": len(done) / wall_s,
        "input_token_throughput": prompt / wall_s,
        "output_token_throughput": completion / wall_s,
        "total_token_throughput": (prompt + completion) / wall_s,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else None,
        "ttft_ms": distribution(r.ttft_s for r in done if r.ttft_s is not None),
        "tpot_ms": distribution(t for r in done if (t := r.tpot_s) is not None),
        "itl_ms": distribution(gap for r in done for gap in r.itl_s),
        "e2e_ms": distribution(r.e2e_s for r in done),
        "failures": dict(sorted(Counter(r.status for r in results if not r.ok).items())),
        "goodput": None,
    }
    if slo.active:
        good = sum(slo.met_by(r) for r in results)
        summary["goodput"] = {"slo_ttft_ms": slo.ttft_ms, "slo_tpot_ms": slo.tpot_ms, "good": good,
                              "fraction": good / len(results) if results else None,
                              "rate": good / wall_s}
    return summary


class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, a line every 10%
    otherwise; nothing when disabled."""

    def __init__(self, label: str, total: int, *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, done: int, failed: int, *, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        frac = min(done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        line = f"{self.label} [{bar:<30}] {done}/{self.total} failed={failed} {now - self._t0:6.1f}s"
        if self.tty:
            if final or now - self._last_draw >= 0.1:
                self._last_draw = now
                self.stream.write("\r" + line + ("\n" if final else ""))
                self.stream.flush()
        elif int(frac * 10) > self._last_decile or (final and done < self.total):
            self._last_decile = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def format_run(label: str, s: dict[str, Any]) -> str:
    """A readable block for one run's summary."""
    req = s["requests"]
    rows = [
        ("Completed / measured", f"{req['completed']} / {req['measured']}"),
        ("Failed", " ".join([str(req["failed"]), *(f"{k}={v}" for k, v in s["failures"].items())])),
        ("Cancelled at deadline / skipped", f"{req['cancelled_at_deadline']} / {req['skipped']}"),
        ("Duration (s)", _fmt(s["duration_s"])),
        ("Max in flight", _fmt(s["max_in_flight"])),
        ("Request throughput (req/s)", _fmt(s["request_throughput"])),
        ("Input tokens/s", _fmt(s["input_token_throughput"])),
        ("Output tokens/s", _fmt(s["output_token_throughput"])),
        ("Cache hit rate", "-" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.1%}"),
    ]
    if s["goodput"]:
        g = s["goodput"]
        frac = "-" if g["fraction"] is None else f"{g['fraction']:.1%}"
        limits = ", ".join(f"{name}<={g[key]:g}ms" for name, key in (("TTFT", "slo_ttft_ms"), ("TPOT", "slo_tpot_ms"))
                           if g[key] is not None)
        rows.append((f"Goodput ({limits})",
                     f"{frac} of requests, {_fmt(g['rate'])} req/s"))
    width = max(len(k) for k, _ in rows)
    lines = [f"=== {label} ===", *(f"{k:<{width}}  {v}" for k, v in rows)]
    head = ["ms", "mean", *(f"P{q}" for q in PERCENTILES), "max"]
    lines.append("  ".join(f"{h:>10}" for h in head))
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[name]
        cells = [name[:-3].upper(), *(_fmt(d[k]) for k in ("mean", *(f"p{q}" for q in PERCENTILES), "max"))]
        lines.append("  ".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def format_sweep(runs: Sequence[dict[str, Any]]) -> str:
    """One row per run: the load setting against throughput and tail latencies."""
    head = ["load", "req/s", "out tok/s", "TTFT P50", "TTFT P99", "TPOT P50", "TPOT P99",
            "E2E P99", "cache", "goodput", "failed"]
    rows = [head]
    for run in runs:
        s = run["summary"]
        g = s["goodput"]
        rows.append([
            run["label"], _fmt(s["request_throughput"]), _fmt(s["output_token_throughput"], 1),
            _fmt(s["ttft_ms"]["p50"], 1), _fmt(s["ttft_ms"]["p99"], 1), _fmt(s["tpot_ms"]["p50"], 1),
            _fmt(s["tpot_ms"]["p99"], 1), _fmt(s["e2e_ms"]["p99"], 1),
            "-" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.1%}",
            "-" if not g or g["fraction"] is None else f"{g['fraction']:.1%}",
            str(s["requests"]["failed"]),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def plot_figures(runs: Sequence[dict[str, Any]], results: Sequence[Sequence[RequestResult]],
                 title: str = "") -> list[tuple[str, Any]]:
    """(file name, matplotlib Figure) for each plot: latency CDFs per run and, for a sweep,
    latency against throughput. Every axes has a title and labels with units; `title` (model,
    backend, dataset) heads each figure. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list[tuple[str, Any]] = []
    metrics = (("TTFT", "time to first token", lambda r: r.ttft_s),
               ("TPOT", "time per output token", lambda r: r.tpot_s),
               ("E2E", "end-to-end latency", lambda r: r.e2e_s))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (name, what, get) in zip(axes, metrics):
        for run, rs in zip(runs, results):
            xs = sorted(v * 1e3 for r in rs if r.ok and (v := get(r)) is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=run["label"])
        ax.set_title(f"{name} CDF ({what})")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests (0-1)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(f"Latency distributions{': ' + title if title else ''}")
    fig.tight_layout()
    figures.append(("latency_cdf.png", fig))
    if len(runs) > 1:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        xs = [run["summary"]["output_token_throughput"] for run in runs]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            name = key[:-3].upper()
            for q in ("p50", "p99"):
                ax.plot(xs, [run["summary"][key][q] for run in runs], marker="o", label=q.upper())
            for x, run in zip(xs, runs):
                ax.annotate(run["label"], (x, run["summary"][key]["p50"] or 0), fontsize="x-small")
            ax.set_title(f"{name} vs output throughput")
            ax.set_xlabel("output throughput (tokens/s)")
            ax.set_ylabel(f"{name} (ms)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
        fig.suptitle(f"Load sweep{': ' + title if title else ''}")
        fig.tight_layout()
        figures.append(("sweep.png", fig))
    return figures


def write_plots(runs: Sequence[dict[str, Any]], results: Sequence[Sequence[RequestResult]],
                plot_dir: str | Path, title: str = "") -> list[Path]:
    """The plot_figures PNGs under plot_dir (each with its title in the PNG's Title text).
    Returns the files written; [] (with a log line) when matplotlib is missing."""
    try:
        figures = plot_figures(runs, results, title)
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'tandem[bench]'): no plots written")
        return []
    import matplotlib.pyplot as plt

    out_dir = Path(plot_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, fig in figures:
        written.append(out_dir / name)
        fig.savefig(written[-1], dpi=110, metadata={"Title": fig.get_suptitle() or name})
        plt.close(fig)
    return written


__all__ = ["OK", "PERCENTILES", "Progress", "RequestResult", "SLO", "distribution", "format_run", "format_sweep",
           "percentile", "plot_figures", "summarize", "write_plots"]

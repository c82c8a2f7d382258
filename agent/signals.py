"""From a worker's scrapes to one sample per detector.

`parse_metrics(text)` reads a worker's Prometheus page (prometheus_client.parser) into a
`Scrape`; `WorkerSignals` keeps a worker's recent scrapes and turns them into samples:

- `unresponsive`: 1 when the health check or the scrape failed, 0 when both answered, None
  while the supervisor is (re)starting the process (it is not yet expected to answer).
- `itl` (decode and role-both workers) and `ttft` (prefill workers): the mean engine step time
  over the last `span_s` (from `tandem_engine_step_seconds`' sum and count), divided by a
  reference: the larger of the worker's own rolling baseline and its peers' current mean (the
  median over the other workers of its role group), so a load or host-wide slowdown that every
  worker shares is not one worker's regression, and the baseline follows it. On a decode
  worker every running stream gets one token per step, so the step time is its inter-token
  latency; a prefill worker's steps are the compute part of time to first token. None while
  idle or until the baseline has enough values.
- `error_rate`: server-side failures (INTERNAL, UNKNOWN, UNAVAILABLE, DATA_LOSS) among the
  worker's RPCs over `span_s`; None below `min_rpcs` calls.
- `stuck`: seconds the engine step counter has not moved while requests are running.
- `kv_pressure`: the share of KV blocks neither free nor evictable.
- `restarts`: restarts within the last `restart_window_s` (the supervisor's count when there
  is one, else the restarts seen here as counters going backwards).

Pure logic over the times and texts it is given.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from agent.confirm import RollingBaseline

logger = logging.getLogger(__name__)

ERROR_CODES = frozenset({"INTERNAL", "UNKNOWN", "UNAVAILABLE", "DATA_LOSS"})


@dataclass(frozen=True)
class Scrape:
    """The figures the detectors use from one /metrics page."""

    t: float
    step_sum: float = 0.0
    step_count: float = 0.0
    steps: float = 0.0
    running: float = 0.0
    kv_total: float = 0.0
    kv_free: float = 0.0
    kv_evictable: float = 0.0
    rpcs: float = 0.0
    rpc_errors: float = 0.0


def parse_metrics(text: str, t: float) -> Scrape:
    """A worker's exposition text -> Scrape (values summed over label sets). ValueError on a
    page that is not Prometheus text."""
    vals: dict[str, float] = {}
    rpcs = errors = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "tandem_worker_rpcs_total":
                rpcs += s.value
                if s.labels.get("code") in ERROR_CODES:
                    errors += s.value
            elif not s.name.endswith("_bucket"):
                vals[s.name] = vals.get(s.name, 0.0) + s.value
    return Scrape(t=t, step_sum=vals.get("tandem_engine_step_seconds_sum", 0.0),
                  step_count=vals.get("tandem_engine_step_seconds_count", 0.0),
                  steps=vals.get("tandem_engine_steps_total", 0.0),
                  running=vals.get("tandem_worker_running_requests", 0.0),
                  kv_total=vals.get("tandem_kv_blocks_total", 0.0), kv_free=vals.get("tandem_kv_blocks_free", 0.0),
                  kv_evictable=vals.get("tandem_kv_blocks_evictable", 0.0), rpcs=rpcs, rpc_errors=errors)


@dataclass(frozen=True)
class Sample:
    """One detector's sample, with what it was computed from (for the decision's evidence)."""

    value: float | None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class SignalConfig:
    span_s: float = 1.0  # latency and error rate are measured over this much recent time
    latency_floor_s: float = 0.005  # a baseline below this counts as this (no ratios of microseconds)
    min_rpcs: int = 5
    restart_window_s: float = 300.0


class WorkerSignals:
    """One worker's scrape history and baselines. `update(...)` once per poll, then `samples()`."""

    def __init__(self, role: str, config: SignalConfig | None = None, latency_warn: float = 2.0) -> None:
        self.role = role
        self.config = config or SignalConfig()
        self.latency_warn = latency_warn  # latency ratios below this feed the baseline
        self.baseline = RollingBaseline()
        self._history: deque[Scrape] = deque(maxlen=512)
        self._last_moved: float | None = None
        self._restarts_seen: deque[float] = deque(maxlen=64)
        self._current: dict[str, Sample] = {}
        self.mean_step_s: float | None = None  # this poll's mean step time, for its peers

    @property
    def latency_detector(self) -> str:
        return "ttft" if self.role == "prefill" else "itl"

    def update(self, now: float, *, healthy: bool, scrape: Scrape | None, starting: bool,
               supervisor_restarts: int | None, scrape_failed: bool = False,
               peer_step_s: float | None = None) -> dict[str, Sample]:
        """Compute this poll's samples. `scrape` None: no metrics (`scrape_failed`: the worker
        has a metrics port that did not answer). `peer_step_s`: the peers' mean step time (the
        agent passes the last poll's median of the others' `mean_step_s`)."""
        self.mean_step_s = None
        if scrape is not None and self._history and scrape.steps < self._history[-1].steps:
            self._restarts_seen.append(now)  # counters went backwards: a new process
            self._history.clear()
            self._last_moved = None
        if scrape is not None:
            self._history.append(scrape)
        out: dict[str, Sample] = {}
        if starting:
            out["unresponsive"] = Sample(None, {"starting": True})
        else:
            out["unresponsive"] = Sample(0.0 if healthy and not scrape_failed else 1.0,
                                         {"health": healthy, "metrics": not scrape_failed})
        if supervisor_restarts is not None:
            out["restarts"] = Sample(float(supervisor_restarts), {"source": "supervisor"})
        else:
            recent = [t for t in self._restarts_seen if now - t <= self.config.restart_window_s]
            out["restarts"] = Sample(float(len(recent)), {"source": "counter resets"})
        if scrape is None or starting:
            self._current = out
            return out
        out[self.latency_detector] = self._latency(peer_step_s)
        out["error_rate"] = self._error_rate()
        out["stuck"] = self._stuck(now, scrape)
        if scrape.kv_total > 0:
            used = 1.0 - (scrape.kv_free + scrape.kv_evictable) / scrape.kv_total
            out["kv_pressure"] = Sample(round(used, 4), {"total": scrape.kv_total, "free": scrape.kv_free,
                                                         "evictable": scrape.kv_evictable})
        self._current = out
        return out

    def _span(self) -> tuple[Scrape, Scrape] | None:
        """(oldest scrape at least span_s old, newest); None without one."""
        if len(self._history) < 2:
            return None
        new = self._history[-1]
        old = None
        for s in reversed(self._history):
            if new.t - s.t >= self.config.span_s:
                old = s
                break
        return (old, new) if old is not None else None

    def _latency(self, peer_step_s: float | None) -> Sample:
        span = self._span()
        if span is None:
            return Sample(None)
        old, new = span
        n = new.step_count - old.step_count
        if n <= 0:
            return Sample(None, {"steps": 0})
        mean = self.mean_step_s = (new.step_sum - old.step_sum) / n
        base = self.baseline.value()
        detail: dict[str, Any] = {"mean_step_s": round(mean, 6), "steps": int(n),
                                  "baseline_s": round(base, 6) if base is not None else None,
                                  "peers_s": round(peer_step_s, 6) if peer_step_s is not None else None}
        if base is None:
            self.baseline.add(mean)
            return Sample(None, detail)
        ratio = mean / max(base, peer_step_s or 0.0, self.config.latency_floor_s)
        if ratio < self.latency_warn:
            self.baseline.add(mean)
        return Sample(round(ratio, 3), detail)

    def _error_rate(self) -> Sample:
        span = self._span()
        if span is None:
            return Sample(None)
        old, new = span
        calls = new.rpcs - old.rpcs
        if calls < self.config.min_rpcs:
            return Sample(None, {"rpcs": calls})
        errors = new.rpc_errors - old.rpc_errors
        return Sample(round(errors / calls, 4), {"rpcs": calls, "errors": errors})

    def _stuck(self, now: float, scrape: Scrape) -> Sample:
        prev = self._history[-2] if len(self._history) >= 2 else None
        if scrape.running <= 0 or prev is None or scrape.steps != prev.steps or self._last_moved is None:
            self._last_moved = now
            return Sample(0.0, {"running": scrape.running})
        return Sample(round(now - self._last_moved, 3), {"running": scrape.running, "steps": scrape.steps})

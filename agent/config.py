"""The agent's settings: each detector's thresholds and action, the polling, and the policy's
limits. Defaults suit a production cluster; `--config FILE` (JSON, any subset) overrides them,
e.g. {"poll_s": 0.25, "detectors": {"itl": {"act": 4, "window_s": 2}}}."""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from agent.confirm import Thresholds

logger = logging.getLogger(__name__)

ACTIONS = ("drain", "restart", "isolate")


@dataclass(frozen=True)
class DetectorConfig:
    """warn/act: sample levels (see agent/signals.py for each detector's unit); window_s: how
    long `act` must hold; cooldown_s: quiet time after a decision; action: what a confirmed
    `act` does (drain, restart or isolate)."""

    warn: float
    act: float
    window_s: float
    cooldown_s: float
    action: str

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"action: must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        self.thresholds()  # validates the levels

    def thresholds(self) -> Thresholds:
        return Thresholds(self.warn, self.act, self.window_s, self.cooldown_s)


DEFAULT_DETECTORS: dict[str, DetectorConfig] = {
    # 1 = the health check or the metrics scrape failed
    "unresponsive": DetectorConfig(warn=1, act=1, window_s=10, cooldown_s=60, action="restart"),
    # mean step time / the worker's rolling baseline
    "itl": DetectorConfig(warn=2, act=3, window_s=30, cooldown_s=120, action="drain"),
    "ttft": DetectorConfig(warn=2, act=3, window_s=30, cooldown_s=120, action="drain"),
    # failed RPCs / RPCs
    "error_rate": DetectorConfig(warn=0.05, act=0.25, window_s=30, cooldown_s=120, action="drain"),
    # seconds without an engine step while requests run
    "stuck": DetectorConfig(warn=10, act=30, window_s=5, cooldown_s=120, action="restart"),
    # share of KV blocks in use (neither free nor evictable)
    "kv_pressure": DetectorConfig(warn=0.9, act=0.98, window_s=60, cooldown_s=300, action="drain"),
    # restarts within restart_window_s
    "restarts": DetectorConfig(warn=1, act=3, window_s=0, cooldown_s=600, action="isolate"),
}


@dataclass(frozen=True)
class AgentConfig:
    """poll_s: how often every worker is checked; span_s: the latency and error-rate
    measurement span; max_unroutable_fraction: the agent never drains a worker if that would
    leave more than this share of a role's workers unroutable (down, drained or isolated), nor
    the last routable one; recover_s: a worker the agent drained is cleared once its detector
    stayed below warn this long; escalate_s: a drained worker not recovered by then is
    restarted (with a supervisor), and cleared once it is healthy again; startup_grace_s: a
    (re)started process is not called unresponsive before this."""

    poll_s: float = 1.0
    span_s: float = 5.0
    health_timeout_s: float = 2.0
    latency_floor_s: float = 0.005
    min_rpcs: int = 5
    restart_window_s: float = 300.0
    max_unroutable_fraction: float = 0.5
    recover_s: float = 120.0
    escalate_s: float = 300.0
    startup_grace_s: float = 180.0
    detectors: dict[str, DetectorConfig] = field(default_factory=lambda: dict(DEFAULT_DETECTORS))

    def __post_init__(self) -> None:
        for name in ("poll_s", "span_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        if not 0 <= self.max_unroutable_fraction <= 1:
            raise ValueError("max_unroutable_fraction: must be in [0, 1]")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def load_config(path: str | Path | None) -> AgentConfig:
    """Defaults, overridden by the JSON file at `path`. ValueError names the bad key."""
    if path is None:
        return AgentConfig()
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a JSON object")
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> AgentConfig:
    known = {f.name for f in fields(AgentConfig)} - {"detectors"}
    top = {k: v for k, v in data.items() if k != "detectors"}
    for key in top:
        if key not in known:
            raise ValueError(f"config: unknown key {key!r} (known: {', '.join(sorted(known))}, detectors)")
    detectors = dict(DEFAULT_DETECTORS)
    for name, over in (data.get("detectors") or {}).items():
        if name not in detectors:
            raise ValueError(f"config: detectors.{name}: unknown detector (known: {', '.join(detectors)})")
        keys = {f.name for f in fields(DetectorConfig)}
        for key in over:
            if key not in keys:
                raise ValueError(f"config: detectors.{name}.{key}: unknown (known: {', '.join(sorted(keys))})")
        try:
            detectors[name] = replace(detectors[name], **over)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"config: detectors.{name}: {exc}") from None
    try:
        return AgentConfig(**top, detectors=detectors)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"config: {exc}") from None

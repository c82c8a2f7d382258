"""From confirmed verdicts to decisions: which action, on which worker, and whether it is allowed.

Call order, once per poll (the agent's loop): `observe(now, workers, samples)` with every
worker's view and its detectors' samples; it feeds each (worker, detector) `Confirmer` and
returns the decisions to carry out or log, each with its evidence. Rules:

- a WARN is reported once when a detector enters its warn level (never acted on);
- an ACT runs the detector's action: `drain` (refused when it would leave more than
  `max_unroutable_fraction` of the worker's role group unroutable, or none routable: the cap),
  `restart` (needs a supervisor; refused otherwise), `isolate`;
- a worker the agent drained is cleared once the detector that drained it stayed below warn for
  `recover_s`; if that has not happened after `escalate_s`, it is restarted (with a supervisor)
  and cleared once healthy again;
- nothing is decided about an isolated worker (only an operator clears it), nor about one
  marked by someone else, except isolation.

Pure logic with the time passed in; the agent's loop carries the decisions out (agent/actions.py).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.config import AgentConfig
from agent.confirm import Confirmer, Level, Verdict
from agent.signals import Sample

logger = logging.getLogger(__name__)

DRAINED = "drained"
ISOLATED = "isolated"


@dataclass(frozen=True)
class WorkerView:
    """A worker as the gateway (or the registry) and the health check see it."""

    name: str
    address: str
    role: str
    up: bool = True
    mark: str = ""  # the gateway's Admin mark: "", "drained", "isolated"
    routable: bool = True
    starting: bool = False  # the supervisor is (re)starting it

    @property
    def group(self) -> str:
        return "prefill" if self.role == "prefill" else "decode"


@dataclass
class Decision:
    """One decision. `action`: warn, drain, restart, isolate or clear. `allowed` False: the
    policy refused it (`outcome` says why); else the loop sets `outcome` once carried out."""

    action: str
    worker: WorkerView
    detector: str
    reason: str
    time: float
    verdict: Verdict | None = None
    thresholds: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)
    allowed: bool = True
    outcome: str = ""


@dataclass
class _Drain:
    detector: str
    since: float
    quiet_since: float | None = None
    escalated_at: float | None = None


class Policy:
    def __init__(self, config: AgentConfig, *, can_restart: bool) -> None:
        self.config = config
        self.can_restart = can_restart
        self._confirmers: dict[tuple[str, str], Confirmer] = {}
        self._drained: dict[str, _Drain] = {}  # address -> why the agent drained it
        self._isolated: set[str] = set()
        self._seen_isolated: set[str] = set()  # isolated at the gateway when last seen

    def state(self, address: str) -> str:
        """The agent's own view: ok, drained, restarting or isolated."""
        if address in self._isolated:
            return ISOLATED
        d = self._drained.get(address)
        if d is None:
            return "ok"
        return "restarting" if d.escalated_at is not None else DRAINED

    def observe(self, now: float, workers: Sequence[WorkerView],
                samples: Mapping[str, Mapping[str, Sample]]) -> list[Decision]:
        out: list[Decision] = []
        for w in workers:
            if w.mark == ISOLATED:
                self._seen_isolated.add(w.address)
            elif w.address in self._seen_isolated:  # an operator cleared it: watch it afresh
                self._seen_isolated.discard(w.address)
                self._isolated.discard(w.address)
                for key in [k for k in self._confirmers if k[0] == w.address]:
                    del self._confirmers[key]
            if w.address in self._isolated or w.mark == ISOLATED:
                continue  # left alone until an operator clears it
            for name, sample in samples.get(w.address, {}).items():
                det = self.config.detectors.get(name)
                if det is None:
                    continue
                conf = self._confirmers.setdefault((w.address, name), Confirmer(det.thresholds()))
                before = conf.last_level
                verdict = conf.observe(now, sample.value)
                self._track_recovery(now, w, name, sample)
                if verdict is None:
                    continue
                th = {"warn": det.warn, "act": det.act, "window_s": det.window_s, "cooldown_s": det.cooldown_s}
                if verdict.level is Level.WARN:
                    if before is Level.OK:
                        out.append(Decision("warn", w, name, f"{name} at {verdict.value:g} >= warn {det.warn:g}",
                                            now, verdict, th, sample.detail))
                    continue
                reason = f"{name} at >= {det.act:g} for {verdict.held_s:.1f}s (window {det.window_s:g}s)"
                d = self._act(now, w, name, det.action, reason, workers)
                if d is not None:
                    d.verdict, d.thresholds, d.detail = verdict, th, sample.detail
                    out.append(d)
            out += self._follow_up(now, w, samples.get(w.address, {}))
        return out

    # ---------------------------------------------------------------- actions

    def _act(self, now: float, w: WorkerView, detector: str, action: str, reason: str,
             workers: Sequence[WorkerView]) -> Decision | None:
        if w.address in self._isolated or w.mark == ISOLATED:
            return None
        d = Decision(action, w, detector, reason, now)
        if action == "isolate":
            self._isolated.add(w.address)
            self._drained.pop(w.address, None)
            return d
        if action == "restart":
            if not self.can_restart:
                d.allowed, d.outcome = False, "refused: no supervisor to restart through (--supervisor)"
            return d
        # drain
        if w.mark or w.address in self._drained:
            return None  # already out of routing
        refusal = self._cap_refusal(w, workers)
        if refusal:
            d.allowed, d.outcome = False, refusal
            return d
        self._drained[w.address] = _Drain(detector, now)
        return d

    def _cap_refusal(self, w: WorkerView, workers: Sequence[WorkerView]) -> str:
        group = [x for x in workers if x.group == w.group]
        unroutable = sum(1 for x in group if not x.routable or x.address in self._drained)
        routable_after = len(group) - unroutable - (1 if w.routable else 0)
        limit = self.config.max_unroutable_fraction
        if routable_after < 1:
            return f"refused: cap (it would leave no routable {w.group} worker)"
        if (unroutable + 1) / len(group) > limit:
            return (f"refused: cap ({unroutable + 1} of {len(group)} {w.group} workers unroutable "
                    f"> max_unroutable_fraction {limit:g})")
        return ""

    # ---------------------------------------------------------------- recovery

    def _track_recovery(self, now: float, w: WorkerView, detector: str, sample: Sample) -> None:
        d = self._drained.get(w.address)
        if d is None or d.detector != detector or sample.value is None:
            return
        if sample.value >= self.config.detectors[detector].warn:
            d.quiet_since = None
        elif d.quiet_since is None:
            d.quiet_since = now

    def _follow_up(self, now: float, w: WorkerView, samples: Mapping[str, Sample]) -> list[Decision]:
        d = self._drained.get(w.address)
        if d is None or w.address in self._isolated:
            return []
        cfg = self.config
        if d.escalated_at is not None:
            health = samples.get("unresponsive")
            if now - d.escalated_at > cfg.poll_s and not w.starting and health is not None and health.value == 0.0:
                del self._drained[w.address]
                return [Decision("clear", w, d.detector, "healthy again after its restart", now)]
            return []
        if d.quiet_since is not None and now - d.quiet_since >= cfg.recover_s:
            del self._drained[w.address]
            return [Decision("clear", w, d.detector, f"{d.detector} below warn for {cfg.recover_s:g}s", now)]
        if self.can_restart and now - d.since >= cfg.escalate_s:
            d.escalated_at = now
            return [Decision("restart", w, d.detector, f"drained {cfg.escalate_s:g}s without recovering", now)]
        return []

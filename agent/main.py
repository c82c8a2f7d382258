"""`tandem agent`: the infra agent's process.

    tandem agent --gateway 127.0.0.1:50051 [--supervisor SOCK] [--config agent.json] [--dry-run]
    tandem agent --redis-url redis://... --namespace NS [--gateway HOST:PORT]

Every `poll_s`: list the workers (the gateway's Admin.ListWorkers, or the Redis worker registry
with --redis-url), check each one's gRPC health and read its /metrics (in parallel), turn them
into detector samples (agent/signals.py), let the policy confirm and decide (agent/policy.py),
carry the decisions out (agent/actions.py) and print each one as one JSON line on stdout (and
--decision-log), with its evidence. Logs go to stderr. SIGTERM / SIGINT stop it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from agent.actions import Actuator, SupervisorClient, SupervisorError
from agent.config import AgentConfig, load_config
from agent.metrics import LEVELS, AgentMetrics
from agent.policy import Decision, Policy, WorkerView
from agent.signals import SignalConfig, WorkerSignals
from agent.sources import Discovered, GatewaySource, Prober, RedisSource
from tandem import security

logger = logging.getLogger(__name__)


@dataclass
class _Process:
    """What the agent knows of one worker's process across polls."""

    first_seen: float
    pid: int | None = None
    started: float = 0.0
    healthy_since_start: bool = False
    restarts: deque[float] = field(default_factory=lambda: deque(maxlen=64))


class Agent:
    """One poll at a time: `poll_once()` returns the decisions it made (already carried out)."""

    def __init__(self, config: AgentConfig, source: GatewaySource | RedisSource, prober: Prober,
                 actuator: Actuator, supervisor: SupervisorClient | None, metrics: AgentMetrics,
                 emit: Callable[[dict[str, Any]], None], clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.config = config
        self.source = source
        self.prober = prober
        self.actuator = actuator
        self.supervisor = supervisor
        self.metrics = metrics
        self.emit = emit
        self.clock = clock
        self.wall = wall
        self.policy = Policy(config, can_restart=supervisor is not None)
        self._signals: dict[str, WorkerSignals] = {}
        self._procs: dict[str, _Process] = {}
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="probe")

    def poll_once(self) -> list[Decision]:
        now = self.clock()
        self.metrics.polls.inc()
        try:
            found = self.source.workers()
        except Exception as exc:  # the gateway or Redis is away: nothing to judge this round
            self.metrics.poll_errors.inc()
            logger.warning("listing the workers failed: %r", exc)
            return []
        procs: dict[str, dict[str, Any]] | None = None
        if self.supervisor is not None:
            try:
                procs = self.supervisor.processes()
            except SupervisorError as exc:
                logger.warning("%s", exc)
        probes = list(self._pool.map(lambda w: (w, self.prober.healthy(w.address), *self.prober.scrape(w, now)),
                                     found))
        views: list[WorkerView] = []
        samples = {}
        peers = self._peer_means(found)
        for w, ok, scrape, failed in probes:
            starting, restarts = self._process(now, w, ok, procs)
            sig = self._signals.get(w.address)
            if sig is None:
                sig = self._signals[w.address] = WorkerSignals(w.role, self._signal_config(),
                                                               self._latency_warn(w.role))
            samples[w.address] = sig.update(now, healthy=ok, scrape=scrape, starting=starting,
                                            supervisor_restarts=restarts, scrape_failed=failed,
                                            peer_step_s=peers.get(w.address))
            views.append(WorkerView(w.name, w.address, w.role, w.up, w.mark, w.routable, starting))
        decisions = self.policy.observe(now, views, samples)
        for d in decisions:
            d.outcome = d.outcome or (self.actuator.carry_out(d) if d.allowed else "refused")
            self.emit(self.record(d, now))
            kind = ("logged" if d.action == "warn" else "refused" if not d.allowed else "dry_run"
                    if d.outcome == "dry-run" else "failed" if d.outcome.startswith("failed") else "executed")
            self.metrics.decisions.labels(d.action, d.detector, kind).inc()
        self._update_metrics(views, samples)
        return decisions

    def _peer_means(self, found: list[Discovered]) -> dict[str, float]:
        """address -> the median of the last poll's mean step time over the other workers of its
        role group (prefill, or decode-capable)."""
        out = {}
        for w in found:
            group = w.role == "prefill"
            others = [s.mean_step_s for x in found if x.address != w.address and (x.role == "prefill") == group
                      and (s := self._signals.get(x.address)) is not None and s.mean_step_s is not None]
            if others:
                out[w.address] = statistics.median(others)
        return out

    def _process(self, now: float, w: Discovered, ok: bool,
                 procs: dict[str, dict[str, Any]] | None) -> tuple[bool, int | None]:
        """(whether the process is (re)starting, restarts within the window or None)."""
        p = self._procs.get(w.address)
        if p is None:
            p = self._procs[w.address] = _Process(first_seen=now, started=now)
        proc = procs.get(w.address) if procs is not None else None
        if proc is not None and proc.get("pid") != p.pid:
            if p.pid is not None:
                p.restarts.append(now)
                p.started, p.healthy_since_start = now, False
            p.pid = proc.get("pid")
        if ok:
            p.healthy_since_start = True
        not_alive = proc is not None and not proc.get("alive", True)
        starting = not_alive or (not p.healthy_since_start and now - p.started < self.config.startup_grace_s)
        if procs is None:
            return starting, None
        return starting, sum(1 for t in p.restarts if now - t <= self.config.restart_window_s)

    def _signal_config(self) -> SignalConfig:
        c = self.config
        return SignalConfig(span_s=c.span_s, latency_floor_s=c.latency_floor_s, min_rpcs=c.min_rpcs,
                            restart_window_s=c.restart_window_s)

    def _latency_warn(self, role: str) -> float:
        return self.config.detectors["ttft" if role == "prefill" else "itl"].warn

    def record(self, d: Decision, now: float) -> dict[str, Any]:
        """The decision's JSON line: what, on which worker, why, and the evidence."""
        wall_now = self.wall()

        def wall(t: float) -> float:
            return round(wall_now - (now - t), 3)

        evidence: dict[str, Any] = {"thresholds": d.thresholds, "detail": d.detail}
        if d.verdict is not None:
            evidence.update(value=d.verdict.value, held_s=round(d.verdict.held_s, 3),
                            samples=[[wall(t), v] for t, v in d.verdict.samples])
        return {"ts": wall(d.time), "decision": d.action, "worker": d.worker.name, "address": d.worker.address,
                "role": d.worker.role, "detector": d.detector, "reason": d.reason, "allowed": d.allowed,
                "outcome": d.outcome, "dry_run": self.actuator.dry_run,
                "state": self.policy.state(d.worker.address), "evidence": evidence}

    def _update_metrics(self, views: list[WorkerView], samples: dict[str, Any]) -> None:
        self.metrics.workers.set(len(views))
        for v in views:
            self.metrics.set_state(v.name, self.policy.state(v.address))
            for name, sample in samples.get(v.address, {}).items():
                conf = self.policy._confirmers.get((v.address, name))
                if conf is not None:
                    self.metrics.detector_level.labels(v.name, name).set(LEVELS[conf.last_level.value])
                if sample.value is not None:
                    self.metrics.sample.labels(v.name, name).set(sample.value)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.prober.close()
        self.actuator.close()
        self.source.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem agent", description="Watch a Tandem cluster; drain, restart or "
                                "isolate unhealthy workers (every decision is one JSON line on stdout).")
    p.add_argument("--gateway", default=None, help="gateway HOST:PORT: lists the workers (Admin) and carries out "
                   "drain / isolate / clear")
    p.add_argument("--redis-url", default=None, help="list the workers from the Redis worker registry instead")
    p.add_argument("--namespace", default=None, help="the registry's namespace (with --redis-url; the gateway's "
                   "--namespace, by default the model identity)")
    p.add_argument("--supervisor", default=None, help="the supervisor's Unix socket (tandem up passes it): "
                   "restarts go through it")
    p.add_argument("--config", default=None, help="JSON file overriding thresholds and timings (agent/config.py)")
    p.add_argument("--dry-run", action="store_true", help="decide and log, carry nothing out")
    p.add_argument("--decision-log", default=None, help="also append every decision's JSON line to this file")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0: any free port; default off)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--auth-token-file", default=None,
                   help="the cluster token for the gateway's Admin, the workers and the supervisor (default: "
                        "$TANDEM_AUTH_TOKEN_FILE or $TANDEM_AUTH_TOKEN)")
    p.add_argument("--tls-ca", default=None, help="PEM CA that signed the gateway's and workers' certificates")
    p.add_argument("--ready-file", default=None, help="write {pid, metrics_port} here (JSON) once watching: "
                   "`tandem up` reports up only after it")
    return p


def write_ready_file(path: str, metrics_port: int | None) -> None:
    """The ready file `tandem up` waits for, written whole (through a rename)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "metrics_port": metrics_port}))
    tmp.replace(target)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [agent] %(name)s: %(message)s")
    if not a.gateway and not a.redis_url:
        parser.error("give --gateway HOST:PORT or --redis-url URL (where the workers are listed)")
    if a.redis_url and not a.namespace:
        parser.error("--namespace: required with --redis-url (the registry's namespace)")
    try:
        config = load_config(a.config)
        token = security.load_token(a.auth_token_file)
    except ValueError as exc:
        parser.error(str(exc))
    source: GatewaySource | RedisSource = (RedisSource(a.redis_url, a.namespace) if a.redis_url
                                           else GatewaySource(a.gateway, config.health_timeout_s, token, a.tls_ca))
    supervisor = SupervisorClient(a.supervisor, token=token) if a.supervisor else None
    metrics = AgentMetrics(a.dry_run)
    if a.metrics_port is not None:
        metrics.serve(a.metrics_port, a.metrics_host)
    log: TextIO | None = open(Path(a.decision_log), "a", buffering=1) if a.decision_log else None

    def emit(line: dict[str, Any]) -> None:
        text = json.dumps(line, sort_keys=True)
        print(text, flush=True)
        if log is not None:
            log.write(text + "\n")

    agent = Agent(config, source, Prober(config.health_timeout_s, token, a.tls_ca),
                  Actuator(a.gateway, supervisor, a.dry_run, token=token, tls_ca=a.tls_ca), supervisor, metrics, emit)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logger.info("agent watching %s every %.2fs%s (metrics %s)", a.gateway or a.redis_url, config.poll_s,
                " in dry-run" if a.dry_run else "", metrics.port if metrics.port is not None else "off")
    if a.ready_file:
        write_ready_file(a.ready_file, metrics.port)
    try:
        while not stop.is_set():
            started = time.monotonic()
            agent.poll_once()
            stop.wait(max(0.0, config.poll_s - (time.monotonic() - started)))
    finally:
        agent.close()
        metrics.close()
        if log is not None:
            log.close()
        if a.ready_file:
            Path(a.ready_file).unlink(missing_ok=True)
    logger.info("agent stopped")
    return 0


__all__ = ["Agent", "main"]

"""The agent's Prometheus metrics (`tandem_agent_*`) on a registry of its own."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem.metrics_endpoint import MetricsEndpoint

logger = logging.getLogger(__name__)

STATES = ("ok", "drained", "restarting", "isolated")
LEVELS = {"ok": 0, "warn": 1, "act": 2}


class AgentMetrics(MetricsEndpoint):
    def __init__(self, dry_run: bool) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("tandem_agent_decisions", "Decisions by action, detector and outcome "
                                 "(executed, dry_run, refused, failed, logged)", ["action", "detector", "outcome"],
                                 registry=r)
        self.worker_state = Gauge("tandem_agent_worker_state", "1 for the agent's current state of each worker",
                                  ["worker", "state"], registry=r)
        self.detector_level = Gauge("tandem_agent_detector_level", "Each detector's level per worker "
                                    "(0 ok, 1 warn, 2 act)", ["worker", "detector"], registry=r)
        self.sample = Gauge("tandem_agent_detector_sample", "Each detector's latest sample per worker",
                            ["worker", "detector"], registry=r)
        self.workers = Gauge("tandem_agent_workers", "Workers watched", registry=r)
        self.polls = Counter("tandem_agent_polls", "Polls of the whole cluster", registry=r)
        self.poll_errors = Counter("tandem_agent_discovery_errors", "Polls where discovery failed", registry=r)
        Gauge("tandem_agent_dry_run", "1 when the agent only logs", registry=r).set(float(dry_run))

    def set_state(self, worker: str, state: str) -> None:
        for s in STATES:
            self.worker_state.labels(worker, s).set(1.0 if s == state else 0.0)

    def serve(self, port: int, host: str) -> int:
        return self._serve(host, port)

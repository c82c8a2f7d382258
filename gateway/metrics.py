"""Prometheus metrics of the gateway (`tandem_gateway_*`), on a registry of its own so several
gateways can live in one process (tests) and `--metrics-port` serves exactly these.

Every series carries a `model` label (the served model's name), bound here once, so callers
give only the labels of their own (`metrics.ttft.labels(tier)`). The registry also holds the
standard `process_*` metrics of the gateway's process. METRICS.md lists every series.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from tandem.metrics_endpoint import MetricsEndpoint
from tandem.types import Tier

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
_STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.32, 0.64, 1.28, 2.56,
                  5.12, 10.24)


class _ModelBound:
    """A labelled metric whose first label, `model`, is fixed: `.labels(*rest)` gives the child."""

    def __init__(self, metric: Any, model: str) -> None:
        self._metric = metric
        self._model = model

    def labels(self, *values: str) -> Any:
        return self._metric.labels(self._model, *values)


class GatewayMetrics(MetricsEndpoint):
    """Every metric the gateway exports. Label values: the served model's name for `model`,
    tier names in lower case, gRPC status code names or finish reasons for `status`,
    routing.REASONS for `reason`."""

    def __init__(self, model: str = "") -> None:
        r = self.registry = CollectorRegistry()
        self.model = model
        m = ["model"]

        def per(metric: Any) -> _ModelBound:
            return _ModelBound(metric, model)

        def one(metric: Any) -> Any:
            return metric.labels(model)

        self.queue_depth = per(Gauge("tandem_gateway_queue_depth", "Requests waiting in a tier queue", [*m, "tier"],
                                     registry=r))
        self.running = one(Gauge("tandem_gateway_running_requests", "Requests dispatched to workers and not ended",
                                 m, registry=r))
        self.ttft = per(Histogram("tandem_gateway_time_to_first_token_seconds", "Arrival to first token sent",
                                  [*m, "tier"], buckets=_LATENCY_BUCKETS, registry=r))
        self.itl = per(Histogram("tandem_gateway_inter_token_seconds",
                                 "Time between consecutive chunks with tokens, per token (a chunk of n tokens t "
                                 "seconds after the previous one counts t/n)",
                                 [*m, "tier"], buckets=_ITL_BUCKETS, registry=r))
        self.e2e = per(Histogram("tandem_gateway_e2e_seconds", "Arrival to the end of the stream", [*m, "tier"],
                                 buckets=_LATENCY_BUCKETS, registry=r))
        self.queue_wait = per(Histogram("tandem_gateway_request_queue_time_seconds", "Arrival to dispatch",
                                        [*m, "tier"], buckets=_LATENCY_BUCKETS, registry=r))
        self.tokens_in = one(Counter("tandem_gateway_prompt_tokens", "Prompt tokens of admitted requests", m,
                                     registry=r))
        self.tokens_out = one(Counter("tandem_gateway_generation_tokens", "Tokens streamed to clients", m,
                                      registry=r))
        self.requests = per(Counter("tandem_gateway_requests", "Finished Generate calls by outcome",
                                    [*m, "status"], registry=r))
        self.errors = per(Counter("tandem_gateway_errors", "Generate calls that ended with a non-OK status",
                                  [*m, "status"], registry=r))
        self.routing = per(Counter("tandem_gateway_routing_decisions", "Prefill routing decisions by reason",
                                   [*m, "reason"], registry=r))
        self.prefill_requests = per(Counter("tandem_gateway_prefill_requests", "Prompts sent to be computed, by "
                                            "the worker computing them (a decode worker prefilling locally counts "
                                            "too)", [*m, "worker"], registry=r))
        self.index_degraded = one(Gauge("tandem_gateway_prefix_index_degraded",
                                        "1 while the prefix index is unreachable (routing is load-only)", m,
                                        registry=r))
        self.dispatched = per(Counter("tandem_gateway_dispatched", "Requests dispatched, by tier and the tier "
                                      "they competed in after aging", [*m, "tier", "effective_tier"], registry=r))
        self.retries = per(Counter("tandem_gateway_retries", "Attempts restarted after a worker failure, by the "
                                   "stage that failed (reserve, prefill, decode, stream)", [*m, "stage"],
                                   registry=r))
        self.migrations = per(Counter("tandem_gateway_migrations", "Requests moved to another worker after "
                                      "output had been streamed (the new worker resumes from the tokens sent)",
                                      [*m, "tier"], registry=r))
        self.workers_up = per(Gauge("tandem_gateway_workers_up", "Workers answering Stats", [*m, "role"],
                                    registry=r))
        ProcessCollector(registry=r)
        self.calls_inflight = one(Gauge("tandem_gateway_calls_in_flight", "Generate calls the gateway holds "
                                        "(admitted or not), bounded by its own max_inflight_calls", m, registry=r))
        self.calls_refused = per(Counter("tandem_gateway_calls_refused", "Generate calls answered RESOURCE_EXHAUSTED "
                                         "by the gateway's admission, by tier and why (queue_full, "
                                         "max_inflight_calls)", [*m, "tier", "reason"], registry=r))
        self.worker_calls = per(Histogram("tandem_gateway_worker_call_seconds",
                                          "How long the gateway waited on a worker call of an attempt, by stage: "
                                          "reserve (decode worker's Reserve), prefill (prefill worker's Prefill: its "
                                          "queue, the prompt and the KV hand-over), first_chunk (Decode or "
                                          "PrefillAndDecode, call to its first chunk)",
                                          [*m, "stage"], buckets=_STAGE_BUCKETS, registry=r))
        self.stalls = per(Counter("tandem_gateway_stalls", "Attempts migrated because their worker made no progress "
                                  "within the stall timeout, by the stage that stalled (reserve, prefill, stream)",
                                  [*m, "stage"], registry=r))
        self.suspects = per(Counter("tandem_gateway_suspect_workers", "Times a worker was marked suspect after a "
                                    "stall", [*m, "role"], registry=r))

    def bind_queue_depth(self, depth: Callable[[Tier], int]) -> None:
        for tier in Tier:
            self.queue_depth.labels(tier.name.lower()).set_function(lambda t=tier: depth(t))

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the /metrics HTTP endpoint; returns the bound port."""
        return self._serve(host, port)

"""Prometheus metrics of a worker (`tandem_` prefix), read from the stats snapshot at scrape time.

Gauges and counters come from a custom collector over `StatsSnapshot` (the engine's
`Engine.stats()` and its KV cache's counters, taken by the engine thread after each step) and
the KV transport's counters, so the engine thread pays nothing per scrape; only the
step-latency histogram and the RPC outcome counter are updated as things happen. Every series
carries `model`, `worker` and `role` labels. Each worker has its own registry, so several
workers can live in one process (tests); the registry also holds the `process_*` metrics.
Names follow vLLM's where the meaning is the same (`tandem_num_requests_running` is
`vllm:num_requests_running`); METRICS.md lists every series.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.metrics_endpoint import MetricsEndpoint
from worker.stats import StatsSnapshot

logger = logging.getLogger(__name__)

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A step queued ahead leaves a gap of a few copies (~10-50 µs); a host that fell behind, a held
# launch or another process's kernels leave longer ones.
_IDLE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 1.0)


class _SnapshotCollector(Collector):
    def __init__(self, labels: dict[str, str], snapshot: Callable[[], StatsSnapshot],
                 kv_stats: Callable[[], dict[str, dict[str, float]]], draining: Callable[[], bool]) -> None:
        self._labels = labels
        self._snapshot = snapshot
        self._kv_stats = kv_stats
        self._draining = draining

    def _family(self, cls: type, name: str, doc: str, value: float, **extra: str) -> Any:
        names = [*self._labels, *extra]
        fam = cls(name, doc, labels=names)
        fam.add_metric([*self._labels.values(), *extra.values()], value)
        return fam

    def collect(self) -> Iterator[Any]:
        s = self._snapshot()
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(g, "tandem_num_requests_running", "Requests in the running batch", s.running)
        yield self._family(g, "tandem_num_requests_waiting", "Requests waiting to be scheduled (preempted ones "
                           "included)", s.waiting + s.swapped)
        yield self._family(g, "tandem_num_requests_held", "Reserved (decode) or prefilled-awaiting-send requests",
                           s.held)
        yield self._family(g, "tandem_queued_prefill_tokens", "Prompt tokens admitted, not yet computed",
                           s.queued_prefill_tokens)
        yield self._family(g, "tandem_kv_blocks_total", "KV blocks in the pool", s.total_blocks)
        yield self._family(g, "tandem_kv_blocks_free", "KV blocks on the free list", s.free_blocks)
        yield self._family(g, "tandem_kv_blocks_used", "KV blocks not on the free list (prefix-cache-only "
                           "blocks included)", s.used_blocks)
        yield self._family(g, "tandem_kv_blocks_evictable", "KV blocks only the prefix cache holds", s.evictable_blocks)
        held = s.total_blocks - s.available_blocks
        yield self._family(g, "tandem_kv_cache_usage_perc", "Fraction of KV blocks held by requests (0-1; "
                           "prefix-cache-only blocks count as free)", held / s.total_blocks if s.total_blocks else 0.0)
        yield self._family(g, "tandem_prefix_cache_hit_ratio", "Prompt tokens found cached / looked up, since start",
                           s.prefix_hit_ratio)
        yield self._family(c, "tandem_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                           s.prefix_query_tokens)
        yield self._family(c, "tandem_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                           s.prefix_hit_tokens)
        yield self._family(c, "tandem_num_preemptions", "Requests preempted", s.preemptions)
        yield self._family(c, "tandem_engine_steps", "Engine steps run", s.steps)
        yield self._family(c, "tandem_engine_scheduled_tokens", "Tokens run through the model (prompt chunks "
                           "plus one per decoding request)", s.scheduled_tokens)
        yield self._family(c, "tandem_generation_tokens", "Tokens sampled", s.generated_tokens)
        yield self._family(g, "tandem_worker_draining", "1 while draining after SIGTERM", float(self._draining()))
        kv = self._kv_stats()
        bytes_fam = c("tandem_kv_transfer_bytes", "KV payload bytes moved", labels=[*self._labels, "direction"])
        secs_fam = c("tandem_kv_transfer_seconds", "Seconds spent moving KV", labels=[*self._labels, "direction"])
        done_fam = c("tandem_kv_transfers", "KV transfers finished", labels=[*self._labels, "direction", "result"])
        base = list(self._labels.values())
        if "sent" in kv:
            st = kv["sent"]
            bytes_fam.add_metric([*base, "sent"], st.get("bytes_sent", 0))
            secs_fam.add_metric([*base, "sent"], st.get("send_seconds", 0.0))
            done_fam.add_metric([*base, "sent", "ok"], st.get("transfers_committed", 0))
            done_fam.add_metric([*base, "sent", "failed"], st.get("transfers_failed", 0))
            done_fam.add_metric([*base, "sent", "aborted"], st.get("transfers_aborted", 0))
        if "received" in kv:
            st = kv["received"]
            bytes_fam.add_metric([*base, "received"], st.get("bytes_received", 0))
            secs_fam.add_metric([*base, "received"], st.get("transfer_seconds", 0.0))
            done_fam.add_metric([*base, "received", "ok"], st.get("transfers_ok", 0))
            done_fam.add_metric([*base, "received", "failed"], st.get("transfers_failed", 0))
        yield bytes_fam
        yield secs_fam
        yield done_fam


class WorkerMetrics(MetricsEndpoint):
    """The worker's registry: snapshot-backed families plus step latency, RPC outcomes and the
    process's own metrics. `model` is the served model's name (its directory's name)."""

    def __init__(self, worker_id: str, role: str, snapshot: Callable[[], StatsSnapshot],
                 kv_stats: Callable[[], dict[str, dict[str, float]]], draining: Callable[[], bool],
                 model: str = "") -> None:
        labels = {"model": model, "worker": worker_id, "role": role}
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(labels, snapshot, kv_stats, draining))
        self._step = Histogram("tandem_engine_step_seconds", "Duration of one engine step", list(labels),
                               buckets=_STEP_BUCKETS, registry=self.registry).labels(**labels)
        self._prefill = Histogram("tandem_prefill_stage_seconds",
                                  "A Prefill call on a prefill worker, by stage: compute (the call's arrival to "
                                  "its first token: the engine's queue, batching window and the steps of its "
                                  "prompt), handover (first token to the KV commit handed to the transport); "
                                  "and two parts of compute: queue (arrival to the prompt queued on the engine "
                                  "thread, which may be finishing a step), finish (the first token sampled on "
                                  "the engine thread to the call seeing it, the commit included); and commit, "
                                  "finish's part on the engine thread (the first token sampled to the commit "
                                  "handed to the transport; the rest of finish is the hop to the call)",
                                  [*labels, "stage"], buckets=_STEP_BUCKETS, registry=self.registry)
        self._rpcs = Counter("tandem_worker_rpcs", "Worker RPCs by method and status code",
                             [*labels, "method", "code"], registry=self.registry)
        self._turn_wait = Counter("tandem_worker_gpu_turn_wait_seconds",
                                  "Seconds a decode worker's steps waited for prefill steps on its GPU (--gpu-turn)",
                                  list(labels), registry=self.registry).labels(**labels)
        self._device_idle = Histogram("tandem_engine_device_idle_seconds",
                                      "Each wait of the GPU for the host between engine steps while the engine has "
                                      "work: from a step's last kernel to the next step's forward, on the device's "
                                      "clock (engine/device_idle.py); the sum is the device's idle time",
                                      list(labels), buckets=_IDLE_BUCKETS, registry=self.registry).labels(**labels)
        ProcessCollector(registry=self.registry)
        self._labels = labels

    def observe_step(self, seconds: float) -> None:
        self._step.observe(seconds)

    def observe_turn_wait(self, seconds: float) -> None:
        self._turn_wait.inc(seconds)

    def observe_device_idle(self, gaps: list[float]) -> None:
        """The seconds of each gap between steps (DeviceIdleClock.take_gaps)."""
        for seconds in gaps:
            self._device_idle.observe(seconds)

    def observe_prefill(self, stage: str, seconds: float) -> None:
        """A Prefill call's `stage` ("compute", "handover", "queue", "finish" or "commit") took `seconds`."""
        self._prefill.labels(**self._labels, stage=stage).observe(seconds)

    def count_rpc(self, method: str, code: str) -> None:
        self._rpcs.labels(**self._labels, method=method, code=code).inc()

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (port 0: any free one); returns the bound port."""
        return self._serve(host, port)

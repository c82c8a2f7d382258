"""Liveness knobs and their arithmetic: when a stream or a prefill counts as stalled, how a
worker's step time is learnt from the chunks it streams, when a suspect worker is trusted
again, and the gateway's own bound on Generate calls in flight.

Pure logic with an injectable clock (no I/O); the attempt flow (gateway.request) asks
`stream_timeout` / `prefill_timeout` before each wait on a worker and reports each chunk
with `observe_chunk`; the registry (gateway.workers) asks `trusted_again` on each Stats answer.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LivenessConfig:
    """stall_timeout_s: a decode stream with no chunk from its worker for
        max(stall_timeout_s, stall_steps x that worker's step time) is migrated like a dead
        worker's (its step time is learnt from the chunks it streams, so a slow batch on a big
        model is not mistaken for a stall).
    prefill_stall_s: the same bound for a prefill (with its KV transfer) and for the first
        chunk of a stream (which includes the prompt's computation).
    ewma_alpha: weight of the newest inter-chunk interval in a worker's step time.
    max_inflight_calls: Generate calls the gateway holds at once, admitted or not; one more is
        answered RESOURCE_EXHAUSTED by the gateway (None: every tier queue's capacity plus every
        decode slot plus `call_margin`, so the bound only bites before the queues would).
    """

    stall_timeout_s: float = 3.0
    stall_steps: float = 20.0
    prefill_stall_s: float = 30.0
    ewma_alpha: float = 0.2
    max_inflight_calls: int | None = None
    call_margin: int = 256

    def __post_init__(self) -> None:
        for name in ("stall_timeout_s", "stall_steps", "prefill_stall_s"):
            _positive(name, getattr(self, name))
        _positive("ewma_alpha", self.ewma_alpha)
        if self.ewma_alpha > 1:
            raise ValueError(f"ewma_alpha: must be in (0, 1], got {self.ewma_alpha}")
        for name in ("max_inflight_calls", "call_margin"):
            v = getattr(self, name)
            if v is None and name == "max_inflight_calls":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "max_inflight_calls" else 0):
                raise ValueError(f"{name}: must be an integer >= {1 if name == 'max_inflight_calls' else 0}, "
                                 f"got {v!r}")

    def call_bound(self, queue_capacity: int, decode_slots: int) -> int:
        """The in-flight Generate bound for a gateway with these queues and decode slots."""
        if self.max_inflight_calls is not None:
            return self.max_inflight_calls
        return queue_capacity + decode_slots + self.call_margin

    # ------------------------------------------------------------ per worker (a WorkerHandle)

    def stream_timeout(self, worker: Any, tokens_per_chunk: int = 1) -> float:
        """Seconds without a chunk after which `worker`'s stream, which sends a chunk every
        `tokens_per_chunk` tokens, is stalled."""
        return max(self.stall_timeout_s, (self.stall_steps + tokens_per_chunk - 1) * worker.step_s)

    def prefill_timeout(self, worker: Any) -> float:
        """Seconds a prefill (with its KV push) or a stream's first chunk may take on `worker`."""
        return max(self.prefill_stall_s, self.stall_steps * worker.step_s)

    def observe_chunk(self, worker: Any, interval_s: float) -> None:
        """A chunk came `interval_s` after the previous one of the same stream."""
        if interval_s <= 0 or not math.isfinite(interval_s):
            return
        worker.step_s = interval_s if worker.step_s <= 0 else (
            self.ewma_alpha * interval_s + (1 - self.ewma_alpha) * worker.step_s)

    def trusted_again(self, suspect_since: float, now: float) -> bool:
        """A worker suspected (stalled) at `suspect_since` that answers Stats at `now` is routed
        to again once it stayed answering for a stall timeout."""
        return now - suspect_since >= self.stall_timeout_s


# The most tokens a worker holds before it sends a chunk (GenerateRequest.stream_interval 0 or
# above it): a worker's stream then costs its event loop and the gateway's one message per this
# many tokens instead of one per step, and a worker lost mid-stream takes at most this many
# unsent tokens with it (they are computed again where the request resumes). A worker also sends
# what it holds once it held it tandem.rules.WORKER_MAX_HOLD_S, so a slow worker that keeps
# stepping is heard from within the stall bound before its step time is learnt.
MAX_WORKER_CHUNK_TOKENS = 16


def worker_stream_interval(client_interval: int) -> int:
    """Tokens per chunk to ask of a worker for a client's stream_interval (1: every step)."""
    if client_interval == 1:
        return 1
    return MAX_WORKER_CHUNK_TOKENS if client_interval == 0 else min(client_interval, MAX_WORKER_CHUNK_TOKENS)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")

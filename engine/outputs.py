"""What the engine hands its callers: step outputs, read-only request views, step plans and stats.

These are the only views of the engine's requests that code outside `engine/` gets; the
scheduler's queues and `Sequence` objects stay inside (see `engine.Engine`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sampler import TokenLogprobs
from engine.sequence import FinishReason
from tandem.types import SamplingParams

if TYPE_CHECKING:
    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence

__all__ = ["DuplicateRequestError", "EngineStats", "FinishReason", "Request", "StepObserver", "StepOutput",
           "StepPlan"]


class DuplicateRequestError(ValueError):
    """The request id is already queued, running, swapped, reserved or held in this engine."""


@dataclass
class StepOutput:
    """What one request gained in one step; `finished` on the last one."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class Request:
    """A read-only view of one request the engine admitted (`Engine.admit` returns it).

    Read it on the engine's thread (a worker's event loop reads `num_cached_tokens`, which is
    set once, at the first admission). Two views are equal when they show the same admission:
    a request that ended and a later one under the same id are not equal.
    """

    __slots__ = ("_seq",)

    def __init__(self, seq: Sequence) -> None:
        self._seq = seq

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Request) and other._seq is self._seq

    def __hash__(self) -> int:
        return id(self._seq)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self._seq.status.value})"

    @property
    def request_id(self) -> str:
        return self._seq.request_id

    @property
    def params(self) -> SamplingParams:
        return self._seq.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._seq.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return self._seq.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """Output tokens so far (of a resumed request, the earlier output included)."""
        return list(self._seq.output_token_ids)

    @property
    def output_logprobs(self) -> list[TokenLogprobs | None]:
        return list(self._seq.output_logprobs)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache at the first admission."""
        return self._seq.num_cached_tokens

    @property
    def block_table(self) -> list[int]:
        """The KV blocks the request holds now, in token order (a prefilled request keeps its
        blocks until `Engine.release`, so its KV can be pushed from them)."""
        return list(self._seq.block_table)

    @property
    def finished(self) -> bool:
        return self._seq.finish_reason is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._seq.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        """The stop string or stop token id that ended the request (None for EOS and length)."""
        return self._seq.stop_reason


class StepPlan:
    """What one scheduled step computes, as the engine's step hooks see it (`Engine.step`'s
    after-layer hook, a tensor-parallel runner's step extras, `StepObserver`)."""

    __slots__ = ("_out", "_sampling")

    def __init__(self, out: SchedulerOutput) -> None:
        self._out = out
        self._sampling: list[Request] | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes (prompt chunks plus one per decoding request)."""
        return self._out.num_tokens

    def sampling(self) -> list[Request]:
        """Requests that sample a token in this step: each decoding request, and each request
        whose last prompt token the step computes."""
        if self._sampling is None:
            self._sampling = [Request(s.seq) for s in self._out.scheduled if s.samples]
        return self._sampling

    def num_decode_requests(self) -> int:
        """Requests that decode one token in this step (past their prompt)."""
        return sum(1 for s in self._out.scheduled
                   if s.num_new_tokens == 1 and s.seq.num_computed_tokens >= s.seq.num_prompt_tokens)


class StepObserver:
    """Hooks an Engine calls on its own thread during `step()`, for benchmarks and profilers
    (`Engine.observer`; None costs nothing). Each gets the host seconds of its phase; they must
    not change the engine."""

    def on_schedule(self, plan: StepPlan, seconds: float) -> None:
        """After the scheduler chose a step (empty steps included)."""

    def on_postprocess(self, seconds: float) -> None:
        """After the scheduler's bookkeeping of a step that ran."""


@dataclass(frozen=True)
class EngineStats:
    """Counts of one engine at one instant (`Engine.stats()`).

    held: reserved (decode side, not yet activated) plus prefilled-and-awaiting-release
    requests. queued_prefill_tokens: prompt tokens admitted but not computed yet (waiting,
    swapped and mid-prefill requests). The num_* counters grow from the engine's start.
    """

    running: int
    waiting: int
    swapped: int
    held: int
    queued_prefill_tokens: int
    num_preemptions: int
    num_swaps_out: int
    num_recomputes: int
    num_scheduled_tokens: int

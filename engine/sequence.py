"""A request's state inside one engine: tokens, KV blocks, progress and why it finished."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.rules import StopChecker
from tandem.types import SamplingParams, Tier

_arrival_counter = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted; its KV lives in host memory
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id, or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    PREFILLED = "prefilled"  # prefill-only request: prompt KV computed, first token sampled


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tier: Tier = Tier.STANDARD
    prefill_only: bool = False
    arrival: float = field(default_factory=time.monotonic)
    order: int = field(default_factory=lambda: next(_arrival_counter))

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Any] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    prefix_match: Any = None  # the radix cache's handle while the sequence holds a lock
    host_blocks: list[int] = field(default_factory=list)  # where its KV went when swapped
    stop: StopChecker | None = None  # set by the engine at admission (and replaced at activation)
    text: str = ""  # output text so far, when the StopChecker has a StopText (stop strings)
    # Reserved with this many trailing ids of prompt_token_ids that are earlier output (a
    # resume): the engine splits them off at activation.
    num_resumed_output: int = 0
    # The model runner's int32 copy of block_table (see ModelRunner._table_row); not state.
    table_cache: Any = field(default=None, repr=False, compare=False)
    # The model runner's SamplingRow of this sequence (see ModelRunner._rows); not state.
    sampling_row: Any = field(default=None, repr=False, compare=False)
    # Overlapped steps (Engine with overlap_schedule): tokens sampled on the device but not yet
    # appended to output_token_ids, and the row of the newest one in its step's samples.
    num_pending: int = 0
    pending_row: int = -1

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        """Token `i` of prompt + output, without building the joined list."""
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens `start` .. `end` of prompt + output, without building the joined list."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= n:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[max(0, start - n) : end - n]

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens, counting sampled tokens still on their way to the host."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt plus output tokens whose ids the host has."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def surely_ends_with_pending(self, max_model_len: int) -> bool:
        """Whether the pending token ends this sequence whatever its value (it needs no step
        after it): a prefill-only request, max_tokens reached, or the model's context full."""
        return self.num_pending > 0 and (
            self.prefill_only
            or len(self.output_token_ids) + self.num_pending >= self.params.max_tokens
            or self.num_tokens >= max_model_len
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def priority_key(self) -> tuple[int, int]:
        """Sort key: lower tier value first, then older first."""
        return (int(self.tier), self.order)

    def blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Extra blocks needed so that `num_tokens` tokens fit in the block table."""
        return max(0, -(-num_tokens // block_size) - len(self.block_table))

"""Torch-free request types shared by the SDK, the gateway and the engine.

`SamplingParams` and `Tier` live here so that `import tandem` stays light for client users
while the engine validates and uses exactly the same definitions.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields, replace
from typing import Any

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


class Tier(enum.IntEnum):
    """Priority tier of a request. Lower value = served first."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2

    @classmethod
    def parse(cls, value: "Tier | int | str") -> "Tier":
        """Accept a Tier, its int value or its (case-insensitive) name; raise ValueError naming `tier`."""
        if isinstance(value, Tier):
            return value
        if isinstance(value, str):
            name = value.strip().upper()
            if name.startswith("TIER_"):
                name = name[5:]
            if name in cls.__members__:
                return cls[name]
            raise ValueError(f"tier: unknown tier {value!r}; expected one of interactive, standard, batch")
        if isinstance(value, int) and not isinstance(value, bool) and value in {t.value for t in cls}:
            return cls(value)
        raise ValueError(f"tier: unknown tier {value!r}; expected one of interactive, standard, batch")


class Role(str, enum.Enum):
    """What a worker process does: prefill only, decode only, or both (no KV transfer)."""

    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


ROLES: tuple[str, ...] = tuple(r.value for r in Role)

# The abort reason of a request whose timeout expired (workers end it with this reason and the
# services answer DEADLINE_EXCEEDED for it).
DEADLINE = "deadline"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 and top_p 1 and min_p 0 disable those filters.
    `logprobs=None` returns none; `logprobs=k` returns the sampled token's logprob plus the
    top-k alternatives. `seed=None` draws from the engine's generator; a seed makes the
    request reproducible on its own, independent of what else is in the batch.
    Call `validate()` (the engine and the gateway do) to get a ValueError naming the field.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept lists (and a single string for `stop`) from callers; store tuples so the
        # dataclass stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop) if self.stop is not None else ())
        if not isinstance(self.stop_token_ids, tuple):
            ids = self.stop_token_ids
            object.__setattr__(self, "stop_token_ids", tuple(ids) if ids is not None else ())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def replace(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise ValueError('<field>: <why>') for the first invalid field; return self."""
        check_int("max_tokens", self.max_tokens, lo=1)
        check_float("temperature", self.temperature, lo=0.0)
        check_int("top_k", self.top_k, lo=0)
        check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            check_int("seed", self.seed, lo=0, hi=MAX_SEED)
        check_int("min_tokens", self.min_tokens, lo=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop: a stop string is longer than {MAX_STOP_STRING_CHARS} characters")
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t, lo=0, hi=(vocab_size - 1) if vocab_size else None)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> None:
    """ValueError('<name>: why') unless value is an int (not bool) within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {value}")


def check_float(name: str, value: Any, lo: float | None = None, hi: float | None = None) -> None:
    """ValueError('<name>: why') unless value is a finite number within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {value}")


__all__ = ["SamplingParams", "Tier", "MAX_SEED", "MAX_LOGPROBS"]

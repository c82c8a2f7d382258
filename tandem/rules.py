"""The per-request rules that the engine and the gateway both apply, in one torch-free home:
when a request stops and which text it shows, how many KV blocks it can need, and which
prompts are acceptable.

The engine decides stops while it generates (`engine.Engine`); the gateway re-applies the same
rules to the tokens workers stream (`gateway.streaming.OutputAssembler`), so that the client's
output equals the offline engine's whichever worker, or how many after a retry, produced it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tandem.detokenize import IncrementalDetokenizer, StopMatcher
from tandem.tokenizer import Tokenizer
from tandem.types import SamplingParams

# What a stop was caused by (`Stop.kind`).
STOP_TOKEN = "stop_token_id"
EOS = "eos"
STOP_STRING = "stop_string"


@dataclass(frozen=True)
class Stop:
    """Why a request ends after a token: `reason` "stop" or "length"; `kind` one of STOP_TOKEN,
    EOS, STOP_STRING ("" for length); `matched` the stop token id or stop string that ended it."""

    reason: str
    kind: str = ""
    matched: str | int | None = None


LENGTH = Stop("length")


def blocks_needed(num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int) -> int:
    """KV blocks a request can hold at most: its prompt plus max_tokens, capped by the context."""
    return -(-min(num_prompt_tokens + max_tokens, max_model_len) // block_size)


def check_prompt_ids(token_ids: Sequence[int], vocab_size: int, max_model_len: int, field: str = "prompt") -> None:
    """A prompt of token ids must be non-empty ids in [0, vocab) that leave room for one output
    token in the model's context. ValueError naming `field` otherwise."""
    if not token_ids:
        raise ValueError(f"{field}: must not be empty")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
        raise ValueError(f"{field}: token ids must be integers in [0, {vocab_size})")
    if len(token_ids) >= max_model_len:
        raise ValueError(f"{field}: {len(token_ids)} tokens leave no room in the model's context of {max_model_len}")


class StopText:
    """The detokenizer and stop-string matcher of one request: `push(token, armed)` returns the
    text the client may see now and whether a stop string completed (text before min_tokens is
    shown but never matched); `tail()` releases the held-back text at the end, or nothing when a
    stop string ended the request.

    context_ids: the token ids the output follows (the prompt), so that a SentencePiece output
    that starts a new word keeps its leading space.
    """

    def __init__(self, tokenizer: Tokenizer, context_ids: Sequence[int], params: SamplingParams) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, context_ids, params.skip_special_tokens)
        self._matcher = StopMatcher(params.stop)

    @property
    def stop_string(self) -> str | None:
        return self._matcher.stop_string

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    def push(self, token: int, armed: bool) -> tuple[str, bool]:
        delta = self._detok.push([token])
        if not armed:
            return delta, False
        return self._matcher.feed(delta)

    def tail(self) -> str:
        if self._matcher.stopped:
            return ""
        text, _ = self._matcher.feed(self._detok.flush())
        return text + self._matcher.flush()


class StopChecker:
    """One request's stop rules, in their one order: a stop token id, then EOS (unless
    ignore_eos), both only once min_tokens output tokens exist; then stop strings; then
    max_tokens and the model context. A stop token's own text is not shown.

    text: the request's StopText, or None when no text is wanted (then stop strings are not
      checked: the engine builds one only for requests with stop strings, to keep decoding off
      its hot path, while the gateway always builds one to stream text).
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int], max_context: int,
                 text: StopText | None = None) -> None:
        self.params = params
        self.max_context = max_context
        self.text = text
        self._eos = frozenset(eos_token_ids)
        self._stop_ids = frozenset(params.stop_token_ids)

    def check(self, token: int, num_output: int, num_tokens: int) -> tuple[str, Stop | None]:
        """The text `token` shows and the Stop it causes (None: the request goes on).

        num_output: output tokens including `token`; num_tokens: prompt plus output tokens.
        """
        p = self.params
        armed = num_output >= p.min_tokens
        if armed and token in self._stop_ids:
            return "", Stop("stop", STOP_TOKEN, token)
        if armed and not p.ignore_eos and token in self._eos:
            return "", Stop("stop", EOS)
        shown = ""
        if self.text is not None:
            shown, stopped = self.text.push(token, armed)
            if stopped:
                return shown, Stop("stop", STOP_STRING, self.text.stop_string)
        if num_output >= p.max_tokens or num_tokens >= self.max_context:
            return shown, LENGTH
        return shown, None

    def tail(self) -> str:
        return self.text.tail() if self.text is not None else ""


# The longest a worker holds a stream's tokens before it sends them (a chunk is due after this
# even with fewer than its stream_interval): a worker that keeps stepping, however slowly, is
# heard from this often, so the gateway's stall bound measures silence, not slowness.
WORKER_MAX_HOLD_S = 0.5


class StreamGrouping:
    """When a stream's held token deltas are due to go out, for a stream_interval
    (GenerateRequest): 1, every delta; N > 1, the first tokens at once, then once N new tokens
    are held (or, with `max_hold_s`, once tokens were held that long since the last send); 0,
    only at the end (or after `max_hold_s`). The end is always due at once. One per stream; the
    gateway groups what it sends the client with it and a worker what it streams to the gateway
    (with WORKER_MAX_HOLD_S)."""

    def __init__(self, interval: int, max_hold_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.max_hold_s = max_hold_s
        self._clock = clock
        self._held = 0
        self._sent_tokens = False
        self._since = clock()  # when the count last started again

    def add(self, num_tokens: int, end: bool = False) -> bool:
        """A delta of `num_tokens` is held; True when everything held is due now (the caller
        sends it, and the count starts again)."""
        self._held += num_tokens
        due = end or self.interval == 1 or (
            self.interval > 1 and (self._held >= self.interval or (self._held > 0 and not self._sent_tokens)))
        if not due and self.max_hold_s is not None and self._held > 0:
            due = self._clock() - self._since >= self.max_hold_s
        if due:
            self._sent_tokens = self._sent_tokens or self._held > 0
            self._held = 0
            if self.max_hold_s is not None:
                self._since = self._clock()
        return due

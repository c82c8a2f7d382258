"""Turns the token deltas workers stream into what the client receives: each token exactly
once, UTF-8-safe text deltas, stop strings cut exactly, and the stop conditions decided here.

The gateway re-applies the engine's stop rules itself, through the same code
(`tandem.rules.StopChecker` with a `StopText`), so its output equals the offline engine's and
does not depend on which worker (or how many, after a retry) produced the tokens.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from tandem.rules import StopChecker, StopText, StreamGrouping
from tandem.tokenizer import Tokenizer
from tandem.types import SamplingParams
from tandem.wire import Chunk, TokenLogprob, Usage

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Emission:
    """What to send the client for one worker delta; finish_reason set on the last one."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str = ""
    matched_stop: str | int | None = None

    @property
    def empty(self) -> bool:
        return not self.token_ids and not self.text and self.finish_reason is None


class OutputAssembler:
    """Accumulates one request's output across worker streams and retries.

    `add(token_ids, logprobs)` accepts the next tokens in order and returns the emission for
    them; tokens after the one that ends the request are dropped (the caller then stops the
    worker). `finish(reason, stop_reason)` ends the request for a reason decided elsewhere
    (the worker's own stop, an abort, an error) and releases held-back text.
    `output_ids` is every token delivered, which is what a retry re-prefills.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], params: SamplingParams,
                 eos_token_ids: Iterable[int], max_context: int, want_text: bool = True) -> None:
        self.params = params
        self.prompt_tokens = len(prompt_ids)
        self.max_context = max_context
        self.want_text = want_text
        self._want_logprobs = params.logprobs is not None
        # Always with text: stop strings are matched on it even when the client wants none.
        self._stop = StopChecker(params, eos_token_ids, max_context, StopText(tokenizer, prompt_ids, params))
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason = ""
        self.matched_stop: str | int | None = None

    @property
    def delivered(self) -> int:
        return len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def usage(self, cached_tokens: int) -> Usage:
        return Usage(self.prompt_tokens, self.delivered, min(max(cached_tokens, 0), self.prompt_tokens))

    def add(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None] = ()) -> Emission:
        """The emission for the next tokens; empty once finished."""
        out = Emission()
        if self.finished:
            return out
        pieces: list[str] = []
        for i, token in enumerate(token_ids):
            token = int(token)
            self.output_ids.append(token)
            out.token_ids.append(token)
            lp = logprobs[i] if i < len(logprobs) else None
            if self._want_logprobs:
                out.logprobs.append(lp if lp is not None else TokenLogprob(token, 0.0))
            n = len(self.output_ids)
            text, stop = self._stop.check(token, n, self.prompt_tokens + n)
            pieces.append(text)
            if stop is not None:
                self._set_finish(stop.reason, stop.kind, stop.matched)
            if self.finished:
                break
        if self.finished:
            pieces.append(self._tail())
            self._fill_finish(out)
        out.text = "".join(pieces) if self.want_text else ""
        return out

    def finish(self, reason: str, stop_reason: str = "", matched_stop: str | int | None = None) -> Emission:
        """End the request now (no more tokens); returns the final emission (tail text)."""
        out = Emission()
        if self.finished:
            return out
        self._set_finish(reason, stop_reason, matched_stop)
        tail = self._tail()
        out.text = tail if self.want_text else ""
        self._fill_finish(out)
        return out

    def _set_finish(self, reason: str, stop_reason: str, matched: str | int | None) -> None:
        self.finish_reason, self.stop_reason, self.matched_stop = reason, stop_reason, matched

    def _fill_finish(self, out: Emission) -> None:
        out.finish_reason, out.stop_reason, out.matched_stop = self.finish_reason, self.stop_reason, self.matched_stop

    def _tail(self) -> str:
        # As engine.output_text: release held-back text unless a stop string ended the stream.
        return self._stop.tail()


def merge_chunks(chunks: Sequence[Chunk]) -> Chunk:
    """One chunk with the deltas of `chunks` in order; the end (finish, stop, usage) of the last."""
    last = chunks[-1]
    if len(chunks) == 1:
        return last
    return Chunk(token_ids=[t for c in chunks for t in c.token_ids], text="".join(c.text for c in chunks),
                 logprobs=[lp for c in chunks for lp in c.logprobs], finish_reason=last.finish_reason,
                 stop_reason=last.stop_reason, matched_stop=last.matched_stop, usage=last.usage,
                 request_id=next((c.request_id for c in chunks if c.request_id), ""))


async def grouped(items: AsyncIterator[Chunk | T], interval: int) -> AsyncIterator[Chunk | T]:
    """`items` (a request's chunks, then maybe another item that ends it, e.g. a failure) with
    the chunks merged as GenerateRequest.stream_interval says (`tandem.rules.StreamGrouping`).
    The last chunk, and whatever ends the request, go out as soon as they come (the chunks held
    before a non-chunk item go first)."""
    grouping = StreamGrouping(interval)
    held: list[Chunk] = []
    async for item in items:
        if not isinstance(item, Chunk):
            if held:
                yield merge_chunks(held)
                held = []
            yield item
            continue
        held.append(item)
        if grouping.add(len(item.token_ids), item.finished):
            yield merge_chunks(held)
            held = []
    if held:
        yield merge_chunks(held)

"""Streaming text out of generated token ids: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns token ids into text deltas that never split a UTF-8
character; `StopMatcher` cuts the stream exactly before a stop string (OpenAI semantics),
holding back any tail that could still become one. Both are torch-free (gateway side).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from tandem.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Tokens of the prompt decoded as left context, so the first output token gets the leading
# space (or byte-fallback continuation) it has in context. Same window as vLLM.
PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing list of output ids into text deltas (vLLM's prefix/read offsets).

    Each step decodes the window `ids[prefix_offset:]` and the shorter window
    `ids[prefix_offset:read_offset]` and emits the difference. A delta is held back while the
    decoded tail ends in U+FFFD (an unfinished multi-byte character). Decoding a window that
    starts a few tokens back keeps SentencePiece's leading-space handling (▁, the decoder's
    strip of the first space) and byte-fallback pieces correct.

    Contract: the concatenation of every `push` result and of `flush()` equals
    `tokenizer.decode(output_ids)` when the prompt is empty or its tokenizer's decoder keeps
    leading spaces (byte-level BPE); after a non-empty prompt it is the text the output adds
    to the prompt, so a SentencePiece output token's leading space is kept.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._id_limit = tokenizer.id_limit
        # Only the window from prefix_offset onward is ever decoded, so older ids are dropped.
        start = max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0)
        self._ids: list[int] = [int(i) for i in prompt_token_ids[start:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._output_ids: list[int] = []
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset], once known

    @property
    def output_token_ids(self) -> list[int]:
        """Every output id pushed so far."""
        return list(self._output_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (possibly '')."""
        ids = [int(i) for i in token_ids]
        self._output_ids.extend(ids)
        return self._push_decodable(self._decodable(ids))

    def flush(self) -> str:
        """Release text still held back at the end of generation (e.g. a dangling partial character)."""
        return self._step(final=True)

    def finish(self, token_ids: Sequence[int]) -> str:
        """`push(token_ids) + flush()` for ids that end the generation: in two decodes when the
        window's text extends to the text with the ids appended and no replacement character is
        involved (an unfinished UTF-8 sequence, which byte-fallback tokens can leave anywhere,
        decodes differently in one piece than step by step); otherwise id by id, over the ids
        that decode to something (an offline run ends with every request's finish at once)."""
        all_ids = [int(i) for i in token_ids]
        ids = self._decodable(all_ids)
        self._output_ids.extend(all_ids)
        if self._read_offset == len(self._ids):  # no text held back
            window = self._ids[self._prefix_offset:]
            before = self._decode(window)
            after = self._decode(window + ids)
            if after.startswith(before) and _REPLACEMENT_CHAR not in after:
                self._ids = (window + ids)[-PROMPT_CONTEXT_TOKENS:]
                self._prefix_offset, self._read_offset = 0, len(self._ids)
                self._prefix_text = None
                return after[len(before):]
        return self._push_decodable(ids) + self.flush()

    def _decodable(self, ids: list[int]) -> list[int]:
        """`ids` less those with no vocabulary entry: they decode to nothing, so every window
        decodes the same without them and a step would emit nothing. Leaving them out keeps a
        held-back window from growing across a run of such ids."""
        limit = self._id_limit
        return [i for i in ids if i < limit]

    def _push_decodable(self, ids: list[int]) -> str:
        pieces = []
        for token_id in ids:
            self._ids.append(token_id)
            pieces.append(self._step(final=False))
        return "".join(pieces)

    def _step(self, final: bool) -> str:
        # The window's left part only changes when the window slides, so while text is held
        # back its decode is reused.
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        prefix_text = self._prefix_text
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        delta = new_text[len(prefix_text) :]
        # Slide the window: the ids just emitted become the left context of the next step.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""


class StopMatcher:
    """Cuts a text stream just before the first stop string (the stop string is not emitted).

    `feed(delta)` returns the text that is safe to show and whether a stop string completed.
    Text that could still grow into a stop string is held back until it can't. When several
    stop strings complete, the one that completes first wins (earliest end, then earliest
    start), so the result does not depend on how the stream was split into deltas.
    """

    def __init__(self, stop_strings: Sequence[str] | None) -> None:
        stops = [] if stop_strings is None else stop_strings
        if isinstance(stops, str) or not isinstance(stops, Sequence):
            raise ValueError("stop must be a list of strings")
        for index, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop[{index}] must be a non-empty string, got {stop!r}")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self._stop_string: str | None = None

    @property
    def stopped(self) -> bool:
        return self._stop_string is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the stream, or None."""
        return self._stop_string

    def feed(self, delta: str) -> tuple[str, bool]:
        """Consume a text delta; return (text to emit, whether a stop string was hit)."""
        if self._stop_string is not None:
            return "", True
        if not self._stops:
            return delta, False
        text = self._held + delta
        hit = self._first_completed(text)
        if hit is not None:
            start, stop = hit
            self._stop_string = stop
            self._held = ""
            return text[:start], True
        keep = self._partial_suffix_length(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Text still held back when the stream ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self._stop_string is not None else held

    def _first_completed(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _partial_suffix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0

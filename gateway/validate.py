"""Admission checks: every field of a GenerateRequest, before anything is queued (DESIGN §7).

A rejected request raises `InvalidRequest` whose message starts with the field's name; the
service answers INVALID_ARGUMENT with it. Context policy: a prompt must leave room for at
least one generated token, and prompt tokens + max_tokens must fit in the model context (else
the field `max_tokens` is rejected; nothing is clamped). When the client left max_tokens
unset, the default (128) is lowered to what the context leaves, as an unset limit means
"as many as fit" rather than a number the client chose.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from gateway.config import MAX_REQUEST_ID_CHARS
from gateway.modelinfo import ServedModel
from tandem.types import SamplingParams, Tier
from tandem.wire import GenerateInput

logger = logging.getLogger(__name__)

# '#' is kept out: the gateway appends "#<attempt>" to the ids it sends workers on a retry.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]+")


class InvalidRequest(ValueError):
    """A request field is invalid; str(exc) is '<field>: <why>'."""

    def __init__(self, field_name: str, why: str) -> None:
        super().__init__(f"{field_name}: {why}")
        self.field = field_name


@dataclass(frozen=True)
class AdmittedRequest:
    """A request that passed every check: the prompt as token ids, the effective params."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    tier: Tier
    request_id: str  # "" when the gateway is to mint one
    stream_text: bool
    stream_interval: int = 1  # new tokens per chunk to the client; 0: only the last chunk


def validate_request(inp: GenerateInput, model: ServedModel, *, max_tokens_set: bool = True,
                     stream_interval: int = 1) -> AdmittedRequest:
    """Check `inp` against `model`; tokenize a text prompt. Raises InvalidRequest.

    `max_tokens_set` says whether the client gave max_tokens (proto `optional` presence);
    `stream_interval` is the gateway's default for a request that does not set its own.
    """
    request_id = check_request_id(inp.request_id)
    prompt_ids = _prompt_ids(inp.prompt, model)
    n = len(prompt_ids)
    if n >= model.max_context:
        raise InvalidRequest(
            "prompt", f"{n} tokens leave no room to generate in the model context of {model.max_context} tokens")
    params = inp.params
    room = model.max_context - n
    if not max_tokens_set and isinstance(params.max_tokens, int) and params.max_tokens > room:
        params = params.replace(max_tokens=room)
    try:
        params.validate(model.vocab_size)
    except ValueError as exc:
        field_name, _, why = str(exc).partition(": ")
        raise InvalidRequest(field_name, why or str(exc)) from None
    if params.max_tokens > room:
        raise InvalidRequest(
            "max_tokens", f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) exceeds the model "
                          f"context of {model.max_context} tokens; at most {room} fit")
    if not isinstance(inp.stream_text, bool):
        raise InvalidRequest("stream_text", f"must be a bool, got {inp.stream_text!r}")
    interval = stream_interval if inp.stream_interval is None else inp.stream_interval
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise InvalidRequest("stream_interval", f"must be an integer >= 0, got {interval!r}")
    return AdmittedRequest(tuple(prompt_ids), params, Tier.parse(inp.tier), request_id, inp.stream_text,
                           interval)


def check_request_id(request_id: str) -> str:
    """'' (mint one) or 1..128 characters of [A-Za-z0-9._:-]."""
    if not isinstance(request_id, str):
        raise InvalidRequest("request_id", f"must be a string, got {type(request_id).__name__}")
    if not request_id:
        return ""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")
    if not _REQUEST_ID.fullmatch(request_id):
        raise InvalidRequest("request_id", "may contain only letters, digits and . _ : -")
    return request_id


def _prompt_ids(prompt: str | tuple[int, ...], model: ServedModel) -> list[int]:
    if not prompt:
        raise InvalidRequest("prompt", "must not be empty (give text or token_ids)")
    if isinstance(prompt, str):
        # Refuse absurd text before tokenizing it: no tokenizer makes fewer tokens than
        # characters / 64, so such a prompt cannot fit anyway.
        if len(prompt) > 64 * model.max_context:
            raise InvalidRequest("prompt", f"{len(prompt)} characters cannot fit in the model context of "
                                           f"{model.max_context} tokens")
        ids = model.tokenizer.encode(prompt)
        if not ids:
            raise InvalidRequest("prompt", "tokenizes to no tokens")
        return ids
    ids = list(prompt)
    for pos, token in enumerate(ids):
        if not 0 <= token < model.vocab_size:
            raise InvalidRequest("prompt", f"token id {token} at position {pos} is outside the vocabulary "
                                           f"[0, {model.vocab_size})")
    return ids

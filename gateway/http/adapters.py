"""OpenAI requests → the gateway's own `GenerateInput`s, and the gateway's `Chunk`s → OpenAI
responses: the HTTP counterpart of tandem.wire's proto adapters. No checks of values here
beyond what has no gRPC twin (n, the prompt's JSON shape, fields Tandem does not implement);
everything else is gateway.validate's, through gateway.admission.

One HTTP request becomes one `Choice` per (prompt, n): choice index = prompt index * n + j,
each its own gateway request with id '<http id>-<index>'. With a seed, choice j of a prompt
gets seed + j, so the n choices differ yet the response is reproducible.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.http.errors import HttpError
from gateway.http.schemas import (ChatCompletionRequest, ChatLogprobs, ChatTokenLogprob, CompletionLogprobs,
                                  CompletionRequest, PromptTokensDetails, TopLogprob, UsageInfo)
from gateway.modelinfo import ServedModel
from tandem.tokenizer import Tokenizer
from tandem.types import MAX_SEED, SamplingParams, Tier
from tandem.wire import Chunk, GenerateInput, TokenLogprob, Usage

logger = logging.getLogger(__name__)

MAX_CHOICES = 128  # n times the number of prompts
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class Choice:
    """One generation of an HTTP request: what the gateway runs for choice `index`."""

    index: int
    prompt_index: int
    inp: GenerateInput
    max_tokens_set: bool


@dataclass
class ChoiceOutput:
    """What one choice produced so far (a unary response is built from these)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason, self.usage = chunk.finish_reason, chunk.usage


# ---------------------------------------------------------------- requests

def check_model(requested: str, model: ServedModel) -> None:
    if requested != model.name:
        raise HttpError(404, f"model: the model {requested!r} does not exist; this server serves {model.name!r}",
                        type="not_found_error", param="model", code="model_not_found")


def completion_choices(req: CompletionRequest, model: ServedModel, http_id: str) -> list[Choice]:
    _check_common(req)
    if req.echo:
        raise HttpError.invalid("echo", "not supported")
    if req.suffix:
        raise HttpError.invalid("suffix", "not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise HttpError.invalid("best_of", "not supported (only best_of equal to n)")
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    params = _params(req, max_tokens=max_tokens, logprobs=req.logprobs)
    return _choices(_prompts(req.prompt), req.n, params, _tier(req.priority), http_id, max_tokens_set=True,
                    stream=bool(req.stream))


def chat_choices(req: ChatCompletionRequest, model: ServedModel, http_id: str) -> list[Choice]:
    _check_common(req)
    if req.tools:
        raise HttpError.invalid("tools", "tool calling is not supported")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise HttpError.invalid("response_format", "only {'type': 'text'} is supported")
    if req.top_logprobs is not None and not req.logprobs:
        raise HttpError.invalid("top_logprobs", "needs logprobs: true")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _params(req, max_tokens=max_tokens, logprobs=logprobs)
    prompt = render_chat(req, model)
    return _choices([prompt], req.n, params, _tier(req.priority), http_id, max_tokens_set=max_tokens is not None,
                    stream=bool(req.stream))


def render_chat(req: ChatCompletionRequest, model: ServedModel) -> tuple[int, ...]:
    """The token ids of `req.messages` rendered by the model's chat template."""
    messages = []
    for m in req.messages:
        content = m.content if isinstance(m.content, str) or m.content is None else "".join(p.text for p in m.content)
        message: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    try:
        text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                   **(req.chat_template_kwargs or {}))
    except ValueError as exc:
        raise HttpError.invalid("messages", str(exc)) from None
    if len(text) > 64 * model.max_context:  # as gateway.validate: cannot fit, do not tokenize it
        raise HttpError.invalid("messages", f"{len(text)} characters cannot fit in the model context of "
                                            f"{model.max_context} tokens")
    ids = model.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    if not ids:
        raise HttpError.invalid("messages", "the chat template renders them to no tokens")
    return tuple(ids)


def _check_common(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.n < 1:
        raise HttpError.invalid("n", f"must be >= 1, got {req.n}")
    if req.stream_options is not None and not req.stream:
        raise HttpError.invalid("stream_options", "only allowed with stream: true")
    if req.logit_bias:
        raise HttpError.invalid("logit_bias", "not supported")


def _prompts(prompt: Any) -> list[str | tuple[int, ...]]:
    """A completions prompt as a list of text or token-id prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise HttpError.invalid("prompt", "must not be empty")
    if all(isinstance(p, int) for p in prompt):
        return [tuple(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [tuple(p) for p in prompt]
    raise HttpError.invalid("prompt", "must be a string, a list of strings, a list of token ids or a list of them")


def _tier(priority: str | int | None) -> Tier:
    if priority is None:
        return Tier.STANDARD
    try:
        return Tier.parse(priority)
    except ValueError:
        raise HttpError.invalid("priority", f"must be interactive, standard or batch, got {priority!r}") from None


def _params(req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
            logprobs: int | None) -> SamplingParams:
    """SamplingParams from the fields the client set; unset ones keep Tandem's defaults.
    Not validated here (gateway.validate names a bad field)."""
    given = {name: getattr(req, name) for name in (
        "temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "top_k", "min_p",
        "repetition_penalty", "ignore_eos", "min_tokens", "skip_special_tokens") if getattr(req, name) is not None}
    if max_tokens is not None:
        given["max_tokens"] = max_tokens
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    return SamplingParams(stop=tuple(stop), stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=logprobs,
                          **given)


def _choices(prompts: Sequence[str | tuple[int, ...]], n: int, params: SamplingParams, tier: Tier, http_id: str,
             *, max_tokens_set: bool, stream: bool) -> list[Choice]:
    """One admission input per prompt and choice; a response that is not streamed asks for its
    whole output at the end (stream_interval 0: the workers send chunks of many tokens), a
    streamed one gets the gateway's --stream-interval."""
    if len(prompts) * n > MAX_CHOICES:
        raise HttpError.invalid("n", f"{len(prompts)} prompts times n={n} exceeds {MAX_CHOICES} choices")
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            index = p * n + j
            ps = params
            if params.seed is not None and j and isinstance(params.seed, int):
                ps = params.replace(seed=(params.seed + j) % (MAX_SEED + 1))
            inp = GenerateInput(prompt=prompt, params=ps, tier=tier, request_id=f"{http_id}-{index}",
                                stream_text=True, stream_interval=None if stream else 0)
            out.append(Choice(index, p, inp, max_tokens_set))
    return out


# ---------------------------------------------------------------- responses

def usage_info(choices: Sequence[Choice], usages: dict[int, Usage]) -> UsageInfo:
    """Usage of a whole HTTP request: each prompt's tokens counted once, every choice's output."""
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    completion = 0
    for c in choices:
        u = usages.get(c.index)
        if u is None:
            continue
        prompt[c.prompt_index] = u.prompt_tokens
        cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), u.cached_tokens)
        completion += u.completion_tokens
    p = sum(prompt.values())
    return UsageInfo(prompt_tokens=p, completion_tokens=completion, total_tokens=p + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))


def token_text(tokenizer: Tokenizer, token_id: int, prev: int | None = None) -> str:
    """The text `token_id` adds after token `prev` (the one before it; None: none). Decoded
    with that one token of context, so a word-initial token keeps its leading space."""
    if prev is None:
        return tokenizer.decode([token_id], skip_special_tokens=False)
    head = tokenizer.decode([prev], skip_special_tokens=False)
    both = tokenizer.decode([prev, token_id], skip_special_tokens=False)
    return both[len(head):] if both.startswith(head) else tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Tokenizer, lps: Sequence[TokenLogprob], prev: int | None,
                        offset: int = 0) -> CompletionLogprobs:
    """OpenAI's completions logprobs; `prev` is the token before the first (the prompt's last,
    or the last one already sent), `offset` the text offset of the first token."""
    out = CompletionLogprobs()
    for lp in lps:
        text = token_text(tokenizer, lp.token_id, prev)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({token_text(tokenizer, t, prev): p for t, p in lp.top} if lp.top else None)
        out.text_offset.append(offset)
        offset += len(text)
        prev = lp.token_id
    return out


def chat_logprobs(tokenizer: Tokenizer, lps: Sequence[TokenLogprob], prev: int | None) -> ChatLogprobs:
    """OpenAI's chat logprobs (`prev` as for completion_logprobs)."""
    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = token_text(tokenizer, token_id, prev)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    content = []
    for lp in lps:
        head = entry(lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=[entry(t, p) for t, p in lp.top]))
        prev = lp.token_id
    return ChatLogprobs(content=content)

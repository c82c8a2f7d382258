"""Engine calls the workers need beyond `engine.Engine`'s public methods, in one place.

Every function here runs on the engine thread. They wrap the engine instead of changing it:
request-id checks before `reserve`, the full prompt checks `add_request` does, replacing the
sampling params of a reserved request at `activate` (Reserve only carries max_tokens), and
resuming a request whose trailing tokens are earlier output (`num_output_tokens`).
"""
from __future__ import annotations

import logging

from engine.engine import Engine, StepOutput
from engine.sampler import TokenLogprobs
from engine.sequence import Sequence
from tandem.types import SamplingParams, Tier

logger = logging.getLogger(__name__)


class DuplicateRequestError(Exception):
    """The request id is already queued, running, reserved or held in this worker."""


def has_work(engine: Engine) -> bool:
    """True while some request is waiting, running or swapped out, or a step's outputs are not
    yet returned (reserved requests do not count)."""
    return engine.has_unfinished()


def knows(engine: Engine, request_id: str) -> bool:
    """True when `request_id` is queued, running, reserved or prefilled-and-held here."""
    return engine.scheduler.get(request_id) is not None or request_id in engine.scheduler.held


def check_prompt(engine: Engine, token_ids: list[int], params: SamplingParams, num_output_tokens: int = 0) -> SamplingParams:
    """The checks `Engine.add_request` applies, for paths that bypass it (reserve).

    Returns the validated params; ValueError naming the field otherwise.
    """
    params = params.validate(engine.model_config.vocab_size)
    vocab = engine.model_config.vocab_size
    if not token_ids:
        raise ValueError("token_ids: the prompt must not be empty")
    if any(not 0 <= t < vocab for t in token_ids):
        raise ValueError(f"token_ids: token ids must be integers in [0, {vocab})")
    if len(token_ids) >= engine.max_model_len:
        raise ValueError(f"token_ids: {len(token_ids)} tokens leave no room in the model's context of {engine.max_model_len}")
    if not 0 <= num_output_tokens < len(token_ids):
        raise ValueError(f"num_output_tokens: must be in [0, {len(token_ids)}), got {num_output_tokens}")
    total = -(-min(len(token_ids) + params.max_tokens, engine.max_model_len) // engine.config.block_size)
    if total > engine.num_total_blocks:
        raise ValueError(f"max_tokens: prompt plus max_tokens needs {total} KV blocks, the cache has {engine.num_total_blocks}")
    return params


def add_request(
    engine: Engine,
    token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    tier: Tier,
    prefill_only: bool = False,
    num_output_tokens: int = 0,
) -> Sequence:
    """`Engine.add_request`, plus: the last `num_output_tokens` ids are earlier output of this
    request (a resume after a fault), so they count toward max_tokens, min_tokens, the
    penalties and the seeded sampler's position, exactly as if generation had gone on."""
    if knows(engine, request_id):
        raise DuplicateRequestError(f"request_id: {request_id!r} is already in this worker")
    check_prompt(engine, token_ids, params, num_output_tokens)
    seq = engine.add_request(list(token_ids), params, request_id, tier, prefill_only)
    if num_output_tokens:
        # Nothing was scheduled yet (same thread), so re-splitting prompt and output is safe.
        _split_output(seq, token_ids, num_output_tokens)
    return seq


def reserve(
    engine: Engine, request_id: str, token_ids: list[int], params: SamplingParams, tier: Tier, num_output_tokens: int = 0
) -> tuple[int, list[int]] | None:
    """`Engine.reserve` with the prompt checks (ValueError) and a duplicate-id check."""
    if knows(engine, request_id):
        raise DuplicateRequestError(f"request_id: {request_id!r} is already in this worker")
    params = check_prompt(engine, token_ids, params, num_output_tokens)
    return engine.reserve(request_id, list(token_ids), params, tier)


def is_reserved(engine: Engine, request_id: str) -> bool:
    seq = engine.scheduler.held.get(request_id)
    return seq is not None and not seq.prefill_only


def activate(
    engine: Engine,
    request_id: str,
    first_token: int,
    logprob: TokenLogprobs | None,
    params: SamplingParams,
    num_output_tokens: int = 0,
) -> StepOutput:
    """`Engine.activate` with the Decode call's sampling params (Reserve only knew max_tokens).

    Raises LookupError when `request_id` holds no reservation, ValueError for bad params.
    """
    seq = engine.scheduler.held.get(request_id)
    if seq is None or seq.prefill_only:
        raise LookupError(f"request_id: {request_id!r} holds no reservation here")
    vocab = engine.model_config.vocab_size
    params = params.validate(vocab)
    if not 0 <= first_token < vocab:
        raise ValueError(f"first_token_id: must be in [0, {vocab}), got {first_token}")
    num_kv_tokens = seq.num_prompt_tokens
    seq.params = params
    if params.stop:
        from tandem.detokenize import IncrementalDetokenizer, StopMatcher

        seq.detok = (
            IncrementalDetokenizer(engine.tokenizer, seq.prompt_token_ids, params.skip_special_tokens),
            StopMatcher(params.stop),
        )
    else:
        seq.detok = None
    if num_output_tokens:
        _split_output(seq, list(seq.prompt_token_ids), num_output_tokens)
    out = engine.activate(request_id, first_token, logprob)
    # activate() counts the prompt as computed; after a resume split, the KV of the earlier
    # output tokens is in the cache too.
    if not out.finished:
        seq.num_computed_tokens = num_kv_tokens
    return out


def queued_prefill_tokens(engine: Engine) -> int:
    """Prompt tokens admitted but not yet computed (waiting, swapped and mid-prefill requests)."""
    s = engine.scheduler
    total = sum(seq.num_tokens - seq.num_computed_tokens for seq in s.waiting)
    total += sum(seq.num_tokens - seq.num_computed_tokens for seq in s.swapped)
    total += sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in s.running)
    return total


def _split_output(seq: Sequence, token_ids: list[int], n: int) -> None:
    seq.prompt_token_ids = list(token_ids[:-n])
    seq.output_token_ids = list(token_ids[-n:])
    seq.output_logprobs = [None] * n

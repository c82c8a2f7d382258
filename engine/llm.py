"""Offline batch generation: `LLM(model_path).generate(prompts, params)` over the step-level Engine."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.engine import Engine, EngineConfig
from engine.sampler import TokenLogprobs
from tandem.types import SamplingParams, Tier

if TYPE_CHECKING:
    from parallel.comm import TPGroup


@dataclass
class CompletionOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprobs | None] | None = None
    stop_reason: str | int | None = None


class LLM:
    """Load a Hugging Face model directory once; generate for many prompts with continuous batching.

    `LLM(model_path, dtype=None, block_size=16, num_kv_blocks=None, max_running=256,
    load_format="auto"|"dummy", ...)`: keyword arguments are EngineConfig fields. With `tp`, this
    is tensor-parallel rank 0 (see Engine); call `close()` to release the other ranks.
    """

    def __init__(self, model_path: str, *, tp: TPGroup | None = None, **kwargs) -> None:
        self.engine = Engine(EngineConfig(model_path=str(model_path), **kwargs), tp)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Release tensor-parallel followers (see Engine.close); a no-op without tp."""
        self.engine.close()

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        tier: Tier | Seq[Tier] = Tier.STANDARD,
    ) -> list[CompletionOutput]:
        """Outputs in prompt order. A single prompt (a string or one list of ids) is a batch of one."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"params: {len(params)} sampling params for {len(prompts)} prompts")
            plist = list(params)
        else:
            plist = [params or SamplingParams()] * len(prompts)
        tiers = list(tier) if isinstance(tier, (list, tuple)) else [tier] * len(prompts)
        engine = self.engine
        seqs = []
        try:
            for p, sp, t in zip(prompts, plist, tiers):
                seqs.append(engine.add_request(p, sp, tier=t))
            while engine.has_unfinished():
                engine.step()
        except BaseException:
            for s in seqs:
                engine.abort(s.request_id)
            raise
        return [
            CompletionOutput(
                request_id=s.request_id,
                text=engine.output_text(s),
                token_ids=list(s.output_token_ids),
                finish_reason=s.finish_reason.value,
                prompt_tokens=s.num_prompt_tokens,
                cached_tokens=s.num_cached_tokens,
                logprobs=list(s.output_logprobs) if s.params.logprobs is not None else None,
                stop_reason=s.stop_reason,
            )
            for s in seqs
        ]

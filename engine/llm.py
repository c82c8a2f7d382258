"""Offline batch generation: `LLM(model_path).generate(prompts, params)` over the step-level Engine."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampler import TokenLogprobs
from engine.shard import ModelShard
from tandem.heap import freeze_startup_heap
from tandem.types import SamplingParams, Tier


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

    `LLM(model_path, dtype=None, block_size=16, num_kv_blocks=None, max_running=None,
    load_format="auto"|"dummy", ...)`: keyword arguments are EngineConfig fields. `shard`: this
    process's part of the model (see Engine; e.g. tensor-parallel rank 0's
    `parallel.runner.TensorParallelShard`); call `close()` to release the other ranks.

    On a GPU the process's heap as it stands once the engine is built and warm is frozen out of
    the garbage collector's scans (tandem.heap, as a worker does and vLLM's does after warm-up):
    a full collection of that heap stops the host for ~150 ms, long enough to starve the
    device of steps (an offline run of 1,000 requests made 14 of them). The collector's youngest
    threshold is raised too, so that what the run keeps (the prefix cache's nodes, the requests)
    seldom brings on a full pass (none in that run since). `TANDEM_GC_FREEZE=0` leaves both as
    they are.

    The prefix cache's KV events (what a worker publishes to the global index) are not
    recorded: nothing here drains them.
    """

    def __init__(self, model_path: str, *, shard: ModelShard | None = None, **kwargs) -> None:
        self.engine = Engine(EngineConfig(model_path=str(model_path), **kwargs), shard)
        self.engine.cache.record_events = False
        self.tokenizer = self.engine.tokenizer
        if self.engine.device.type == "cuda":
            freeze_startup_heap()

    def close(self) -> None:
        """Release tensor-parallel followers (see Engine.close); a no-op for a whole model."""
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
        requests = []
        texts: dict[str, str] = {}
        try:
            for p, sp, t in zip(prompts, plist, tiers):
                requests.append(engine.admit(p, sp, tier=t))
            by_id = {r.request_id: r for r in requests}
            while engine.has_unfinished():
                # The requests hold what the outputs below need; a request's text is decoded
                # when it ends, while the device runs the step queued after it.
                for out in engine.step(outputs=False):
                    texts[out.request_id] = engine.output_text(by_id[out.request_id])
        except BaseException:
            for r in requests:
                engine.abort(r.request_id)
            raise
        return [
            CompletionOutput(
                request_id=r.request_id,
                text=texts[r.request_id] if r.request_id in texts else engine.output_text(r),
                token_ids=r.output_token_ids,
                finish_reason=r.finish_reason.value,
                prompt_tokens=r.num_prompt_tokens,
                cached_tokens=r.num_cached_tokens,
                logprobs=r.output_logprobs if r.params.logprobs is not None else None,
                stop_reason=r.stop_reason,
            )
            for r in requests
        ]

"""The step-level engine: requests in, one scheduling step at a time, token outputs out.

Workers (prefill, decode, both) drive `step()` from their own loops; `LLM` (engine/llm.py) is
the offline loop over the same calls. One Engine owns one model replica and its KV cache.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.block_allocator import BlockAllocator
from engine.config import ModelConfig, parse_dtype
from engine.kv_cache import KVCache
from engine.model_runner import ModelRunner
from engine.radix_cache import RadixCache
from engine.sampler import PendingSamples, Sampler, TokenLogprobs
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import FinishReason, Sequence, SeqStatus
from engine.weights import load_model
from tandem.hashing import model_identity, seed_hash
from tandem.tokenizer import Tokenizer
from tandem.types import SamplingParams, Tier

if TYPE_CHECKING:
    from parallel.comm import TPGroup

logger = logging.getLogger(__name__)

OVERLAP_ENV = "TANDEM_OVERLAP_SCHEDULE"


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str | torch.dtype | None = None  # None: the checkpoint's dtype (float32 on CPU)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from memory
    max_running: int = 256
    max_batched_tokens: int = 4096
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    load_format: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    enable_prefix_cache: bool = True
    swap_space_gb: float = 1.0  # host memory for preempted requests' KV
    kv_cache_dtype: str = "auto"  # "auto" (model dtype) or "fp8" (e4m3)
    gpu_memory_fraction: float = 0.90
    cpu_kv_cache_gb: float = 1.0
    seed: int | None = None
    cuda_graphs: bool = True  # capture decode graphs on CUDA devices
    # Decode steps of at most kernels.ops.GEMV_MAX_ROWS tokens as fused GEMVs (DecoderLayer.
    # enable_fused_decode). Off by default until measured against cuBLAS on the device.
    fused_decode_gemv: bool = False
    # Overlap the host's scheduling of step n+1 with the device's step n (see Engine.step).
    # None: $TANDEM_OVERLAP_SCHEDULE ("1" or "0") if set, else on for CUDA devices. Never with
    # tensor parallelism.
    overlap_schedule: bool | None = None
    # Run a few synthetic steps at start-up on CUDA devices (`Engine.warm_up`), so that Triton's
    # compiles land before the first request rather than in its latency.
    warm_up: bool = True


@dataclass
class StepOutput:
    """What one request gained in one step; `finished` on the last one."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs | None]
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    seq: Sequence | None = field(default=None, repr=False)


class Engine:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None) -> None:
        """Load the model and allocate the KV cache.

        tp: this process's rank of a tensor-parallel group (parallel.comm.TPGroup); every rank
          builds an Engine from the same config. The rank loads only its shard of the model, its
          KV cache holds only its KV heads, and the block counts are the minimum over the ranks.
          Rank 0 schedules and samples as usual (and calls `close()` when done); the other ranks
          call `follow()`. A group of one is the same as None.
        """
        self.config = config
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        path = Path(config.model_path)
        self.model_config = ModelConfig.from_dir(path)
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = parse_dtype(config.dtype) or (self.model_config.torch_dtype if device.type == "cuda" else torch.float32)
        self.device, self.dtype = device, dtype
        self.tokenizer = Tokenizer.from_dir(path)
        self.identity = model_identity(path, config.load_format)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        if self.tp is None:
            kv_config = self.model_config
            self.model = load_model(path, self.model_config, dtype, device, config.load_format)
        else:
            from parallel.tensor_parallel import load_tensor_parallel_model, shard_config

            kv_config = shard_config(self.model_config, self.tp.world_size)  # ValueError before any loading
            self.model = load_tensor_parallel_model(path, self.model_config, dtype, device, self.tp, config.load_format)

        if config.fused_decode_gemv:
            enabled = [layer.enable_fused_decode() for layer in self.model.layers]
            if not all(enabled):
                logger.info("fused decode GEMVs: %d of %d layers (the others keep the unfused path)",
                            sum(enabled), len(enabled))
        kv_dtype = {"auto": dtype, "fp8": torch.float8_e4m3fn}.get(config.kv_cache_dtype)
        if kv_dtype is None:
            raise ValueError(f"kv_cache_dtype: must be 'auto' or 'fp8', got {config.kv_cache_dtype!r}")
        block_bytes = KVCache.bytes_per_block(kv_config, config.block_size, kv_dtype)
        num_blocks = config.num_kv_blocks or self._derive_num_blocks(block_bytes)
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks: must be >= 1, got {num_blocks}")
        num_host = int(config.swap_space_gb * 2**30 // block_bytes)
        if self.tp is not None:  # block ids are rank 0's, so every rank needs as many blocks
            num_blocks, num_host = self.tp.min_ints([num_blocks, num_host], device)
        self.sched_config = SchedulerConfig(
            block_size=config.block_size,
            max_running=config.max_running,
            max_batched_tokens=config.max_batched_tokens,
            num_host_blocks=num_host,
            max_model_len=self.max_model_len,
        )
        self.kv_cache = KVCache(kv_config, num_blocks, config.block_size, kv_dtype, device, num_host)
        self.allocator = BlockAllocator(num_blocks)
        self.hash_seed = seed_hash(self.identity)
        self.cache = RadixCache(self.allocator, config.block_size, self.hash_seed, config.enable_prefix_cache)
        self.scheduler = Scheduler(self.sched_config, self.allocator, self.cache)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self.runner: ModelRunner | None = None  # None on tensor-parallel followers: they run rank 0's steps
        sampler = Sampler(self.model_config.vocab_size, seed=config.seed)
        if self.tp is None:
            self.runner = ModelRunner(self.model, self.kv_cache, sampler, self.eos_token_ids, device)
            if config.cuda_graphs and device.type == "cuda":
                self.runner.capture_decode_graphs(config.max_running, self.max_model_len)
        elif self.tp.rank == 0:
            from parallel.runner import TPModelRunner

            self.runner = TPModelRunner(self.model, self.kv_cache, sampler, self.eos_token_ids, device, self.tp)
        overlap = config.overlap_schedule
        if overlap is None:
            overlap = {"1": True, "0": False}.get(os.environ.get(OVERLAP_ENV, ""), device.type == "cuda")
        self.overlap = self.tp is None and bool(overlap)
        self._inflight: _InFlight | None = None  # a launched step whose samples are not yet processed
        self._ready: list[StepOutput] = []  # outputs of a step resolved outside step(), returned by the next
        if config.warm_up and device.type == "cuda" and self.tp is None:
            self.warm_up()
        rank = "" if self.tp is None else f" (tensor parallel rank {self.tp.rank} of {self.tp.world_size})"
        logger.info("engine ready%s: %s on %s (%s), %d KV blocks of %d%s", rank, self.identity, device, dtype, num_blocks,
                    config.block_size, ", overlapped steps" if self.overlap else "")

    def warm_up(self) -> float:
        """Run the kinds of step a server meets (one prefill, a prefill of several sequences next
        to running decodes, a prefill behind a cached prefix, plain decodes) on synthetic
        prompts, so their kernels are compiled before the first request. Leaves no request
        behind. Returns the seconds it took."""
        t0 = time.perf_counter()
        vocab = self.model_config.vocab_size
        # Prompts fit the context and, all four at once, a quarter of the cache.
        room = max(4, min(self.max_model_len - 8, 320, self.allocator.num_total * self.config.block_size // 4 - 16))
        long = room - room // 8

        def prompt(n: int, salt: int) -> list[int]:
            return [(salt + i * 7919) % (vocab - 1) + 1 for i in range(max(1, n))]

        params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
        ids = [f"warm-up-{uuid.uuid4().hex[:8]}-{i}" for i in range(4)]
        self.add_request(prompt(min(37, long), 1), params, ids[0])
        self.step()  # one sequence's prefill; its decodes follow
        self.add_request(prompt(long, 2), params, ids[1])
        self.add_request(prompt(min(17, long), 3), params, ids[2])
        while self.has_unfinished():  # several prefills beside a decode, then decodes
            self.step()
        self.add_request(prompt(long, 2) + prompt(room // 8, 4), params, ids[3])  # behind a cached prefix
        while self.has_unfinished():
            self.step()
        seconds = time.perf_counter() - t0
        logger.info("warm-up steps ran in %.1f s", seconds)
        return seconds

    def _derive_num_blocks(self, block_bytes: int) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            activation_reserve = 4 * 2**30
            budget = free * self.config.gpu_memory_fraction - activation_reserve
        else:
            budget = self.config.cpu_kv_cache_gb * 2**30
        want = self.config.max_running * -(-self.max_model_len // self.config.block_size)
        return max(1, min(int(budget // block_bytes), want))

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        tier: Tier | int | str = Tier.STANDARD,
        prefill_only: bool = False,
    ) -> Sequence:
        """Validate and queue one request; ValueError naming the field on bad input."""
        params = (params or SamplingParams()).validate(self.model_config.vocab_size)
        tier = Tier.parse(tier)
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
                raise ValueError(f"prompt: token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(token_ids)} tokens leave no room in the model's context of {self.max_model_len}")
        total_blocks = -(-min(len(token_ids) + params.max_tokens, self.max_model_len) // self.config.block_size)
        if total_blocks > self.allocator.num_total:
            raise ValueError(
                f"max_tokens: prompt plus max_tokens needs {total_blocks} KV blocks, the cache has {self.allocator.num_total}"
            )
        seq = Sequence(request_id or uuid.uuid4().hex, token_ids, params, tier, prefill_only)
        if params.stop:
            from tandem.detokenize import IncrementalDetokenizer, StopMatcher

            seq.detok = (IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens), StopMatcher(params.stop))
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a queued, running, reserved or prefilled request and free its blocks."""
        self.settle()
        return self.scheduler.abort(request_id) is not None or self.scheduler.release(request_id)

    # ---- disaggregation hooks (prefill side: add_request(prefill_only=True) then release) ----
    def release(self, request_id: str) -> bool:
        """Free the blocks of a prefilled (or reserved, never activated) request."""
        self.settle()
        return self.scheduler.release(request_id)

    def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, tier: Tier | int | str = Tier.STANDARD
    ) -> tuple[int, list[int]] | None:
        """Decode side: hold KV blocks for a prompt whose KV a prefill worker will push.

        Returns (leading prompt blocks already cached here, destination block ids for the rest)
        or None when the cache is too full right now.
        """
        params = params.validate(self.model_config.vocab_size)
        self.settle()
        seq = Sequence(request_id, list(prompt_token_ids), params, Tier.parse(tier))
        if params.stop:
            from tandem.detokenize import IncrementalDetokenizer, StopMatcher

            seq.detok = (IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.skip_special_tokens), StopMatcher(params.stop))
        return self.scheduler.reserve(seq)

    def activate(self, request_id: str, first_token: int, logprob: TokenLogprobs | None = None) -> StepOutput:
        """Decode side: the pushed KV is in place; join the running batch after `first_token`.

        Returns the first token's StepOutput (finished already if it was a stop token).
        """
        self.settle()
        seq = self.scheduler.activate(request_id, first_token, logprob)
        reason, stop_reason = self._check_stop(seq, first_token)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            seq.stop_reason = stop_reason
        return StepOutput(request_id, [first_token], [logprob], reason is not None, reason, stop_reason, seq)

    def has_unfinished(self) -> bool:
        """Whether `step()` has work: queued or running requests, or outputs not yet returned."""
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._ready)

    def settle(self) -> None:
        """Process the samples of a step still in flight (their outputs come with the next
        `step()`), so that the caller may change requests and free blocks. Every method that
        does so calls it; it waits for the device."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._ready += self._resolve(inflight)

    # ---- one step ----------------------------------------------------------------------------
    def step(self, on_layer: Callable[[int, SchedulerOutput], None] | None = None) -> list[StepOutput]:
        """Schedule, run and postprocess one batch.

        `on_layer(layer, scheduler_output)` runs after each layer's K/V are in the cache (the
        prefill worker pushes them to the decode worker from there, overlapping the next layer).
        """
        if self.runner is None:
            raise RuntimeError(f"step: tensor-parallel rank {self.tp.rank} runs rank 0's steps through follow()")
        if not self.overlap or on_layer is not None:
            self.settle()
            results, self._ready = self._ready, []
            out = self.scheduler.schedule()
            if out.is_empty:
                return results
            hook = (lambda layer: on_layer(layer, out)) if on_layer is not None else None
            sampled_idx, samples = self.runner.execute(out, hook)
            self.scheduler.postprocess(out)
            return results + self._process_samples(out, sampled_idx, samples)
        return self._overlapped_step()

    def _overlapped_step(self) -> list[StepOutput]:
        """Schedule and launch step n+1 while step n may still run on the device, then process
        step n's samples. Sequences sampled in step n carry a pending token (counted by the
        scheduler, read by step n+1 from the device); one that step n ends was scheduled in n+1
        anyway, and its n+1 sample is dropped. Step n+1 stays in flight unless some sequence in
        it needs its own tokens on the host to sample the next (penalties, seeds, min_tokens)."""
        results, self._ready = self._ready, []
        prev, self._inflight = self._inflight, None
        out = self.scheduler.schedule()
        launched = None
        if not out.is_empty:
            prev_tokens = prev.samples.tokens if prev is not None and prev.samples is not None else None
            idx, samples = self.runner.launch(out, None, prev_tokens)
            launched = _InFlight(out, idx, samples)
            for j, i in enumerate(idx):
                seq = out.scheduled[i].seq
                seq.num_pending += 1
                seq.pending_row = j
        if prev is not None:
            results += self._resolve(prev)
        if launched is not None:
            self.scheduler.postprocess(out)
            if all(_overlap_safe(out.scheduled[i].seq) for i in launched.sample_index):
                self._inflight = launched
            else:
                results += self._resolve(launched)
        return results

    def _resolve(self, step: _InFlight) -> list[StepOutput]:
        """Wait for a launched step's samples and process them."""
        samples = step.samples.result() if step.samples is not None else None
        for i in step.sample_index:
            step.out.scheduled[i].seq.num_pending -= 1
        return self._process_samples(step.out, step.sample_index, samples)

    def _process_samples(self, out: SchedulerOutput, idx: list[int], samples) -> list[StepOutput]:
        results = []
        for j, i in enumerate(idx):
            seq = out.scheduled[i].seq
            if seq.status is SeqStatus.FINISHED:
                continue  # ended by an earlier step's sample (or aborted) while this one ran
            token = samples.token_ids[j]
            lp = samples.logprobs[j]
            seq.output_token_ids.append(token)
            seq.output_logprobs.append(lp)
            reason, stop_reason = self._check_stop(seq, token)
            if reason is None and seq.prefill_only:
                reason = FinishReason.PREFILLED
            if reason is not None:
                if reason is FinishReason.PREFILLED:
                    self.scheduler.finish_prefill(seq)
                else:
                    self.scheduler.finish(seq, reason)
                seq.stop_reason = stop_reason
                seq.finish_reason = reason
            results.append(StepOutput(seq.request_id, [token], [lp], reason is not None, reason, stop_reason, seq))
        return results

    def _check_stop(self, seq: Sequence, token: int) -> tuple[FinishReason | None, str | int | None]:
        """Why `seq` ends after appending `token` (None if it goes on). Stops wait for min_tokens."""
        p = seq.params
        n = len(seq.output_token_ids)
        armed = n >= p.min_tokens
        if armed and token in p.stop_token_ids:
            return FinishReason.STOP, token
        if armed and not p.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP, None
        if seq.detok is not None:
            detok, matcher = seq.detok
            delta = detok.push([token])
            if armed:
                text, stopped = matcher.feed(delta)
                seq.text += text
                if stopped:
                    return FinishReason.STOP, matcher.stop_string
            else:
                seq.text += delta
        if n >= p.max_tokens or seq.num_known_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def output_text(self, seq: Sequence) -> str:
        """Final text of a finished sequence (cut before a stop string when one ended it)."""
        if seq.detok is not None:
            detok, matcher = seq.detok
            if matcher.stopped:
                return seq.text
            tail, _ = matcher.feed(detok.flush())
            return seq.text + tail + matcher.flush()
        # Decode in the prompt's context (as the gateway streams it): a SentencePiece output that
        # starts a new word keeps its leading space.
        from tandem.detokenize import IncrementalDetokenizer

        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens)
        return detok.finish(seq.output_token_ids)

    # ---- tensor parallelism ------------------------------------------------------------------
    def follow(self) -> int:
        """Tensor-parallel ranks 1..world-1: run each step rank 0's engine broadcasts, on this
        rank's shard and KV cache, until rank 0 calls `close()`. Returns the steps run."""
        if self.tp is None or self.tp.rank == 0:
            raise RuntimeError("follow: only tensor-parallel ranks other than 0 follow; this engine runs step()")
        from parallel.runner import follower_loop

        return follower_loop(self.model, self.kv_cache, self.tp, self.device)

    def close(self) -> None:
        """Tensor-parallel rank 0: release the other ranks from `follow()` (idempotent; otherwise a no-op)."""
        if self.tp is not None and self.runner is not None:
            self.runner.stop()

    # ---- introspection --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total

    def num_free_blocks_after_reset(self) -> int:
        """Free blocks once the prefix cache drops its unlocked entries (for leak checks)."""
        self.cache.reset()
        return self.allocator.num_free


@dataclass
class _InFlight:
    """A launched step: its schedule, the scheduled indices that sample, and their samples."""

    out: SchedulerOutput
    sample_index: list[int]
    samples: PendingSamples | None


def _overlap_safe(seq: Sequence) -> bool:
    """Whether `seq`'s next sample may be drawn before its last token reaches the host: true
    unless its sampling reads its own output tokens (penalties, min_tokens masking, the
    per-position seed)."""
    p = seq.params
    return (p.seed is None and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0 and len(seq.output_token_ids) + seq.num_pending > p.min_tokens)


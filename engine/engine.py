"""The step-level engine: requests in, one scheduling step at a time, token outputs out.

Workers (prefill, decode, both) drive `step()` from their own loops; `LLM` (engine/llm.py) is
the offline loop over the same calls. One Engine owns one model replica (or this process's part
of one, see engine/shard.py) and its KV cache. It is the one door to its scheduler and its
requests: callers admit, reserve, activate, abort and release requests through it and read
`Request` views, `StepOutput`s and `EngineStats` (engine/outputs.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.block_allocator import BlockAllocator
from engine.config import EngineConfig, ModelConfig, parse_dtype
from engine.cublas import default_no_workspace
from engine.cuda_graphs import MAX_GRAPH_BATCH
from engine.device_idle import DeviceIdleClock
from engine.jit_watch import LateCompileWatch
from engine.kv_cache import KVCache
from engine.memory import check_weights_fit, default_max_running, derive_num_blocks
from engine.model import fused_decode_projections, fused_gemv_rows
from engine.model_runner import ModelRunner
from engine.outputs import DuplicateRequestError, EngineStats, Request, StepObserver, StepOutput, StepPlan
from engine.prefill_graphs import MAX_SEQS as PREFILL_GRAPH_MAX_SEQS, graph_token_limit
from engine.quant import Fp8Linear, apply_quantization
from engine.radix_cache import RadixCache
from engine.sampler import PendingSamples, Sampler, TokenLogprobs
from engine.scheduler import PrefillAlone, Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import FinishReason, Sequence, SeqStatus
from engine.shard import ModelShard, WholeModel
from engine.shared_weights import SharedWeights, load_shared
from engine.warm_up import warm_up
from engine.weights import model_without_weights
from tandem.detokenize import IncrementalDetokenizer
from tandem.hashing import model_identity, seed_hash
from tandem.rules import STOP_STRING, STOP_TOKEN, Stop, StopChecker, StopText, blocks_needed, check_prompt_ids
from tandem.tokenizer import Tokenizer
from tandem.types import SamplingParams, Tier
from tandem_kernels.gemv_tilings import default_fused_rows
from tandem_kernels.ops import require_fp8_device

logger = logging.getLogger(__name__)

# Re-exported: callers import these from here (or from engine.outputs / engine.config).
__all__ = ["DuplicateRequestError", "Engine", "EngineConfig", "EngineStats", "FinishReason", "Request",
           "StepObserver", "StepOutput", "StepPlan"]

OVERLAP_ENV = "TANDEM_OVERLAP_SCHEDULE"


class Engine:
    """One model replica's scheduler, KV cache and runner, driven one step at a time.

    Threads: an Engine is not thread-safe. Every method runs on the one thread that owns it
    (a worker's engine thread, or the offline caller's); only `Request.num_cached_tokens` may
    be read elsewhere. Request lifecycle, each call validated once, here:

    - local: `admit` -> `step()` until its StepOutput is `finished` (or `abort`);
    - prefill side of a disaggregated request: `admit(prefill_only=True)` -> `step()` until it
      finishes PREFILLED (its first token sampled; STOP or LENGTH when that token ends it; its
      blocks stay held either way so its KV can be pushed from `Request.block_table`) ->
      `release` (or `abort`);
    - decode side: `reserve` (blocks held for KV another engine pushes) -> `activate` with the
      first token -> `step()` as a local request; or `release` / `abort` instead of activating.

    A request id is known (`knows`) from admission or reservation until it finishes (held ones:
    until released); admitting or reserving a known id raises DuplicateRequestError.
    """

    def __init__(self, config: EngineConfig, shard: ModelShard | None = None) -> None:
        """Load the model and allocate the KV cache.

        shard: this process's part of the model replica (engine/shard.py); None: the whole model
          here. A tensor-parallel rank passes `parallel.runner.TensorParallelShard`: every rank
          builds an Engine from the same config, the rank that gets a runner schedules and
          samples (and calls `close()` when done), the others call `follow()`.
        """
        self.config = config
        self.shard = shard if shard is not None else WholeModel()
        self.observer: StepObserver | None = None  # see StepObserver; benchmarks set it
        path = Path(config.model_path)
        self.model_config = ModelConfig.from_dir(path)
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = parse_dtype(config.dtype) or (self.model_config.torch_dtype if device.type == "cuda" else torch.float32)
        self.device, self.dtype = device, dtype
        if device.type == "cuda":
            default_no_workspace()  # before this process's first GEMM (engine/cublas.py)
        self.tokenizer = Tokenizer.from_dir(path)
        self.identity = model_identity(path, config.load_format)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        self.prefill_graph_tokens = graph_token_limit(config.prefill_graph_tokens, config.max_batched_tokens)
        if config.kv_cache_dtype == "fp8":
            require_fp8_device(device, "kv_cache_dtype 'fp8' (--kv-cache-dtype fp8)")
        if config.quantization == "fp8":
            require_fp8_device(device, "quantization 'fp8' (--quantization fp8)")
        if config.shared_weights_dir is None or config.shared_weights_charged:
            check_weights_fit(self.model_config, dtype, device, config.gpu_memory_fraction,
                              1 if self.shard.runs_alone else _world_size(self.shard))
        self.shared_weights: SharedWeights | None = None
        if config.shared_weights_dir is not None:
            self.model, kv_config = self._load_shared(path, dtype, device), self.model_config
        else:
            self.model, kv_config = self.shard.load(path, self.model_config, dtype, device, config.load_format)
            apply_quantization(self.model, config.quantization)
        fp8_weights = any(isinstance(m, Fp8Linear) for m in self.model.modules())
        if fp8_weights:
            require_fp8_device(device, "weights: this checkpoint is FP8 (config.json quantization_config)")

        fused = fused_decode_projections(config.fused_decode_gemv, device, fp8_weights)
        if fused:
            rows = fused_gemv_rows(default_fused_rows(device, fp8_weights))
            enabled = [layer.enable_fused_decode(fused, rows) for layer in self.model.layers]
            if not all(enabled):
                logger.info("fused decode GEMVs: %d of %d layers (the others keep the unfused path)",
                            sum(enabled), len(enabled))
        kv_dtype = KVCache.storage_dtype(config.kv_cache_dtype, dtype)
        block_bytes = KVCache.bytes_per_block(kv_config, config.block_size, kv_dtype)
        charged = self.shared_weights.manifest.nbytes if self.shared_weights and config.shared_weights_charged else 0
        num_blocks = config.num_kv_blocks or derive_num_blocks(
            config, self.model, self.model_config, kv_config, kv_dtype, dtype, device, self.shard.runs_alone,
            _world_size(self.shard), self.max_model_len, block_bytes, shared_weight_bytes=charged)
        num_host = int(config.swap_space_gb * 2**30 // block_bytes)
        # Block ids are the scheduling process's, so every process of the replica needs as many.
        num_blocks, num_host = self.shard.agree_block_counts(num_blocks, num_host, device)
        self.max_running = default_max_running(config.max_running, config.num_kv_blocks, num_blocks,
                                               config.block_size, self.max_model_len, device.type)
        self.sched_config = SchedulerConfig(
            block_size=config.block_size,
            max_running=self.max_running,
            max_batched_tokens=config.max_batched_tokens,
            num_host_blocks=num_host,
            max_model_len=self.max_model_len,
        )
        try:
            self.kv_cache = KVCache(kv_config, num_blocks, config.block_size, kv_dtype, device, num_host,
                                    layout=config.kv_cache_layout)
        except torch.cuda.OutOfMemoryError:
            raise ValueError(f"gpu_memory_fraction: {num_blocks} KV blocks do not fit next to what else uses "
                             f"{device} now; lower --gpu-memory-fraction (or --num-kv-blocks)") from None
        self.allocator = BlockAllocator(num_blocks)
        self.hash_seed = seed_hash(self.identity)
        self.cache = RadixCache(self.allocator, config.block_size, self.hash_seed, config.enable_prefix_cache)
        self._scheduler = Scheduler(self.sched_config, self.allocator, self.cache)
        self.eos_token_ids = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        sampler = Sampler(self.model_config.vocab_size, seed=config.seed)
        # None on a follower: it runs the scheduling process's steps (`follow`).
        self.runner: ModelRunner | None = self.shard.make_runner(self.model, self.kv_cache, sampler,
                                                                 self.eos_token_ids, device)
        alone = self.shard.runs_alone
        if self.runner is not None and device.type == "cuda":
            self.runner.bucket_logits(self.max_running)  # no sampled row count loads a kernel mid-step
        if alone and self.runner is not None and config.cuda_graphs and device.type == "cuda":
            # Bounded: larger decode batches than the largest graph run eagerly.
            self.runner.capture_decode_graphs(min(self.max_running, MAX_GRAPH_BATCH), self.max_model_len)
            if config.max_running is None:  # derived: lowered where a smaller batch decodes faster a token
                self.lower_max_running(self.runner.graphs.throughput_cap())
        if alone and self.runner is not None and config.prefill_graph_tokens and device.type == "cuda":
            self.runner.capture_prefill_graphs(self.prefill_graph_tokens, self.max_model_len)
            # Prompts that a graph holds get a step of their own beside running decodes.
            self.prefill_alone = PrefillAlone(self.prefill_graph_tokens, PREFILL_GRAPH_MAX_SEQS)
        overlap = config.overlap_schedule
        if overlap is None:
            overlap = {"1": True, "0": False}.get(os.environ.get(OVERLAP_ENV, ""), device.type == "cuda")
        self.overlap = alone and bool(overlap)
        self._inflight: _InFlight | None = None  # a launched step whose samples are not yet processed
        self._ready: list[StepOutput] = []  # outputs of a step resolved outside step(), returned by the next
        self.late_compiles: LateCompileWatch | None = None  # Triton compiles after warm-up (logged)
        if config.warm_up and device.type == "cuda" and alone:
            self.warm_up()
            watch = LateCompileWatch()
            if watch.install():
                self.late_compiles = watch
        logger.info("engine ready%s: %s on %s (%s), %d KV blocks of %d%s", self.shard.describe(), self.identity, device,
                    dtype, num_blocks, config.block_size, ", overlapped steps" if self.overlap else "")

    def lower_max_running(self, cap: int) -> None:
        """Run at most `cap` sequences at once from now on, where that is fewer than max_running
        (the decode graphs' `throughput_cap`: a derived max_running whose batch a smaller bucket
        decodes faster a token)."""
        if cap >= self.max_running:
            return
        logger.info("max_running %d -> %d: the decode graphs run %d rows faster a row than %d (ms a replay: %s)",
                    self.max_running, cap, cap, self.max_running,
                    {b: round(t, 3) for b, t in sorted(getattr(self.runner.graphs, "replay_ms", {}).items())})
        self.max_running = cap
        self.sched_config = dataclasses.replace(self.sched_config, max_running=cap)
        self._scheduler.config = self.sched_config

    def warm_up(self) -> float:
        """Compile the kernels of the steps a server meets before the first request
        (engine/warm_up.py); returns the seconds it took."""
        return warm_up(self)

    # ---- requests ----------------------------------------------------------------------------
    def admit(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        tier: Tier | int | str = Tier.STANDARD,
        *,
        prefill_only: bool = False,
        num_output_tokens: int = 0,
        field: str = "prompt",
    ) -> Request:
        """Validate and queue one request; `step()` then computes it.

        prompt: text (tokenized here) or token ids. num_output_tokens: the last n ids are
          earlier output of this request (a resume after a fault): they count toward
          max_tokens, min_tokens, the penalties and a seeded sampler's position, exactly as if
          generation had gone on. prefill_only: finish once the first token is sampled
          (PREFILLED, or STOP / LENGTH when that token ends it) and hold the blocks until
          `release` (the prefill side of disaggregation).
        field: how error messages name the prompt (a worker says "token_ids").
        Raises DuplicateRequestError (a ValueError) for a known request id, ValueError naming
        the field for bad params, prompt, num_output_tokens or a request the cache can never
        hold. Nothing is queued when it raises. request_id None: a fresh id.
        """
        if request_id is not None and self.knows(request_id):
            raise DuplicateRequestError(f"request_id: {request_id!r} is already in this engine")
        params = (params or SamplingParams()).validate(self.model_config.vocab_size)
        tier = Tier.parse(tier)
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_request(token_ids, params, num_output_tokens, field)
        seq = Sequence(request_id or uuid.uuid4().hex, token_ids, params, tier, prefill_only)
        # A resumed request's stop text follows all of its earlier tokens.
        seq.stop = self._stop_checker(token_ids, params)
        if num_output_tokens:
            _split_output(seq, num_output_tokens)
        self._scheduler.add(seq)
        return Request(seq)

    def _check_request(self, token_ids: list[int], params: SamplingParams, num_output_tokens: int, field: str) -> None:
        check_prompt_ids(token_ids, self.model_config.vocab_size, self.max_model_len, field)
        if isinstance(num_output_tokens, bool) or not isinstance(num_output_tokens, int) \
                or not 0 <= num_output_tokens < len(token_ids):
            raise ValueError(f"num_output_tokens: must be in [0, {len(token_ids)}), got {num_output_tokens}")
        total = blocks_needed(len(token_ids), params.max_tokens, self.max_model_len, self.config.block_size)
        if total > self.allocator.num_total:
            raise ValueError(
                f"max_tokens: prompt plus max_tokens needs {total} KV blocks, the cache has {self.allocator.num_total}"
            )

    def _stop_checker(self, prompt_token_ids: list[int], params: SamplingParams) -> StopChecker:
        # Only requests with stop strings detokenize while they run: it is off the hot path.
        text = StopText(self.tokenizer, prompt_token_ids, params) if params.stop else None
        return StopChecker(params, self.eos_token_ids, self.max_model_len, text)

    def abort(self, request_id: str) -> bool:
        """Stop a queued, running, reserved or prefilled request and free its blocks; its
        StepOutputs stop (the caller tells its listener). False when the id is not known."""
        self.settle()
        return self._scheduler.abort(request_id) is not None or self._scheduler.release(request_id)

    def release(self, request_id: str) -> bool:
        """Free the blocks of a prefilled (after its KV was pushed, or the push failed) or a
        reserved, never activated request. False when no such request is held."""
        self.settle()
        return self._scheduler.release(request_id)

    def reserve(
        self,
        request_id: str,
        token_ids: Seq[int],
        params: SamplingParams,
        tier: Tier | int | str = Tier.STANDARD,
        *,
        num_output_tokens: int = 0,
        field: str = "token_ids",
    ) -> tuple[int, list[int]] | None:
        """Decode side: hold KV blocks for a prompt whose KV a prefill engine will push.

        token_ids, num_output_tokens: as in `admit` (the KV pushed covers all of token_ids;
        `activate` splits off the earlier output). params: what is known before activation
        (a worker's Reserve knows only max_tokens; `activate` replaces them).
        Returns (leading prompt blocks already cached here, destination block ids for the rest,
        in order) or None when the cache is too full right now (nothing is held then). Raises
        as `admit` does. The request then counts in `stats().held` until `activate`,
        `release` or `abort`.
        """
        if self.knows(request_id):
            raise DuplicateRequestError(f"request_id: {request_id!r} is already in this engine")
        params = params.validate(self.model_config.vocab_size)
        token_ids = list(token_ids)
        self._check_request(token_ids, params, num_output_tokens, field)
        # No settle: a step in flight goes on. The blocks it writes are held by its sequences
        # (a finished one's until that step is done, Scheduler.finish), so none is handed out here.
        seq = Sequence(request_id, token_ids, params, Tier.parse(tier))
        seq.num_resumed_output = num_output_tokens
        return self._scheduler.reserve(seq)

    def activate(self, request_id: str, first_token: int, logprob: TokenLogprobs | None = None,
                 params: SamplingParams | None = None) -> StepOutput:
        """Decode side: the pushed KV is in the reserved blocks; join the running batch after
        `first_token` (sampled by the prefill engine).

        params: the request's sampling params, replacing the reservation's (None: keep them).
        Returns the first token's StepOutput (finished already if the first token ends the
        request; the blocks are freed then). Raises LookupError when `request_id` holds no
        reservation here (never reserved, released, aborted or activated), ValueError naming
        the field for bad params or first_token_id; the reservation stays as it was then.
        """
        seq = self._scheduler.held.get(request_id)
        if seq is None or seq.prefill_only:
            raise LookupError(f"request_id: {request_id!r} holds no reservation here")
        vocab = self.model_config.vocab_size
        params = params.validate(vocab) if params is not None else seq.params
        if isinstance(first_token, bool) or not isinstance(first_token, int) or not 0 <= first_token < vocab:
            raise ValueError(f"first_token_id: must be in [0, {vocab}), got {first_token}")
        self.settle()
        num_kv_tokens = seq.num_prompt_tokens  # the pushed KV covers every reserved token
        seq.params = params
        seq.stop = self._stop_checker(seq.prompt_token_ids, params)
        if seq.num_resumed_output:
            _split_output(seq, seq.num_resumed_output)
        seq = self._scheduler.activate(request_id, first_token, logprob)
        reason, stop_reason = self._check_stop(seq, first_token)
        if reason is not None:
            self._scheduler.finish(seq, reason)
            seq.stop_reason = stop_reason
        else:
            # activate() counts the prompt as computed; after a resume split the KV of the
            # earlier output tokens is in the cache too.
            seq.num_computed_tokens = num_kv_tokens
        return StepOutput(request_id, [first_token], [logprob], reason is not None, reason, stop_reason)

    def holds_any(self) -> bool:
        """Whether some request is reserved or prefilled-and-held: on the decode side, a prompt
        whose KV another engine is about to compute and push."""
        return bool(self._scheduler.held)

    def num_running(self) -> int:
        """Sequences in the running batch now (O(1))."""
        return len(self._scheduler.running)

    def knows(self, request_id: str) -> bool:
        """Whether `request_id` is queued, running, swapped, reserved or prefilled-and-held."""
        return self._scheduler.knows(request_id)

    def get(self, request_id: str) -> Request | None:
        """The queued, running or swapped request under `request_id` (None for unknown,
        finished, reserved or held ones). Compare it with a later `get` to tell whether the
        same request still runs (Request equality is per admission), e.g. in a deadline timer."""
        seq = self._scheduler.get(request_id)
        return Request(seq) if seq is not None else None

    def stats(self) -> EngineStats:
        """Queue lengths and scheduling counters now (O(requests): for per-step snapshots)."""
        s = self._scheduler
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped), held=len(s.held),
            queued_prefill_tokens=s.queued_prefill_tokens(), num_preemptions=s.stats.num_preemptions,
            num_swaps_out=s.stats.num_swaps_out, num_recomputes=s.stats.num_recomputes,
            num_scheduled_tokens=s.stats.num_scheduled_tokens,
        )

    def request_ids(self) -> list[str]:
        """Ids of the queued, running and swapped requests (not reserved or held ones)."""
        s = self._scheduler
        return [seq.request_id for queue in (s.waiting, s.running, s.swapped) for seq in queue]

    def has_unfinished(self) -> bool:
        """Whether `step()` has work: queued or running requests, or outputs not yet returned
        (reserved and held requests do not count)."""
        return self._scheduler.has_unfinished() or self._inflight is not None or bool(self._ready)

    def settle(self) -> None:
        """Process the samples of a step still in flight (their outputs come with the next
        `step()`), so that the caller may change requests and free blocks. Every method that
        does so calls it (not `reserve`, which only takes free blocks); it waits for the device."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            self._ready += self._resolve(inflight)

    # ---- one step ----------------------------------------------------------------------------
    def step(self, on_layer: Callable[[int, StepPlan], None] | None = None,
             hold: Callable[[], None] | None = None,
             while_running: Callable[[StepPlan, Callable[[], bool]], None] | None = None,
             outputs: bool = True) -> list[StepOutput]:
        """Schedule, run and postprocess one batch; returns what each request gained.

        `outputs=False` returns only the outputs that end a request (a few a step), for a
        caller that reads the requests once they end (`LLM.generate`): a StepOutput and its two
        lists for every sequence of every step are what most of a large batch's garbage
        collections collect.

        `on_layer(layer, plan)` runs after each layer's K/V are queued into the cache (the prefill
        worker pushes them to the decode worker from there, overlapping the next layer; a step
        replayed from a prefill graph queues every layer at once, then runs the hook for each).
        `hold()`, when given, runs once the step's inputs are prepared, right before its forward
        is queued, and after the forward of the step before it has finished on the device: the
        step is prepared ahead but queued just in time, so at any moment the device holds at
        most one forward of this engine, and the LM head and sampling of the one before (a
        decode worker sharing its GPU checks its turn there).
        `while_running(plan, ready)`, in a step that samples, runs once the whole step is queued
        and before its samples are read; `ready()` says whether they are in (the prefill worker
        pushes the KV of prompts whose target came after their layers ran, while the device
        still works). Either hook makes the step wait for its own samples (no overlap).
        RuntimeError on a follower (see `follow`).
        """
        if self.runner is None:
            raise RuntimeError(f"step: {self.shard} runs rank 0's steps through follow()")
        if not self.overlap or on_layer is not None or while_running is not None:
            self.settle()
            results, self._ready = _returned(self._ready, outputs), []
            out = self._schedule()
            if out.is_empty:
                self._queued_nothing()
                return results
            plan = StepPlan(out)
            hook = None if on_layer is None else lambda layer: on_layer(layer, plan)  # noqa: E731
            running = None if while_running is None else lambda ready: while_running(plan, ready)  # noqa: E731
            sampled_idx, samples = self.runner.execute(out, hook, hold, running)
            self._postprocess(out)
            results += self._process_samples(out, sampled_idx, samples, outputs)
            if not self.has_unfinished():  # no step follows until work comes (a prefill worker's prompt handed over)
                self._queued_nothing()
            return results
        return self._overlapped_step(hold, outputs)

    def _schedule(self) -> SchedulerOutput:
        if self.observer is None:
            return self._scheduler.schedule()
        t = time.perf_counter()
        out = self._scheduler.schedule()
        self.observer.on_schedule(StepPlan(out), time.perf_counter() - t)
        return out

    def _postprocess(self, out: SchedulerOutput) -> None:
        if self.observer is None:
            self._scheduler.postprocess(out)
            return
        t = time.perf_counter()
        self._scheduler.postprocess(out)
        self.observer.on_postprocess(time.perf_counter() - t)

    def _overlapped_step(self, hold: Callable[[], None] | None = None, outputs: bool = True) -> list[StepOutput]:
        """Schedule and launch step n+1 while step n may still run on the device, then process
        step n's samples. Sequences sampled in step n carry a pending token (counted by the
        scheduler, read by step n+1 from the device); one that step n ends was scheduled in n+1
        anyway, and its n+1 sample is dropped. Step n+1 stays in flight: no row's sampling needs
        its pending token on the host (a position counts it, penalties read it on the device:
        SamplingRow.pending). With `hold` (see `step`) step n+1 is queued only once step n has
        finished."""
        results, self._ready = _returned(self._ready, outputs), []
        prev, self._inflight = self._inflight, None
        out = self._schedule()
        launched = None
        if not out.is_empty:
            prev_tokens = prev.samples.tokens if prev is not None and prev.samples is not None else None
            gate = None if hold is None else (lambda: _after_forward(prev, hold))
            idx, samples, forward_done = self.runner.launch(out, None, prev_tokens, gate)
            launched = _InFlight(out, idx, samples, forward_done)
            for j, i in enumerate(idx):
                seq = out.scheduled[i].seq
                seq.num_pending += 1
                seq.pending_row = j
        if prev is not None:
            results += self._resolve(prev, outputs)
        if launched is not None:
            self._postprocess(out)
            self._inflight = launched
        else:
            self._queued_nothing()
        return results

    def _queued_nothing(self) -> None:
        """A step that queued no forward, or one after which nothing is left to step: the
        device's wait until the next forward is for work (DeviceIdleClock.nothing_to_run)."""
        if self.runner.idle_clock is not None:
            self.runner.idle_clock.nothing_to_run()

    def _resolve(self, step: _InFlight, outputs: bool = True) -> list[StepOutput]:
        """Wait for a launched step's samples and process them (see `step` for `outputs`)."""
        samples = step.samples.result() if step.samples is not None else None
        for i in step.sample_index:
            seq = step.out.scheduled[i].seq
            seq.num_pending -= 1
            if not seq.num_pending and seq.status is SeqStatus.FINISHED:
                self._scheduler.release_finished(seq)  # ended by the step before this one
        return self._process_samples(step.out, step.sample_index, samples, outputs)

    def _process_samples(self, out: SchedulerOutput, idx: list[int], samples, outputs: bool = True) -> list[StepOutput]:
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
                if seq.prefill_only:  # PREFILLED, or a first token that ends it: its KV is still pushed
                    self._scheduler.finish_prefill(seq, reason)
                else:
                    self._scheduler.finish(seq, reason)
                seq.stop_reason = stop_reason
                seq.finish_reason = reason
            if outputs or reason is not None:
                results.append(StepOutput(seq.request_id, [token], [lp], reason is not None, reason, stop_reason))
        return results

    def _check_stop(self, seq: Sequence, token: int) -> tuple[FinishReason | None, str | int | None]:
        """Why `seq` ends after appending `token` (None if it goes on), by tandem.rules."""
        shown, stop = seq.stop.check(token, len(seq.output_token_ids), seq.num_known_tokens)
        if shown:
            seq.text += shown
        if stop is None:
            return None, None
        return _FINISH[stop.reason], _stop_reason(stop)

    def output_text(self, request: Request) -> str:
        """Final text of a finished request (cut before a stop string when one ended it)."""
        seq = request._seq
        if seq.stop.text is not None:
            return seq.text + seq.stop.tail()
        # Decode in the prompt's context (as the gateway streams it): a SentencePiece output that
        # starts a new word keeps its leading space.
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens)
        return detok.finish(seq.output_token_ids)

    # ---- a model replica over several processes ------------------------------------------
    def follow(self, on_step: Callable[[bytes], Callable[[int], None] | None] | None = None) -> int:
        """A follower (an engine whose shard gave it no runner, e.g. tensor-parallel ranks
        1..world-1): run each step the scheduling process's engine sends, on this process's part
        of the model and KV cache, until that engine calls `close()`. Returns the steps run.

        on_step: called with each step's extras before its forward; the hook it returns runs
          after each layer of that step (a prefill worker's follower pushes its KV from there).
        RuntimeError on an engine that schedules its own steps.
        """
        return self.shard.follow(self.model, self.kv_cache, self.device, on_step)

    def _load_shared(self, path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        """The model with its weights in the shared arena of config.shared_weights_dir: loaded
        here (then quantized) when no other process holds them, else mapped from one."""
        config = self.config
        if not isinstance(self.shard, WholeModel):
            raise ValueError("shared_weights_dir: shared weights need the whole model in one process (--tp 1)")
        identity = {"model": self.identity, "dtype": str(dtype), "quantization": config.quantization,
                    "device": device.type}

        def load() -> torch.nn.Module:
            model, _ = self.shard.load(path, self.model_config, dtype, device, config.load_format)
            return apply_quantization(model, config.quantization)

        self.shared_weights = load_shared(
            config.shared_weights_dir, identity, device, load=load,
            build=lambda: model_without_weights(self.model_config, dtype, config.load_format, config.quantization))
        return self.shared_weights.model

    def close(self) -> None:
        """Release whatever runs beside this engine's runner (tensor-parallel followers wait in
        `follow()`), stop serving shared weights and unhook the late-compile watch; idempotent."""
        if self.shared_weights is not None:
            self.shared_weights.close()
        if self.runner is not None:
            self.runner.stop()
        if self.late_compiles is not None:
            self.late_compiles.uninstall()
            self.late_compiles = None

    def measure_device_idle(self) -> DeviceIdleClock | None:
        """Start measuring how long the device waits for the host between steps
        (engine/device_idle.py); the clock is read with its `take()` on the engine's thread.
        None where there is nothing to measure: the CPU, or a follower rank."""
        if self.runner is None or self.runner.device.type != "cuda":
            return None
        if self.runner.idle_clock is None:
            self.runner.idle_clock = DeviceIdleClock(self.runner.device)
        return self.runner.idle_clock

    # ---- introspection --------------------------------------------------------------------
    @property
    def prefill_alone(self) -> PrefillAlone | None:
        """When waiting prompts get a step without the running decodes (engine.scheduler's
        PrefillAlone; set where prefill graphs are captured); None: they join the decodes' step."""
        return self._scheduler.prefill_alone

    @prefill_alone.setter
    def prefill_alone(self, rule: PrefillAlone | None) -> None:
        self._scheduler.prefill_alone = rule

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


_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


def _stop_reason(stop: Stop) -> str | int | None:
    """A StepOutput's stop_reason: the stop token id or stop string (None for EOS and length)."""
    return stop.matched if stop.kind in (STOP_TOKEN, STOP_STRING) else None


def _split_output(seq: Sequence, n: int) -> None:
    """The last `n` of a fresh sequence's prompt ids are earlier output of a resumed request."""
    ids = seq.prompt_token_ids
    seq.prompt_token_ids, seq.output_token_ids = ids[:-n], ids[-n:]
    seq.output_logprobs = [None] * n


@dataclass
class _InFlight:
    """A launched step: its schedule, the scheduled indices that sample, their samples, and the
    event at the end of its forward (None where the forward has finished on return: a CPU)."""

    out: SchedulerOutput
    sample_index: list[int]
    samples: PendingSamples | None
    forward_done: torch.cuda.Event | None = None


def _after_forward(prev: _InFlight | None, hold: Callable[[], None]) -> None:
    """Wait for step `prev`'s forward to finish on the device, then run `hold`: the gate that
    queues the next step's forward only after it. The step's LM head and sampling may still run
    meanwhile: they cover the host's reaction (waking, the turn's look, the graph's launch), so
    the device does not idle between held steps."""
    if prev is not None and prev.forward_done is not None:
        prev.forward_done.synchronize()
    hold()


def _returned(ready: list[StepOutput], outputs: bool) -> list[StepOutput]:
    """What `step` returns of the outputs resolved before it (see `step` for `outputs`)."""
    return ready if outputs else [o for o in ready if o.finished]


def _world_size(shard: ModelShard) -> int:
    """Processes one model replica is split over (1 for a whole model)."""
    tp = getattr(shard, "tp", None)
    return int(getattr(tp, "world_size", 1) or 1)

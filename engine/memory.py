"""How much of a GPU the KV cache gets, and how many sequences run at once by default.

`Engine` sizes its KV pool here, after its weights are loaded and before the pool exists:

    kv bytes = gpu_memory_fraction × the GPU's total memory
               − weights (what this process has allocated once they are loaded, plus the
                 weights it shares with other processes and is charged for: shared_weights.py)
               − activations of the largest step (measured: a forward of max_batched_tokens
                 prompt tokens and the logits of the largest decode batch, as vLLM profiles;
                 with a derived max_running, of the rows it can sample: `fitted_batch`)
               − CUDA graphs of the decode batches and of prefill steps up to
                 prefill_graph_tokens (estimated from the measured per-token activations, plus
                 a fixed amount per captured size)
               − the sampler's buffers for the largest decode batch (probabilities, sorted
                 copies and indices of vocab-wide rows): with a derived max_running, the batch
                 that the rest of the pool derives (`fitted_batch`), not the device's ceiling
                 (which the step is profiled at: `StepActivations` scales its rows down)
               − NON_TORCH_BYTES (CUDA context, cuBLAS and Triton workspaces, KV transfer staging)

It is computed from this process's own allocations and the GPU's total memory, never from the
free memory of the moment, so two workers that start together on one GPU, each with its own
share (`tandem up` gives each one), both come up. A share that cannot hold the weights, or the
KV of one request of max_model_len tokens, is a ValueError naming the flag to change.

`derive_max_running` is the default cap on running sequences: the tokens the pool holds over
the context a running sequence is expected to hold (as SGLang derives max_running_requests), so
an FP8 KV cache (twice the tokens) runs twice the sequences.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.config import EXPECTED_CONTEXT_TOKENS, EngineConfig, ModelConfig
from engine.cuda_graphs import DEFAULT_BUCKETS, MAX_GRAPH_BATCH, spare_buckets, timed_buckets_enabled
from engine.kv_cache import KVCache
from engine.prefill_graphs import buckets_up_to, graph_token_limit
from engine.quant.formats import checkpoint_fp8_format

logger = logging.getLogger(__name__)

GiB = 2**30
NON_TORCH_BYTES = int(1.5 * GiB)
GRAPH_BYTES_PER_BATCH_SIZE = 8 * 2**20  # each captured graph's own (non-pool) memory
SAMPLER_BYTES_PER_LOGIT = 24  # fp32 probabilities, a sorted fp32 copy, int64 indices, fp32 noise
# Running sequences: the caps (the context one is expected to hold: config.EXPECTED_CONTEXT_TOKENS).
MAX_RUNNING_CEILING_CUDA = 512  # derived max_running's cap (an explicit one may go to MAX_GRAPH_BATCH with graphs)
MAX_RUNNING_CEILING_CPU = 256


def derive_max_running(pool_tokens: int, max_model_len: int, device_type: str) -> int:
    """The default max_running: KV pool tokens over the context a running sequence is expected
    to hold (min(max_model_len, EXPECTED_CONTEXT_TOKENS)), at least 1, at most the device's
    ceiling (MAX_RUNNING_CEILING_CUDA / _CPU)."""
    context = max(1, min(max_model_len, EXPECTED_CONTEXT_TOKENS))
    ceiling = MAX_RUNNING_CEILING_CUDA if device_type == "cuda" else MAX_RUNNING_CEILING_CPU
    return max(1, min(ceiling, pool_tokens // context))


def default_max_running(max_running: int | None, num_kv_blocks: int | None, pool_blocks: int, block_size: int,
                        max_model_len: int, device_type: str) -> int:
    """An engine's max_running: the explicit one; beside a hand-sized pool (`num_kv_blocks`
    given) the device's ceiling (preemption does the rest); else `derive_max_running` of the
    pool of `pool_blocks` blocks. `tandem up` calls it too, to show and size what each worker runs."""
    if max_running is not None:
        return max_running
    if num_kv_blocks is not None:
        return derive_max_running(2**62, max_model_len, device_type)
    return derive_max_running(pool_blocks * block_size, max_model_len, device_type)


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU engine's memory budget, in bytes; `kv` is what is left for the KV pool."""

    limit: int
    weights: int
    activations: int
    graphs: int
    sampler: int
    other: int

    @property
    def kv(self) -> int:
        return self.limit - self.weights - self.activations - self.graphs - self.sampler - self.other

    def describe(self) -> str:
        parts = ", ".join(f"{name} {getattr(self, name) / GiB:.1f}" for name in
                          ("weights", "activations", "graphs", "sampler", "other"))
        return f"{self.limit / GiB:.1f} GiB = {parts}, KV {max(0, self.kv) / GiB:.1f} GiB"


def weight_bytes(config: ModelConfig, dtype: torch.dtype, tp: int = 1, fp8: bool = False) -> int:
    """Bytes of one tensor-parallel rank's weights of `dtype`; with `fp8` (--quantization fp8 or
    an FP8 checkpoint) the decoder layers' projections are e4m3 with a float32 scale per output
    channel (engine.quant.fp8) and the rest `dtype`."""
    total = config.num_params() * dtype.itemsize
    if fp8:
        projections = config.num_layers * config.projection_params()
        total -= projections * (dtype.itemsize - 1) - config.num_layers * config.projection_channels() * 4
    return total // tp


def check_weights_fit(config: ModelConfig, dtype: torch.dtype, device: torch.device, fraction: float,
                      tp: int = 1) -> None:
    """Before loading: ValueError naming --gpu-memory-fraction (and --tp) when the weights alone
    exceed this engine's share of the GPU: an FP8 checkpoint's as they load (e4m3), any other's
    in `dtype` (--quantization fp8 loads them so before quantizing)."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    weights = weight_bytes(config, dtype, tp, fp8=checkpoint_fp8_format(config.raw) is not None)
    if weights + NON_TORCH_BYTES > fraction * total:
        raise ValueError(
            f"gpu_memory_fraction: the weights take {weights / GiB:.1f} GiB, more than --gpu-memory-fraction "
            f"{fraction:g} of this GPU ({fraction * total / GiB:.1f} of {total / GiB:.1f} GiB); raise it, "
            "give this worker a GPU of its own, or raise --tp")


@dataclass(frozen=True)
class StepActivations:
    """What the largest step allocates above the weights and its KV blocks, in bytes: the forward
    of `num_tokens` prompt tokens peaks at `forward` and leaves `held` allocated (its hidden
    states), on which each row sampled adds `per_row` (its logits, their fp32 copy, the
    probabilities and a sort's values and indices). `profiled_rows` is the rows the figure was
    taken at; the graphs' estimates read their per-token activations there (`per_token`)."""

    num_tokens: int
    forward: int
    held: int
    per_row: int
    profiled_rows: int

    def peak(self, rows: int) -> int:
        """The step's peak with `rows` rows sampled (at most num_tokens): an engine samples a row
        for each running sequence a step, so a derived max_running's rows bound it."""
        return max(self.forward, self.held + min(rows, self.num_tokens) * self.per_row)

    @property
    def per_token(self) -> float:
        """Activations a token, at the profiled rows: what the graphs' pools are estimated from."""
        return self.peak(self.profiled_rows) / max(1, self.num_tokens)


@torch.inference_mode()
def profile_step(model, kv_config: ModelConfig, block_size: int, kv_dtype: torch.dtype, device: torch.device,
                 num_tokens: int, max_model_len: int, sample_rows: int) -> StepActivations:
    """A step of `num_tokens` prompt tokens, measured: the forward's peak and what it leaves
    held, then the logits and sampling of `sample_rows` rows (their bytes a row), not counting
    the temporary KV blocks it writes to. Runs one real forward on `device`; leaves nothing
    allocated."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    seq_len = max(1, min(num_tokens, max_model_len))
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    per_seq = -(-seq_len // block_size)
    cache = KVCache(kv_config, per_seq * len(lens), block_size, kv_dtype, device)
    kv_bytes = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    slots, positions, starts = [], [], [0]
    for i, n in enumerate(lens):
        slots += [i * per_seq * block_size + p for p in range(n)]
        positions += list(range(n))
        starts.append(starts[-1] + n)
    tables = torch.arange(per_seq * len(lens), dtype=torch.int32, device=device).view(len(lens), per_seq)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), block_tables=tables,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), is_decode=False,
        k_scale=cache.k_scale, v_scale=cache.v_scale)
    ids = torch.ones(num_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, torch.tensor(positions, dtype=torch.int64, device=device), cache.layers, meta)
    torch.cuda.synchronize(device)
    above = base + kv_bytes
    forward = torch.cuda.max_memory_allocated(device) - above
    held = torch.cuda.memory_allocated(device) - above
    torch.cuda.reset_peak_memory_stats(device)
    rows = max(1, min(sample_rows, num_tokens))
    logits = model.logits(hidden[num_tokens - rows:]).float()
    probs = torch.softmax(logits, dim=-1)
    ordered = probs.sort(dim=-1, descending=True)
    torch.cuda.synchronize(device)
    sampled = torch.cuda.max_memory_allocated(device) - above
    del cache, meta, ids, hidden, logits, probs, ordered, tables
    torch.cuda.empty_cache()
    return StepActivations(num_tokens=num_tokens, forward=max(0, forward), held=max(0, held),
                           per_row=-(-max(0, sampled - held) // rows), profiled_rows=rows)


def estimate_step(config: ModelConfig, dtype: torch.dtype, num_tokens: int, sample_rows: int,
                  tp: int = 1) -> StepActivations:
    """An upper estimate of `profile_step` without running the model (tensor-parallel ranks,
    whose forward needs every rank): the widest intermediate tensors of one layer, a few times
    over, then the sampled rows on top."""
    elem = torch.empty((), dtype=dtype).element_size()
    width = 4 * config.hidden_size + (2 * config.intermediate_size + config.q_size + 2 * config.kv_size) // tp
    # Sampling rows: the logits, their fp32 copy, the probabilities, and a sort's values and int64
    # indices (what profile_step runs). Llama-3.1-8B, 4,096 tokens, 512 rows: 2.9 GiB against
    # 2.5 profiled on an H200. The forward's tensors are counted as held under the rows (a sum).
    forward = 4 * num_tokens * width * elem
    return StepActivations(num_tokens=num_tokens, forward=forward, held=forward,
                           per_row=config.vocab_size * (elem + 4 + 4 + 4 + 8),
                           profiled_rows=max(1, min(sample_rows, num_tokens)))


def prefill_graph_bytes(step: StepActivations, prefill_graph_tokens: int) -> int:
    """What prefill graphs of up to `prefill_graph_tokens` tokens take (engine/prefill_graphs.py):
    their pool holds a step of that many tokens' activations (`step.per_token` a token; the
    step's num_tokens also caps the graphs), plus a fixed amount per captured size; 0 for none."""
    tokens = graph_token_limit(prefill_graph_tokens, step.num_tokens)
    if tokens <= 0:
        return 0
    return int(step.per_token * tokens) + len(buckets_up_to(tokens)) * GRAPH_BYTES_PER_BATCH_SIZE


def plan_kv(*, device: torch.device, fraction: float, step: StepActivations, max_batch: int,
            graph_batches: int, vocab_size: int, prefill_graph_tokens: int = 0,
            graph_rows: int | None = None, shared_weight_bytes: int = 0) -> MemoryPlan:
    """The budget of an engine on `device` whose weights are loaded: `step` from `profile_step`
    (or `estimate_step`), its peak with `max_batch` rows sampled; `max_batch` the largest
    decode batch (sampler rows, and the largest CUDA graph when `graph_batches` > 0 graphs are
    captured, unless `graph_rows` names the largest graph's rows); `prefill_graph_tokens` the
    largest prefill graph (engine/prefill_graphs.py, whose pool holds a step of that many tokens'
    activations), 0 for none; `shared_weight_bytes` the weights in a shared arena
    (engine/shared_weights.py) this engine's budget holds, which torch does not count."""
    total = torch.cuda.get_device_properties(device).total_memory
    rows = graph_rows or max_batch
    graphs = int(step.per_token * rows * 2) + graph_batches * GRAPH_BYTES_PER_BATCH_SIZE if graph_batches else 0
    graphs += prefill_graph_bytes(step, prefill_graph_tokens)
    return MemoryPlan(limit=int(fraction * total), weights=torch.cuda.memory_allocated(device) + shared_weight_bytes,
                      activations=step.peak(max_batch), graphs=graphs,
                      sampler=max_batch * vocab_size * SAMPLER_BYTES_PER_LOGIT, other=NON_TORCH_BYTES)


def derive_num_blocks(config: EngineConfig, model: torch.nn.Module, model_config: ModelConfig, kv_config: ModelConfig,
                      kv_dtype: torch.dtype, dtype: torch.dtype, device: torch.device, alone: bool, world_size: int,
                      max_model_len: int, block_bytes: int, shared_weight_bytes: int = 0) -> int:
    """KV blocks for an engine whose weights are loaded on `device`. On CUDA: the whole budget
    of its gpu_memory_fraction once weights (its own allocations, plus `shared_weight_bytes` of
    weights it shares with other processes and is charged for), the largest step's activations
    (profiled when the process runs the model `alone`, else `estimate_step` for its
    tensor-parallel share), CUDA graphs, the sampler and the rest are counted (`plan_kv`; for a
    derived max_running, the sampler's rows, the step's sampled rows and the decode graphs'
    batches it can reach: `fitted_batch`); on the CPU: cpu_kv_cache_gb. With an explicit
    max_running, no more than max_running max-length requests can use. ValueError naming the flag when one request of max_model_len does not fit."""
    bs = config.block_size
    per_request = -(-max_model_len // bs)
    max_batch = config.max_running or (MAX_RUNNING_CEILING_CUDA if device.type == "cuda" else MAX_RUNNING_CEILING_CPU)
    if device.type == "cuda":
        num_tokens = config.max_batched_tokens
        rows = min(max_batch, num_tokens)
        if alone:
            step = profile_step(model, kv_config, bs, kv_dtype, device, num_tokens, max_model_len, rows)
        else:
            step = estimate_step(model_config, dtype, num_tokens, rows, world_size)

        def planned(batch: int) -> MemoryPlan:
            """The budget with sampler rows and decode graphs for batches of up to `batch`."""
            graph_batch = min(batch, MAX_GRAPH_BATCH)
            # Buckets up to the cap, the cap, and the timed spares above it (engine/cuda_graphs.py).
            spares = spare_buckets(graph_batch) if timed_buckets_enabled() else []
            captured = sum(1 for b in DEFAULT_BUCKETS if b <= graph_batch) + 1 + len(spares)
            return plan_kv(device=device, fraction=config.gpu_memory_fraction, step=step, max_batch=batch,
                           graph_batches=captured if alone and config.cuda_graphs else 0,
                           graph_rows=max([graph_batch, *spares]), vocab_size=model_config.vocab_size,
                           prefill_graph_tokens=config.prefill_graph_tokens if alone else 0,
                           shared_weight_bytes=shared_weight_bytes)

        if config.max_running is None:
            max_batch = fitted_batch(lambda batch: max(0, planned(batch).kv) // block_bytes * bs, max_model_len,
                                     max_batch)
        plan = planned(max_batch)
        blocks = max(0, plan.kv) // block_bytes
        logger.info("memory: %s -> %d KV blocks of %d tokens", plan.describe(), blocks, bs)
        if blocks < per_request:
            raise ValueError(too_small(plan, blocks, per_request, block_bytes, config.gpu_memory_fraction,
                                       max_model_len))
    else:
        blocks = int(config.cpu_kv_cache_gb * GiB // block_bytes)
        if blocks < per_request:
            raise ValueError(f"max_model_len: one request of --max-model-len {max_model_len} needs "
                             f"{per_request} KV blocks, the CPU KV budget (cpu_kv_cache_gb "
                             f"{config.cpu_kv_cache_gb:g}) holds {blocks}; lower --max-model-len")
    if config.max_running is not None or device.type != "cuda":
        blocks = min(blocks, max_batch * per_request)
    return max(1, blocks)


def fitted_batch(pool_tokens: Callable[[int], int], max_model_len: int, ceiling: int) -> int:
    """The fewest sampler rows and decode-graph batches a derived max_running can be planned
    with: the smallest batch b <= `ceiling` whose pool (`pool_tokens(b)`, tokens left for KV once
    b rows are planned) derives no more than b running sequences (derive_max_running). Planning
    the device's ceiling (512 rows, ~1.5 GiB of Llama-3.1-8B's sampler buffers) for an engine that
    derives 148 would leave the difference unused, and so would the step's logits for 512 rows
    (StepActivations.peak). The pool shrinks as b grows, so the rule is monotonic and a
    bisection finds it."""
    lo, hi = 1, ceiling  # hi always qualifies: no derived max_running exceeds the ceiling
    while lo < hi:
        mid = (lo + hi) // 2
        if derive_max_running(pool_tokens(mid), max_model_len, "cuda") <= mid:
            hi = mid
        else:
            lo = mid + 1
    return hi


def too_small(plan: MemoryPlan, blocks: int, need_blocks: int, block_bytes: int, fraction: float,
              max_model_len: int) -> str:
    """The one-line error for a KV pool of `blocks` that cannot hold one request of max_model_len."""
    need = need_blocks * block_bytes
    return (f"gpu_memory_fraction: --gpu-memory-fraction {fraction:g} leaves {max(0, plan.kv) / GiB:.2f} GiB "
            f"for the KV cache ({plan.describe()}); one request of --max-model-len {max_model_len} needs "
            f"{math.ceil(need / GiB * 100) / 100:.2f} GiB: raise --gpu-memory-fraction or lower --max-model-len")

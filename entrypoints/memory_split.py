"""A prefill worker's share of a GPU it shares with decode workers, from what it needs.

Where `tandem up` puts a prefill and a decode worker on one GPU, the decode worker's KV holds
every running sequence, so its share decides how many run at once; a prefill worker needs its
weights, one step's activations and sampler rows, and KV for one request of its own context
plus a step's worth of other prompts (and its prefix cache keeps what that room allows).
`tandem up` gives such a prefill worker a context of at most SHARED_PREFILL_MAX_MODEL_LEN
(`--prefill-max-model-len`); the decode worker prefills the rare longer prompt itself.
`prefill_need_bytes` adds those up the way the worker's own memory plan does
(`engine.memory`), with the upper estimate of a step's activations and a margin;
`prefill_memory_ratio` turns the need into the placement's prefill-to-decode ratio on a GPU of a
given size. Unless `--prefill-memory-ratio` is given, `tandem up` uses it when it can read the
GPU's size (`nvidia-smi`), and the fixed `PREFILL_MEMORY_RATIO` otherwise.

Llama-3.1-8B (bf16, one copy of the weights in the decode worker's share): a prefill worker of
32,768 tokens needs ~10.2 GiB, and the decode worker gets 77.0% of an 80 GB H100 (82.6% of an
H200); one of the model's 131,072 tokens would need ~22.5 GiB, leaving the decode worker 61.5%
(73.8%).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.config import ModelConfig, parse_dtype
from engine.kv_cache import KVCache
from engine.memory import (MAX_RUNNING_CEILING_CUDA, NON_TORCH_BYTES, SAMPLER_BYTES_PER_LOGIT, derive_max_running,
                           estimate_step, prefill_graph_bytes, weight_bytes)
from engine.quant.formats import checkpoint_fp8_format
from entrypoints.nvidia_smi import memory_bytes
from entrypoints.placement import MAX_PREFILL_MEMORY_RATIO, MIN_PREFILL_MEMORY_RATIO, Placement

logger = logging.getLogger(__name__)

GiB = 1 << 30
MARGIN_BYTES = 1 * GiB  # allocator slack (estimate_step is already an upper estimate)
# What CUDA reports as a GPU's memory against nvidia-smi's memory.total (H200: 139.8 of 140.4
# GiB); the workers' shares are fractions of the former.
CUDA_VISIBLE_SHARE = 0.99
DECODE_GRAPH_BYTES = 1 * GiB  # a decode worker's captured graphs (Llama-3.1-8B: 0.8 GiB)
MIN_FITTED_CONTEXT = 4096  # fitting_max_model_len halves the context no further


def prefill_need_bytes(mc: ModelConfig, *, dtype: torch.dtype, kv_cache_dtype: str, max_model_len: int | None,
                       max_batched_tokens: int, max_running: int | None = None, tp: int = 1,
                       prefill_graph_tokens: int = 0, shared_weights: bool = False, fp8_weights: bool = False) -> int:
    """Bytes of one GPU a prefill worker (one tensor-parallel rank) needs: weights of `dtype`
    (`fp8_weights`: the projections e4m3, engine.memory.weight_bytes; none where
    `shared_weights`: a decode worker's share holds them, engine/shared_weights.py),
    KV for one request of `max_model_len` (None: the model's) plus one step's prompts, a step's
    activations and the sampler's buffers for the rows the worker plans
    (`engine.memory.derive_num_blocks`: `max_running` rows, else the sequences that KV derives,
    `engine.memory.fitted_batch`), its prefill graphs
    (`prefill_graph_tokens`, as `engine.memory.plan_kv` counts them), what torch does not see,
    and MARGIN_BYTES."""
    context = min(max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    kv_dtype = KVCache.storage_dtype(kv_cache_dtype, dtype)
    kv_tokens = context + max_batched_tokens
    kv = kv_tokens * KVCache.bytes_per_block(mc, 1, kv_dtype) // tp
    step = estimate_step(mc, dtype, max_batched_tokens, max_running or MAX_RUNNING_CEILING_CUDA, tp)
    weights = 0 if shared_weights else weight_bytes(mc, dtype, tp, fp8_weights)
    # The worker plans its sampler and its step's sampled rows for the sequences its pool derives
    # (engine.memory.fitted_batch).
    rows = max_running or derive_max_running(kv_tokens, context, "cuda")
    activations = step.peak(rows)
    sampler = rows * mc.vocab_size * SAMPLER_BYTES_PER_LOGIT
    # Tensor-parallel workers capture no prefill graphs.
    graphs = prefill_graph_bytes(step, prefill_graph_tokens) if tp == 1 else 0
    return weights + kv + activations + sampler + graphs + NON_TORCH_BYTES + MARGIN_BYTES


def prefill_memory_ratio(need_bytes: int, gpu_bytes: int, cluster_share: float, prefill_per_gpu: int = 1,
                         decode_per_gpu: int = 1) -> float:
    """The placement's prefill-to-decode memory ratio that gives each of `prefill_per_gpu`
    prefill workers `need_bytes` of a `gpu_bytes` GPU whose `cluster_share` is split among them
    and `decode_per_gpu` decode workers (entrypoints.placement splits a GPU's share by weight:
    prefill r, decode 1). Clamped to the ratios placement accepts, and never above 1 (the
    decode workers get no less than a prefill worker): a model too big for that fails in the
    worker with the flag to change."""
    want = need_bytes / (gpu_bytes * CUDA_VISIBLE_SHARE)  # the prefill worker's fraction of the GPU
    rest = cluster_share - prefill_per_gpu * want
    if rest <= 0:
        return 1.0
    ratio = want * decode_per_gpu / rest
    return min(1.0, MAX_PREFILL_MEMORY_RATIO, max(MIN_PREFILL_MEMORY_RATIO, ratio))


def shared_gpu_ratio(placement: Placement, model: str, physical: Callable[[tuple[int, ...]], str], *,
                     dtype: str | None, kv_cache_dtype: str, max_model_len: int | None, max_batched_tokens: int,
                     max_running: int | None, tp: int, cluster_share: float, quantization: str | None = None,
                     prefill_graph_tokens: int = 0, shared_weights: bool = False) -> float | None:
    """The prefill-to-decode memory ratio from what a prefill worker of `model` needs on the
    first GPU of `placement` that hosts both roles (`physical` names it for nvidia-smi; with
    `shared_weights` the weights are in a decode worker's share); None when no GPU does, its
    size cannot be read, or the model's config cannot (the workers then report what is wrong
    with it). `quantization`: --quantization (an FP8 checkpoint's weights count as FP8 without it)."""
    shared = _shared_gpu(placement, model, physical, dtype, quantization)
    if shared is None:
        return None
    gpu, here, size, mc, element, fp8 = shared
    need = prefill_need_bytes(mc, dtype=element, kv_cache_dtype=kv_cache_dtype,
                              max_model_len=max_model_len, max_batched_tokens=max_batched_tokens,
                              max_running=max_running, tp=tp, prefill_graph_tokens=prefill_graph_tokens,
                              shared_weights=shared_weights, fp8_weights=fp8)
    ratio = prefill_memory_ratio(need, size, cluster_share, here.count("prefill"), here.count("decode"))
    logger.info("a prefill worker needs %.1f GiB of GPU %d's %.1f GiB: prefill memory ratio %.3f",
                need / GiB, gpu, size / GiB, ratio)
    return ratio


def fitting_max_model_len(placement: Placement, model: str, physical: Callable[[tuple[int, ...]], str], *,
                          dtype: str | None, kv_cache_dtype: str, max_batched_tokens: int,
                          max_running: int | None, tp: int, cluster_share: float, quantization: str | None = None,
                          prefill_graph_tokens: int = 0, shared_weights: bool = False,
                          prefill_max_model_len: int | None = None) -> int | None:
    """For a cluster given no --max-model-len: the model's context halved until, on the first GPU
    of `placement` hosting both roles, its decode workers can each hold one request of it and
    its prefill workers one of it or of `prefill_max_model_len`, the shorter (each needs
    prefill_need_bytes; a decode worker no prefill graphs but DECODE_GRAPH_BYTES of decode
    graphs) within `cluster_share` of the GPU. None when the model's
    own context fits, no GPU is shared, its size or the model cannot be read, or not even
    MIN_FITTED_CONTEXT fits (the workers then name the flag to change). With `shared_weights`
    the GPU holds the weights once, in the first decode worker's share. Llama-3.1-8B on an 80 GB
    H100, each worker with its own weights and the whole context: 131,072 tokens need ~79 GiB of
    the 71 that 0.9 of it leaves; 65,536 fit."""
    shared = _shared_gpu(placement, model, physical, dtype, quantization)
    if shared is None:
        return None
    _, here, size, mc, element, fp8 = shared

    def need(context: int, graph_tokens: int, shared: bool) -> int:
        return prefill_need_bytes(mc, dtype=element, kv_cache_dtype=kv_cache_dtype, max_model_len=context,
                                  max_batched_tokens=max_batched_tokens, max_running=max_running, tp=tp,
                                  prefill_graph_tokens=graph_tokens, shared_weights=shared, fp8_weights=fp8)

    budget = cluster_share * size * CUDA_VISIBLE_SHARE
    context = mc.max_position_embeddings
    while context >= MIN_FITTED_CONTEXT:
        prefill = need(min(context, prefill_max_model_len or context), prefill_graph_tokens, shared_weights)
        decode = need(context, 0, shared_weights) + DECODE_GRAPH_BYTES
        weights_once = weight_bytes(mc, element, tp, fp8) if shared_weights else 0
        if here.count("prefill") * prefill + here.count("decode") * decode + weights_once <= budget:
            return None if context == mc.max_position_embeddings else context
        context //= 2
    return None


def _shared_gpu(placement: Placement, model: str, physical: Callable[[tuple[int, ...]], str], dtype: str | None,
                quantization: str | None = None):
    """(gpu, the roles on it, its bytes, the model's ModelConfig, the dtype, whether the weights
    are FP8: `quantization` or the checkpoint's own format) of the first GPU of `placement` that
    hosts a prefill and a decode worker; None when none does or its size or the model's config
    cannot be read."""
    if not placement.prefill_decode_gpus:
        return None
    gpu = placement.prefill_decode_gpus[0]
    here = [w.role for w in placement.workers if gpu in w.gpus]
    size = memory_bytes(physical((gpu,)))
    if size is None:
        return None
    try:
        mc = ModelConfig.from_dir(model)
        element = parse_dtype(dtype, "--dtype") if dtype else mc.torch_dtype
        fp8 = quantization == "fp8" or checkpoint_fp8_format(mc.raw) is not None
    except (OSError, ValueError) as exc:
        logger.warning("cannot size the prefill worker's share from %s (%s)", model, exc)
        return None
    return gpu, here, size, mc, element, fp8


__all__ = ["fitting_max_model_len", "prefill_memory_ratio", "prefill_need_bytes", "shared_gpu_ratio"]

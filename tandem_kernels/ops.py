"""The kernel entry points the engine calls: Triton on CUDA tensors, tandem_kernels.reference elsewhere.

Every function has the name, signature and semantics of its tandem_kernels.reference counterpart.
TANDEM_KERNELS=reference forces the torch reference; TANDEM_KERNELS=triton forces the Triton
kernels even on CPU tensors (which then need TRITON_INTERPRET=1, as the tests set). Unset or
"auto": Triton when the tensors are on CUDA and triton imports, else the reference. Triton is
imported only when a Triton kernel is first used, so this module imports where triton is absent.
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from types import ModuleType
from typing import Any

import torch

from tandem_kernels import reference

logger = logging.getLogger(__name__)

ENV_VAR = "TANDEM_KERNELS"
_MODES = ("auto", "reference", "triton")

GEMV_MAX_ROWS = 8  # rows of x a fused decode GEMV (gemv) takes; larger batches belong to the GEMM
GEMV_PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # a decoder layer's GEMVs, by the names gemv tiles them by

# Reference functions with no Triton version: plain re-exports.
rope_cos_sin_cache = reference.rope_cos_sin_cache
gather_kv = reference.gather_kv


class KernelBackendError(RuntimeError):
    """The Triton backend was forced but cannot run here."""


def backend_mode() -> str:
    """The TANDEM_KERNELS setting: 'auto' (default), 'reference' or 'triton'."""
    mode = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"{ENV_VAR} must be one of {_MODES}, got {mode!r}")
    return mode


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether triton imports (cached; the import happens on the first call)."""
    try:
        importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install raising something else
        logger.info("triton unavailable, using the torch reference kernels: %s", exc)
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _use_triton(x: torch.Tensor) -> bool:
    mode = backend_mode()
    if mode == "reference":
        return False
    if mode == "triton":
        if not triton_available():
            raise KernelBackendError(f"{ENV_VAR}=triton but triton does not import")
        if not x.is_cuda and not _interpreting():
            raise KernelBackendError(f"{ENV_VAR}=triton with {x.device} tensors needs TRITON_INTERPRET=1")
        return True
    return x.is_cuda and triton_available()


@functools.lru_cache(maxsize=None)
def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")


def _triton(module: str, fn: str) -> Any:
    return getattr(_module(module), fn)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """See tandem_kernels.reference.rms_norm."""
    if _use_triton(x):
        return _triton("norm", "rms_norm")(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """See tandem_kernels.reference.fused_add_rms_norm."""
    if _use_triton(x):
        return _triton("norm", "fused_add_rms_norm")(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
    silu_pair: bool = False, weight_scale: torch.Tensor | None = None, projection: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See tandem_kernels.reference.gemv (x: at most GEMV_MAX_ROWS rows; an e4m3 weight with its
    `weight_scale`). projection (one of GEMV_PROJECTIONS): the Triton launch takes that
    projection's tiling on x's GPU at x's rows (gemv_tilings.tiling_for)."""
    if x.dim() == 2 and x.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"x: at most {GEMV_MAX_ROWS} rows, got {x.shape[0]}")
    kw = dict(residual=residual, norm_weight=norm_weight, eps=eps, silu_pair=silu_pair, weight_scale=weight_scale)
    if _use_triton(x):
        rows = x.shape[0] if x.dim() == 2 else 1
        tiling = (_triton("gemv", "tiling_for")(projection, x.device, weight_scale is not None, rows)
                  if projection is not None else None)
        return _triton("gemv", "gemv")(x, weight, bias, tiling=tiling, **kw)
    return reference.gemv(x, weight, bias, **kw)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """See tandem_kernels.reference.argmax_rows."""
    if _use_triton(x):
        return _triton("argmax", "argmax_rows")(x)
    return reference.argmax_rows(x)


def sample_filtered(x: torch.Tensor, temperature: torch.Tensor, kth: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """See tandem_kernels.reference.sample_filtered."""
    if _use_triton(x):
        return _triton("sampling", "sample_filtered")(x, temperature, kth, top_p, min_p, noise)
    return reference.sample_filtered(x, temperature, kth, top_p, min_p, noise)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """See tandem_kernels.reference.silu_and_mul."""
    if _use_triton(x):
        return _triton("activation", "silu_and_mul")(x)
    return reference.silu_and_mul(x)


def apply_rotary(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int, is_neox: bool
) -> torch.Tensor:
    """See tandem_kernels.reference.apply_rotary."""
    if _use_triton(x):
        return _triton("rotary", "apply_rotary")(x, positions, cos_sin_cache, rotary_dim, is_neox)
    return reference.apply_rotary(x, positions, cos_sin_cache, rotary_dim, is_neox)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """See tandem_kernels.reference.store_kv."""
    if _use_triton(k):
        return _triton("rotary", "store_kv")(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return reference.store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def rotary_and_store_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, rotary_dim: int, is_neox: bool,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See tandem_kernels.reference.rotary_and_store_kv."""
    args = (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, rotary_dim, is_neox,
            k_scale, v_scale)
    if _use_triton(q):
        return _triton("rotary", "rotary_and_store_kv")(*args)
    return reference.rotary_and_store_kv(*args)


def extend_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    k_scale: float = 1.0, v_scale: float = 1.0, out: torch.Tensor | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """See tandem_kernels.reference.extend_attention."""
    args = (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, k_scale, v_scale)
    if _use_triton(q):
        return _triton("extend_attention", "extend_attention")(*args, out=out, new_kv=new_kv)
    return reference.extend_attention(*args, out=out, new_kv=new_kv)


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, k_scale: float = 1.0, v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See tandem_kernels.reference.paged_decode_attention."""
    args = (q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    if _use_triton(q):
        return _triton("decode_attention", "paged_decode_attention")(*args, out=out)
    return reference.paged_decode_attention(*args, out=out)


def rotary_store_and_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, rotary_dim: int, is_neox: bool,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
    v_scale: float = 1.0, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """See tandem_kernels.reference.rotary_store_and_decode."""
    args = (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, rotary_dim, is_neox, block_tables,
            context_lens, scale, k_scale, v_scale)
    if _use_triton(q):
        return _triton("decode_attention", "rotary_store_and_decode")(*args, out=out)
    return reference.rotary_store_and_decode(*args, out=out)


# ---- FP8 weights: activation quantization fused into the ops before each GEMM, and the GEMM ----

def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """See tandem_kernels.reference.quantize_fp8_per_token."""
    if _use_triton(x):
        return _triton("quant", "quantize_fp8_per_token")(x)
    return reference.quantize_fp8_per_token(x)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 x_scales: reference.DeferredScales | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See tandem_kernels.reference.rms_norm_fp8."""
    if _use_triton(x):
        return _triton("norm", "rms_norm_fp8")(x, weight, eps, x_scales)
    return reference.rms_norm_fp8(x, weight, eps, x_scales)


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    x_scales: reference.DeferredScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See tandem_kernels.reference.fused_add_rms_norm_fp8."""
    if _use_triton(x):
        return _triton("norm", "fused_add_rms_norm_fp8")(x, residual, weight, eps, x_scales)
    return reference.fused_add_rms_norm_fp8(x, residual, weight, eps, x_scales)


def silu_and_mul_fp8(x: torch.Tensor,
                     x_scales: reference.DeferredScales | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See tandem_kernels.reference.silu_and_mul_fp8."""
    if _use_triton(x):
        return _triton("activation", "silu_and_mul_fp8")(x, x_scales)
    return reference.silu_and_mul_fp8(x, x_scales)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device (the current one where `device` has no index), asked of
    the driver once per device: the one home for the launchers' capability checks."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


FP8_MIN_CAPABILITY = (8, 9)  # e4m3 in Triton's kernels and cuBLASLt's FP8 GEMMs: Ada, Hopper and later


def require_fp8_device(device: torch.device, what: str) -> None:
    """ValueError naming `what` (the flag or field that asked for e4m3) where `device` is a CUDA
    GPU older than FP8_MIN_CAPABILITY: Triton cannot build kernels that hold e4m3 values there,
    so the FP8 KV cache and FP8 weights would fail to compile mid-start-up. CPUs run the
    references and pass."""
    if device.type != "cuda":
        return
    cap = device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        need = ".".join(map(str, FP8_MIN_CAPABILITY))
        raise ValueError(f"{what}: FP8 (e4m3) needs a GPU of compute capability {need} or newer (Ada, Hopper, "
                         f"Blackwell); {device} is {cap[0]}.{cap[1]}. Serve it in bf16 or fp16 instead")


def scaled_mm_applies(q: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether fp8_linear runs as cuBLASLt's FP8 GEMM (torch._scaled_mm, row-wise scales): CUDA
    tensors on an sm_89+ device, bf16 output, K and N multiples of 16, kernels not forced to
    the reference. Otherwise it runs the float32 reference."""
    if not q.is_cuda or backend_mode() == "reference" or out_dtype != torch.bfloat16:
        return False
    n, k = weight.shape
    if k % 16 or n % 16:
        return False
    return hasattr(torch, "_scaled_mm") and device_capability(q.device) >= FP8_MIN_CAPABILITY


def fp8_linear(
    q: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """See tandem_kernels.reference.fp8_linear. On the GPU: torch._scaled_mm with a [T, 1] scale per token
    and a [1, N] scale per output channel (`weight` is [N, K] row-major, so weight.t() is the
    column-major operand cuBLASLt wants), the bias added after. Accumulation takes the fast path
    (no periodic promotion to fp32 inside the MMA loop), as vLLM's FP8 GEMMs do: 6–10% faster at
    the decode and prefill shapes (BENCHMARKS.md §15)."""
    if not scaled_mm_applies(q, weight, out_dtype):
        return reference.fp8_linear(q, x_scale, weight, weight_scale, bias, out_dtype)
    y = torch._scaled_mm(q, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), out_dtype=out_dtype,
                         use_fast_accum=True)
    return y if bias is None else y.add_(bias)


def fp8_product(q: torch.Tensor, weight: torch.Tensor, unit_scale: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
    """See tandem_kernels.reference.fp8_product. On the GPU: torch._scaled_mm with one scale per
    tensor, both `unit_scale` (a float32 1.0 on q's device, made before any graph capture), which
    cuBLASLt runs 1.2-1.5x faster than row-wise scales at M <= 384 (BENCHMARKS.md §15, §22); the
    reader of the product applies the row and column scales."""
    if not scaled_mm_applies(q, weight, out_dtype):
        return reference.fp8_product(q, weight, out_dtype)
    return torch._scaled_mm(q, weight.t(), scale_a=unit_scale, scale_b=unit_scale, out_dtype=out_dtype,
                            use_fast_accum=True)

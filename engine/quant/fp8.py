"""FP8 weights (W8A8, e4m3): `Fp8Linear` and the rewrite that puts it into a built CausalLM.

Each decoder layer's four projections become `Fp8Linear`: e4m3 weights with one float32 scale
per output channel, GEMMs through tandem_kernels.ops.fp8_linear (cuBLASLt's FP8 GEMM on the GPU, its
float32 emulation elsewhere), activations quantized per token at run time. The quantization of
the activations rides on the kernel that already runs before each GEMM:

    input_layernorm -> qkv_proj            Fp8RMSNorm: residual add + RMSNorm + quantize, one kernel
    attention -> o_proj                    Fp8Linear quantizes its bf16 input (one small kernel)
    post_attention_layernorm -> gate_up    Fp8RMSNorm
    gate_up -> mlp.act -> down_proj        SiluAndMulFp8: SiLU-and-multiply + quantize, one kernel

The norm and the activation hand the projection an `Fp8Activation` (e4m3 rows + [T, 1] scales)
in place of a tensor; the model's forward passes it through untouched. Embeddings, the final
norm, q/k norms and lm_head stay in the model dtype. Tensor-parallel models are refused: their
projections are not plain nn.Linear (ValueError naming --quantization).

Deferred scales. cuBLASLt's FP8 GEMM with one scale per tensor is 1.2-1.5x faster than with a
scale per row and column at up to a few hundred rows (BENCHMARKS.md §15), the decode steps'
sizes. So where the kernel that reads a projection's output is one of ours, the projection
stops at the unscaled product and hands on an `Fp8Product`; the reader applies the scales as it
loads (rounding to the model dtype, so it sees what the scaled GEMM would have stored):

    o_proj -> post_attention_layernorm     Fp8RMSNorm
    gate_up -> mlp.act                      SiluAndMulFp8
    down_proj -> next input_layernorm       Fp8RMSNorm (not the last layer's: the final norm is bf16)

Up to DEFERRED_MAX_ROWS rows (above them the row-wise GEMM is as fast); not where a bias is
added or a sandwich norm (GLM-4) reads the output. Off unless TANDEM_FP8_DEFERRED_SCALES=1: on
the H200 the offline FP8 run was no faster with it (15,111 vs 15,170 out tok/s, BENCHMARKS.md §23).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from engine.model import MLP, CausalLM, RMSNorm
from tandem_kernels import ops
from tandem_kernels.reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8",)
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
DEFERRED_SCALES_ENV = "TANDEM_FP8_DEFERRED_SCALES"  # "1": defer where our kernels read the product
DEFERRED_MAX_ROWS = 512  # measured (§15): per-tensor 1.47x row-wise at 64 rows, 1.19x at 384, 0.98x at 1,024


class Fp8Activation(NamedTuple):
    """Activation rows quantized per token: x ~= data * scale."""

    data: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32


class Fp8Product(NamedTuple):
    """A projection's output with its scales not yet applied: y ~= data * row_scale * col_scale
    (tandem_kernels.reference.apply_deferred_scales)."""

    data: torch.Tensor  # [T, N] in the model dtype: the unscaled product
    row_scale: torch.Tensor  # [T, 1] float32: the input's per-token scales
    col_scale: torch.Tensor  # [N] float32: the weight's per-channel scales

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.row_scale, self.col_scale


def deferred_scales_enabled() -> bool:
    return os.environ.get(DEFERRED_SCALES_ENV, "0") == "1"


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (e4m3 [N, K], float32 scale [N]) with weight ~= q * scale[:, None]."""
    wf = weight.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8Linear(nn.Module):
    """y [T, N] = x [T, K] W^T (+ b), W held as e4m3 `weight` [N, K] times float32
    `weight_scale` [N]; x a tensor (quantized here, per token) or an Fp8Activation."""

    def __init__(self, in_features: int, out_features: int, bias: bool, out_dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                         requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=out_dtype, device=device), requires_grad=False)
                     if bias else None)
        self.defers_scales = False  # set by convert_to_fp8 where the output's reader applies them
        # The per-tensor GEMM's scales: a buffer, so it exists (filled) before any graph capture.
        self.register_buffer("unit_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """Quantize `linear`'s weight per output channel (its bias kept in the model dtype)."""
        w = linear.weight.data
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
        q, scale = quantize_weight_per_channel(w)
        layer.weight.data, layer.weight_scale.data = q, scale
        if linear.bias is not None:
            layer.bias.data = linear.bias.data
        return layer

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor | Fp8Product:
        """The output, or an Fp8Product where this projection defers its scales (defers_scales,
        at most DEFERRED_MAX_ROWS rows)."""
        q, scale = x if isinstance(x, Fp8Activation) else ops.quantize_fp8_per_token(x)
        if self.defers_scales and q.shape[0] <= DEFERRED_MAX_ROWS:
            return Fp8Product(ops.fp8_product(q, self.weight, self.unit_scale, self.out_dtype), scale,
                              self.weight_scale)
        return ops.fp8_linear(q, scale, self.weight, self.weight_scale, self.bias, self.out_dtype)

    def extra_repr(self) -> str:
        deferred = ", scales deferred to the reader" if self.defers_scales else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel{deferred}"


class Fp8RMSNorm(RMSNorm):
    """RMSNorm (with the residual add) whose output is quantized per token for an Fp8Linear."""

    @classmethod
    def from_norm(cls, norm: RMSNorm) -> Fp8RMSNorm:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.weight, layer.eps = norm.weight, norm.eps
        return layer

    def forward(self, x: torch.Tensor | Fp8Product, residual: torch.Tensor | None = None):
        x, scales = (x.data, x.scales) if isinstance(x, Fp8Product) else (x, None)
        if residual is None:
            return Fp8Activation(*ops.rms_norm_fp8(x, self.weight, self.eps, scales))
        q, scale, summed = ops.fused_add_rms_norm_fp8(x, residual, self.weight, self.eps, scales)
        return Fp8Activation(q, scale), summed


class SiluAndMulFp8(nn.Module):
    """MLP.act for an Fp8Linear down_proj: [T, 2I] -> Fp8Activation of silu(gate) * up."""

    def forward(self, x: torch.Tensor | Fp8Product) -> Fp8Activation:
        if isinstance(x, Fp8Product):
            return Fp8Activation(*ops.silu_and_mul_fp8(x.data, x.scales))
        return Fp8Activation(*ops.silu_and_mul_fp8(x))


Skip = Callable[[str], bool]  # model module name (e.g. "layers.0.mlp.down_proj") -> keep unquantized


def convert_to_fp8(model: CausalLM, quantize_weights: bool = True, skip: Skip | None = None) -> list[str]:
    """Rewrite `model`'s projections (in place) to Fp8Linear, and the norm / activation before
    each to its FP8 variant. quantize_weights: quantize the weights the modules hold; else
    leave empty FP8 modules for a checkpoint loader to fill. Projections already FP8 stay.
    Returns the names of the projections left unquantized (`skip`)."""
    kept: list[str] = []
    for i, layer in enumerate(model.layers):
        for path in PROJECTIONS:
            owner_name, attr = path.split(".")
            owner = getattr(layer, owner_name)
            module = getattr(owner, attr)
            name = f"layers.{i}.{path}"
            if isinstance(module, Fp8Linear):
                continue
            if type(module) is not nn.Linear:
                raise ValueError(
                    f"quantization: {name} is a {type(module).__name__}, not a plain Linear; FP8 weights "
                    "(--quantization fp8, or an FP8 checkpoint) need the whole model in one process, not "
                    "tensor parallelism (--tp > 1)")
            if skip is not None and skip(name):
                kept.append(name)
                continue
            if quantize_weights:
                new = Fp8Linear.from_linear(module)
            else:
                w = module.weight
                new = Fp8Linear(module.in_features, module.out_features, module.bias is not None, w.dtype, w.device)
            setattr(owner, attr, new)
            del module
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(attn.qkv_proj, Fp8Linear) and not isinstance(layer.input_layernorm, Fp8RMSNorm):
            layer.input_layernorm = Fp8RMSNorm.from_norm(layer.input_layernorm)
        if isinstance(mlp.gate_up_proj, Fp8Linear) and not isinstance(layer.post_attention_layernorm, Fp8RMSNorm):
            layer.post_attention_layernorm = Fp8RMSNorm.from_norm(layer.post_attention_layernorm)
        if isinstance(mlp.down_proj, Fp8Linear) and isinstance(mlp, MLP):
            mlp.act = SiluAndMulFp8()
    defer_scales(model, deferred_scales_enabled())
    return kept


def defer_scales(model: CausalLM, enabled: bool = True) -> int:
    """Set each FP8 projection's defers_scales: on (with `enabled`) where no bias is added and the
    kernel that reads its output applies scales (the module docstring's three readers). Returns
    how many defer."""
    layers = list(model.layers)
    deferring = 0
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        following = layers[i + 1] if i + 1 < len(layers) else None
        readers = {
            attn.o_proj: isinstance(layer.post_attention_layernorm, Fp8RMSNorm)
            and layer.post_self_attn_layernorm is None,
            mlp.gate_up_proj: isinstance(getattr(mlp, "act", None), SiluAndMulFp8),
            mlp.down_proj: following is not None and isinstance(following.input_layernorm, Fp8RMSNorm)
            and layer.post_mlp_layernorm is None,
        }
        for proj, reader_scales in readers.items():
            if isinstance(proj, Fp8Linear):
                proj.defers_scales = enabled and reader_scales and proj.bias is None
                deferring += proj.defers_scales
    return deferring  # qkv_proj never defers: rotary and the q/k norms read its output


def apply_quantization(model: CausalLM, method: str | None) -> CausalLM:
    """Quantize a loaded model's weights in place (`EngineConfig.quantization`); None: no-op.
    Frees the replaced weights' device memory before returning (the KV cache is sized after)."""
    if method is None:
        return model
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {QUANTIZATIONS} or None, got {method!r}")
    device = model.embed_tokens.weight.device
    with torch.no_grad():
        convert_to_fp8(model, quantize_weights=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    fp8 = sum(isinstance(m, Fp8Linear) for m in model.modules())
    logger.info("FP8 weights: %d projections in e4m3 with per-channel scales", fp8)
    return model

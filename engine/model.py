"""The one decoder-only transformer definition for every supported family (config decides the differences).

Linear layers are merged (qkv_proj, gate_up_proj) for fewer, larger matmuls; the weight loader
maps Hugging Face names onto them. Attention reads and writes the paged KV cache via tandem_kernels.ops.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
from torch import nn

from engine.attention import AttentionMetadata, attend, extend_new_kv_enabled, fused_rotary_enabled
from engine.config import ModelConfig
from engine.rope import build_cos_sin_cache
from tandem_kernels import ops
from tandem_kernels.gemv_tilings import default_fused_projections
from tandem_kernels.ops import GEMV_MAX_ROWS, GEMV_PROJECTIONS

FUSED_GEMV_ENV = "TANDEM_FUSED_GEMV"  # comma-separated projections fused_decode_gemv fuses (A/B runs)
FUSED_GEMV_ROWS_ENV = "TANDEM_FUSED_GEMV_ROWS"  # decode steps of at most this many tokens fuse (A/B runs)
# Which projections fuse by default, their tiles and (for FP8 weights) at how many rows, is the
# GPU's (tandem_kernels/gemv_tilings.py DEVICE_TILINGS, FP8_DEVICE_ROWS): one row elsewhere.


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    """A layer's attention: its projections, and `core` between them (DecoderLayer.forward runs
    them, each projection through cuBLAS or a fused decode GEMV)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.rotary_dim = config.rotary_dim
        self.is_neox = not config.rope_interleaved
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # Read once, at build (the variables are for A/B runs: a process sets them before its engine).
        self.fused_rotary = fused_rotary_enabled()
        self.extend_new_kv = extend_new_kv_enabled()

    def core(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Attention between the projections: qkv [T, q + 2 kv] -> [T, q_size], K/V stored."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # q: [tokens, heads, head_dim]
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_cache
        if meta.is_decode and self.fused_rotary:  # one kernel: rotary, the step's K/V stored, attention
            return ops.rotary_store_and_decode(
                q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping, self.rotary_dim,
                self.is_neox, meta.block_tables, meta.seq_lens, self.scale, meta.k_scale, meta.v_scale,
            ).reshape(t, self.q_size)
        q, k_rot = ops.rotary_and_store_kv(
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping,
            self.rotary_dim, self.is_neox, meta.k_scale, meta.v_scale,
        )
        new_kv = (k_rot, v) if not meta.is_decode and self.extend_new_kv else None
        return attend(q, k_cache, v_cache, meta, self.scale, new_kv).reshape(t, self.q_size)


class SiluAndMul(nn.Module):
    """[T, 2I] -> [T, I] = silu(gate) * up; a module so that a rewrite (engine/quant) can swap it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)


class MLP(nn.Module):
    """A layer's MLP: gate_up, act, down (DecoderLayer.forward runs them, as for Attention)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = SiluAndMul()


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        # GLM-4 normalizes each sublayer's output before it joins the residual stream.
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, eps) if config.sandwich_norm else None
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, eps) if config.sandwich_norm else None
        self.fused_decode: frozenset[str] = frozenset()  # see enable_fused_decode
        self.fused_rows = 0

    def enable_fused_decode(self, projections: Iterable[str] | None = None, rows: int | None = None) -> bool:
        """Run decode steps of at most `rows` tokens (None: fused_gemv_rows()) with `projections`
        (of GEMV_PROJECTIONS; None: fused_gemv_projections()) as fused GEMVs (tandem_kernels.ops.gemv:
        qkv with the norm in front, gate_up with the norm in front and SiLU-and-multiply behind);
        the others keep their unfused ops. FP8 projections (engine/quant/fp8.py: e4m3 `weight`,
        `weight_scale` per output row) fuse with their weights as stored and the activations
        unquantized; a layer holding any fuses all four or none, since its unfused norms and
        activation hand on FP8 values the fused GEMVs do not take. A projection another rewrite
        replaced (tensor-parallel), or one other than qkv with a bias, keeps the unfused path.
        Returns whether any projection is fused."""
        linears = self.projections()
        wanted = fused_gemv_projections() if projections is None else frozenset(projections)
        if not wanted <= set(GEMV_PROJECTIONS):
            raise ValueError(f"fused GEMV projections must be among {GEMV_PROJECTIONS}, got {sorted(wanted)}")
        self.fused_rows = fused_gemv_rows() if rows is None else rows
        if not 1 <= self.fused_rows <= GEMV_MAX_ROWS:
            raise ValueError(f"fused GEMV rows must be in [1, {GEMV_MAX_ROWS}], got {self.fused_rows}")
        fusable = {name for name, linear in linears.items()
                   if (type(linear) is nn.Linear or is_fp8_projection(linear))
                   and (name == "qkv" or linear.bias is None)}
        fused = wanted & fusable
        if any(is_fp8_projection(linear) for linear in linears.values()) and fused != set(GEMV_PROJECTIONS):
            fused = set()
        self.fused_decode = frozenset(fused)
        return bool(self.fused_decode)

    def projections(self) -> dict[str, nn.Module]:
        """The layer's four projections by their GEMV_PROJECTIONS names."""
        attn, mlp = self.self_attn, self.mlp
        return {"qkv": attn.qkv_proj, "o_proj": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}

    def forward(self, positions, x, residual, kv_cache, meta, cos_sin_cache):
        """One layer: x, residual -> x, residual. In decode steps of at most self.fused_rows tokens
        the projections in self.fused_decode run as fused GEMVs, with the norm in front of qkv and
        gate_up and the SiLU-and-multiply behind gate_up folded in; every other op is the same.
        The three phases are the layer's order of ops; engine/nano_batch.py runs them apart."""
        fused = self.fused_projections(x, meta)
        qkv, residual = self.before_attention(x, residual, fused)
        a = self.self_attn.core(positions, qkv, kv_cache, meta, cos_sin_cache)
        return self.after_attention(a, residual, fused)

    def fused_projections(self, x: torch.Tensor, meta: AttentionMetadata) -> frozenset[str]:
        """The projections this step runs as fused GEMVs: self.fused_decode in decode steps of at
        most self.fused_rows tokens, else none."""
        return self.fused_decode if meta.is_decode and x.shape[0] <= self.fused_rows else frozenset()

    def before_attention(self, x, residual, fused: frozenset[str]):
        """The input norm (adding x to the residual stream) and the qkv projection: -> qkv, residual."""
        attn, norm = self.self_attn, self.input_layernorm
        if "qkv" in fused:
            qkv, new_residual = ops.gemv(x, attn.qkv_proj.weight, attn.qkv_proj.bias, residual=residual,
                                         norm_weight=norm.weight, eps=norm.eps,
                                         weight_scale=_weight_scale(attn.qkv_proj), projection="qkv")
            return qkv, (x if residual is None else new_residual)
        if residual is None:
            residual, x = x, norm(x)
        else:
            x, residual = norm(x, residual)
        return attn.qkv_proj(x), residual

    def after_attention(self, a, residual, fused: frozenset[str]):
        """o_proj, the MLP and the norms between: attention output a, residual -> x, residual."""
        attn, mlp = self.self_attn, self.mlp
        if "o_proj" in fused:
            o = ops.gemv(a, attn.o_proj.weight, weight_scale=_weight_scale(attn.o_proj), projection="o_proj")[0]
        else:
            o = attn.o_proj(a)
        if self.post_self_attn_layernorm is not None:
            o = self.post_self_attn_layernorm(o)
        norm = self.post_attention_layernorm
        if "gate_up" in fused:
            act, residual = ops.gemv(o, mlp.gate_up_proj.weight, residual=residual, norm_weight=norm.weight,
                                     eps=norm.eps, silu_pair=True, weight_scale=_weight_scale(mlp.gate_up_proj),
                                     projection="gate_up")
        else:
            h, residual = norm(o, residual)
            act = mlp.act(mlp.gate_up_proj(h))
        if "down" in fused:
            x = ops.gemv(act, mlp.down_proj.weight, weight_scale=_weight_scale(mlp.down_proj), projection="down")[0]
        else:
            x = mlp.down_proj(act)
        if self.post_mlp_layernorm is not None:
            x = self.post_mlp_layernorm(x)
        return x, residual


def is_fp8_projection(linear: nn.Module) -> bool:
    """Whether `linear` holds e4m3 weights with a scale per output row (engine/quant/fp8.py
    Fp8Linear), which the fused decode GEMV streams as they are."""
    weight, scale = getattr(linear, "weight", None), getattr(linear, "weight_scale", None)
    return isinstance(weight, torch.Tensor) and weight.dtype == torch.float8_e4m3fn and scale is not None


def _weight_scale(linear: nn.Module) -> torch.Tensor | None:
    return linear.weight_scale if is_fp8_projection(linear) else None


def fused_decode_projections(setting: bool | None, device: torch.device, fp8_weights: bool = False) -> frozenset[str]:
    """The projections EngineConfig.fused_decode_gemv (`setting`) fuses on `device`: None: the
    GPU's (gemv_tilings.default_fused_projections, for FP8 weights with `fp8_weights`: all four
    where the fused GEMV beat cuBLASLt's FP8 GEMM; none on a CPU or a GPU not measured), True:
    all of GEMV_PROJECTIONS, False: none. FUSED_GEMV_ENV's names replace the first two."""
    if setting is None:
        if device.type != "cuda":
            return frozenset()
        return fused_gemv_projections(default_fused_projections(device, fp8_weights))
    return fused_gemv_projections() if setting else frozenset()


def fused_gemv_projections(default: Iterable[str] = GEMV_PROJECTIONS) -> frozenset[str]:
    """The projections fused_decode_gemv fuses: FUSED_GEMV_ENV's comma-separated names where set
    (A/B runs), else `default` (the engine passes its GPU's, gemv_tilings.default_fused_projections)."""
    raw = os.environ.get(FUSED_GEMV_ENV)
    if raw is None:
        return frozenset(default)
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    if not names <= set(GEMV_PROJECTIONS):
        raise ValueError(f"{FUSED_GEMV_ENV}: names must be among {GEMV_PROJECTIONS}, got {raw!r}")
    return names


LayerHook = Callable[[int], None]


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden states [T, hidden]; logits() projects rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # float32 whatever the model dtype, on the model's device (kernels read it directly).
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(config, self.embed_tokens.weight.device),
                             persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        after_layer: LayerHook | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, kv_caches[i], meta, self.cos_sin_cache)
            if after_layer is not None:
                after_layer(i)  # the layer's K/V are in the cache now: a transfer may push them
        x, _ = self.norm(x, residual)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] in the model's dtype, as the LM head's GEMM writes them: the sampler widens
        to float32 only where it computes (penalties, temperature, log-probs); a greedy row's
        argmax is the same on either. (Widening every row here cost an FP8 decode step of 512
        rows a 263 MB copy, ~0.19 ms, and its argmax twice the bytes; BENCHMARKS.md §28.)"""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.matmul(hidden, weight.t())


def fused_gemv_rows(default: int = 1) -> int:
    """The most tokens a decode step may have for its projections to run as fused GEMVs:
    FUSED_GEMV_ROWS_ENV where set (A/B runs), else `default` (the engine passes its GPU's,
    gemv_tilings.default_fused_rows)."""
    raw = os.environ.get(FUSED_GEMV_ROWS_ENV)
    if raw is None:
        return default
    try:
        rows = int(raw)
    except ValueError:
        rows = 0
    if not 1 <= rows <= GEMV_MAX_ROWS:
        raise ValueError(f"{FUSED_GEMV_ROWS_ENV}: must be an integer in [1, {GEMV_MAX_ROWS}], got {raw!r}")
    return rows

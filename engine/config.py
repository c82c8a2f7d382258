"""The engine's settings (`EngineConfig`) and the model configuration read from a Hugging Face
config.json (`ModelConfig`), where family differences become fields.

One plain model definition (engine/model.py) serves every family; `ModelConfig` is where Llama,
Mistral, Qwen2, Qwen3 and GLM differ.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "glm", "glm4")
KV_CACHE_DTYPES = ("auto", "fp8")
KV_CACHE_LAYOUTS = ("nhd", "hnd")  # engine/kv_cache.py
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("fp8",)  # engine/quant
MAX_PREFILL_GRAPH_TOKENS = 8192  # the largest prefill_graph_tokens (its graphs' activations stay in their pool)
# The context a running sequence is expected to hold: what a derived max_running plans for
# (engine/memory.py, an SGLang-like derivation) and where overlapped decode halves are timed
# (engine/nano_batch.py).
EXPECTED_CONTEXT_TOKENS = 2048

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(value: str | torch.dtype | None, field_name: str = "dtype") -> torch.dtype | None:
    """Map 'bfloat16' / torch.bfloat16 / None to a torch dtype; ValueError naming the field otherwise."""
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and value not in _DTYPES.values():
            raise ValueError(f"{field_name}: unsupported dtype {value}; use float32, bfloat16 or float16")
        return value
    key = str(value).lower().removeprefix("torch.")
    if key == "auto":
        return None
    if key not in _DTYPES:
        raise ValueError(f"{field_name}: unsupported dtype {value!r}; use float32, bfloat16 or float16")
    return _DTYPES[key]


@dataclass(frozen=True)
class EngineConfig:
    """One engine's settings; `__post_init__` raises ValueError naming the first invalid field."""

    model_path: str
    dtype: str | torch.dtype | None = None  # None: the checkpoint's dtype (float32 on CPU)
    block_size: int = 16  # a power of two in [16, 64] (DESIGN §2)
    num_kv_blocks: int | None = None  # None: derived from memory
    max_running: int | None = None  # None: from the KV pool and max_model_len (engine/memory.py)
    max_batched_tokens: int = 4096
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    load_format: str = "auto"  # "auto" (the checkpoint's weights) or "dummy" (random weights)
    device: str | None = None  # None: cuda when available, else cpu
    enable_prefix_cache: bool = True
    swap_space_gb: float = 1.0  # host memory for preempted requests' KV
    kv_cache_dtype: str = "auto"  # "auto" (model dtype) or "fp8" (e4m3)
    # How a block is stored: "nhd" (its slots in order, each slot's KV heads together) or "hnd"
    # (each KV head's slots together); indexed as [blocks, block_size, kv_heads, head_dim]
    # either way (engine/kv_cache.py).
    kv_cache_layout: str = "nhd"
    gpu_memory_fraction: float = 0.90
    cpu_kv_cache_gb: float = 1.0
    seed: int | None = None
    cuda_graphs: bool = True  # capture decode graphs on CUDA devices
    # Capture prefill graphs for pure prefill steps of up to this many tokens on CUDA devices
    # (engine/prefill_graphs.py); 0: none. A prefill worker sets it (its steps are host-bound
    # below a few thousand tokens); LLM's large mixed steps are not.
    prefill_graph_tokens: int = 0
    # Decode steps of one token (of up to two with FP8 weights on an H100:
    # gemv_tilings.FP8_DEVICE_ROWS) run projections as fused GEMVs with the norms and SiLU inside
    # (DecoderLayer.enable_fused_decode). None: those that beat cuBLAS on this GPU
    # (tandem_kernels/gemv_tilings.py DEVICE_TILINGS; none on a CPU or a GPU not measured; for
    # FP8 weights all four where gemv_tilings.FP8_DEVICE_TILINGS names the GPU);
    # True: all four; False: none (BENCHMARKS.md §32-33, §38-39).
    fused_decode_gemv: bool | None = None
    # Overlap the host's scheduling of step n+1 with the device's step n (see Engine.step).
    # None: $TANDEM_OVERLAP_SCHEDULE ("1" or "0") if set, else on for CUDA devices. Never with
    # tensor parallelism.
    overlap_schedule: bool | None = None
    # Run a few synthetic steps at start-up on CUDA devices (`Engine.warm_up`), so that Triton's
    # compiles land before the first request rather than in its latency.
    warm_up: bool = True
    # Weight quantization at load: "fp8" (e4m3 weights, per-channel scales, per-token activation
    # scales; engine/quant/fp8.py) or None (the checkpoint's weights as they are; an FP8
    # checkpoint loads as FP8 either way).
    quantization: str | None = None
    # A rendezvous directory (engine/shared_weights.py) where the processes on one device keep one
    # copy of the weights: the first loads them, the others map them. None: this process's own copy.
    shared_weights_dir: str | None = None
    # Whether this process's memory budget (gpu_memory_fraction) holds the shared weights: true
    # for one process of those sharing (tandem up: the decode worker), false for the others,
    # whose budget then holds no weights at all.
    shared_weights_charged: bool = True

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path: a model directory is required")
        parse_dtype(self.dtype)
        bs = self.block_size
        if not (_is_int(bs) and 16 <= bs <= 64 and bs & (bs - 1) == 0):
            raise ValueError(f"block_size: must be a power of two in [16, 64], got {bs!r}")
        for name in ("max_batched_tokens",):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 1):
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if not (_is_int(self.prefill_graph_tokens) and 0 <= self.prefill_graph_tokens <= MAX_PREFILL_GRAPH_TOKENS):
            raise ValueError(f"prefill_graph_tokens: must be an integer in [0, {MAX_PREFILL_GRAPH_TOKENS}], "
                             f"got {self.prefill_graph_tokens!r}")
        for name in ("num_kv_blocks", "max_model_len", "max_running"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 1):
                raise ValueError(f"{name}: must be a positive integer or None, got {value!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.kv_cache_layout not in KV_CACHE_LAYOUTS:
            raise ValueError(f"kv_cache_layout: must be one of {KV_CACHE_LAYOUTS}, got {self.kv_cache_layout!r}")
        if not (_is_number(self.gpu_memory_fraction) and 0 < self.gpu_memory_fraction <= 1):
            raise ValueError(f"gpu_memory_fraction: must be in (0, 1], got {self.gpu_memory_fraction!r}")
        if not (_is_number(self.swap_space_gb) and self.swap_space_gb >= 0):
            raise ValueError(f"swap_space_gb: must be >= 0, got {self.swap_space_gb!r}")
        if not (_is_number(self.cpu_kv_cache_gb) and self.cpu_kv_cache_gb > 0):
            raise ValueError(f"cpu_kv_cache_gb: must be > 0, got {self.cpu_kv_cache_gb!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed: must be an integer or None, got {self.seed!r}")
        if self.shared_weights_dir is not None and not (isinstance(self.shared_weights_dir, str)
                                                        and self.shared_weights_dir):
            raise ValueError(f"shared_weights_dir: a directory path or None, got {self.shared_weights_dir!r}")
        for name in ("enable_prefix_cache", "cuda_graphs", "warm_up", "shared_weights_charged"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        if self.fused_decode_gemv is not None and not isinstance(self.fused_decode_gemv, bool):
            raise ValueError(f"fused_decode_gemv: must be a bool or None, got {self.fused_decode_gemv!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.overlap_schedule is not None and not isinstance(self.overlap_schedule, bool):
            raise ValueError(f"overlap_schedule: must be a bool or None, got {self.overlap_schedule!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    partial_rotary_factor: float = 1.0
    rope_interleaved: bool = False  # GLM rotates interleaved pairs; the rest rotate halves
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sandwich_norm: bool = False  # GLM-4: extra norms after attention and after the MLP
    tie_word_embeddings: bool = False
    torch_dtype: torch.dtype = torch.float32
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_params(self) -> int:
        """Weights of one decoder layer's four projections (qkv, o_proj, gate_up, down)."""
        h = self.hidden_size
        return h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * self.intermediate_size

    def projection_channels(self) -> int:
        """Output channels of one decoder layer's four projections (qkv, o_proj, gate_up, down)."""
        h = self.hidden_size
        return (self.q_size + 2 * self.kv_size) + h + 2 * self.intermediate_size + h

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, v = self.hidden_size, self.vocab_size
        per_layer = self.projection_params() + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + lm_head

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json: model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise ValueError(f"config.json: {key} must be a positive integer, got {cfg.get(key)!r}")
        num_heads = cfg["num_attention_heads"]
        num_kv_heads = cfg.get("num_key_value_heads") or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"config.json: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads

        # transformers 5 folds rope_theta/rope_scaling into rope_parameters; accept both layouts.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = float(rope_params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope_params.get("rope_type") or (rope_scaling or {}).get("rope_type") or (rope_scaling or {}).get("type")
        if rope_type in (None, "default"):
            rope_scaling = None
        elif rope_type == "llama3":
            rope_scaling = {**(rope_scaling or {}), **rope_params, "rope_type": "llama3"}
        else:
            raise ValueError(f"config.json: rope type {rope_type!r} is not supported (default and llama3 are)")
        partial = float(rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))

        is_glm = model_type in ("glm", "glm4")
        if is_glm and "partial_rotary_factor" not in rope_params and "partial_rotary_factor" not in cfg:
            partial = 0.5
        qkv_bias = bool(cfg.get("attention_bias", model_type in ("qwen2", "glm", "glm4")))
        if model_type == "qwen2":
            qkv_bias = True
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} is not supported (silu is)")

        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        sliding = cfg.get("sliding_window") if (model_type == "mistral" or cfg.get("use_sliding_window")) else None
        dtype = parse_dtype(cfg.get("torch_dtype") or cfg.get("dtype") or "float32", "config.json torch_dtype")
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            partial_rotary_factor=partial,
            rope_interleaved=is_glm,
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            sandwich_norm=model_type == "glm4",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            torch_dtype=dtype or torch.float32,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding,
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model_path: no config.json in {model_dir}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"config.json: not valid JSON ({e})") from e
        return cls.from_dict(cfg)

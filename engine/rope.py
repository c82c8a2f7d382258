"""Rotary-embedding frequency tables (default and Llama 3.1 scaling), in the cos|sin layout kernels use."""
from __future__ import annotations

import math

import torch

from engine.config import ModelConfig
from tandem_kernels.reference import rope_cos_sin_cache


def inv_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.rotary_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type") == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling, config.max_position_embeddings)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: dict, max_positions: int) -> torch.Tensor:
    factor = float(s["factor"])
    low = float(s.get("low_freq_factor", 1.0))
    high = float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s.get("original_max_position_embeddings", max_positions))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def build_cos_sin_cache(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_position_embeddings, rotary_dim] float32: cos in the first half, sin in the second."""
    return rope_cos_sin_cache(config.max_position_embeddings, config.rotary_dim, inv_frequencies(config).to(device))

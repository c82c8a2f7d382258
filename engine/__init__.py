"""Tandem's inference engine: models, paged KV cache, radix prefix cache, sampler, scheduler.

`from engine import LLM, SamplingParams` for offline generation; workers use `Engine`.
"""
from __future__ import annotations

from tandem.types import SamplingParams, Tier

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "Tier"]


def __getattr__(name: str):
    # Lazy so that light submodules (engine.config, engine.block_allocator) import without torch models.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "Engine":
        from engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)

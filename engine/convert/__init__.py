"""Converters from other checkpoint formats into Hugging Face model directories.

`convert_llama2c` turns a llama2.c checkpoint plus its tokenizer.bin into a directory that
both the engine and transformers' `LlamaForCausalLM` / `AutoTokenizer` load.
"""
from __future__ import annotations

from engine.convert.llama2c import convert_llama2c, main_convert

__all__ = ["convert_llama2c", "main_convert"]

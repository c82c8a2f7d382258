"""Tandem client SDK: `from tandem import Client, AsyncClient, SamplingParams, Tier`."""
from __future__ import annotations

from tandem.types import SamplingParams, Tier

__all__ = ["SamplingParams", "Tier"]

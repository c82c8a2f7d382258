"""Tables keyed by GPU family: the one rule for reading them by a GPU's product name.

A family is a substring of the name torch or nvidia-smi reports ("H100" in "NVIDIA H100 80GB
HBM3"). Torch-free (this package's __init__ imports nothing), so that a benchmark's parent
process reads tables by the kernels' rule without importing torch.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


def family_of(name: str | None, families: Mapping[str, object]) -> str | None:
    """The first key of `families` that is a substring of GPU `name`; None where none is (or no name)."""
    return next((family for family in families if name and family in name), None)


def family_entry(table: Mapping[str, T], name: str | None, default: T) -> T:
    """`table`'s entry for the family of GPU `name` (the first key found in the name), else `default`."""
    family = family_of(name, table)
    return default if family is None else table[family]

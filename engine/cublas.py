"""cuBLAS's workspace in an engine's process: none, unless the process names one.

cuBLAS picks split-K kernels for skinny GEMMs (a decode step's few rows against a whole weight)
only when it has a workspace to reduce their partial sums in; torch gives it 32 MiB on Hopper.
Those kernels, and the reduce kernels after them, made batch-1 decode 1.3-1.4% slower than the
kernels cuBLAS picks without a workspace (`CUBLAS_WORKSPACE_CONFIG=:0:0`), and the online
1024/256 run's TPOT P50 1.5-4.5% slower; prefill's and full batches' GEMMs, which split no K,
ran the same (BENCHMARKS.md §17, §24, §25). So an engine on a GPU sets that variable where the
process has not. torch reads it once, when the process first creates a cuBLAS handle: set
before any GEMM on the GPU (the Engine sets it before loading the model), or it changes nothing.
"""
from __future__ import annotations

import os

WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
NO_WORKSPACE = ":0:0"


def default_no_workspace() -> bool:
    """Set CUBLAS_WORKSPACE_CONFIG to ':0:0' unless it is set (a user's value, e.g. torch's Hopper
    default ':4096:8', wins); returns whether this call set it."""
    if os.environ.get(WORKSPACE_ENV):
        return False
    os.environ[WORKSPACE_ENV] = NO_WORKSPACE
    return True

"""What `tandem up` asks nvidia-smi about a GPU, so that it never opens a CUDA context itself:
its memory (the workers' shares are sized from it) and its compute capability (FP8 needs 8.9+);
the benchmarks ask its name, `tandem up --mps` its UUID.

Each answer is asked once per GPU, field and nvidia-smi executable; None wherever nvidia-smi is
missing, fails or answers something else."""
from __future__ import annotations

import functools
import logging
import shutil
import subprocess

logger = logging.getLogger(__name__)


def memory_bytes(physical_gpu: str) -> int | None:
    """Total memory of one GPU (an index or UUID as CUDA_VISIBLE_DEVICES names it)."""
    return parse_memory_mib(_ask(physical_gpu, "memory.total") or "")


def compute_capability(physical_gpu: str) -> tuple[int, int] | None:
    """(major, minor) of one GPU, e.g. (9, 0) for an H100 or H200."""
    return parse_compute_cap(_ask(physical_gpu, "compute_cap") or "")


def name(physical_gpu: str) -> str | None:
    """The GPU's product name, e.g. "NVIDIA H100 80GB HBM3"."""
    return _first_line(_ask(physical_gpu, "name") or "") or None


def uuid(physical_gpu: str) -> str | None:
    """The GPU's UUID ("GPU-8a2c..."), the name that stays the same whatever CUDA_VISIBLE_DEVICES says."""
    first = _first_line(_ask(physical_gpu, "uuid") or "")
    return first if first.startswith(("GPU-", "MIG-")) else None


def parse_memory_mib(text: str) -> int | None:
    """Bytes from nvidia-smi's `memory.total` in MiB (its first line); None for anything else."""
    first = _first_line(text)
    return int(first) * (1 << 20) if first.isdigit() and int(first) > 0 else None


def parse_compute_cap(text: str) -> tuple[int, int] | None:
    """(major, minor) from nvidia-smi's `compute_cap` ("8.9"; its first line); None for anything else."""
    major, dot, minor = _first_line(text).partition(".")
    return (int(major), int(minor)) if dot and major.isdigit() and minor.isdigit() else None


def _first_line(text: str) -> str:
    """The first line of nvidia-smi's answer (one line a GPU it was asked about), stripped."""
    return text.strip().splitlines()[0].strip() if text.strip() else ""


def _ask(physical_gpu: str, field: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    return None if exe is None else _asked(exe, physical_gpu, field)


@functools.lru_cache(maxsize=128)
def _asked(exe: str, physical_gpu: str, field: str) -> str | None:
    try:
        return subprocess.run([exe, f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", physical_gpu],
                              capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("nvidia-smi could not tell GPU %s's %s (%s)", physical_gpu, field, exc)
        return None

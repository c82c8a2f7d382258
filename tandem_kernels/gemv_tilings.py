"""Which decode GEMVs a GPU runs fused, and how each is tiled there (no triton import).

The fused GEMVs (tandem_kernels.gemv) win or lose against cuBLAS by the card: at batch 1 on an
H100 all four of a layer's projections stream faster fused (the step 5.6% faster end to end), on
an H200 only o_proj and down do (qkv and gate_up, cuBLAS already at 0.93-1.0 of copy there, lose
1-2% of the step), and their fastest tiles differ (BENCHMARKS.md §32-33). `DEVICE_TILINGS` holds,
per GPU family, the projections it fuses by default and each one's tiling, as measured there;
a GPU no entry names fuses none by default (cuBLAS is the safe choice where nothing was
measured) and takes `FALLBACK_TILINGS` when a caller asks for fused GEMVs anyway.

FP8 weights (e4m3, half the bytes a row) have their own table, `FP8_DEVICE_TILINGS`: a GPU it
names fuses all four projections of an FP8 model by default (there the fused GEMV beats
cuBLASLt's FP8 GEMM at one row), each at that tiling, in steps of up to `FP8_DEVICE_ROWS` tokens,
and from some row count up at `FP8_SEVERAL_ROW_TILINGS`' tiles where a GPU has them; elsewhere
FP8 projections keep cuBLASLt unless asked, and then take the bf16 tiling.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from tandem_kernels.gpu_family import family_entry
from tandem_kernels.ops import GEMV_PROJECTIONS as PROJECTIONS

TILING_ENV = "TANDEM_GEMV_TILING"  # JSON: GemvTiling fields over every default, or {projection: fields}


@dataclass(frozen=True)
class GemvTiling:
    """How a GEMV is launched; every choice keeps its semantics.

    block_n: weight rows a program owns (its output columns).
    block_k: weight columns a loop step loads at one row of x (divided by the padded row count
      unless wide_rows).
    num_warps: warps a program.
    late_reduce: keep per-lane partial sums over the K tile and reduce across lanes once at the
      end (more registers, no shuffles in the loop); else reduce every tile.
    prefetch: load the first weight tile before waiting on the kernel before (PDL), and each next
      tile before multiplying the current one (two tiles a program in flight).
    wide_rows: at several rows, each still multiplies a block_k-wide weight tile (block_k is not
      divided by the row count): the weight stream of one row, at rows times the registers for
      the product; without it a program's product stays block_n x block_k values and its weight
      tile narrows as rows grow.
    flat_row: at one row with late_reduce, the product and the per-lane sums are [block_n,
      block_k], the row's activations a vector broadcast over the weight tile, not [1, block_n,
      block_k]: Triton then keeps the weight tile in the layout it was loaded in instead of
      passing it through shared memory (sm_90 SASS of the K loop, bench/kernel_ir.py: 0.21 ->
      0.16 warp-instructions a bf16 weight, 0.26 -> 0.21 an e4m3 one; BENCHMARKS.md §38). At
      several rows (with late_reduce) the weight tile is loaded as [1, block_n, block_k], in the
      layout of the rows' product it is broadcast into, and each lane folds its sums by eight as
      they accumulate: no shared-memory round trip of the tile (§39: at 2 rows the FP8 step
      3.703 ms vs cuBLASLt's 4.916; at 4 rows 0.3-0.5 warp-instructions a bf16 weight, still
      slower than cuBLAS in the step).
    stages: 1: the next weight tile is carried in registers from one loop step to the next (with
      prefetch). Above 1: Triton pipelines the loop's tile loads (tl.range's num_stages: copies
      into shared memory, stages - 1 tiles in flight), and prefetch loads only the first tile
      before the PDL wait. A carried e4m3 tile is held a byte a register and repacked for the
      converter every step (twice the loop's instructions at one row, BENCHMARKS.md §38).
      With flat_row, 2-4 stages took the H100's FP8 batch-1 token from 4.553 to 3.386 ms and its
      bf16 one from 5.660 to 5.508 (§39).
    separate_norm: the norm in front (qkv, gate_up) runs as its own kernel (tandem_kernels.norm)
      and the GEMV reads the normalized rows, one tensor once a tile: in the GEMV every program
      computes the rows' norm itself, reading x and the residual over all of K first and again
      a tile at a time (at four rows and gate_up's 1,792 programs about as many bytes from L2 as
      the weights from memory), where the unfused-norm projections o_proj and down beat
      cuBLAS(Lt) at four rows and qkv and gate_up did not (§39). Same results.
    fma_chain: at several rows with flat_row, each lane folds its eight products into their sum
      as a chain of eight multiply-adds (the tile and the rows split into their eight interleaved
      parts in registers) rather than tl.sum's tree over the eight (a multiply, then adds: 1.5
      float instructions a product where the chain issues one FFMA). sm_90 SASS: 14% (bf16) and
      27% (e4m3) fewer loop instructions a weight (medians over 60 tiles at 2 and 4 rows), but
      on small tiles (2 x 512 at 2 rows) a layout change through shared memory in the loop and
      elsewhere more registers (fewer programs an SM, fewer tiles in flight): the H100's steps at
      the default tiles were 2-42% slower with it, in two calls (BENCHMARKS.md §41).
    """

    block_n: int = 8
    block_k: int = 512
    num_warps: int = 4
    late_reduce: bool = False
    prefetch: bool = True
    wide_rows: bool = False
    flat_row: bool = False
    stages: int = 1
    separate_norm: bool = False
    fma_chain: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvTiling.{name} must be a power of two, got {v}")
        if not 1 <= self.stages <= 4:
            raise ValueError(f"GemvTiling.stages must be in [1, 4], got {self.stages}")


_ROWS_4x512 = GemvTiling(block_n=4, block_k=512, late_reduce=True)
_ROWS_2x1024 = GemvTiling(block_n=2, block_k=1024, late_reduce=True)
_ROWS_8x256 = GemvTiling(block_n=8, block_k=256, late_reduce=True)

# Per GPU family (a substring of torch.cuda.get_device_name, first match wins): the projections
# fused by default at one row, each at its fastest tiling in that card's `gemv_sweep`, kept only
# where the whole batch-1 step was faster with it (throughput_bench's decode_b1_* sections).
DEVICE_TILINGS: dict[str, dict[str, GemvTiling]] = {
    # §33: o_proj + down 4.263-4.293 ms a token vs cuBLAS 4.344-4.346; + qkv 4.312-4.335; all four 4.363.
    "H200": {"o_proj": _ROWS_4x512, "down": _ROWS_4x512},
    # §39: one row a 2-D product and the tile loads pipelined, 5.508 ms a token against 5.660 at
    # §32's tiles (each without them); §32: all four 5.654-5.657 ms vs cuBLAS 5.980-5.986.
    "H100": {"qkv": GemvTiling(block_n=2, block_k=1024, late_reduce=True, flat_row=True),
             "o_proj": GemvTiling(block_n=2, block_k=1024, late_reduce=True, flat_row=True, stages=3),
             "gate_up": GemvTiling(block_n=2, block_k=1024, late_reduce=True, flat_row=True, stages=3),
             "down": GemvTiling(block_n=2, block_k=1024, late_reduce=True, flat_row=True, stages=3)},
}
# §39 (H100, batch 1, FP8 weights): one row a 2-D product and the tile loads pipelined (2-4
# stages), 3.386 ms a token against 4.553 at §38's tiles without them and cuBLASLt's 4.985, one
# run. §38: §32's H100 tiles with twice the rows a program, 4.475-4.481 ms vs 5.068 at the bf16
# tiles (twice block_k 5.169; four times the rows 6.038; per-tile reduction 5.770; 8 warps 4.990).
FP8_DEVICE_TILINGS: dict[str, dict[str, GemvTiling]] = {
    "H100": {"qkv": GemvTiling(block_n=8, block_k=512, late_reduce=True, flat_row=True, stages=3, wide_rows=True),
             "o_proj": GemvTiling(block_n=4, block_k=1024, late_reduce=True, flat_row=True, stages=2, wide_rows=True),
             "gate_up": GemvTiling(block_n=8, block_k=512, late_reduce=True, flat_row=True, stages=3, wide_rows=True),
             "down": GemvTiling(block_n=4, block_k=1024, late_reduce=True, flat_row=True, stages=3, wide_rows=True)},
}
# Where a GPU's FP8 layers fuse at more rows than the tiles above suit: from `rows` rows up (a
# step of 3 rows runs the 4-row kernel: rows pad to a power of two), these tiles. §41 (H100, 4
# rows, one call): the four-row sweep's fastest, the norm as its own kernel in front of qkv and
# gate_up, 3.809 ms a step against cuBLASLt's 4.678 (-18.6%; with fma_chain 4.181; at the
# one-row tiles 5.403 in another call).
_ROWS4 = dict(late_reduce=True, flat_row=True, wide_rows=True, stages=3)
FP8_SEVERAL_ROW_TILINGS: dict[str, tuple[int, dict[str, GemvTiling]]] = {
    "H100": (3, {"qkv": GemvTiling(block_n=16, block_k=512, separate_norm=True, **_ROWS4),
                 "o_proj": GemvTiling(block_n=16, block_k=1024, **_ROWS4),
                 "gate_up": GemvTiling(block_n=8, block_k=512, separate_norm=True, **_ROWS4),
                 "down": GemvTiling(block_n=16, block_k=1024, **_ROWS4)}),
}
# The most tokens a decode step of an FP8 layer may have for it to fuse, where more than one
# (wide_rows above: each row against the whole tile). §39 (H100, batch 2): 3.703 ms a step
# against cuBLASLt's 4.916; §41 (batch 4, FP8_SEVERAL_ROW_TILINGS): 3.809 vs 4.678. bf16 layers
# fuse at one row (batch 2: -2.4%, other tiles; batch 4 at the four-row sweep's tiles: +0.3%, §41).
FP8_DEVICE_ROWS: dict[str, int] = {"H100": 4}
# Any other device (and a projection its entry leaves out): the H200's sweep's fastest at one row.
FALLBACK_TILINGS: dict[str, GemvTiling] = {
    "qkv": _ROWS_4x512, "o_proj": _ROWS_4x512, "gate_up": _ROWS_8x256, "down": _ROWS_4x512,
}


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device | str | None) -> str:
    """torch.cuda.get_device_name of a CUDA device (cached); "" for any other device or None."""
    device = torch.device(device) if isinstance(device, str) else device
    if device is None or device.type != "cuda":
        return ""
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


def device_tilings(name: str, fp8: bool = False) -> dict[str, GemvTiling]:
    """The DEVICE_TILINGS (FP8_DEVICE_TILINGS with `fp8`) entry naming GPU `name`; {} where none does."""
    return family_entry(FP8_DEVICE_TILINGS if fp8 else DEVICE_TILINGS, name, {})


def default_fused_projections(device: torch.device | str | None, fp8: bool = False) -> frozenset[str]:
    """The projections `device` runs as fused GEMVs by default, for bf16 weights or (`fp8`) FP8
    ones (none off the GPUs measured)."""
    return frozenset(device_tilings(device_name(device), fp8))


def default_fused_rows(device: torch.device | str | None, fp8: bool = False) -> int:
    """The most tokens a decode step on `device` may have for its projections (`fp8`: e4m3
    weights) to run as fused GEMVs by default: FP8_DEVICE_ROWS' entry for FP8 weights, else 1."""
    return family_entry(FP8_DEVICE_ROWS, device_name(device), 1) if fp8 else 1


def base_tiling(projection: str, gpu_name: str, fp8: bool = False, rows: int = 1) -> GemvTiling:
    """The tiling of `projection` (one of PROJECTIONS) at `rows` rows on the GPU named
    `gpu_name`: for `fp8` weights its FP8_SEVERAL_ROW_TILINGS entry's where `rows` reaches that
    entry's, else its FP8_DEVICE_TILINGS entry's where there is one; else its DEVICE_TILINGS
    entry's, else FALLBACK_TILINGS'."""
    if projection not in PROJECTIONS:
        raise ValueError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
    tiling = None
    if fp8:
        from_rows, several = family_entry(FP8_SEVERAL_ROW_TILINGS, gpu_name, (0, {}))
        tiling = (several.get(projection) if rows >= from_rows else None) \
            or device_tilings(gpu_name, fp8=True).get(projection)
    return tiling or device_tilings(gpu_name).get(projection, FALLBACK_TILINGS[projection])


def tiling_for(projection: str, device: torch.device | str | None = None, fp8: bool = False,
               rows: int = 1) -> GemvTiling:
    """base_tiling of `projection` at `rows` rows on `device` (`fp8`: for e4m3 weights), with
    TILING_ENV's fields over it where set."""
    from tandem_kernels.triton_common import env_overridden  # triton: only where a kernel launches

    base = base_tiling(projection, device_name(device), fp8, rows)
    return env_overridden(base, TILING_ENV, os.environ.get(TILING_ENV, ""), projection, PROJECTIONS)


__all__ = ["DEVICE_TILINGS", "FALLBACK_TILINGS", "FP8_DEVICE_ROWS", "FP8_DEVICE_TILINGS", "FP8_SEVERAL_ROW_TILINGS",
           "TILING_ENV", "GemvTiling", "base_tiling", "default_fused_projections", "default_fused_rows",
           "device_name", "device_tilings", "tiling_for"]

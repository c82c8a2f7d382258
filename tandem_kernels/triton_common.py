"""Helpers shared by the Triton kernels: launch-size arithmetic, device facts, FP8 rounding.

Imports triton at module level, so only kernel modules (themselves imported lazily by
tandem_kernels.ops) import this file.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from tandem_kernels.ops import device_capability

FP8_MAX = 448.0  # largest finite torch.float8_e4m3fn value
PDL_ENV = "TANDEM_PDL"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def env_overridden(base, env: str, fields: str, key: str | None = None, keys: tuple[str, ...] = ()):
    """`base` (a frozen dataclass: a kernel's tuning) with the fields the JSON object `fields`
    (the value of the variable `env`) gives. With `key`, an object whose names include any of
    `keys` gives each key its own fields, and this `key` takes its entry (none: base). Empty
    `fields`: base. A bad object or field raises ValueError naming `env`. Cached: the variable
    is read at every launch."""
    if not fields.strip():
        return base
    try:
        spec = json.loads(fields)
        if not isinstance(spec, dict):
            raise TypeError("not an object")
        if key is not None and any(k in keys for k in spec):
            spec = spec.get(key, {})
        return dataclasses.replace(base, **spec)
    except (ValueError, TypeError) as exc:
        by_key = " (or of them by name)" if keys else ""
        raise ValueError(f"{env}: expected a JSON object of {type(base).__name__} fields{by_key}, "
                         f"got {fields!r}: {exc}") from None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; 132 (an H100/H200) when it is not a CUDA device."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def pdl_enabled(device: torch.device) -> bool:
    """Whether the kernels launch with programmatic dependent launch (PDL): a kernel is let onto
    the GPU while the one before it in the stream finishes, and waits for it (`pdl_begin`)
    before touching memory, so its launch and scheduling hide behind the other's tail; CUDA
    graphs keep the edges. On for sm_90+ devices (batch-1 decode 1.2% faster, offline within
    noise, outputs token-identical: BENCHMARKS.md §16); never under the interpreter (which runs no
    PTX); TANDEM_PDL=0 turns it off."""
    if os.environ.get(PDL_ENV, "1").strip() == "0" or device.type != "cuda" or interpreting():
        return False
    return device_capability(device) >= (9, 0)


def pdl_launch(device: torch.device) -> dict:
    """A launch's PDL keywords: the kernel's PDL constant (see pdl_begin) and Triton's
    launch_pdl option, always set together."""
    on = pdl_enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_begin(PDL: tl.constexpr):
    """A kernel's first statement. With PDL (the kernel launched with launch_pdl, see
    pdl_enabled): wait until the kernel before it has finished and its writes are visible,
    then let the kernel after it launch (it waits in turn, so nothing reads early)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def soft_fp8_round() -> bool:
    """Whether kernels must round to e4m3 themselves before the cast.

    The interpreter's float -> e4m3 cast rounds half-up and loses the carry out of the mantissa
    (a value just under a power of two can come out halved); the GPU's cvt instruction rounds to
    nearest even. Rounding to an exactly representable value first makes both casts exact.
    """
    return interpreting()


@triton.jit
def round_to_e4m3(x):
    """Round fp32 `x` (already within +-448) to the nearest e4m3 value, ties to even, in fp32."""
    bits = x.to(tl.int32, bitcast=True)
    # Keep 3 of 23 mantissa bits: add half an ulp minus one plus the lowest kept bit, truncate.
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = bits.to(tl.float32, bitcast=True)
    # Below 2^-6 e4m3 is subnormal with a fixed step of 2^-9: 1.5 * 2^14 has exactly that ulp.
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def quantize_for_store(x, scale, IS_FP8: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """fp32 `x` ready to be cast to the cache dtype: x / scale clamped to +-448 for FP8, else x."""
    if IS_FP8:
        y = tl.minimum(tl.maximum(x / scale, -448.0), 448.0)
        if SOFT_ROUND:
            y = round_to_e4m3(y)
        return y
    else:
        return x


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether tl.dot operands of `dtype` must be widened to fp32 first.

    The interpreter multiplies bf16 operands as their raw 16-bit integers; on the GPU the
    tensor cores take bf16 directly. Widening is exact, so results agree to accumulation order.
    """
    return interpreting() and dtype == torch.bfloat16


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot(a, b) with an fp32 accumulator; UPCAST widens bf16 operands (see upcast_dots)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def e4m3_to_f16_opaque(x):
    """e4m3 bytes -> fp16 through inline PTX the compiler may not move (is_pure=False): it converts
    in the tile's load layout, and the fp16 tile then reaches the MMA operand layout through shared
    memory with 16-bit (ldmatrix) reads, instead of byte gathers of a transposed FP8 tile."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def widen(x, DTYPE: tl.constexpr, OPAQUE: tl.constexpr):
    """A loaded K/V tile in the dots' dtype: FP8 through e4m3_to_f16_opaque when OPAQUE (fp16
    only), otherwise a plain cast."""
    if OPAQUE:
        return e4m3_to_f16_opaque(x.to(tl.uint8, bitcast=True))
    else:
        return x.to(DTYPE)


@triton.jit
def token_place(offs, BLOCK_SIZE: tl.constexpr, UNSIGNED: tl.constexpr = False):
    """(block-table index, slot in its block) of token positions `offs`. UNSIGNED: by unsigned
    division and remainder (positions are never negative), a shift and a mask, where signed ones
    by a power of two take a few more instructions each."""
    if UNSIGNED:
        u = offs.to(tl.uint32, bitcast=True)
        return u // BLOCK_SIZE, (u % BLOCK_SIZE).to(tl.int32, bitcast=True)
    else:
        return offs // BLOCK_SIZE, offs % BLOCK_SIZE


@triton.jit
def tile_blocks_at(bt_row, n0, tok, end, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr = True,
                   UNSIGNED: tl.constexpr = False):
    """The paged cache's block of each token n0 + tok (`tok` offsets of any shape), from one
    sequence's block-table row (0 for tokens at or past `end`, which are not read). MASKED=False:
    the caller knows every token lies before `end`, and the load goes unmasked. UNSIGNED: see
    token_place."""
    offs = n0 + tok
    index, _ = token_place(offs, BLOCK_SIZE, UNSIGNED)
    if MASKED:
        return tl.load(bt_row + index, mask=offs < end, other=0).to(tl.int64)
    else:
        return tl.load(bt_row + index).to(tl.int64)


@triton.jit
def first_tile_blocks_at(bt_row, start, tok, end, BLOCK_SIZE: tl.constexpr, AHEAD: tl.constexpr,
                         UNSIGNED: tl.constexpr = False):
    """What a KV loop from `start` over tiles of offsets `tok` carries into its first
    `next_tile_blocks_at`: with AHEAD the first tile's blocks, read before the loop; without,
    nothing (0)."""
    if AHEAD:
        return tile_blocks_at(bt_row, start, tok, end, BLOCK_SIZE, True, UNSIGNED)
    else:
        return 0


@triton.jit
def next_tile_blocks_at(carried, bt_row, n0, tok, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                        AHEAD: tl.constexpr, MASKED: tl.constexpr = True, UNSIGNED: tl.constexpr = False):
    """(this tile's blocks, what to carry to the next tile) for tiles of offsets `tok`, BLOCK_N
    tokens apart. AHEAD: `carried` holds this tile's blocks, read with the tile before, and the
    next tile's are read now in their place, so that a tile's K/V loads depend on nothing loaded
    in their own iteration and Triton's pipeliner keeps a tile in flight during a tile's math;
    otherwise the tile reads its own and `carried` passes through."""
    if AHEAD:
        return carried, tile_blocks_at(bt_row, n0 + BLOCK_N, tok, end, BLOCK_SIZE, True, UNSIGNED)
    else:
        return tile_blocks_at(bt_row, n0, tok, end, BLOCK_SIZE, MASKED, UNSIGNED), carried


@triton.jit
def first_tile_blocks(bt_row, start, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, AHEAD: tl.constexpr,
                      UNSIGNED: tl.constexpr = False):
    """first_tile_blocks_at for tiles of BLOCK_N consecutive tokens."""
    return first_tile_blocks_at(bt_row, start, tl.arange(0, BLOCK_N), end, BLOCK_SIZE, AHEAD, UNSIGNED)


@triton.jit
def next_tile_blocks(carried, bt_row, n0, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     AHEAD: tl.constexpr, MASKED: tl.constexpr = True, UNSIGNED: tl.constexpr = False):
    """next_tile_blocks_at for tiles of BLOCK_N consecutive tokens."""
    return next_tile_blocks_at(carried, bt_row, n0, tl.arange(0, BLOCK_N), end, BLOCK_N, BLOCK_SIZE, AHEAD,
                               MASKED, UNSIGNED)

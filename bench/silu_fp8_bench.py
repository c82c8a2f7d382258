"""SiLU-and-multiply + FP8 quantize on the GPU: the row held whole vs two passes over it.

    python bench/silu_fp8_bench.py [--rows 384,512] [--inter 14336]
    python bench/silu_fp8_bench.py --rows 384,8448 --sweep      # launch shapes

Times tandem_kernels.activation's silu_and_mul_fp8 at the Llama-3.1-8B MLP's width, plain and with
deferred scales, with ONE_PASS_MAX as it is (one pass) and lowered below the row (two passes), on
the same inputs; prints one JSON line per case: microseconds per call and GB/s of the bytes a call
must move (the product read once, the FP8 rows and their scales written). `--sweep` times the
kernel's launch shapes instead (SWEEP: whole rows over 8-32 warps, a program a row or one an SM
looping over rows, two passes of 2,048-8,192 columns), the one `silu_fp8_shape` picks marked, on
rows without deferred scales; then, at row counts that defer scales (up to DEFERRED_MAX_ROWS),
DEFERRED_SWEEP's shapes on rows with them, the column scales held in L1 (SCALES_L1) or not.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

# (BLOCK, ONE_PASS, num_warps, PERSIST) of _silu_and_mul_fp8_kernel that --sweep times; BLOCK 0 is the
# row's whole width (rounded up to a power of two); PERSIST 1: one program an SM looping over rows,
# the next row's loads in flight while it finishes one (Triton 3.9 for sm_90: 57 registers at 32
# warps, 98 at 16, no spills).
SWEEP = [(0, True, 32, 0), (0, True, 16, 0), (0, True, 8, 0), (0, True, 32, 1), (0, True, 16, 1),
         (2048, False, 8, 0), (4096, False, 8, 0), (4096, False, 16, 0), (8192, False, 16, 0), (8192, False, 32, 0)]
# (BLOCK, ONE_PASS, num_warps, SCALES_L1) timed on rows with deferred scales.
DEFERRED_SWEEP = [(0, True, 32, True), (0, True, 32, False), (0, True, 16, True), (0, True, 16, False),
                  (4096, False, 16, True), (4096, False, 16, False)]


def deferred_scales(rows: int, inter: int) -> tuple:
    """A deferred FP8 GEMM's (row scales [rows, 1], column scales [2 * inter]) of plausible size."""
    return (torch.rand(rows, 1, device="cuda") * 1e-3 + 1e-4, torch.rand(2 * inter, device="cuda") * 1e-2 + 1e-3)


def sweep(act, rows: int, inter: int) -> None:
    """One JSON line per SWEEP shape at `rows` x `inter`, then per DEFERRED_SWEEP shape where rows
    of that count defer their scales."""
    import triton

    from bench.kernel_bench import bench_ms
    from engine.quant.fp8 import DEFERRED_MAX_ROWS

    x = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    moved = x.numel() * x.element_size() + rows * inter + rows * 4
    chosen = act.silu_fp8_shape(inter)
    whole = triton.next_power_of_2(inter)
    cases = [(None, dict(BLOCK=block or whole, ONE_PASS=one_pass, num_warps=warps, PERSIST=persist,
                         SCALES_L1=chosen["SCALES_L1"])) for block, one_pass, warps, persist in SWEEP]
    if rows <= DEFERRED_MAX_ROWS:
        scales = deferred_scales(rows, inter)
        cases += [(scales, dict(BLOCK=block or whole, ONE_PASS=one_pass, num_warps=warps, PERSIST=0, SCALES_L1=keep))
                  for block, one_pass, warps, keep in DEFERRED_SWEEP]
    pick = act.silu_fp8_shape
    for scales, shape in cases:
        act.silu_fp8_shape = lambda _inter, shape=shape: shape
        line = {"rows": rows, "inter": inter, "deferred": scales is not None, **shape}
        try:
            ms = bench_ms(lambda: act.silu_and_mul_fp8(x, scales))
        except Exception as exc:  # a shape that does not compile (registers) is reported, not fatal
            print(json.dumps({**line, "error": str(exc)[:200]}), flush=True)
            continue
        finally:
            act.silu_fp8_shape = pick
        print(json.dumps({**line, "default": shape == chosen, "us": round(ms * 1e3, 2),
                          "GBps": round(moved / ms / 1e6)}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="384,512")
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--sweep", action="store_true", help="time the kernel's launch shapes (SWEEP) instead")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("silu_fp8_bench needs a CUDA device", file=sys.stderr)
        return 2
    from tandem_kernels import activation as act
    from bench.kernel_bench import bench_ms

    if a.sweep:
        for rows in (int(r) for r in a.rows.split(",")):
            sweep(act, rows, a.inter)
        return 0
    one_pass_max = act.ONE_PASS_MAX
    for rows in (int(r) for r in a.rows.split(",")):
        x = torch.randn(rows, 2 * a.inter, device="cuda", dtype=torch.bfloat16)
        scales = deferred_scales(rows, a.inter)
        moved = x.numel() * x.element_size() + rows * a.inter + rows * 4
        for deferred in (False, True):
            for passes, limit in ((1, one_pass_max), (2, 16)):
                act.ONE_PASS_MAX = limit
                try:
                    ms = bench_ms(lambda: act.silu_and_mul_fp8(x, scales if deferred else None))
                finally:
                    act.ONE_PASS_MAX = one_pass_max
                print(json.dumps({"rows": rows, "inter": a.inter, "deferred": deferred, "passes": passes,
                                  "us": round(ms * 1e3, 2), "GBps": round(moved / ms / 1e6)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

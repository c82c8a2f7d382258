"""SiLU-and-multiply + FP8 quantize on the GPU: the row held whole vs two passes over it.

    python bench/silu_fp8_bench.py [--rows 384,512] [--inter 14336]

Times tandem_kernels.activation's silu_and_mul_fp8 at the Llama-3.1-8B MLP's width, plain and with
deferred scales, with ONE_PASS_MAX as it is (one pass) and lowered below the row (two passes), on
the same inputs; prints one JSON line per case: microseconds per call and GB/s of the bytes a call
must move (the product read once, the FP8 rows and their scales written).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="384,512")
    p.add_argument("--inter", type=int, default=14336)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("silu_fp8_bench needs a CUDA device", file=sys.stderr)
        return 2
    from tandem_kernels import activation as act
    from bench.kernel_bench import bench_ms

    one_pass_max = act.ONE_PASS_MAX
    for rows in (int(r) for r in a.rows.split(",")):
        x = torch.randn(rows, 2 * a.inter, device="cuda", dtype=torch.bfloat16)
        scales = (torch.rand(rows, 1, device="cuda") * 1e-3 + 1e-4, torch.rand(2 * a.inter, device="cuda") * 1e-2 + 1e-3)
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

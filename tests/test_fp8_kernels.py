"""The FP8 activation-quantization kernels (tandem_kernels/quant.py, the FP8 variants in tandem_kernels/norm.py
and tandem_kernels/activation.py) against their torch references, under TRITON_INTERPRET=1.

As in tests/test_kernels.py each case runs in a fresh interpreter (TRITON_INTERPRET must be set
before triton is imported), through tandem_kernels.ops, on fresh random inputs; the seed is printed on
failure. e4m3 outputs may differ from the reference by one e4m3 step where the interpreter's
rounding of an intermediate to bf16 differs from torch's (it truncates); scales by that rounding.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8 = torch.float8_e4m3fn
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# A row's scale is its amax over 448, and the amax is of outputs rounded to the input dtype: the
# kernel and the reference may round the largest element to neighbouring values (the product
# w * x * rsqrt is formed in another order), two steps of that dtype at most (bf16: 2**-7 each).
SCALE_RTOL = {torch.float32: 1e-6, torch.float16: 2 * 2**-10, torch.bfloat16: 2 * 2**-7}
# (rows, cols): one row, odd widths, a row longer than tandem_kernels.quant.CHUNK (the loop's second chunk)
SHAPES = ((1, 64), (7, 100), (33, 257), (3, 5000))


def fp8_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within one e4m3 step: 1/8 relative for normal values, 2^-9 absolute for subnormal ones."""
    assert got.dtype == FP8 and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    torch.testing.assert_close(got.float(), want.float(), atol=2.0 ** -8, rtol=0.13, msg=lambda m: f"{what}: {m}")


def scales_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    torch.testing.assert_close(got, want, atol=0.0, rtol=SCALE_RTOL[dtype], msg=lambda m: f"{what}: {m}")


def rand(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    # A few large entries per row, as real activations have: the scale follows the row's largest.
    x = torch.randn(rows, cols) * torch.rand(rows, 1) * 4
    x[:, torch.randint(0, cols, (2,))] *= 20
    return x.to(dtype)


def case_quantize() -> None:
    from tandem_kernels import ops, reference as ref

    for dtype in DTYPES:
        for rows, cols in SHAPES:
            x = rand(rows, cols, dtype)
            q, s = ops.quantize_fp8_per_token(x)
            rq, rs = ref.quantize_fp8_per_token(x)
            fp8_close(q, rq, f"quantize {dtype} {x.shape}")
            scales_close(s, rs, torch.float32, f"quantize scale {dtype} {x.shape}")  # exact: no bf16 rounding
            assert (q.float().abs() <= 448).all()
    # A strided view (a column slice), and an all-zero row: scale stays finite, q is 0.
    x = rand(6, 96, torch.float32)[:, 16:80]
    x[2] = 0
    q, s = ops.quantize_fp8_per_token(x)
    rq, rs = ref.quantize_fp8_per_token(x)
    fp8_close(q, rq, "quantize strided")
    assert torch.equal(s, rs) and s[2].item() == torch.tensor(ref.FP8_MIN_SCALE).item() and not q[2].float().any()


def case_norm() -> None:
    from tandem_kernels import ops, reference as ref

    for dtype in DTYPES:
        for rows, cols in SHAPES:
            x, r = rand(rows, cols, dtype), rand(rows, cols, dtype)
            w = (torch.rand(cols) + 0.5).to(dtype)
            q, s = ops.rms_norm_fp8(x, w, 1e-6)
            rq, rs = ref.rms_norm_fp8(x, w, 1e-6)
            fp8_close(q, rq, f"rms_norm_fp8 {dtype} {x.shape}")
            scales_close(s, rs, dtype, f"rms_norm_fp8 scale {dtype} {x.shape}")
            q, s, summed = ops.fused_add_rms_norm_fp8(x, r, w, 1e-5)
            rq, rs, rsum = ref.fused_add_rms_norm_fp8(x, r, w, 1e-5)
            fp8_close(q, rq, f"fused_add_rms_norm_fp8 {dtype} {x.shape}")
            scales_close(s, rs, dtype, f"fused_add_rms_norm_fp8 scale {dtype} {x.shape}")
            assert summed.dtype == dtype
            torch.testing.assert_close(summed, rsum, atol=1e-2, rtol=1e-2)


def deferred(rows: int, cols: int, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """An unscaled FP8 product (large values: sums of e4m3 products) and its row and column scales.
    In float32 any scales; in 16-bit dtypes powers of two, so the scaled value is exact in that
    dtype: the interpreter rounds a cast to it by truncation where torch rounds to nearest, and
    where the residual cancels the scaled value one such step moves the sum far (seen: 20%)."""
    p = (torch.randn(rows, cols) * 300).to(dtype)
    if dtype == torch.float32:
        return p, (torch.rand(rows, 1) * 1e-3 + 1e-5, torch.rand(cols) * 1e-2 + 1e-4)
    return p, (2.0 ** torch.randint(-14, -8, (rows, 1)).float(), 2.0 ** torch.randint(-8, -3, (cols,)).float())


def case_deferred_scales() -> None:
    """The norm kernels apply an FP8 product's deferred scales as they load (SiLU-and-multiply's,
    through both of its loops, are case_silu's); a bad shape of them is named."""
    from tandem_kernels import ops, reference as ref

    for dtype in DTYPES:
        for rows, cols in SHAPES:
            p, scales = deferred(rows, cols, dtype)
            r, w = rand(rows, cols, dtype), (torch.rand(cols) + 0.5).to(dtype)
            q, s, summed = ops.fused_add_rms_norm_fp8(p, r, w, 1e-5, scales)
            rq, rs, rsum = ref.fused_add_rms_norm_fp8(p, r, w, 1e-5, scales)
            fp8_close(q, rq, f"fused_add_rms_norm_fp8 deferred {dtype} {p.shape}")
            scales_close(s, rs, dtype, f"fused_add_rms_norm_fp8 deferred scale {dtype} {p.shape}")
            torch.testing.assert_close(summed, rsum, atol=1e-2, rtol=1e-2)
            # The scales were applied: the sum is not the unscaled product's.
            assert not torch.allclose(summed.float(), (p.float() + r.float()).to(dtype).float(), rtol=0.1)
            q, s = ops.rms_norm_fp8(p, w, 1e-6, scales)
            rq, rs = ref.rms_norm_fp8(p, w, 1e-6, scales)
            fp8_close(q, rq, f"rms_norm_fp8 deferred {dtype} {p.shape}")
            scales_close(s, rs, dtype, f"rms_norm_fp8 deferred scale {dtype} {p.shape}")
    with pytest.raises(ValueError, match="x_scales"):
        ops.silu_and_mul_fp8(torch.zeros(2, 8), (torch.ones(2, 1), torch.ones(4)))


def case_silu() -> None:
    """Both of silu_and_mul_fp8's loops: the row held whole (ONE_PASS), and two passes over it in
    chunks (forced by a lower ONE_PASS_MAX; the 5,000-column rows take two chunks), with and
    without deferred scales; deferred ones with their column scales loaded to stay in L1
    (SCALES_L1) and without (the default, measured faster)."""
    from tandem_kernels import activation as act, ops, reference as ref

    saved, pick = act.ONE_PASS_MAX, act.silu_fp8_shape
    for one_pass_max in (saved, 16):
        act.ONE_PASS_MAX = one_pass_max  # this case runs in a fresh interpreter of its own
        for dtype in DTYPES:
            for rows, inter in SHAPES:
                what = f"silu_and_mul_fp8 {dtype} {(rows, inter)} {act.silu_fp8_shape(inter)}"
                x = rand(rows, 2 * inter, dtype)
                q, s = ops.silu_and_mul_fp8(x)
                rq, rs = ref.silu_and_mul_fp8(x)
                assert q.shape == (rows, inter)
                fp8_close(q, rq, what)
                scales_close(s, rs, dtype, f"{what} scale")
                p, scales = deferred(rows, 2 * inter, dtype)
                rq, rs = ref.silu_and_mul_fp8(p, scales)
                for keep in (True, False):
                    act.silu_fp8_shape = lambda n, keep=keep: {**pick(n), "SCALES_L1": keep}
                    q, s = ops.silu_and_mul_fp8(p, scales)
                    act.silu_fp8_shape = pick
                    fp8_close(q, rq, f"{what} deferred, scales_l1={keep}")
                    scales_close(s, rs, dtype, f"{what} deferred scale, scales_l1={keep}")
    act.ONE_PASS_MAX = saved
    assert not pick(14336)["SCALES_L1"]
    assert act.silu_fp8_shape(14336)["ONE_PASS"] and not act.silu_fp8_shape(2 * saved)["ONE_PASS"]


def case_silu_persistent() -> None:
    """silu_and_mul_fp8's persistent loop (PERSIST > 0): few programs, each taking every so-many-th
    row and loading the next while it finishes one, give the one-program-a-row results; rows
    fewer than programs, one program for every row, and rows not a multiple of the programs.
    Deferred scales keep a program a row."""
    from tandem_kernels import activation as act, ops, reference as ref

    pick = act.silu_fp8_shape
    act.silu_fp8_shape = lambda inter: {**pick(inter), "PERSIST": 1}  # this case runs in an interpreter of its own
    for sms in (1, 2, 3):
        act.num_sms = lambda device, sms=sms: sms
        for dtype in DTYPES:
            for rows, inter in ((1, 64), (2, 100), (7, 257), (10, 96)):
                what = f"persistent silu_and_mul_fp8 {dtype} {(rows, inter)} over {sms} programs"
                x = rand(rows, 2 * inter, dtype)
                q, s = ops.silu_and_mul_fp8(x)
                rq, rs = ref.silu_and_mul_fp8(x)
                fp8_close(q, rq, what)
                scales_close(s, rs, dtype, f"{what} scale")
        p, scales = deferred(5, 2 * 64, torch.float32)
        q, s = ops.silu_and_mul_fp8(p, scales)
        rq, rs = ref.silu_and_mul_fp8(p, scales)
        fp8_close(q, rq, "persistent shape, deferred scales")
    assert pick(14336)["PERSIST"] == 0  # the default launches a program a row


def case_errors() -> None:
    from tandem_kernels import ops

    for call, arg in ((ops.quantize_fp8_per_token, torch.zeros(2, 3, 4)), (ops.silu_and_mul_fp8, torch.zeros(2, 5))):
        with pytest.raises(ValueError):
            call(arg)
    with pytest.raises(ValueError, match="weight"):
        ops.rms_norm_fp8(torch.zeros(2, 8), torch.ones(4), 1e-6)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_kernel_matches_reference(case: str) -> None:
    seed = secrets.randbelow(2**31)
    env = dict(os.environ, TANDEM_KERNELS="triton", TRITON_INTERPRET="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), case, str(seed)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"case {case} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert f"ok {case}" in proc.stdout


def test_deferred_scales_reference_is_the_scaled_product() -> None:
    """fp8_product then apply_deferred_scales is fp8_linear, rounded once more to the output dtype."""
    from engine.quant.fp8 import quantize_weight_per_channel
    from tandem_kernels import ops, reference as ref

    x, w = torch.randn(9, 48), torch.randn(40, 48) * 0.3
    q, s = ref.quantize_fp8_per_token(x)
    wq, ws = quantize_weight_per_channel(w)
    one = torch.ones(())
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-7)):
        got = ref.apply_deferred_scales(ops.fp8_product(q, wq, one, dtype), (s, ws))
        want = ops.fp8_linear(q, s, wq, ws, None, dtype)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=tol)


def test_fp8_linear_reference_is_the_dequantized_product() -> None:
    """The CPU GEMM is exactly (dequantized x) @ (dequantized W)^T, up to float32 summation order."""
    from engine.quant.fp8 import quantize_weight_per_channel
    from tandem_kernels import ops, reference as ref

    x, w, b = torch.randn(9, 48), torch.randn(40, 48) * 0.3, torch.randn(40)
    q, s = ref.quantize_fp8_per_token(x)
    wq, ws = quantize_weight_per_channel(w)
    got = ops.fp8_linear(q, s, wq, ws, b, torch.float32)
    want = (q.float() * s) @ (wq.float() * ws[:, None]).t() + b
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # ... and within e4m3's error of the unquantized product (3 mantissa bits: ~3% relative).
    exact = x @ w.t() + b
    assert ((got - exact).norm() / exact.norm()).item() < 0.08


if __name__ == "__main__":
    name, seed_arg = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(seed_arg)
    CASES[name]()
    print(f"ok {name}")

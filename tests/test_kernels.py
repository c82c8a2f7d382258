"""Every Triton kernel against its torch reference (tandem_kernels.reference), on CPU, through the interpreter.

Triton picks the interpreter when a kernel is decorated, i.e. when a kernel module is imported,
from TRITON_INTERPRET. Setting it at the top of this module would depend on no other test having
imported a kernel module (or triton) first, so each case runs instead in a fresh interpreter:
`python tests/test_kernels.py CASE SEED` with TRITON_INTERPRET=1 and TANDEM_KERNELS=triton in its
environment, before anything imports triton. Kernels are called through tandem_kernels.ops, so the
dispatch is exercised too. Inputs are fresh random tensors each run; the seed is printed on failure.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import secrets
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8 = torch.float8_e4m3fn
# (atol, rtol) per input dtype. bf16 is loose: the interpreter rounds fp32 -> bf16 by truncation.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str, scale: float = 1.0,
          rscale: float = 1.0) -> None:
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol * scale, rtol=rtol * rscale,
                               msg=lambda m: f"{what}: {m}")


def fp8_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Within one e4m3 step: 1/8 relative for normal values, 2^-9 absolute for subnormal ones."""
    torch.testing.assert_close(got.float(), want.float(), atol=2.0 ** -8, rtol=0.13, msg=lambda m: f"{what}: {m}")


def rand(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype)


def paged(lens: list[int], block_size: int, hk: int, d: int, dtype: torch.dtype, width: int | None = None):
    """Random K/V caches and random non-contiguous int32 block tables for sequences of `lens` tokens."""
    need = [(n + block_size - 1) // block_size for n in lens]
    width = max(width or 1, *need, 1)
    num_blocks = sum(need) + 5
    perm = torch.randperm(num_blocks).to(torch.int32)
    table = torch.randint(0, num_blocks, (len(lens), width), dtype=torch.int32)  # junk past the context
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n]
        at += n
    shape = (num_blocks, block_size, hk, d)
    kc = (torch.randn(shape) * 2).to(dtype)
    vc = (torch.randn(shape) * 2).to(dtype)
    return kc, vc, table


# ---- cases: each runs in the subprocess and raises on a mismatch ----

def case_norm() -> None:
    from tandem_kernels import ops, reference as ref

    for dtype, (rows, hidden) in itertools.product(TOL, ((1, 64), (7, 100), (33, 257))):
        x, r = rand(rows, hidden, dtype=dtype), rand(rows, hidden, dtype=dtype)
        w = torch.rand(hidden) + 0.5
        close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), dtype, f"rms_norm {dtype} {x.shape}")
        got, want = ops.fused_add_rms_norm(x, r, w, 1e-5), ref.fused_add_rms_norm(x, r, w, 1e-5)
        assert got[0].dtype == dtype and got[1].shape == x.shape
        close(got[0], want[0], dtype, f"fused_add_rms_norm out {dtype} {x.shape}")
        close(got[1], want[1], dtype, f"fused_add_rms_norm residual {dtype} {x.shape}")
    # q/k norm on a strided [T, H, D] slice of a fused qkv output, and a non-contiguous 2-D x.
    for dtype in TOL:
        qkv = rand(5, (3 + 2) * 32, dtype=dtype)
        q = qkv[:, : 3 * 32].view(5, 3, 32)
        w = torch.rand(32, dtype=dtype) + 0.5
        close(ops.rms_norm(q, w, 1e-6), ref.rms_norm(q, w, 1e-6), dtype, f"rms_norm strided 3-D {dtype}")
        x, r, w = rand(48, 6, dtype=dtype).t(), rand(6, 48, dtype=dtype), torch.rand(48) + 0.5
        got, want = ops.fused_add_rms_norm(x, r, w, 1e-6), ref.fused_add_rms_norm(x, r, w, 1e-6)
        close(got[0], want[0], dtype, f"fused_add_rms_norm transposed {dtype}")


def case_activation() -> None:
    from tandem_kernels import ops, reference as ref

    for dtype, shape in itertools.product(TOL, ((5, 96), (2, 3, 200), (1, 74), (3, 4100))):
        x = rand(*shape, dtype=dtype, scale=3.0)
        got = ops.silu_and_mul(x)
        assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
        close(got, ref.silu_and_mul(x), dtype, f"silu_and_mul {dtype} {shape}")


def case_rotary() -> None:
    from tandem_kernels import ops, reference as ref

    configs = [  # (dtype, cache dtype, hq, hk, d, rotary_dim, is_neox, block_size)
        (torch.float32, torch.float32, 4, 4, 64, 64, True, 16),
        (torch.float32, torch.float32, 4, 2, 64, 32, False, 16),  # GLM: interleaved, partial
        (torch.bfloat16, torch.bfloat16, 8, 2, 128, 128, True, 32),
        (torch.bfloat16, torch.bfloat16, 4, 1, 128, 64, False, 16),
        (torch.float16, torch.float16, 2, 2, 32, 16, True, 16),
        (torch.float32, FP8, 4, 2, 64, 64, True, 16),
        (torch.bfloat16, FP8, 4, 2, 64, 32, False, 16),
        (torch.float32, torch.float32, 3, 1, 48, 24, True, 16),  # head_dim not a power of two
    ]
    for dtype, cdt, hq, hk, d, rot, neox, bs in configs:
        what = f"rotary {dtype} cache={cdt} hq={hq} hk={hk} d={d} rot={rot} neox={neox}"
        t = int(torch.randint(1, 40, ()).item())
        qkv = rand(t, (hq + 2 * hk) * d, dtype=dtype, scale=3.0)
        q, k, v = (y.view(t, -1, d) for y in qkv.split([hq * d, hk * d, hk * d], dim=-1))
        inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
        cos_sin = ref.rope_cos_sin_cache(512, rot, inv)
        pos = torch.randint(0, 512, (t,))
        blocks = t // bs + 3
        slots = torch.randperm(blocks * bs)[:t]
        slots[torch.rand(t) < 0.25] = -1
        k_scale, v_scale = (0.3, 0.7) if cdt == FP8 else (1.0, 1.0)
        start = (torch.randn(blocks, bs, hk, d) * 2).to(cdt)
        caches = [start.clone() for _ in range(4)]
        got = ops.rotary_and_store_kv(q, k, v, pos, cos_sin, caches[0], caches[1], slots, rot, neox, k_scale, v_scale)
        want = ref.rotary_and_store_kv(q, k, v, pos, cos_sin, caches[2], caches[3], slots, rot, neox, k_scale, v_scale)
        close(got[0], want[0], dtype, what + " q", scale=3.0)
        close(got[1], want[1], dtype, what + " k", scale=3.0)
        if cdt == FP8:
            fp8_close(caches[0], caches[2], what + " k cache")
            fp8_close(caches[1], caches[3], what + " v cache")
        else:
            close(caches[0], caches[2], dtype, what + " k cache", scale=3.0)
            close(caches[1], caches[3], dtype, what + " v cache", scale=3.0)
        written = torch.zeros(blocks * bs, dtype=torch.bool)
        written[slots[slots >= 0]] = True
        for c in caches[:2]:  # slots not written (incl. the skipped ones) keep their bytes
            flat, orig = c.view(blocks * bs, -1), start.view(blocks * bs, -1)
            assert torch.equal(flat[~written].view(torch.uint8), orig[~written].view(torch.uint8)), what
        close(ops.apply_rotary(q, pos, cos_sin, rot, neox), ref.apply_rotary(q, pos, cos_sin, rot, neox),
              dtype, what + " apply_rotary", scale=3.0)
        mine, theirs = start.clone(), start.clone()
        ops.store_kv(k, v, mine, caches[1], slots, k_scale, v_scale)
        ref.store_kv(k, v, theirs, caches[3], slots, k_scale, v_scale)
        (fp8_close if cdt == FP8 else lambda a, b, w: close(a, b, dtype, w, 3.0))(mine, theirs, what + " store_kv")


def case_decode() -> None:
    from tandem_kernels import ops, reference as ref

    configs = [  # (dtype, cache dtype, batch, hq, hk, d, block_size, table width in blocks)
        (torch.float32, torch.float32, 3, 4, 4, 32, 16, 6),  # GQA 1, one split
        (torch.float32, torch.float32, 4, 4, 2, 64, 16, 40),  # GQA 2, several splits
        (torch.bfloat16, torch.bfloat16, 5, 8, 2, 32, 16, 30),  # GQA 4
        (torch.bfloat16, torch.bfloat16, 1, 4, 1, 128, 32, 12),
        (torch.float16, torch.float16, 2, 2, 1, 64, 16, 24),
        (torch.bfloat16, FP8, 3, 4, 2, 64, 16, 33),
        (torch.float32, FP8, 2, 2, 2, 32, 32, 4),
        (torch.float32, torch.float32, 2, 3, 1, 48, 16, 20),  # head_dim not a power of two
    ]
    for dtype, cdt, b, hq, hk, d, bs, width in configs:
        what = f"decode {dtype} cache={cdt} b={b} hq={hq} hk={hk} d={d} bs={bs} width={width}"
        lens = torch.randint(1, width * bs + 1, (b,)).tolist()
        lens[0] = width * bs  # a full table, often a block multiple
        if b > 2:
            lens[1] = 0  # a padded batch row: zeros
        kc, vc, table = paged(lens, bs, hk, d, cdt, width)
        q = rand(b, hq, d, dtype=dtype)
        ctx = torch.tensor(lens, dtype=torch.int32)
        k_scale, v_scale = (0.5, 1.5) if cdt == FP8 else (1.0, 1.0)
        got = ops.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, k_scale, v_scale)
        assert got.shape == q.shape and got.dtype == dtype and torch.isfinite(got.float()).all(), what
        live = ctx > 0  # an empty context gives zeros (the batched reference gives NaN there)
        assert torch.equal(got[~live].float(), torch.zeros_like(got[~live].float())), what
        want = ref.paged_decode_attention(q[live], kc, vc, table[live], ctx[live], d ** -0.5, k_scale, v_scale)
        close(got[live], want, dtype, what, scale=2.0)


def case_gemv() -> None:
    """The decode GEMV alone, with a bias, with the norm in front (with and without the residual
    sum), and with SiLU-and-multiply behind; odd sizes, 1 to MAX_ROWS rows."""
    from tandem_kernels import gemv as gm, ops, reference as ref
    from tandem_kernels.gemv import MAX_ROWS

    cases = [
        (torch.float32, 1, (37, 100), False, False, False, False),
        (torch.float32, 3, (50, 513), True, True, False, False),
        (torch.bfloat16, 1, (64, 600), True, True, False, False),  # k ragged at every block_k below
        (torch.bfloat16, 2, (48, 300), True, False, True, False),
        (torch.bfloat16, 1, (2 * 40, 257), True, True, False, True),
        (torch.float16, MAX_ROWS, (2 * 24, 96), True, True, False, True),
        (torch.bfloat16, 5, (33, 64), False, False, True, False),
        (torch.float32, 2, (2 * 20, 70), True, True, True, True),
    ]
    # The default; per-lane sums without the prefetch; short tiles (many loop steps, a ragged last
    # one) with the next tile loaded ahead; a program of more rows than some weights have; each
    # row against the whole tile, with and without per-lane sums; one row's 2-D product (several
    # rows': a 3-D product of the tile loaded in its layout, wide or narrowed by the rows); the norm
    # as its own kernel; the several rows' sums as chains of multiply-adds.
    tilings = [gm.GemvTiling(), gm.GemvTiling(late_reduce=True, prefetch=False),
               gm.GemvTiling(block_n=4, block_k=64), gm.GemvTiling(block_n=64, block_k=128, num_warps=8),
               gm.GemvTiling(block_n=2, block_k=64, wide_rows=True),
               gm.GemvTiling(block_n=4, block_k=32, late_reduce=True, wide_rows=True),
               gm.GemvTiling(block_n=4, block_k=64, late_reduce=True, flat_row=True),
               gm.GemvTiling(block_n=4, block_k=64, late_reduce=True, flat_row=True, stages=3),
               gm.GemvTiling(block_n=8, block_k=32, stages=2, prefetch=False),
               gm.GemvTiling(block_n=4, block_k=64, late_reduce=True, flat_row=True, wide_rows=True, stages=2),
               gm.GemvTiling(block_n=8, block_k=32, late_reduce=True, flat_row=True),
               gm.GemvTiling(block_n=4, block_k=64, late_reduce=True, flat_row=True, wide_rows=True, separate_norm=True),
               gm.GemvTiling(block_n=4, block_k=64, late_reduce=True, flat_row=True, wide_rows=True, fma_chain=True)]
    for t, (dtype, rows, (n, k), norm, res, bias, silu) in itertools.product(tilings, cases):
        what = f"gemv {dtype} rows={rows} n={n} k={k} norm={norm} residual={res} bias={bias} silu={silu} {t}"
        x, w = rand(rows, k, dtype=dtype), rand(n, k, dtype=dtype, scale=k ** -0.5)
        kw = dict(residual=rand(rows, k, dtype=dtype) if res else None,
                  norm_weight=(torch.rand(k) + 0.5).to(dtype) if norm else None, eps=1e-5, silu_pair=silu)
        b = rand(n, dtype=dtype) if bias else None
        got, got_res = gm.gemv(x, w, b, tiling=t, **kw)
        want, want_res = ref.gemv(x, w, b, **kw)
        assert got.shape == want.shape and got.dtype == dtype, what
        # SiLU(gate) * up multiplies two GEMV outputs, each rounded (by truncation in the
        # interpreter) from inputs rounded the same way: twice the error of one output. Over 120
        # seeds of the bf16 case the error reached 1.1x the one-output bound, 0.55x this one.
        close(got, want, dtype, what, scale=2.0 if silu else 1.0, rscale=2.0 if silu else 1.0)
        if res:
            close(got_res, want_res, dtype, what + " residual")
        else:
            assert got_res is None, what
    # FP8 weights (e4m3, a float32 scale a row) with unquantized activations: the norm, residual,
    # bias and SiLU pair (gate and up rows each scaled by their own row's scale) as above.
    for t, (dtype, rows, (n, k), norm, res, bias, silu) in itertools.product(tilings[:3] + tilings[-6:], cases[2:6]):
        what = f"gemv e4m3 {dtype} rows={rows} n={n} k={k} norm={norm} residual={res} bias={bias} silu={silu} {t}"
        x, w = rand(rows, k, dtype=dtype), rand(n, k, dtype=torch.float32, scale=k ** -0.5)
        scale = (w.abs().amax(1) / 448.0).clamp(min=1e-12) * (1 + torch.rand(n))  # rows' scales differ
        q = (w / scale[:, None]).clamp(-448, 448).to(FP8)
        q.view(torch.uint8)[:, :3] = torch.tensor([0x01, 0x85, 0x07], dtype=torch.uint8)  # e4m3 subnormals, both signs
        kw = dict(residual=rand(rows, k, dtype=dtype) if res else None,
                  norm_weight=(torch.rand(k) + 0.5).to(dtype) if norm else None, eps=1e-5, silu_pair=silu,
                  weight_scale=scale)
        b = rand(n, dtype=dtype) if bias else None
        got, _ = gm.gemv(x, q, b, tiling=t, **kw)
        want, _ = ref.gemv(x, q, b, **kw)
        close(got, want, dtype, what, scale=2.0 if silu else 1.0, rscale=2.0 if silu else 1.0)
    f32 = torch.float32
    for weight, scale in ((rand(4, 8, dtype=FP8), None), (rand(4, 8, dtype=f32), torch.ones(4)),
                          (rand(4, 8, dtype=FP8), torch.ones(3))):
        try:
            ops.gemv(rand(1, 8, dtype=f32), weight, weight_scale=scale)
        except ValueError as exc:
            assert "weight" in str(exc)
        else:
            raise AssertionError("an e4m3 weight without its scales (or scales without one) must raise ValueError")
    try:
        ops.gemv(rand(MAX_ROWS + 1, 8, dtype=torch.float32), rand(4, 8, dtype=torch.float32))
    except ValueError as exc:
        assert "rows" in str(exc)
    else:
        raise AssertionError("more than MAX_ROWS rows must raise ValueError")
    # TANDEM_GEMV_TILING: fields over every projection's tiling, or fields by projection (the
    # others keep theirs); a bad object, field or value raises ValueError naming the variable.
    base = {name: gm.tiling_for(name) for name in gm.PROJECTIONS}
    os.environ[gm.TILING_ENV] = '{"block_k": 1024}'
    assert all(gm.tiling_for(name) == dataclasses.replace(base[name], block_k=1024) for name in gm.PROJECTIONS)
    os.environ[gm.TILING_ENV] = '{"qkv": {"block_n": 4, "prefetch": false}, "down": {"num_warps": 8}}'
    assert gm.tiling_for("qkv") == dataclasses.replace(base["qkv"], block_n=4, prefetch=False)
    assert gm.tiling_for("down") == dataclasses.replace(base["down"], num_warps=8)
    assert gm.tiling_for("o_proj") == base["o_proj"] and gm.tiling_for("gate_up") == base["gate_up"]
    for bad in ('{"block_kk": 512}', '[8, 512]', '{"qkv": {"block_n": 6}}', 'block_n=8'):
        os.environ[gm.TILING_ENV] = bad
        try:
            gm.tiling_for("qkv")
        except ValueError as exc:
            assert gm.TILING_ENV in str(exc) or "power of two" in str(exc), (bad, exc)
        else:
            raise AssertionError(f"{gm.TILING_ENV}={bad!r} must raise ValueError")
    del os.environ[gm.TILING_ENV]
    try:
        gm.tiling_for("lm_head")
    except ValueError as exc:
        assert "projection" in str(exc)
    else:
        raise AssertionError("an unknown projection must raise ValueError")


def case_argmax_rows() -> None:
    """Row argmax against torch's on fresh random rows: bf16 (many ties) and float32, one row and
    several, a ragged last chunk, a strided view, ties across chunks, NaN and all -inf rows."""
    from tandem_kernels import argmax as am, reference as ref

    for dtype, rows, cols in ((torch.bfloat16, 1, 10_000), (torch.float32, 5, 8193), (torch.bfloat16, 3, 37),
                              (torch.float16, 2, 4096)):
        x = (torch.randn(rows, cols + 3) * 4).to(dtype)[:, :cols]  # padded rows: a view of stride cols + 3
        if rows > 1:
            x[1, 17] = x[1, cols - 2] = x[1].max() + 1  # a tie across chunks (where cols > CHUNK): the first wins
            x[-1] = float("-inf")
        assert torch.equal(am.argmax_rows(x), ref.argmax_rows(x)), (dtype, rows, cols)
    x = torch.randn(2, 9000)
    x[0, 5000] = float("nan")
    assert am.argmax_rows(x)[0].item() == 5000
    try:
        am.argmax_rows(torch.empty(2, 0))
    except ValueError as exc:
        assert "cols" in str(exc)
    else:
        raise AssertionError("an empty row must raise ValueError")


def _allowed_f64(x, temperature, kth, top_p, min_p, slack):
    """Float64 allowed sets of reference.sample_filtered's rule, widened (slack > 0) or narrowed
    (slack < 0) by `slack` of the normaliser at the top-p edge and in logit units at min-p's."""
    x = x.double()
    t = temperature.double().unsqueeze(1)
    valid = (x >= kth.double().unsqueeze(1)) & (x > float("-inf"))
    m = torch.where(valid, x, float("-inf")).amax(1, keepdim=True)
    w = torch.where(valid, torch.exp((x - m) / t), 0.0)
    vals, order = x.sort(1, descending=True)
    ws = w.gather(1, order)
    total = ws.cumsum(1)  # mass up to each sorted position; the mass strictly above a value is
    last = torch.searchsorted(-vals, -vals, right=False)  # the total before its first occurrence
    above = torch.empty_like(w).scatter_(1, order, torch.where(last > 0, total.gather(1, (last - 1).clamp(min=0)), 0.0))
    top_p = top_p.double().unsqueeze(1)
    in_p = (above < (top_p + slack) * w.sum(1, keepdim=True)) | (top_p >= 1.0)
    return valid & in_p & (x >= m + torch.log(min_p.double()).unsqueeze(1) * t - slack)


def case_sample_filtered() -> None:
    """The sort-free filtered race against the reference's sorted rule on fresh random logits:
    bf16 (ties) and float32, several column blocks, a strided view, -inf logits, every filter
    alone and together. The kernel's token is allowed (within float slack at the edges) and
    within float rounding of the allowed set's best score (so, the noise being Exponential(1),
    a draw from the renormalised allowed set); it is the reference's token on all but near-tied
    rows; top_p ~0 is the argmax."""
    from tandem_kernels import ops, reference as ref

    for dtype, rows, cols in ((torch.bfloat16, 24, 5000), (torch.float32, 16, 2049), (torch.bfloat16, 6, 37)):
        x = (torch.randn(rows, cols + 5) * torch.rand(rows, 1) * 6).to(dtype)[:, :cols]
        x[0, : cols // 2] = float("-inf")  # masked tokens never win
        temperature = torch.rand(rows) * 1.5 + 0.3
        k = torch.randint(1, min(cols, 60), (rows,))
        kth = x.float().topk(int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        kth = torch.where(torch.rand(rows) < 0.5, kth, float("-inf"))
        top_p = torch.where(torch.rand(rows) < 0.7, torch.rand(rows) * 0.95 + 0.02, torch.tensor(2.0))
        min_p = torch.where(torch.rand(rows) < 0.4, torch.rand(rows) * 0.3, torch.tensor(0.0))
        noise = torch.empty(rows, cols).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
        got = ops.sample_filtered(x, temperature, kth, top_p, min_p, noise)
        want = ref.sample_filtered(x, temperature, kth, top_p, min_p, noise)
        loose = _allowed_f64(x.float(), temperature, kth, top_p, min_p, 1e-5)
        strict = _allowed_f64(x.float(), temperature, kth, top_p, min_p, -1e-5)
        score = x.double() / temperature.double().unsqueeze(1) - torch.log(noise.double())
        best = torch.where(strict, score, float("-inf")).amax(1)
        for r in range(rows):
            tok = int(got[r])
            assert loose[r, tok], (dtype, r, tok, "outside the allowed set")
            assert score[r, tok] >= best[r] - 1e-4, (dtype, r, tok, float(score[r, tok]), float(best[r]))
        assert (got == want).float().mean() >= 0.9, (dtype, got.tolist(), want.tolist())

    # Rows with no finite logit (all masked, or NaN) end with some in-range index, never a hang.
    x = torch.randn(4, 300)
    x[0] = float("-inf")
    x[1] = float("nan")
    x[2, :150] = float("nan")
    four = torch.ones(4)
    got = ops.sample_filtered(x, four, torch.full((4,), float("-inf")), torch.full((4,), 0.5), 0 * four,
                              torch.empty(4, 300).exponential_())
    assert ((got >= 0) & (got < 300)).all(), got
    assert 150 <= int(got[2]) < 300, "a NaN logit never wins while a number is left"

    x = torch.randn(8, 3000)
    one = torch.ones(8)
    got = ops.sample_filtered(x, one, torch.full((8,), float("-inf")), torch.full((8,), 1e-7), 0 * one,
                              torch.empty(8, 3000).exponential_())
    assert torch.equal(got, x.argmax(1)), "top_p ~0 keeps only the most likely token"


def case_gemv_table_tilings() -> None:
    """Every tiling a GPU's tables choose (gemv_tilings.base_tiling: bf16 at one row, FP8 at each
    row count up to FP8_DEVICE_ROWS, the several-row tiles included) on small shapes of each
    projection's kind, bf16 or e4m3 weights, against the reference."""
    from engine.quant.fp8 import quantize_weight_per_channel
    from tandem_kernels import gemv as gm, gemv_tilings as gt, reference as ref

    shapes = {"qkv": (48, 96, True, False), "o_proj": (32, 64, False, False),
              "gate_up": (2 * 24, 96, True, True), "down": (32, 80, False, False)}
    families = {*gt.DEVICE_TILINGS, *gt.FP8_DEVICE_TILINGS, *gt.FP8_SEVERAL_ROW_TILINGS, *gt.FP8_DEVICE_ROWS}
    for family, fp8, (projection, (n, k, norm, silu)) in itertools.product(sorted(families), (False, True),
                                                                           shapes.items()):
        most = gt.FP8_DEVICE_ROWS.get(family, 1) if fp8 else 1
        for rows in range(1, most + 1):
            t = gt.base_tiling(projection, family, fp8, rows)
            what = f"{family} fp8={fp8} {projection} rows={rows} {t}"
            x, w = rand(rows, k, dtype=torch.bfloat16), rand(n, k, dtype=torch.float32, scale=k ** -0.5)
            w, scale = quantize_weight_per_channel(w) if fp8 else (w.to(torch.bfloat16), None)
            kw = dict(residual=rand(rows, k, dtype=torch.bfloat16) if norm else None,
                      norm_weight=(torch.rand(k) + 0.5).to(torch.bfloat16) if norm else None, eps=1e-5,
                      silu_pair=silu, weight_scale=scale)
            got, got_res = gm.gemv(x, w, tiling=t, **kw)
            want, want_res = ref.gemv(x, w, **kw)
            close(got, want, torch.bfloat16, what, scale=2.0 if silu else 1.0, rscale=2.0 if silu else 1.0)
            if norm:
                close(got_res, want_res, torch.bfloat16, what + " residual")


def case_fused_decode_engine() -> None:
    """The engine with all four projections as fused decode GEMVs (in steps of both prompts'
    tokens) gives the unfused engine's greedy tokens, every kernel in Triton (interpreted), for a
    plain layer (llama) and one with qkv bias (qwen2)."""
    import tempfile
    from pathlib import Path

    from engine import LLM, SamplingParams
    from engine.demo import make_random_model

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (7, 19)]
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("llama", "qwen2"):
            path = make_random_model(Path(tmp) / family, family, seed=1)
            want = [o.token_ids for o in LLM(path, num_kv_blocks=32).generate(prompts, params)]
            os.environ.update(TANDEM_FUSED_GEMV="qkv,o_proj,gate_up,down", TANDEM_FUSED_GEMV_ROWS="2")
            try:
                fused = LLM(path, num_kv_blocks=32, fused_decode_gemv=True)
            finally:
                del os.environ["TANDEM_FUSED_GEMV"], os.environ["TANDEM_FUSED_GEMV_ROWS"]
            assert all(len(layer.fused_decode) == 4 for layer in fused.engine.model.layers)
            got = [o.token_ids for o in fused.generate(prompts, params)]
            assert got == want, f"{family}: fused {got} != unfused {want}"


def case_decode_tunings() -> None:
    """Every launch shape of the decode kernel (tile sizes, split lengths, where FP8 is widened)
    gives the reference's result; GQA 4 with partial blocks and an empty context."""
    from tandem_kernels import decode_attention as da, reference as ref

    for cdt, cvt, block_n, min_partition in itertools.product(
            (torch.bfloat16, FP8), ("", "v", "kv"), (16, 64), (16, 64)):
        b, hq, hk, d, bs, width = 3, 8, 2, 64, 16, 9
        stages = 3 if block_n == 16 else 2  # half the shapes with the block-table entries read a tile ahead
        what = (f"decode tuning cache={cdt} opaque_cvt={cvt} block_n={block_n} min_partition={min_partition} "
                f"num_stages={stages} narrow_offsets={block_n == 16} unsigned_index={min_partition == 16} "
                f"prefetch={cvt != 'v'} prefetch_tiles={2 if block_n == 16 else 1}")
        lens = [width * bs - 3, 0, int(torch.randint(1, width * bs, ()))]
        kc, vc, table = paged(lens, bs, hk, d, cdt, width)
        q = rand(b, hq, d, dtype=torch.bfloat16)
        ctx = torch.tensor(lens, dtype=torch.int32)
        tuning = da.DecodeTuning(block_n=block_n, min_partition=min_partition, opaque_cvt=cvt, num_stages=stages,
                                 narrow_offsets=block_n == 16,  # half with 32-bit K/V offsets,
                                 unsigned_index=min_partition == 16,  # half with unsigned table math
                                 prefetch=cvt != "v",  # a third with the first tile loaded in the loop
                                 prefetch_tiles=2 if block_n == 16 else 1)  # half two tiles before the wait
        got = da.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, 0.5, 1.5, tuning=tuning)
        assert torch.equal(got[1].float(), torch.zeros_like(got[1].float())), what
        live = ctx > 0
        want = ref.paged_decode_attention(q[live], kc, vc, table[live], ctx[live], d ** -0.5, 0.5, 1.5)
        close(got[live], want, torch.bfloat16, what, scale=2.0)
    try:
        da.DecodeTuning(opaque_cvt="k")
    except ValueError as exc:
        assert "opaque_cvt" in str(exc)
    else:
        raise AssertionError("an unknown opaque_cvt must raise ValueError")


def case_decode_narrow_offsets_only_where_they_fit() -> None:
    """narrow_offsets (32-bit K/V addresses) is taken only where every offset the cache views
    allow fits in 31 bits: an engine-sized FP8 pool does, a view one block past 2**31 elements
    does not and falls back to 64-bit addresses (shapes only: the caches are on the meta device)."""
    from tandem_kernels import decode_attention as da

    bsz, hq, hk, d, bs = 4, 32, 8, 128, 16
    per_block = bs * hk * d
    for blocks, fits in ((2**31 // per_block, True), (2**31 // per_block + 1, False)):
        kc = torch.empty(blocks, bs, hk, d, dtype=FP8, device="meta")
        q = torch.empty(bsz, hq, d, dtype=torch.bfloat16, device="meta")
        table = torch.empty(bsz, 64, dtype=torch.int32, device="meta")
        lens = torch.empty(bsz, dtype=torch.int32, device="meta")
        for narrow in (False, True):
            tuning = da.DecodeTuning(narrow_offsets=narrow)
            _, _, consts = da.stage1_launch(q, kc, torch.empty_like(kc), table, lens, d ** -0.5, 1.0, 1.0, tuning, 1,
                                            torch.empty_like(q), None, None)
            assert consts["NARROW"] is (narrow and fits), (blocks, narrow, consts["NARROW"])
    assert da.FP8_TUNING.narrow_offsets and not da.BF16_TUNING.narrow_offsets


def case_decode_softmax_variants() -> None:
    """The softmax bookkeeping variants (row sums kept lane by lane, lazy rescaling) give the
    reference's result, on keys whose scores grow along the context so that the running max
    moves by far more than the lazy threshold (and, early on, by less), in one split and many."""
    from tandem_kernels import decode_attention as da, reference as ref

    for cdt, defer, lazy, min_partition in itertools.product(
            (torch.bfloat16, FP8), (False, True), (False, True), (16, 256)):
        b, hq, hk, d, bs, width = 2, 8, 2, 32, 16, 10
        what = (f"decode softmax cache={cdt} defer_sum={defer} lazy_rescale={lazy} min_partition={min_partition} "
                f"prefetch={not defer}")
        lens = [width * bs - 7, int(torch.randint(bs, width * bs, ()))]
        kc, vc, table = paged(lens, bs, hk, d, cdt, width)
        grown = kc.float()
        for row, n in zip(table.tolist(), lens):
            for j, block in enumerate(row[: -(-n // bs)]):
                grown[block] *= 1 + 1.5 * j  # a block's scores ~(1 + 1.5 j) times the first's
        kc = grown.clamp(-400, 400).to(cdt)
        q = rand(b, hq, d, dtype=torch.bfloat16)
        ctx = torch.tensor(lens, dtype=torch.int32)
        tuning = da.DecodeTuning(block_n=16, min_partition=min_partition, opaque_cvt="v" if cdt == FP8 else "",
                                 defer_sum=defer, lazy_rescale=lazy, prefetch=not defer)
        got = da.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, 0.5, 1.5, tuning=tuning)
        want = ref.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, 0.5, 1.5)
        close(got, want, torch.bfloat16, what, scale=2.0)


def case_decode_warp_split() -> None:
    """warp_split (each warp's own online softmax over its share of a tile, merged after the loop)
    gives the reference's result: scores growing along the context (the warps' maxima differ and
    move), contexts shorter than a tile (warps with no token), an empty one, GQA groups of 1, 4
    and 8, one split and several, the block table read a tile ahead or not."""
    from tandem_kernels import decode_attention as da, reference as ref

    for cdt, (block_n, warps), (hq, hk), min_partition in itertools.product(
            (torch.bfloat16, FP8), ((64, 4), (32, 2)), ((8, 2), (16, 2), (4, 4)), (64, 256)):
        b, d, bs, width = 4, 32, 16, 12
        stages = 3 if hq == 8 else 2
        what = (f"decode warp_split cache={cdt} block_n={block_n} warps={warps} heads={hq}/{hk} "
                f"min_partition={min_partition} num_stages={stages}")
        lens = [width * bs - 7, 5, 0, int(torch.randint(bs, width * bs, ()))]
        kc, vc, table = paged(lens, bs, hk, d, cdt, width)
        grown = kc.float()
        for row, n in zip(table.tolist(), lens):
            for j, block in enumerate(row[: -(-n // bs)]):
                grown[block] *= 1 + 1.5 * j
        kc = grown.clamp(-400, 400).to(cdt)
        q = rand(b, hq, d, dtype=torch.bfloat16)
        ctx = torch.tensor(lens, dtype=torch.int32)
        tuning = da.DecodeTuning(block_n=block_n, num_warps=warps, min_partition=min_partition, num_stages=stages,
                                 opaque_cvt="v" if cdt == FP8 else "", warp_split=True,
                                 narrow_offsets=cdt == FP8, unsigned_index=cdt == FP8)
        got = da.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, 0.5, 1.5, tuning=tuning)
        assert torch.equal(got[2].float(), torch.zeros_like(got[2].float())), what
        live = ctx > 0
        want = ref.paged_decode_attention(q[live], kc, vc, table[live], ctx[live], d ** -0.5, 0.5, 1.5)
        close(got[live], want, torch.bfloat16, what, scale=2.0)
    # The experiments' override: TANDEM_DECODE_TUNING's fields over the default, bad JSON named.
    import os

    os.environ[da.TUNING_ENV] = '{"warp_split": true}'
    assert da.default_tuning(FP8).warp_split and da.default_tuning(FP8).narrow_offsets
    os.environ[da.TUNING_ENV] = '{"warp_splt": true}'
    try:
        da.default_tuning(FP8)
    except ValueError as exc:
        assert da.TUNING_ENV in str(exc)
    else:
        raise AssertionError("an unknown field in TANDEM_DECODE_TUNING must raise ValueError")
    del os.environ[da.TUNING_ENV]
    assert da.default_tuning(FP8) == da.FP8_TUNING
    # FP8 batches that fill the GPU on their own take the warp-split tuning; batches of at most
    # PREFETCH_UPTO pairs an SM load their first tile before the PDL wait (both caches).
    full = math.ceil(da.FP8_WIDE_FROM * 132)
    assert da.default_tuning(FP8, full - 1, 132) == da.FP8_TUNING
    assert da.default_tuning(FP8, full, 132) == da.FP8_WIDE_TUNING and da.FP8_WIDE_TUNING.warp_split
    assert da.default_tuning(torch.bfloat16, 10 * full, 132) == da.BF16_TUNING
    small = int(da.PREFETCH_UPTO * 132)
    assert small >= 32  # batch 4 of 8 KV heads on 132 SMs, as measured (BENCHMARKS.md §31)
    for cdt, plain in ((torch.bfloat16, da.BF16_TUNING), (FP8, da.FP8_TUNING)):
        assert da.default_tuning(cdt, small, 132).prefetch and da.default_tuning(cdt, 8, 132).prefetch
        assert da.default_tuning(cdt, small + 1, 132) == plain and not plain.prefetch
    try:
        da.DecodeTuning(block_n=32, num_warps=4, warp_split=True)
    except ValueError as exc:
        assert "warp_split" in str(exc)
    else:
        raise AssertionError("a warp's share of a tile below 16 tokens must raise ValueError")


def case_gather_ceiling_checksums() -> None:
    """bench/gather_ceiling.py's kernel reads exactly what the decode kernel's programs read:
    the XOR of its programs' words equals that of every K and V row of each sequence's context,
    bf16 and FP8, the engine's layout and the head-major one, one split and several, with and
    without the block table read a tile ahead."""
    from bench.gather_ceiling import LAYOUTS, as_layout, gather_checksums, reference_checksums

    for cdt, layout, splits, stages in itertools.product((torch.bfloat16, FP8), LAYOUTS, (1, 3), (2, 3)):
        bs, hk, d = 16, 2, 32
        lens = [int(torch.randint(1, 90, ())), 70, 1]
        kc, vc, table = paged(lens, bs, hk, d, cdt)
        ctx = torch.tensor(lens, dtype=torch.int32)
        k, v = as_layout(kc, layout), as_layout(vc, layout)
        got = gather_checksums(k, v, table, ctx, splits, block_n=16, min_partition=16, num_stages=stages, ahead=True)
        folded = got[:, :, 0].clone()
        for i in range(1, splits):
            folded ^= got[:, :, i]
        want = reference_checksums(kc, vc, table, ctx)
        assert torch.equal(folded, want), f"gather {cdt} {layout} splits={splits} stages={stages}: {folded} != {want}"


def case_pdl_stays_off_where_it_cannot_run() -> None:
    """Programmatic dependent launch is on by default (TANDEM_PDL=1 asks for it explicitly); on a
    CPU tensor and under the interpreter (which runs no PTX) the kernels launch without it, and run."""
    from tandem_kernels import ops, reference as ref
    from tandem_kernels.triton_common import PDL_ENV, pdl_enabled, pdl_launch

    os.environ[PDL_ENV] = "1"
    try:
        assert not pdl_enabled(torch.device("cpu"))
        assert pdl_launch(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
        x, w = rand(3, 64, dtype=torch.float32), torch.rand(64) + 0.5
        close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), torch.float32, "rms_norm with TANDEM_PDL=1")
    finally:
        del os.environ[PDL_ENV]


def case_decode_cache_strides() -> None:
    """The decode kernel addresses its caches through their strides: caches stored head-major
    ([blocks, kv_heads, block_size, head_dim], viewed in the engine's index order, as
    bench/gather_ceiling.py times them) give the reference's result, bf16 and FP8, one split and
    several; a K or V cache whose head_dim is not its contiguous dim is refused, naming it."""
    from bench.gather_ceiling import as_layout
    from tandem_kernels import decode_attention as da, reference as ref

    b, hq, hk, d, bs = 2, 8, 2, 32, 16
    for cdt, min_partition in itertools.product((torch.bfloat16, FP8), (16, 256)):
        kc, vc, table = paged([70, 9], bs, hk, d, cdt)
        q = rand(b, hq, d, dtype=torch.bfloat16)
        ctx = torch.tensor([70, 9], dtype=torch.int32)
        tuning = dataclasses.replace(da.default_tuning(cdt), block_n=16, min_partition=min_partition)
        got = da.paged_decode_attention(q, as_layout(kc, "hnd"), as_layout(vc, "hnd"), table, ctx, d ** -0.5,
                                        0.5, 1.5, tuning=tuning)
        want = ref.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, 0.5, 1.5)
        close(got, want, torch.bfloat16, f"decode head-major cache={cdt} min_partition={min_partition}", scale=2.0)
    kc, vc, table = paged([20, 7], bs, hk, d, torch.bfloat16, 2)
    q = rand(b, hq, d, dtype=torch.bfloat16)
    ctx = torch.tensor([20, 7], dtype=torch.int32)
    slots_inner = vc.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)  # same values, slots contiguous
    for name, k, v in (("k_cache", slots_inner, vc), ("v_cache", kc, slots_inner)):
        try:
            da.paged_decode_attention(q, k, v, table, ctx, d ** -0.5)
        except ValueError as exc:
            assert name in str(exc), exc
        else:
            raise AssertionError(f"a {name} without a contiguous last dim must be refused")


def case_head_major_cache() -> None:
    """A KV cache stored head-major (KVCache layout "hnd": [blocks, kv_heads, block_size, head_dim],
    viewed as [blocks, block_size, kv_heads, head_dim]): rotary + store writes the values it
    writes into the engine's layout, extend attention reads them to the same result, bf16 and
    FP8; and an engine with it gives the default layout's greedy tokens, every kernel in Triton
    (interpreted), with a prefix-cache hit."""
    import tempfile
    from pathlib import Path

    from bench.gather_ceiling import as_layout
    from engine import LLM, SamplingParams
    from engine.demo import make_random_model
    from tandem_kernels import ops, reference as ref

    hq, hk, d, bs, rot = 4, 2, 32, 16, 32
    for cdt in (torch.bfloat16, FP8):
        seqs = [(37, 0), (5, 20)]  # (new tokens, cached prefix)
        lens = [n + p for n, p in seqs]
        kc, vc, table = paged(lens, bs, hk, d, cdt)
        head_k, head_v = as_layout(kc, "hnd"), as_layout(vc, "hnd")
        t = sum(n for n, _ in seqs)
        qkv = rand(t, (hq + 2 * hk) * d, dtype=torch.bfloat16, scale=2.0)
        q, k, v = (y.view(t, -1, d) for y in qkv.split([hq * d, hk * d, hk * d], dim=-1))
        inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
        cos_sin = ref.rope_cos_sin_cache(512, rot, inv)
        pos = torch.cat([torch.arange(p, p + n) for n, p in seqs])
        slots = torch.cat([table[i, pos_i // bs].long() * bs + pos_i % bs
                           for i, pos_i in enumerate(torch.arange(p, p + n) for n, p in seqs)])
        q1, _ = ops.rotary_and_store_kv(q, k, v, pos, cos_sin, kc, vc, slots, rot, True, 0.5, 1.5)
        q2, _ = ops.rotary_and_store_kv(q, k, v, pos, cos_sin, head_k, head_v, slots, rot, True, 0.5, 1.5)
        what = f"head-major cache={cdt}"
        assert torch.equal(q1, q2), what
        for engine_order, head_major in ((kc, head_k), (vc, head_v)):
            assert not head_major.is_contiguous() and head_major.stride(2) == d * bs, what
            assert torch.equal(engine_order.view(torch.uint8), head_major.view(torch.uint8)), f"{what}: stores differ"
        flat_k, flat_v = kc.clone(), vc.clone()  # the reference's store takes any strides too
        strided_k, strided_v = as_layout(flat_k, "hnd"), as_layout(flat_v, "hnd")
        ref.store_kv(k, v, flat_k, flat_v, slots, 0.5, 1.5)
        ref.store_kv(k, v, strided_k, strided_v, slots, 0.5, 1.5)
        assert torch.equal(flat_k.view(torch.uint8), strided_k.view(torch.uint8)), what
        assert torch.equal(flat_v.view(torch.uint8), strided_v.view(torch.uint8)), what
        qsl = torch.tensor([0] + list(itertools.accumulate(n for n, _ in seqs)), dtype=torch.int32)
        sl = torch.tensor(lens, dtype=torch.int32)
        got = ops.extend_attention(q1, head_k, head_v, table, qsl, sl, d ** -0.5, 0.5, 1.5)
        want = ops.extend_attention(q1, kc, vc, table, qsl, sl, d ** -0.5, 0.5, 1.5)
        close(got, want, torch.bfloat16, f"extend {what}", scale=2.0)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    shared = torch.randint(0, 256, (40,)).tolist()
    prompts = [shared + torch.randint(0, 256, (n,)).tolist() for n in (3, 9)]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random_model(Path(tmp) / "llama", "llama", seed=1)
        plain = LLM(path, num_kv_blocks=32)
        want = [plain.generate([p], params)[0].token_ids for p in prompts]  # one after the other: a hit
        head_major = LLM(path, num_kv_blocks=32, kv_cache_layout="hnd")
        assert head_major.engine.kv_cache.layout == "hnd"
        got = [head_major.generate([p], params)[0].token_ids for p in prompts]
        assert got == want, f"head-major {got} != {want}"
        assert head_major.engine.cache.stats().hit_tokens >= 32, "the second prompt should reuse the first's blocks"


def case_rotary_store_and_decode() -> None:
    """ops.rotary_store_and_decode (a decode step's rotary, K/V store and attention in the decode
    kernel) against rotary_and_store_kv then paged_decode_attention (the reference): neox and
    interleaved, partial rotary, GQA groups of 1, 2 and 4, bf16 and FP8 caches (head-major too),
    one split and several, the default and the warp-split loops; a padded row (context 0, slot
    -1) gives zeros and writes nothing, a row whose slot is -1 writes nothing; the slots it does
    not write keep their bytes. And an engine with TANDEM_FUSED_ROTARY=1 gives the greedy tokens
    of one without, every kernel in Triton (interpreted)."""
    import tempfile
    from pathlib import Path

    from bench.gather_ceiling import as_layout
    from engine import LLM, SamplingParams
    from engine.attention import FUSED_ROTARY_ENV
    from engine.demo import make_random_model
    from tandem_kernels import decode_attention as da, ops, reference as ref

    warps = dataclasses.replace(da.FP8_TUNING, block_n=32, num_warps=2, resident=8, warp_split=True)
    configs = [  # (q dtype, cache dtype, layout, batch, hq, hk, d, rotary_dim, neox, block_size, width, tuning)
        (torch.bfloat16, torch.bfloat16, "nhd", 4, 8, 2, 64, 64, True, 16, 30, None),  # several splits
        (torch.bfloat16, torch.bfloat16, "nhd", 3, 4, 1, 64, 32, False, 16, 4, None),  # GLM-like, one split
        (torch.float32, torch.float32, "nhd", 3, 4, 4, 48, 24, True, 16, 12, None),  # head_dim 48
        (torch.bfloat16, FP8, "nhd", 4, 4, 2, 64, 64, True, 16, 24, None),
        (torch.bfloat16, FP8, "hnd", 4, 8, 2, 32, 32, False, 16, 24, warps),
    ]
    for dtype, cdt, layout, b, hq, hk, d, rot, neox, bs, width, tuning in configs:
        what = (f"rotary_store_and_decode {dtype} cache={cdt} {layout} b={b} heads={hq}/{hk} d={d} rot={rot} "
                f"neox={neox} width={width} warp_split={tuning is not None}")
        lens = torch.randint(1, width * bs + 1, (b,)).tolist()
        lens[0] = width * bs  # the step's token in the table's last slot
        lens[1] = 0  # a padded row
        kc, vc, table = paged(lens, bs, hk, d, cdt, width)
        if layout == "hnd":
            kc, vc = as_layout(kc, "hnd"), as_layout(vc, "hnd")
        qkv = rand(b, (hq + 2 * hk) * d, dtype=dtype, scale=2.0)
        q, k, v = (y.view(b, -1, d) for y in qkv.split([hq * d, hk * d, hk * d], dim=-1))
        inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
        cos_sin = ref.rope_cos_sin_cache(width * bs + 1, rot, inv)
        ctx = torch.tensor(lens, dtype=torch.int32)
        pos = (ctx - 1).clamp(min=0).long()
        slots = torch.tensor([int(table[i, p // bs]) * bs + p % bs for i, p in enumerate(pos.tolist())])
        slots[1] = -1
        if b > 3:
            slots[3] = -1  # not stored: attention reads what the slot held
        scales = (0.5, 1.5) if cdt == FP8 else (1.0, 1.0)
        mine_k, mine_v, ref_k, ref_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        if layout == "hnd":
            mine_k, mine_v, ref_k, ref_v = (as_layout(c.contiguous(), "hnd") for c in (kc, vc, kc, vc))
        got = da.rotary_store_and_decode(q, k, v, pos, cos_sin, mine_k, mine_v, slots, rot, neox, table, ctx,
                                         d ** -0.5, *scales, tuning=tuning)
        ref.rotary_store_and_decode(q, k, v, pos, cos_sin, ref_k, ref_v, slots, rot, neox, table, ctx,
                                    d ** -0.5, *scales)  # for its caches
        two_k, two_v = (as_layout(c.contiguous(), "hnd") if layout == "hnd" else c.clone() for c in (kc, vc))
        rotated, _ = ops.rotary_and_store_kv(q, k, v, pos, cos_sin, two_k, two_v, slots, rot, neox, *scales)
        two = da.paged_decode_attention(rotated, two_k, two_v, table, ctx, d ** -0.5, *scales, tuning=tuning)
        assert torch.equal(got[1].float(), torch.zeros_like(got[1].float())), f"{what}: a padded row"
        # The two kernels it replaces give the same bytes: the same rotation, store and loop.
        assert torch.equal(got, two), f"{what}: differs from rotary_and_store_kv + paged_decode_attention"
        assert torch.equal(mine_k.view(torch.uint8), two_k.view(torch.uint8)), what
        assert torch.equal(mine_v.view(torch.uint8), two_v.view(torch.uint8)), what
        # Against the reference: its attention over the caches the kernel wrote (which match the
        # reference's own to an e4m3 step, below), from the reference's rotation of q (rounded to
        # bf16 to nearest, where the interpreter truncates: looser than case_decode).
        live = ctx > 0
        q_rot = ref.apply_rotary(q, pos, cos_sin, rot, neox)
        want = ref.paged_decode_attention(q_rot[live], mine_k, mine_v, table[live], ctx[live], d ** -0.5, *scales)
        close(got[live], want, dtype, what, scale=4.0, rscale=4.0)
        for mine, theirs, start, name in ((mine_k, ref_k, kc, "k"), (mine_v, ref_v, vc, "v")):
            (fp8_close if cdt == FP8 else lambda a, c, w: close(a, c, dtype, w, 3.0))(mine, theirs, f"{what} {name} cache")
            written = torch.zeros(start.shape[:2], dtype=torch.bool)
            for slot in slots[slots >= 0].tolist():
                written[slot // bs, slot % bs] = True
            assert written.sum() == int((slots >= 0).sum()), what
            assert torch.equal(mine[~written].view(torch.uint8), start[~written].view(torch.uint8)), \
                f"{what}: {name} slots it should not write changed"
            assert not torch.equal(mine[written].view(torch.uint8), start[written].view(torch.uint8)), \
                f"{what}: {name} not stored"
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 19, 33)]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random_model(Path(tmp) / "llama", "llama", seed=2)
        want = [o.token_ids for o in LLM(path, num_kv_blocks=32).generate(prompts, params)]
        os.environ[FUSED_ROTARY_ENV] = "1"
        got = [o.token_ids for o in LLM(path, num_kv_blocks=32).generate(prompts, params)]
        del os.environ[FUSED_ROTARY_ENV]
        assert got == want, f"fused rotary {got} != {want}"


def case_decode_wide_table() -> None:
    """Block tables far wider than the contexts, as a CUDA graph captured for the model's longest
    context has them: the split count comes from the width, and each sequence divides its own
    context among the splits (a one-token context, one just past a split, the whole width)."""
    from tandem_kernels import decode_attention as da, reference as ref

    for cdt, stages in itertools.product((torch.bfloat16, FP8), (2, 3)):
        b, hq, hk, d, bs, width = 4, 8, 2, 64, 16, 128
        tuning = dataclasses.replace(da.default_tuning(cdt), num_stages=stages)
        splits = da.choose_splits(b, hk, width * bs, 132, tuning)
        assert splits > 8, splits  # the test needs many splits for short contexts to spread over
        part = max(tuning.min_partition, tuning.block_n)
        lens = [1, part * (splits // 2) + 1, int(torch.randint(2, 300, ())), width * bs]  # one just past a split
        what = f"decode wide table cache={cdt} num_stages={stages} splits={splits} lens={lens}"
        kc, vc, table = paged(lens, bs, hk, d, cdt, width)
        q = rand(b, hq, d, dtype=torch.bfloat16)
        ctx = torch.tensor(lens, dtype=torch.int32)
        got = da.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, 0.5, 1.5, tuning=tuning)
        want = ref.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, 0.5, 1.5)
        close(got, want, torch.bfloat16, what, scale=2.0)


def case_decode_min_splits() -> None:
    """A batch that fills a round of resident programs on its own runs one split a sequence; with
    min_splits each context is divided into that many (no more than min_partition-token splits
    reach), with balance_rounds into as many as fill the last round, and the result is the
    reference's (bf16 and FP8; a short context, an empty one)."""
    from tandem_kernels import decode_attention as da, reference as ref

    b, hq, hk, d, bs, width = 6, 8, 2, 64, 16, 8
    sms = 2  # 6 sequences x 2 KV heads = 12 programs: past the 2 SMs' round of resident programs
    launch_sms, da.num_sms = da.num_sms, lambda device: sms  # launches as on a 2-SM GPU
    try:
        _decode_min_splits(da, ref, b, hq, hk, d, bs, width, sms)
    finally:
        da.num_sms = launch_sms
    try:
        da.DecodeTuning(min_splits=0)
    except ValueError as exc:
        assert "min_splits" in str(exc)
    else:
        raise AssertionError("min_splits 0 must raise ValueError")


def _decode_min_splits(da, ref, b: int, hq: int, hk: int, d: int, bs: int, width: int, sms: int) -> None:
    for cdt in (torch.bfloat16, FP8):
        base = dataclasses.replace(da.default_tuning(cdt), block_n=16, min_partition=16)
        assert da.choose_splits(b, hk, width * bs, sms, base) == 1
        # balance_rounds: 12 programs in rounds of 4 x 2 = 8 fill 0.75 of two; split in two, 24 fill three
        for min_splits, balance, want_splits in ((3, False, 3), (64, False, width * bs // 16), (1, True, 2)):
            tuning = dataclasses.replace(base, min_splits=min_splits, balance_rounds=balance)
            assert da.choose_splits(b, hk, width * bs, sms, tuning) == want_splits, (cdt, min_splits, balance)
            lens = [width * bs, 0, 5, int(torch.randint(17, width * bs, ())), 47, width * bs - 1]
            kc, vc, table = paged(lens, bs, hk, d, cdt, width)
            q = rand(b, hq, d, dtype=torch.bfloat16)
            ctx = torch.tensor(lens, dtype=torch.int32)
            got = da.paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, 0.5, 1.5, tuning=tuning)
            live = ctx > 0
            want = ref.paged_decode_attention(q[live], kc, vc, table[live], ctx[live], d ** -0.5, 0.5, 1.5)
            close(got[live], want, torch.bfloat16,
                  f"decode min_splits={min_splits} balance_rounds={balance} cache={cdt} lens={lens}", scale=2.0)


def case_extend() -> None:
    from tandem_kernels import ops, reference as ref

    configs = [  # (dtype, cache dtype, hq, hk, d, block_size, [(q_len, prefix), ...])
        (torch.float32, torch.float32, 2, 2, 32, 16, [(131, 0)]),  # two query tiles, no prefix
        (torch.float32, torch.float32, 4, 2, 32, 16, [(1, 20), (0, 7), (37, 50), (5, 0)]),
        (torch.bfloat16, torch.bfloat16, 4, 1, 64, 16, [(70, 133), (1, 0)]),
        (torch.float16, torch.float16, 2, 1, 32, 32, [(19, 77), (3, 3)]),
        (torch.bfloat16, FP8, 4, 2, 32, 16, [(45, 60), (2, 0)]),
        (torch.float32, torch.float32, 2, 1, 128, 16, [(9, 30)]),
        (torch.float32, torch.float32, 3, 3, 48, 16, [(20, 11)]),  # head_dim not a power of two
    ]
    for dtype, cdt, hq, hk, d, bs, seqs in configs:
        what = f"extend {dtype} cache={cdt} hq={hq} hk={hk} d={d} bs={bs} seqs={seqs}"
        lens = [n + p for n, p in seqs]
        kc, vc, table = paged(lens, bs, hk, d, cdt)
        qsl = torch.tensor([0] + list(itertools.accumulate(n for n, _ in seqs)), dtype=torch.int32)
        q = rand(int(qsl[-1]), hq, d, dtype=dtype)
        sl = torch.tensor(lens, dtype=torch.int32)
        k_scale, v_scale = (0.5, 1.5) if cdt == FP8 else (1.0, 1.0)
        got = ops.extend_attention(q, kc, vc, table, qsl, sl, d ** -0.5, k_scale, v_scale)
        want = ref.extend_attention(q, kc, vc, table, qsl, sl, d ** -0.5, k_scale, v_scale)
        assert got.shape == q.shape and got.dtype == dtype, what
        close(got, want, dtype, what, scale=2.0)


def case_extend_new_kv() -> None:
    """extend_attention with new_kv (the new tokens' K/V read as computed, strided views of one
    qkv row as the model hands them, the context before them from the cache) gives the
    reference's result: no prefix, a prefix inside one tile, past several, two query tiles, a
    one-token prompt; bf16, fp32 and FP8 caches. The cache's own copies of the new tokens hold
    other values here, so a kernel that read them fails."""
    from tandem_kernels import ops, reference as ref

    configs = [  # (dtype, cache dtype, hq, hk, d, [(q_len, prefix), ...])
        (torch.bfloat16, torch.bfloat16, 4, 2, 32, [(150, 0), (1, 5), (37, 300)]),
        (torch.float32, torch.float32, 2, 1, 48, [(20, 11), (131, 0)]),
        (torch.bfloat16, FP8, 4, 2, 32, [(45, 130), (2, 0), (140, 3)]),
    ]
    for dtype, cdt, hq, hk, d, seqs in configs:
        what = f"extend new_kv {dtype} cache={cdt} hq={hq} hk={hk} d={d} seqs={seqs}"
        bs = 16
        lens = [n + p for n, p in seqs]
        kc, vc, table = paged(lens, bs, hk, d, cdt)
        qsl = torch.tensor([0] + list(itertools.accumulate(n for n, _ in seqs)), dtype=torch.int32)
        t = int(qsl[-1])
        qkv = rand(t, (hq + 2 * hk) * d, dtype=dtype)
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
        sl = torch.tensor(lens, dtype=torch.int32)
        k_scale, v_scale = (0.5, 1.5) if cdt == FP8 else (1.0, 1.0)
        got = ops.extend_attention(q, kc, vc, table, qsl, sl, d ** -0.5, k_scale, v_scale, new_kv=(k, v))
        want = ref.extend_attention(q, kc, vc, table, qsl, sl, d ** -0.5, k_scale, v_scale, new_kv=(k, v))
        close(got, want, dtype, what, scale=2.0)
        cached = ref.extend_attention(q, kc, vc, table, qsl, sl, d ** -0.5, k_scale, v_scale)
        assert not torch.allclose(cached.float(), want.float(), atol=0.05), f"{what}: new_kv changed nothing"
    try:
        ops.extend_attention(q, kc, vc, table, qsl, sl, d ** -0.5, new_kv=(k[:-1], v))
    except ValueError as exc:
        assert "new k" in str(exc)
    else:
        raise AssertionError("a new k of the wrong shape must raise ValueError")
    # An engine on a bf16 cache (the new tokens' cached copies are the values computed) gives the
    # greedy tokens of one reading every key from the cache (TANDEM_EXTEND_NEW_KV=0), every kernel
    # in Triton (interpreted); a chunked prompt reads its earlier chunks from the cache.
    import os
    import tempfile
    from pathlib import Path

    from engine import LLM, SamplingParams
    from engine.attention import EXTEND_NEW_KV_ENV
    from engine.demo import make_random_model

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (9, 70)]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_random_model(Path(tmp) / "llama", "llama", seed=3)
        runs = {}
        for value in ("0", "1"):
            os.environ[EXTEND_NEW_KV_ENV] = value
            llm = LLM(path, num_kv_blocks=32, max_batched_tokens=32)  # the 70-token prompt in chunks
            runs[value] = [o.token_ids for o in llm.generate(prompts, params)]
        del os.environ[EXTEND_NEW_KV_ENV]
        assert runs["1"] == runs["0"], runs


def case_extend_padded() -> None:
    """A prefill graph's padded layout (engine/prefill_graphs.py): rows past the real tokens in no
    sequence, empty sequences after the real ones (query_start_loc repeating the token count,
    length 0), stale block-table rows. The real rows get the unpadded reference's result."""
    from tandem_kernels import ops, reference as ref

    for dtype, cdt, seqs, pad_rows, pad_seqs in [(torch.float32, torch.float32, [(37, 20), (5, 0)], 150, 3),
                                                 (torch.bfloat16, torch.bfloat16, [(129, 0)], 1, 1)]:
        hq, hk, d, bs = 2, 1, 32, 16
        what = f"extend padded {dtype} seqs={seqs} pad_rows={pad_rows} pad_seqs={pad_seqs}"
        lens = [n + p for n, p in seqs]
        kc, vc, table = paged(lens + [bs] * pad_seqs, bs, hk, d, cdt)
        n = sum(q for q, _ in seqs)
        qsl = torch.tensor([0] + list(itertools.accumulate(q for q, _ in seqs)), dtype=torch.int32)
        sl = torch.tensor(lens, dtype=torch.int32)
        q = rand(n + pad_rows, hq, d, dtype=dtype)
        padded_qsl = torch.cat([qsl, torch.full((pad_seqs,), n, dtype=torch.int32)])
        padded_sl = torch.cat([sl, torch.zeros(pad_seqs, dtype=torch.int32)])
        got = ops.extend_attention(q, kc, vc, table, padded_qsl, padded_sl, d ** -0.5)
        want = ref.extend_attention(q[:n], kc, vc, table[: len(seqs)], qsl, sl, d ** -0.5)
        close(got[:n], want, dtype, what, scale=2.0)


def case_extend_blocks_ahead() -> None:
    """extend_attention with and without each tile's block-table entries read a tile ahead
    (BLOCKS_AHEAD: which caches do) gives the reference's result, both caches: prefixes over
    several unmasked tiles, the masked tail after them, a one-token prompt and a query tile past
    the first."""
    from tandem_kernels import extend_attention as ea, reference as ref

    saved = ea.BLOCKS_AHEAD
    try:
        for ahead, (cdt, seqs) in itertools.product(
                (False, True), ((torch.bfloat16, [(70, 300), (1, 0), (130, 5)]), (FP8, [(45, 260), (2, 0)]))):
            ea.BLOCKS_AHEAD = frozenset({cdt} if ahead else ())
            hq, hk, d, bs = 4, 2, 32, 16
            what = f"extend blocks ahead={ahead} cache={cdt} seqs={seqs}"
            lens = [n + p for n, p in seqs]
            kc, vc, table = paged(lens, bs, hk, d, cdt)
            qsl = torch.tensor([0] + list(itertools.accumulate(n for n, _ in seqs)), dtype=torch.int32)
            q = rand(int(qsl[-1]), hq, d, dtype=torch.bfloat16)
            sl = torch.tensor(lens, dtype=torch.int32)
            got = ea.extend_attention(q, kc, vc, table, qsl, sl, d ** -0.5, 0.5, 1.5)
            want = ref.extend_attention(q, kc, vc, table, qsl, sl, d ** -0.5, 0.5, 1.5)
            close(got, want, torch.bfloat16, what, scale=2.0)
    finally:
        ea.BLOCKS_AHEAD = saved


def case_attention_into_one_output() -> None:
    """engine.attention.attend on a mixed batch: the decode kernel (one split and several) and the
    extend kernel each write their rows of one output (out=), leaving the other rows as they were;
    the result is the one the kernels give on their own. A wrong out is named."""
    from engine.attention import AttentionMetadata, attend
    from tandem_kernels import ops

    hq, hk, d, bs = 4, 2, 32, 16
    for cdt, decode_lens in ((torch.bfloat16, [5, 600]), (FP8, [33, 17, 1])):  # 600: several splits
        prompts = [(20, 0), (9, 40)]  # (new tokens, cached prefix)
        lens = decode_lens + [n + p for n, p in prompts]
        kc, vc, table = paged(lens, bs, hk, d, cdt)
        n = len(decode_lens)
        tail_qsl = torch.tensor([0] + list(itertools.accumulate(q for q, _ in prompts)), dtype=torch.int32)
        q = rand(n + int(tail_qsl[-1]), hq, d, dtype=torch.bfloat16)
        sl = torch.tensor(lens, dtype=torch.int32)
        scales = (0.5, 1.5) if cdt == FP8 else (1.0, 1.0)
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=table,
                                 query_start_loc=torch.cat([torch.arange(n, dtype=torch.int32), tail_qsl + n]),
                                 seq_lens=sl, is_decode=False, k_scale=scales[0], v_scale=scales[1],
                                 num_decode_seqs=n, tail_query_start_loc=tail_qsl)
        got = attend(q, kc, vc, meta, d ** -0.5)
        head = ops.paged_decode_attention(q[:n], kc, vc, table[:n], sl[:n], d ** -0.5, *scales)
        tail = ops.extend_attention(q[n:], kc, vc, table[n:], tail_qsl, sl[n:], d ** -0.5, *scales)
        what = f"attend into one output, cache={cdt}"
        assert torch.equal(got, torch.cat([head, tail])), what
        k_new, v_new = rand(q.shape[0], hk, d, dtype=torch.bfloat16), rand(q.shape[0], hk, d, dtype=torch.bfloat16)
        tail_new = ops.extend_attention(q[n:], kc, vc, table[n:], tail_qsl, sl[n:], d ** -0.5, *scales,
                                        new_kv=(k_new[n:], v_new[n:]))  # the prompts' rows of new_kv
        got_new = attend(q, kc, vc, meta, d ** -0.5, new_kv=(k_new, v_new))
        assert torch.equal(got_new, torch.cat([head, tail_new])) and not torch.equal(tail_new, tail), what
        marked = torch.full((n + 2, hq, d), 7.0, dtype=torch.bfloat16)
        ops.paged_decode_attention(q[:n], kc, vc, table[:n], sl[:n], d ** -0.5, *scales, out=marked[1:n + 1])
        assert torch.equal(marked[1:n + 1], head), what
        assert (marked[0] == 7).all() and (marked[n + 1] == 7).all(), f"{what}: rows outside out were written"
    for bad, named in ((torch.empty(n, hq, d, dtype=torch.float32), "out must be"),
                       (torch.empty(n, d, hq, dtype=torch.bfloat16).transpose(1, 2), "contiguous last dim")):
        for call in (ops.paged_decode_attention, ops.extend_attention):
            args = (table[:n], sl[:n]) if call is ops.paged_decode_attention else (
                table[:n], torch.arange(n + 1, dtype=torch.int32), sl[:n])
            try:
                call(q[:n], kc, vc, *args, d ** -0.5, out=bad)
            except ValueError as exc:
                assert named in str(exc), exc
            else:
                raise AssertionError(f"{call.__name__} took a bad out")


def case_dispatch() -> None:
    """Runs without TRITON_INTERPRET and with triton made unimportable."""
    sys.modules["triton"] = None  # `import triton` now raises ImportError
    from tandem_kernels import ops, reference as ref

    x, w = torch.randn(3, 16), torch.rand(16)
    for mode in ("auto", "reference"):
        os.environ["TANDEM_KERNELS"] = mode
        assert torch.equal(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)), mode
    assert not ops.triton_available()
    os.environ["TANDEM_KERNELS"] = "triton"
    try:
        ops.silu_and_mul(x)
    except ops.KernelBackendError:
        pass
    else:
        raise AssertionError("TANDEM_KERNELS=triton without triton must raise KernelBackendError")
    os.environ["TANDEM_KERNELS"] = "fastest"
    try:
        ops.silu_and_mul(x)
    except ValueError as exc:
        assert "TANDEM_KERNELS" in str(exc)
    else:
        raise AssertionError("an unknown TANDEM_KERNELS value must raise ValueError")


@pytest.mark.parametrize("pairs, round_size, most, want", [
    (1680, 528, 64, 2),   # an H100's 210 sequences x 8 KV heads: 3.2 rounds -> 0.80 full at one split, 0.91 at two
    (640, 528, 64, 3),    # 1.2 rounds: 0.61 at one, 0.81 at two, 0.91 at three
    (640, 528, 2, 2),     # no context reaches three splits: the better of one and two
    (3072, 528, 64, 1),   # 5.8 rounds: 0.97 full already
    (400, 528, 64, 1),    # one round, less than full: choose_splits' own rule fills it
    (528, 528, 64, 1),
])
def test_balanced_splits_fill_the_last_round(pairs: int, round_size: int, most: int, want: int) -> None:
    from tandem_kernels.decode_attention import balanced_splits

    assert balanced_splits(pairs, round_size, most) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sample_filtered_on_the_gpu_at_a_real_vocabulary() -> None:
    """The compiled kernel at Llama 3's vocabulary and a full decode batch against the CPU
    reference on the same bf16 logits and noise: every token allowed, the reference's on all
    but near-tied rows."""
    from tandem_kernels import ops, reference as ref

    rows, cols = 128, 128_256
    x = (torch.randn(rows, cols) * torch.rand(rows, 1) * 8).to(torch.bfloat16)
    temperature = torch.rand(rows) + 0.5
    k = torch.randint(1, 100, (rows,))
    kth = x.float().topk(100, dim=1).values.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    kth = torch.where(torch.rand(rows) < 0.3, kth, float("-inf"))
    top_p = torch.where(torch.rand(rows) < 0.8, torch.rand(rows) * 0.9 + 0.05, torch.tensor(2.0))
    min_p = torch.where(torch.rand(rows) < 0.3, torch.rand(rows) * 0.2, torch.tensor(0.0))
    noise = torch.empty(rows, cols).exponential_().clamp_min_(torch.finfo(torch.float32).tiny)
    args = (x, temperature, kth, top_p, min_p, noise)
    got = ops.sample_filtered(*(a.cuda() for a in args)).cpu()
    want = ref.sample_filtered(*args)
    loose = _allowed_f64(x.float(), temperature, kth, top_p, min_p, 1e-4)
    assert bool(loose[torch.arange(rows), got].all()), "a token outside its row's filters"
    assert (got == want).float().mean() >= 0.95, (got.tolist(), want.tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8", [False, True])
def test_gemv_tilings_on_the_gpu_at_llama_shapes(fp8: bool) -> None:
    """Every launch choice of the fused GEMV the benchmarks compare (the GPU's tiling, flat_row,
    stages with and without the prefetch) compiled for the GPU at Llama-3.1-8B's four weights,
    bf16 or e4m3, against the reference."""
    import dataclasses as dc

    from tandem_kernels import gemv as gm, reference as ref
    from tandem_kernels.gemv_tilings import tiling_for

    shapes = {"qkv": (6144, 4096, True, False), "o_proj": (4096, 4096, False, False),
              "gate_up": (28672, 4096, True, True), "down": (4096, 14336, False, False)}
    dev = torch.device("cuda")
    for projection, (n, k, norm, silu) in shapes.items():
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev) * k ** -0.5
        scale = None
        if fp8:
            scale = w.abs().amax(1) / 448.0
            w = (w / scale[:, None]).to(FP8)
        else:
            w = w.to(torch.bfloat16)
        kw = dict(residual=torch.randn(1, k, device=dev, dtype=torch.bfloat16) if norm else None,
                  norm_weight=torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5 if norm else None, eps=1e-5,
                  silu_pair=silu, weight_scale=scale)
        want = ref.gemv(x, w, **kw)[0].float()
        base = tiling_for(projection, dev, fp8)
        for fields in ({}, {"flat_row": True}, {"flat_row": True, "stages": 3}, {"stages": 2, "prefetch": False}):
            got = gm.gemv(x, w, tiling=dc.replace(base, **fields), **kw)[0].float()
            close(got, want, torch.bfloat16, f"{projection} fp8={fp8} {fields}", scale=2.0, rscale=2.0)
        for rows, fields in ((2, dict(wide_rows=True)),
                             (4, dict(block_n=16, block_k=1024, late_reduce=True, flat_row=True, wide_rows=True,
                                      stages=3)),
                             (4, dict(block_n=16, block_k=1024, late_reduce=True, flat_row=True, wide_rows=True,
                                      stages=3, separate_norm=True)),
                             (2, dict(block_n=8, block_k=512, late_reduce=True, flat_row=True, wide_rows=True,
                                      stages=3, fma_chain=True)),
                             (4, dict(block_n=2, block_k=1024, late_reduce=True, flat_row=True, stages=3,
                                      fma_chain=True)),
                             (8, dict(block_n=8, block_k=1024, late_reduce=True, flat_row=True, stages=2))):
            xr = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            kr = dict(kw, residual=torch.randn(rows, k, device=dev, dtype=torch.bfloat16) if norm else None)
            want = ref.gemv(xr, w, **kr)[0].float()
            got = gm.gemv(xr, w, tiling=dc.replace(base, **fields), **kr)[0].float()
            close(got, want, torch.bfloat16, f"{projection} fp8={fp8} rows={rows} {fields}", scale=2.0, rscale=2.0)


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(case: str) -> None:
    seed = secrets.randbelow(2**31)
    env = dict(os.environ, TANDEM_KERNELS="triton", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["TRITON_INTERPRET"] = "0" if case == "dispatch" else "1"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), case, str(seed)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"case {case} seed {seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert f"ok {case}" in proc.stdout


if __name__ == "__main__":
    name, seed_arg = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(seed_arg)
    CASES[name]()
    print(f"ok {name}")

"""bench/kernel_ir.py: the attention kernels compiled for sm_90 on this machine (no GPU) and how
their KV loops are pipelined. The decode kernel's FP8 default must keep a second K/V tile in
flight during a tile's math (the block-table lookahead, BENCHMARKS.md §14); a change that loses
that fails here, where no benchmark runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def kernel_ir(*flags: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(REPO), TRITON_DEFAULT_FP_FUSION="1")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "kernel_ir.py"), *flags],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return kernel_ir("--tuning", '{"num_stages": 2}', "--tuning", '{"narrow_offsets": false}')


def pick(rows: list[dict], kernel: str, cache: str, **match) -> dict:
    found = [r for r in rows if r["kernel"] == kernel and r["cache"] == cache
             and all((r.get("tuning") or r).get(k) == v for k, v in match.items())]
    assert len(found) >= 1, (kernel, cache, match)
    return found[0]


def test_fp8_decode_keeps_a_tile_in_flight_by_default(rows):
    fp8 = pick(rows, "decode_stage1", "fp8e4nv", num_stages=3)
    assert fp8["staged_tiles"] == 2 and fp8["groups_in_flight"] == [2], fp8
    assert fp8["spilled_bytes"] == 0 and fp8["registers"] > 0 and fp8["programs_per_sm"] >= 4, fp8
    # At the full batch the engine picks the warp-split tuning: its tiles stay in flight too, and
    # an SM holds the programs its split count aims at.
    from tandem_kernels.decode_attention import FP8_WIDE_TUNING

    wide = pick(rows, "decode_stage1", "fp8e4nv", warp_split=True)
    assert wide["staged_tiles"] == 2 and wide["groups_in_flight"] == [2], wide
    assert wide["spilled_bytes"] == 0 and wide["programs_per_sm"] >= FP8_WIDE_TUNING.resident, wide
    two = pick(rows, "decode_stage1", "fp8e4nv", num_stages=2)  # Triton's own staging: nothing in flight
    assert two["staged_tiles"] == 1 and two["groups_in_flight"] == [0], two
    assert two["shared_bytes"] < fp8["shared_bytes"]


def test_decode_loop_mix(rows):
    """The SASS loop report sees the decode kernel's KV loop: its MMAs, FP8's widening (two
    64 x 128 tiles a warp's quarter of which is 128 values a lane, two a conversion), and fewer
    integer instructions with the FP8 default's 32-bit offsets than without them."""
    for cache in ("bf16", "fp8e4nv"):
        mix = pick(rows, "decode_stage1", cache)["loop_mix"]
        assert mix["mma"] >= 16 and mix["exp"] >= 1, (cache, mix)
        assert (mix["convert"] >= 64) == (cache == "fp8e4nv"), (cache, mix)
    narrow = pick(rows, "decode_stage1", "fp8e4nv", narrow_offsets=True, num_stages=3)
    wide = pick(rows, "decode_stage1", "fp8e4nv", narrow_offsets=False, num_stages=3)
    assert narrow["loop_mix"]["integer"] < wide["loop_mix"]["integer"], (narrow["loop_mix"], wide["loop_mix"])
    assert narrow["loop_instructions"] < wide["loop_instructions"]


def test_bf16_decode_and_extend_lookahead(rows):
    bf16 = pick(rows, "decode_stage1", "bf16", num_stages=2)
    assert bf16["groups_in_flight"] == [0] and bf16["spilled_bytes"] == 0, bf16
    for cache in ("bf16", "fp8e4nv"):
        off = pick(rows, "extend", cache, blocks_ahead=False)
        on = pick(rows, "extend", cache, blocks_ahead=True)
        assert off["groups_in_flight"] == [0], off
        assert on["groups_in_flight"] == [2] and on["staged_tiles"] >= 2, on
        assert on["shared_bytes"] <= 232448, on  # within an sm_90 program's shared memory


def test_pdl_build_waits_before_any_load(rows, tmp_path):
    """Launched with programmatic dependent launch (TANDEM_PDL=1), the decode kernel may start
    while the kernel before it finishes: its PTX must wait for that kernel (griddepcontrol.wait)
    before its first global load or copy, and the build must cost nothing else (same registers,
    shared memory and pipelining as the default build)."""
    pdl = kernel_ir("--pdl", "--dump", str(tmp_path))
    for cache in ("bf16", "fp8e4nv"):
        built = pick(pdl, "decode_stage1", cache)
        plain = pick(rows, "decode_stage1", cache, num_stages=built["tuning"]["num_stages"])
        assert built["pdl"] is True
        for key in ("registers", "shared_bytes", "programs_per_sm", "staged_tiles", "groups_in_flight"):
            assert built[key] == plain[key], (cache, key, built[key], plain[key])
        ptx = (tmp_path / f"decode_{cache}.ptx").read_text()
        wait = ptx.find("griddepcontrol.wait")
        first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0)
        assert 0 <= wait < first_load, cache
        assert "griddepcontrol" not in ptx[:wait]  # nothing of it before the wait


def test_specialize_folds_ones_and_marks_divisible_ints():
    import torch

    from bench.kernel_ir import specialize

    class Kernel:  # the two attributes of a JITFunction that specialize reads
        __name__ = "k"
        arg_names = ["x_ptr", "n", "stride", "width", "odd", "scale", "BLOCK"]
        do_not_specialize = ["width"]

    x = torch.empty(4, dtype=torch.float8_e4m3fn, device="meta")
    sig, consts, attrs = specialize(Kernel, [x, 1, 32, 64, 7, 0.5], {"BLOCK": 16})
    assert sig == {"x_ptr": "*fp8e4nv", "n": "constexpr", "stride": "i32", "width": "i32", "odd": "i32",
                   "scale": "fp32", "BLOCK": "constexpr"}
    assert consts == {(1,): 1, (6,): 16}
    assert set(attrs) == {(0,), (2,)}  # the pointer and the stride of 32; not width (generic) nor 7
    with pytest.raises(ValueError, match="positional args"):
        specialize(Kernel, [x, 1], {"BLOCK": 16})


def test_pipelining_reads_buffers_and_waits():
    from bench.kernel_ir import pipelining

    ir = """%a = ttg.local_alloc : () -> !ttg.memdesc<3x64x128xf8E4M3FN, #shared, #smem, mutable>
    %b = ttg.memdesc_index %a[%c0_i32] : !ttg.memdesc<3x64x128xf8E4M3FN, #shared, #smem, mutable> -> !ttg.memdesc<64x128xf8E4M3FN>
    %c = ttg.local_alloc : () -> !ttg.memdesc<128x4x16xf8E4M3FN, #shared, #smem, mutable>
    %t = ttg.async_copy_global_to_local %p, %a
    %w = ttg.async_wait %k, %v {num = 4 : i32}
    %z = ttg.async_wait {num = 0 : i32}"""
    assert pipelining(ir) == {"staged_tiles": 3, "groups_in_flight": [4]}
    assert pipelining("%t = ttg.async_copy_global_to_local %p, %a") == {"staged_tiles": 1, "groups_in_flight": []}
    assert pipelining("tt.load") == {"staged_tiles": 0, "groups_in_flight": []}


def test_small_batch_pdl_builds_load_what_no_kernel_writes_before_the_wait(tmp_path):
    """With the prefetching tuning (DecodeTuning.prefetch) at batch 1, the decode kernel's PTX under
    PDL loads the split's context, block-table entries and first K/V tile before it waits
    for the kernel before (griddepcontrol.wait), and every other load after; the decode GEMVs
    load their first weight tile before it. A compiler that moved them behind the wait would
    lose the overlap silently; this fails instead."""
    built = kernel_ir("--pdl", "--batch", "1", "--ctx", "1024", "--dump", str(tmp_path),
                      "--tuning", '{"prefetch": true, "resident": 3}')
    for cache in ("bf16", "fp8e4nv"):
        row = pick(built, "decode_stage1", cache, prefetch=True)
        assert row["pdl"] is True, row
        assert row["spilled_bytes"] == 0, row
        ptx = (tmp_path / f"{row['name']}.ptx").read_text()
        wait = ptx.find("griddepcontrol.wait")
        early = ptx[:wait].count("ld.global")
        assert wait > 0 and early >= 4, (cache, early)  # context, table entries, K and V tiles
        assert ptx[wait:].count("ld.global") > 0, cache  # q, the step's own row, the loop's tiles
    # The fused decode GEMVs (tandem_kernels.gemv, prefetch on by default): the first weight tile
    # before the wait, the activations and the other tiles after it; no spills.
    for projection in ("qkv", "o_proj", "gate_up", "down"):
        row = pick(built, "gemv", "", projection=projection)
        assert row["spilled_bytes"] == 0, row
        ptx = (tmp_path / f"{row['name']}.ptx").read_text()
        wait = ptx.find("griddepcontrol.wait")
        assert wait > 0 and ptx[:wait].count("ld.global") >= 1, projection
        after = ptx[wait:]  # x (and the norm's residual), the next tiles (copied to shared memory when staged)
        assert after.count("ld.global") + after.count("cp.async.") >= 2, projection


@pytest.mark.parametrize("batch", ["1", "8"])
def test_every_gemv_tiling_builds_for_the_gpu(batch):
    """Each of GemvTiling's switches (late_reduce x prefetch, wide_rows) compiles for sm_90 at
    every projection, without spills; with late_reduce the loop shuffles less than without (its lanes
    keep their partial sums). The interpreter runs these tilings (tests/test_kernels.py) but does
    not type-check a kernel as the compiler does: a late_reduce build that failed to compile
    passed there."""
    tilings = [{"late_reduce": late, "prefetch": prefetch} for late in (False, True) for prefetch in (False, True)]
    tilings.append({"wide_rows": True, "late_reduce": False})  # every row against the whole tile
    built = kernel_ir("--pdl", "--batch", batch, "--only-gemv",
                      *[a for t in tilings for a in ("--gemv-tiling", json.dumps(t))])

    def row(projection: str, fields: dict) -> dict:
        found = [r for r in built if r["projection"] == projection and r["tiling"] == fields]
        assert len(found) == 1, (projection, fields)
        return found[0]

    for projection in ("qkv", "o_proj", "gate_up", "down"):
        for fields in tilings:
            assert row(projection, fields)["spilled_bytes"] == 0, (projection, fields)
        for prefetch in (False, True):
            late = row(projection, {"late_reduce": True, "prefetch": prefetch})["loop_mix"]["shuffle"]
            every = row(projection, {"late_reduce": False, "prefetch": prefetch})["loop_mix"]["shuffle"]
            assert late < every, (projection, prefetch, late, every)


def test_the_greedy_argmax_builds_for_the_gpu(rows):
    """Both argmax kernels (on by default for every greedy row) compile for sm_90 for the logits'
    dtypes the sampler sees (the model's, float32 after penalties), without spills."""
    for cache in ("bf16", "fp32"):
        for stage in (1, 2):
            row = pick(rows, f"argmax_stage{stage}", cache)
            assert row["spilled_bytes"] == 0 and row["programs_per_sm"] >= 1, row


"""bench/tiling_table.py: the table entries a results file's steps support, as code that builds
the very tilings the fused steps ran."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.tiling_table import report, tiling_literal
from tandem_kernels.gemv_tilings import GemvTiling

REPO = Path(__file__).resolve().parents[1]
TILES = {"qkv": {"block_n": 16, "block_k": 512, "late_reduce": True, "flat_row": True, "stages": 3},
         "o_proj": {"block_n": 4, "block_k": 1024, "late_reduce": True, "separate_norm": False},
         "gate_up": {"block_n": 8, "block_k": 256, "late_reduce": True, "separate_norm": True},
         "down": {"block_n": 2, "block_k": 1024, "late_reduce": True, "flat_row": True, "stages": 2}}


def results(**ms: float) -> dict:
    """Sections named as throughput_bench names them, with a step time each; the fused ones
    with TILES."""
    sections = {}
    for name, value in ms.items():
        key = f"{name}_ms_per_token" if name.startswith("decode_b1") else f"{name}_ms_per_step"
        sections[name] = {key: value, "wall_s": 1.0}
        if "fused_all" in name:
            sections[name]["gemv_tilings"] = TILES
    return {"sections": sections}


def test_an_entry_is_code_for_the_tilings_the_faster_step_ran() -> None:
    lines = report(results(decode_b1=4.4, decode_b1_fused_all=4.1, decode_b4_fp8=3.0,
                           decode_b4_fp8_fused_all=2.7), "H200")
    entry = next(line for line in lines if line.startswith('DEVICE_TILINGS["H200"] = '))
    built = eval(entry.split(" = ", 1)[1], {"GemvTiling": GemvTiling})
    assert built == {name: GemvTiling(**fields) for name, fields in TILES.items()}
    assert "block_k" not in entry.split('"qkv": ')[1].split(")")[0]  # defaults are left out
    assert "-6.8%" in lines[0]  # 4.1 against 4.4
    several = next(line for line in lines if line.startswith('FP8_SEVERAL_ROW_TILINGS["H200"] = '))
    assert eval(several.split(" = ", 1)[1], {"GemvTiling": GemvTiling})[0] == 3
    assert 'FP8_DEVICE_ROWS["H200"] = 4' in lines
    assert "# FP8, 1 row: not measured (decode_b1_fp8_fused_all missing)" in lines


def test_a_slower_fused_step_gets_no_entry_and_the_unfused_baseline_comes_first() -> None:
    lines = report(results(decode_b1=4.0, decode_b1_unfused=4.5, decode_b1_fused_all=4.2,
                           decode_b2_fp8=3.0, decode_b2_fp8_fused_all=3.1), "H200")
    assert lines[0].startswith("# bf16, 1 row: decode_b1_fused_all 4.200 ms vs decode_b1_unfused 4.500 ms")
    assert any(line.startswith('DEVICE_TILINGS["H200"]') for line in lines)
    fp8_rows = lines.index("# FP8, 2 rows: decode_b2_fp8_fused_all 3.100 ms vs decode_b2_fp8 3.000 ms (+3.3%)")
    assert lines[fp8_rows + 1] == "#   not faster: no entry"
    assert not any(line.startswith("FP8_DEVICE_ROWS") for line in lines)


def test_a_field_gemv_tiling_lacks_is_named() -> None:
    data = results(decode_b1=4.4, decode_b1_fused_all=4.1)
    data["sections"]["decode_b1_fused_all"]["gemv_tilings"] = {"qkv": {"block_n": 4, "warp_split": 2}}
    assert "#   decode_b1_fused_all: gemv_tilings: GemvTiling has no field warp_split" in report(data, "H200")
    assert tiling_literal({}) == "GemvTiling()"


def test_the_command_reads_a_file_and_names_a_bad_one(tmp_path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results(decode_b1=4.4, decode_b1_fused_all=4.1)))
    out = subprocess.run([sys.executable, "bench/tiling_table.py", str(path), "--gpu", "H200"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and 'DEVICE_TILINGS["H200"] = {"qkv": GemvTiling(' in out.stdout
    bad = subprocess.run([sys.executable, "bench/tiling_table.py", str(tmp_path / "none.json"), "--gpu", "H200"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "results: cannot read" in bad.stderr

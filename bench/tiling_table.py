"""The fused-GEMV table entries a GPU's measured steps support, as code to paste into
tandem_kernels/gemv_tilings.py.

Reads a throughput_bench results file and, for each kind of step the tables decide, compares
the step with every projection fused (at the tilings it ran, the sweep's picks) against the
same step without them, one run:

  bf16, 1 row    decode_b1_fused_all   vs decode_b1_unfused (else decode_b1)   DEVICE_TILINGS
  FP8, 1 row     decode_b1_fp8_fused_all vs decode_b1_fp8_unfused              FP8_DEVICE_TILINGS
  FP8, 2 rows    decode_b2_fp8_fused_all vs decode_b2_fp8                      FP8_DEVICE_ROWS >= 2
  FP8, 4 rows    decode_b4_fp8_fused_all vs decode_b4_fp8                      FP8_SEVERAL_ROW_TILINGS, FP8_DEVICE_ROWS 4
  bf16, 2 / 4    decode_b{2,4}_fused_all vs decode_b{2,4}                      (bf16 fuses at one row)

and prints each comparison, and the entry where the fused step was faster. Whether to keep every
projection fused or only some (the H200's bf16 entry fuses two) is the decode_b1_fused_* A/B
sections' call, which this does not make. The baseline of the 2- and 4-row FP8 steps is the
GPU's default there: check that the results were taken where the table had no entry yet.

    python3 bench/tiling_table.py bench/results/h200_throughput.json --gpu H200
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tandem_kernels.gemv_tilings import PROJECTIONS, GemvTiling  # noqa: E402

# (what, fused section, baselines in order of preference, the table it decides)
STEPS = (
    ("bf16, 1 row", "decode_b1_fused_all", ("decode_b1_unfused", "decode_b1"), "DEVICE_TILINGS"),
    ("FP8, 1 row", "decode_b1_fp8_fused_all", ("decode_b1_fp8_unfused",), "FP8_DEVICE_TILINGS"),
    ("FP8, 2 rows", "decode_b2_fp8_fused_all", ("decode_b2_fp8",), "FP8_DEVICE_ROWS"),
    ("FP8, 4 rows", "decode_b4_fp8_fused_all", ("decode_b4_fp8",), "FP8_SEVERAL_ROW_TILINGS"),
    ("bf16, 2 rows", "decode_b2_fused_all", ("decode_b2",), None),
    ("bf16, 4 rows", "decode_b4_fused_all", ("decode_b4",), None),
)


def step_ms(section: dict) -> float | None:
    """A decode section's ms a token (batch 1) or a step."""
    for key, value in section.items():
        if key.endswith(("_ms_per_token", "_ms_per_step")) and isinstance(value, (int, float)):
            return float(value)
    return None


def tiling_literal(fields: dict) -> str:
    """`GemvTiling(...)` naming only the fields that differ from the defaults; ValueError for a
    field GemvTiling does not have."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(GemvTiling)})
    if unknown:
        raise ValueError(f"gemv_tilings: GemvTiling has no field {', '.join(unknown)}")
    tiling = GemvTiling(**fields)  # checks the values
    defaults = GemvTiling()
    changed = [f"{f.name}={getattr(tiling, f.name)!r}" for f in dataclasses.fields(GemvTiling)
               if getattr(tiling, f.name) != getattr(defaults, f.name)]
    return f"GemvTiling({', '.join(changed)})"


def entry_literal(tilings: dict) -> str:
    """A table entry {projection: GemvTiling(...)} in PROJECTIONS' order."""
    return "{" + ", ".join(f'"{p}": {tiling_literal(tilings[p])}' for p in PROJECTIONS if p in tilings) + "}"


def report(results: dict, gpu: str) -> list[str]:
    """One block of lines a kind of step: the two steps, the change, and the entry where the
    fused step was faster (or why there is none)."""
    sections = results.get("sections", {})
    lines = []
    for what, fused_name, bases, table in STEPS:
        fused = sections.get(fused_name)
        base_name = next((b for b in bases if b in sections), None)
        if fused is None or base_name is None:
            missing = fused_name if fused is None else " or ".join(bases)
            lines.append(f"# {what}: not measured ({missing} missing)")
            continue
        got, base = step_ms(fused), step_ms(sections[base_name])
        if got is None or base is None or "gemv_tilings" not in fused:
            lines.append(f"# {what}: {fused_name} or {base_name} holds no step time or tilings (an error?)")
            continue
        change = got / base - 1
        lines.append(f"# {what}: {fused_name} {got:.3f} ms vs {base_name} {base:.3f} ms ({change:+.1%})")
        if got >= base:
            lines.append("#   not faster: no entry")
            continue
        try:
            entry = entry_literal(fused["gemv_tilings"])
        except ValueError as exc:
            lines.append(f"#   {fused_name}: {exc}")
            continue
        if table == "FP8_DEVICE_ROWS":
            lines.append(f'FP8_DEVICE_ROWS["{gpu}"] = 2  # at least; with the 2-row tiles {entry}')
        elif table == "FP8_SEVERAL_ROW_TILINGS":
            lines.append(f'FP8_SEVERAL_ROW_TILINGS["{gpu}"] = (3, {entry})')
            lines.append(f'FP8_DEVICE_ROWS["{gpu}"] = 4')
        elif table is not None:
            lines.append(f'{table}["{gpu}"] = {entry}')
        else:
            lines.append("#   (bf16 fuses at one row: a table of bf16 rows would be new)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="a throughput_bench results file (JSON)")
    p.add_argument("--gpu", required=True, help="the GPU family the entries are for, as the tables key it (H200)")
    a = p.parse_args(argv)
    try:
        results = json.loads(Path(a.results).read_text())
    except (OSError, ValueError) as exc:
        p.error(f"results: cannot read {a.results} ({exc})")
    print("\n".join(report(results, a.gpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

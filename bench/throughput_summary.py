"""bench/throughput_bench.py's summary: the issue's keys from the sections' results, their goals,
the ratios each run measured, group S's decode rows against their defaults, and the table printed
last."""
from __future__ import annotations

from typing import Any

from bench.throughput_context import section_value

# key -> (comparison, goal) from the "Done when"
GOALS: dict[str, tuple[str, float]] = {
    "offline_bf16_out_tok_s": (">=", 11_000), "offline_fp8kv_out_tok_s": ("", 0), "fp8kv_over_bf16": (">=", 1.35),
    "offline_fp8_out_tok_s": (">=", 18_000), "decode_b1_ms_per_token": ("", 0),
    "decode_b1_roofline_fraction": (">=", 0.85), "gptfast_b1_ms_per_token": ("", 0),
    "b1_speed_over_gptfast": (">=", 1.1), "services_vs_offline": (">=", 0.90), "colocated_vs_offline": (">=", 0.95),
    "online_ttft_p50_ms": ("<=", 35), "online_tpot_p50_ms": ("<=", 4.5), "online_colocated_ttft_p50_ms": ("", 0),
    "online_colocated_tpot_p50_ms": ("", 0), "max_rate_within_slo": (">=", 20), "copy_GBps": ("", 0),
    "matmul_bf16_TFLOPs": ("", 0), "matmul_fp8_TFLOPs": ("", 0),
}


def _ratio(num: Any, den: Any, digits: int = 3) -> float | None:
    return round(num / den, digits) if isinstance(num, (int, float)) and isinstance(den, (int, float)) and den else None


# The table's ratios: key -> (numerator, denominator), each (section, field). A ratio is quoted
# from one run (both sections measured by the same command, on the same machine): each run
# records the ratios it measured, and the summary takes the latest run's.
RATIOS = {
    "fp8kv_over_bf16": (("offline_fp8kv", "output_tok_s"), ("offline_bf16", "output_tok_s")),
    "b1_speed_over_gptfast": (("gptfast", "gptfast_b1_ms_per_token"), ("decode_b1", "decode_b1_ms_per_token")),
    "services_vs_offline": (("services", "output_tok_s"), ("offline_subset", "output_tok_s")),
    "colocated_vs_offline": (("colocated", "output_tok_s"), ("offline_subset", "output_tok_s")),
    "services_small_prefill_vs_offline": (("services_small_prefill", "output_tok_s"), ("offline_subset", "output_tok_s")),
    "services_own_weights_vs_offline": (("services_own_weights", "output_tok_s"), ("offline_subset", "output_tok_s")),
    "services_no_mps_vs_offline": (("services_no_mps", "output_tok_s"), ("offline_subset", "output_tok_s")),
    "services_whole_prefill_context_vs_offline": (("services_whole_prefill_context", "output_tok_s"),
                                                  ("offline_subset", "output_tok_s")),
}


def run_ratios(sections: dict, names: list[str]) -> dict:
    """The ratios whose two sections are both among `names` (one run's) and succeeded."""
    ratios = {}
    for key, ((num, num_key), (den, den_key)) in RATIOS.items():
        if num in names and den in names:
            value = _ratio(section_value(sections, num, num_key), section_value(sections, den, den_key))
            if value is not None:
                ratios[key] = value
    return ratios


# The summary's keys in the order the table prints them: each figure read straight from one
# section (key -> (section, field)), or a ratio of two (RATIOS, None here).
FIGURES: dict[str, tuple[str, str] | None] = {
    "offline_bf16_out_tok_s": ("offline_bf16", "output_tok_s"),
    "offline_fp8kv_out_tok_s": ("offline_fp8kv", "output_tok_s"), "fp8kv_over_bf16": None,
    "offline_fp8_out_tok_s": ("offline_fp8", "output_tok_s"),
    "decode_b1_ms_per_token": ("decode_b1", "decode_b1_ms_per_token"),
    "weight_read_floor_ms": ("decode_b1", "weight_read_floor_ms"),
    "decode_b1_roofline_fraction": ("decode_b1", "decode_b1_roofline_fraction"),
    "gptfast_b1_ms_per_token": ("gptfast", "gptfast_b1_ms_per_token"), "b1_speed_over_gptfast": None,
    "services_out_tok_s": ("services", "output_tok_s"), "colocated_out_tok_s": ("colocated", "output_tok_s"),
    "offline_subset_out_tok_s": ("offline_subset", "output_tok_s"),
    "services_vs_offline": None, "colocated_vs_offline": None, "services_small_prefill_vs_offline": None,
    "services_own_weights_vs_offline": None, "services_no_mps_vs_offline": None,
    "services_whole_prefill_context_vs_offline": None,
    "online_ttft_p50_ms": ("online", "ttft_p50_ms"), "online_tpot_p50_ms": ("online", "tpot_p50_ms"),
    "online_colocated_ttft_p50_ms": ("online_colocated", "ttft_p50_ms"),
    "online_colocated_tpot_p50_ms": ("online_colocated", "tpot_p50_ms"),
    "max_rate_within_slo": ("max_rate", "max_rate_within_slo"),
    "copy_GBps": ("ceilings", "copy_GBps"), "matmul_bf16_TFLOPs": ("ceilings", "matmul_bf16_TFLOPs"),
    "matmul_fp8_TFLOPs": ("ceilings", "matmul_fp8_TFLOPs"),
}
assert {k for k, v in FIGURES.items() if v is None} == set(RATIOS)


def _figure(sections: dict, key: str) -> Any:
    name, field = FIGURES[key]
    value = section_value(sections, name, field)
    return _round(value) if name.startswith("online") else value  # the load generator's percentiles


def key_sections(key: str) -> tuple[str, ...]:
    """The sections a summary key is measured by: one for a figure, two for a ratio."""
    figure = FIGURES[key]
    return (figure[0],) if figure is not None else tuple(name for name, _ in RATIOS[key])


def summarize(sections: dict, runs: list[dict] | None = None) -> dict:
    """The issue's keys from the sections' results (None where a section is missing or failed).

    With `runs` (the file's run records), each ratio is the one the latest run that measured both
    its sections recorded (`run_ratios`), or None when no run did; without `runs`, or for a
    record from before runs kept their ratios, the quotient of what the sections hold."""
    summary = {key: None if figure is None else _figure(sections, key) for key, figure in FIGURES.items()}
    for key, ((num, num_key), (den, den_key)) in RATIOS.items():
        quotient = _ratio(section_value(sections, num, num_key), section_value(sections, den, den_key))
        if runs is None:
            summary[key] = quotient
            continue
        run = measured_by(key, runs)  # the latest run that measured both
        touched = [r for r in runs if {num, den} & set(r.get("sections", ()))]
        if run is not None and isinstance(run.get("ratios"), dict):
            summary[key] = run["ratios"].get(key)
        elif run is not None and touched[-1] is run:  # an older record, and no later run measured either
            summary[key] = quotient
    return summary


def measured_by(key: str, runs: list[dict]) -> dict | None:
    """The run record whose figure `key` the summary holds: the latest run that measured all of
    its sections (key_sections); None when no run record did (a section merged from elsewhere)."""
    needed = set(key_sections(key))
    return next((run for run in reversed(runs) if needed <= set(run.get("sections", ()))), None)


def small_batch(sections: dict, names: list[str]) -> dict:
    """The decode rows among `names` (group S's): {section: {"ms", "vs_default"}}, ms a step (a
    token at batch 1) and the default's ms over it (> 1: the variant is faster), against
    decode_b1 / decode_b4 as the same file holds them."""
    out = {}
    for name in names:
        if not name.startswith("decode_b"):
            continue
        batch = name.split("_")[1]  # "b1", "b4"
        key = f"decode_{batch}_ms_per_{'token' if batch == 'b1' else 'step'}"
        ms = section_value(sections, name, key)
        if ms is not None:
            out[name] = {"ms": ms, "vs_default": _ratio(section_value(sections, f"decode_{batch}", key), ms)}
    return out


def _round(x: Any) -> Any:
    return round(x, 2) if isinstance(x, float) else x


def goal_text(key: str) -> str:
    """`key`'s goal as the table prints it ("<= 4.5"), "" for a key without one."""
    op, goal = GOALS.get(key, ("", 0))
    return f"{op} {goal:g}" if op else ""


def meets(key: str, value: Any) -> bool | None:
    """Whether `value` meets `key`'s goal; None for a key without a goal or a missing value."""
    op, goal = GOALS.get(key, ("", 0))
    if not op or not isinstance(value, (int, float)):
        return None
    return value >= goal if op == ">=" else value <= goal


def format_table(summary: dict) -> str:
    rows = [("key", "measured", "goal", "met")]
    for key, value in summary.items():
        met = meets(key, value)
        rows.append((key, "-" if value is None else f"{value:g}" if isinstance(value, (int, float)) else str(value),
                     goal_text(key), "" if met is None else "yes" if met else "NO"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

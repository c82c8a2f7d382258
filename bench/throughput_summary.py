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


def summarize(sections: dict, runs: list[dict] | None = None) -> dict:
    """The issue's keys from the sections' results (None where a section is missing or failed).

    With `runs` (the file's run records), each ratio is the one the latest run that measured both
    its sections recorded (`run_ratios`), or None when no run did; without `runs`, or for a
    record from before runs kept their ratios, the quotient of what the sections hold."""
    g = lambda name, key: section_value(sections, name, key)  # noqa: E731
    summary = {
        "offline_bf16_out_tok_s": g("offline_bf16", "output_tok_s"),
        "offline_fp8kv_out_tok_s": g("offline_fp8kv", "output_tok_s"), "fp8kv_over_bf16": None,
        "offline_fp8_out_tok_s": g("offline_fp8", "output_tok_s"),
        "decode_b1_ms_per_token": g("decode_b1", "decode_b1_ms_per_token"),
        "weight_read_floor_ms": g("decode_b1", "weight_read_floor_ms"),
        "decode_b1_roofline_fraction": g("decode_b1", "decode_b1_roofline_fraction"),
        "gptfast_b1_ms_per_token": g("gptfast", "gptfast_b1_ms_per_token"), "b1_speed_over_gptfast": None,
        "services_out_tok_s": g("services", "output_tok_s"), "colocated_out_tok_s": g("colocated", "output_tok_s"),
        "offline_subset_out_tok_s": g("offline_subset", "output_tok_s"),
        "services_vs_offline": None, "colocated_vs_offline": None, "services_small_prefill_vs_offline": None,
        "services_own_weights_vs_offline": None, "services_no_mps_vs_offline": None,
        "services_whole_prefill_context_vs_offline": None,
        "online_ttft_p50_ms": _round(g("online", "ttft_p50_ms")),
        "online_tpot_p50_ms": _round(g("online", "tpot_p50_ms")),
        "online_colocated_ttft_p50_ms": _round(g("online_colocated", "ttft_p50_ms")),
        "online_colocated_tpot_p50_ms": _round(g("online_colocated", "tpot_p50_ms")),
        "max_rate_within_slo": g("max_rate", "max_rate_within_slo"),
        "copy_GBps": g("ceilings", "copy_GBps"), "matmul_bf16_TFLOPs": g("ceilings", "matmul_bf16_TFLOPs"),
        "matmul_fp8_TFLOPs": g("ceilings", "matmul_fp8_TFLOPs"),
    }
    for key, ((num, num_key), (den, den_key)) in RATIOS.items():
        quotient = _ratio(g(num, num_key), g(den, den_key))
        if runs is None:
            summary[key] = quotient
            continue
        touched = [run for run in runs if {num, den} & set(run.get("sections", ()))]
        both = [run for run in touched if {num, den} <= set(run.get("sections", ()))]
        if both and isinstance(both[-1].get("ratios"), dict):
            summary[key] = both[-1]["ratios"].get(key)
        elif both and touched[-1] is both[-1]:  # an older record, and no later run measured either
            summary[key] = quotient
    return summary


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


def format_table(summary: dict) -> str:
    rows = [("key", "measured", "goal", "met")]
    for key, value in summary.items():
        op, goal = GOALS.get(key, ("", 0))
        met = "" if not op or value is None else ("yes" if (value >= goal if op == ">=" else value <= goal) else "NO")
        rows.append((key, "-" if value is None else f"{value:g}" if isinstance(value, (int, float)) else str(value),
                     f"{op} {goal:g}" if op else "", met))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

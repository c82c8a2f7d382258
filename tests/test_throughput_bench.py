"""bench/throughput_bench.py on the CPU: its flags, its plan, the JSON it writes after a section
that needs no GPU, a GPU section's failure recorded while the others run, --merge, the summary's
ratios and the max-rate search."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import throughput_bench as tb
from bench import throughput_clusters as clusters
from bench import throughput_gpu as gpu
from bench import throughput_summary as summary
from bench.throughput_context import Context

REPO = Path(__file__).resolve().parents[1]
ISSUE_KEYS = ("offline_bf16_out_tok_s", "offline_fp8kv_out_tok_s", "fp8kv_over_bf16", "offline_fp8_out_tok_s",
              "decode_b1_roofline_fraction", "gptfast_b1_ms_per_token", "b1_speed_over_gptfast",
              "services_vs_offline", "colocated_vs_offline", "online_ttft_p50_ms", "online_tpot_p50_ms",
              "max_rate_within_slo", "copy_GBps", "matmul_bf16_TFLOPs")


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/throughput_bench.py", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_dry_run_lists_each_group_with_budgets():
    a = run("--dry-run", "--only", "A")
    assert a.returncode == 0, a.stderr
    for name in ("ceilings", "decode_b1", "offline_bf16", "offline_fp8kv", "offline_fp8", "gptfast"):
        assert name in a.stdout
    assert "services" not in a.stdout
    b = run("--dry-run", "--only", "B", "--budget", "max_rate=99", "--skip", "online_colocated")
    assert b.returncode == 0, b.stderr
    assert "max_rate" in b.stdout and " 99 " in b.stdout and "online_colocated" not in b.stdout
    assert "gptfast" not in b.stdout
    # The run's own deadline ends it (and its last cluster's stop) inside the device's 10 minutes.
    assert tb.build_parser().parse_args([]).deadline_s <= 570


def test_a_decode_section_brings_this_machines_ceilings():
    """The decode sections' fractions are of the copy speed: a run with one measures it too, unless
    --skip ceilings; a run without one does not."""
    def names(*argv: str) -> list[str]:
        r = run("--dry-run", *argv)
        assert r.returncode == 0, r.stderr
        return [line.split()[0] for line in r.stdout.splitlines()[1:-1]]

    assert names("--only", "decode_b4_ctx1024") == ["ceilings", "decode_b4_ctx1024"]
    assert names("--only", "decode_b1,ceilings") == ["ceilings", "decode_b1"]
    assert names("--only", "decode_b1", "--skip", "ceilings") == ["decode_b1"]
    assert names("--only", "gptfast,online") == ["gptfast", "online"]


@pytest.mark.parametrize("argv, flag", [
    (["--only", "nope"], "--only"), (["--skip", "A,bogus"], "--skip"), (["--budget", "gptfast=abc"], "--budget"),
    (["--budget", "nosuch=10"], "--budget"), (["--rates", "8,4"], "--rates"), (["--online-rate", "0"], "--online-rate"),
    (["--only", "env", "--skip", "env"], "--only/--skip"), (["--merge", "/nonexistent.json"], "--merge"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, flag):
    r = run("--dry-run", *argv)
    assert r.returncode == 2
    assert flag in r.stderr


def test_writes_json_records_a_failing_gpu_section_and_runs_the_rest(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the failure path of a GPU section on a host without one")
    out = tmp_path / "res.json"
    r = run("--only", "decode_b1,env", "--out", str(out), "--deadline-s", "200")
    assert r.returncode == 1, r.stdout + r.stderr  # a section failed
    res = json.loads(out.read_text())
    assert "CUDA" in res["sections"]["decode_b1"]["error"]
    env = res["sections"]["env"]
    assert "error" not in env and env["python"] and env["cuda_available"] is False
    for key in ISSUE_KEYS:
        assert key in res and res[key] is None
    assert res["runs"][0]["sections"] == ["ceilings", "decode_b1", "env"]  # decode_b1 brings the ceilings
    assert set(res["runs"][0]["section_seconds"]) == {"ceilings", "decode_b1", "env"}
    table = r.stdout.splitlines()[-len(summary.summarize({})) - 1:]  # printed last: a header, a row per key
    assert table[0].split() == ["key", "measured", "goal", "met"]
    assert any(line.startswith("offline_bf16_out_tok_s") for line in table)


def test_merge_keeps_the_earlier_group_and_recomputes_the_summary(tmp_path):
    first = tmp_path / "a.json"
    first.write_text(json.dumps({"runs": [{"sections": ["offline_bf16", "offline_fp8kv", "decode_b1", "gptfast"]}],
                                 "sections": {
        "offline_bf16": {"output_tok_s": 10_000.0}, "offline_fp8kv": {"output_tok_s": 12_500.0},
        "decode_b1": {"decode_b1_ms_per_token": 4.0, "decode_b1_roofline_fraction": 0.8}, "gptfast": {
            "gptfast_b1_ms_per_token": 4.9}}}))
    out = tmp_path / "ab.json"
    r = run("--only", "env", "--merge", str(first), "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["fp8kv_over_bf16"] == 1.25
    assert res["b1_speed_over_gptfast"] == pytest.approx(4.9 / 4.0, abs=1e-3)
    assert len(res["runs"]) == 2 and "env" in res["sections"] and "offline_bf16" in res["sections"]


def test_a_ratio_comes_from_one_run_not_from_sections_of_two(tmp_path):
    """A later run that measured only the denominator does not make a ratio with an earlier run's
    numerator: the table keeps the ratio the earlier run measured with both."""
    first = tmp_path / "a.json"
    first.write_text(json.dumps({
        "runs": [{"sections": ["colocated", "offline_subset"], "ratios": {"colocated_vs_offline": 0.9}},
                 {"sections": ["offline_subset"], "ratios": {}}],
        "sections": {"colocated": {"output_tok_s": 9_000.0}, "offline_subset": {"output_tok_s": 12_000.0}}}))
    out = tmp_path / "b.json"
    r = run("--only", "env", "--merge", str(first), "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["colocated_vs_offline"] == 0.9  # not 9,000 / 12,000
    assert res["services_vs_offline"] is None and res["runs"][-1]["ratios"] == {}
    sections = {"services": {"output_tok_s": 7_000.0}, "offline_subset": {"output_tok_s": 8_750.0},
                "colocated": {"output_tok_s": 1.0}}
    assert summary.run_ratios(sections, ["services", "offline_subset"]) == {"services_vs_offline": 0.8}
    assert summary.run_ratios(sections, ["colocated"]) == {}


def test_summary_ratios_skip_failed_sections():
    s = summary.summarize({"services": {"output_tok_s": 7_000.0}, "colocated": {"error": "boom", "output_tok_s": 1.0},
                      "offline_subset": {"output_tok_s": 8_750.0},
                      "online": {"ttft_p50_ms": 41.234, "tpot_p50_ms": 6.1}})
    assert s["services_vs_offline"] == 0.8
    assert s["colocated_vs_offline"] is None
    assert (s["online_ttft_p50_ms"], s["online_tpot_p50_ms"]) == (41.23, 6.1)
    table = summary.format_table(s)
    assert "services_vs_offline" in table and ">= 0.9" in table and "NO" in table


def _row(rate: float, capacity: float) -> dict:
    over = rate > capacity
    return {"rate": rate, "requests": 100, "failed": 0, "cancelled": 0, "skipped": 0, "ttft_p50_ms": 40.0,
            "ttft_p99_ms": 2_000.0 if over else 120.0, "tpot_p50_ms": 6.0, "tpot_p99_ms": 9.0}


def test_every_cluster_mode_is_flags_that_tandem_up_takes():
    """Each Clusters mode's flags parse as `tandem up`'s (a misspelt one would fail only on the
    device), and the hold section's mode asks for the hold it compares."""
    from entrypoints.up_flags import parse_args

    for mode, flags in clusters.Clusters.MODES.items():
        parse_args(["--model", "m", *flags])
    assert parse_args(["--model", "m", *clusters.Clusters.MODES["disagg_hold_reserving"]]).gpu_turn_hold == "reserving"
    assert parse_args(["--model", "m"]).gpu_turn_hold != "reserving"  # `online`, its baseline, holds otherwise


def test_max_rate_search_steps_up_then_bisects():
    seen = []

    def measure(rate):
        seen.append(rate)
        return _row(rate, capacity=14.5)

    res = clusters.search_max_rate(measure, [8, 12, 16, 20], refine=2, ttft_ms=500, tpot_ms=25, fits=lambda r: True)
    assert seen == [8, 12, 16, 14, 15]
    assert res["max_rate_within_slo"] == 14 and res["first_rate_missing_slo"] == 15 and res["stopped"] is None
    none = clusters.search_max_rate(lambda r: _row(r, capacity=1), [8, 12], refine=1, ttft_ms=500, tpot_ms=25,
                              fits=lambda r: True)
    assert none["max_rate_within_slo"] == 0 and none["first_rate_missing_slo"] == 4
    cut = clusters.search_max_rate(lambda r: _row(r, capacity=100), [8, 12, 16], refine=1, ttft_ms=500, tpot_ms=25,
                             fits=lambda r: r < 16)
    assert cut["max_rate_within_slo"] == 12 and "16" in cut["stopped"]


def test_a_failed_request_misses_the_slo():
    row = _row(8, capacity=100)
    assert clusters.within_slo(row, 500, 25)
    assert not clusters.within_slo({**row, "failed": 1}, 500, 25)
    assert not clusters.within_slo({**row, "tpot_p99_ms": 25.5}, 500, 25)


def test_the_cluster_sections_run_end_to_end_on_a_tiny_model(tiny_models, tmp_path):
    """Group B's plumbing (`tandem up` in both modes, the SDK burst, `tandem bench` online and
    the max-rate search) on the CPU with small shapes, so a device run does not find it broken."""
    out = tmp_path / "b.json"
    r = subprocess.run(
        [sys.executable, "bench/throughput_bench.py", "--only", "services,online,max_rate,colocated",
         "--model", str(tiny_models["llama"]), "--input-len", "24", "--output-len", "8", "--services-prompts", "8",
         "--online-output-len", "8", "--online-requests", "6", "--online-rate", "4", "--rates", "4",
         "--rate-refine", "0", "--point-s", "2", "--point-min-requests", "6", "--point-max-s", "10",
         "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--deadline-s", "240"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads(out.read_text())
    services, colocated = res["sections"]["services"], res["sections"]["colocated"]
    assert services["completed"] == services["prompts"] == 8 and services["output_tokens"] == 8 * 8
    assert colocated["completed"] == 8 and colocated["output_tokens"] == 8 * 8
    assert res["services_out_tok_s"] > 0 and res["colocated_out_tok_s"] > 0
    online = res["sections"]["online"]
    assert online["failed"] == 0 and online["requests"] >= 6
    assert res["online_ttft_p50_ms"] > 0 and res["online_tpot_p50_ms"] > 0
    stages = online["stage_means_ms"]  # what each process's histograms saw during the run
    assert stages["gateway gw_reserve"] > 0 and stages["gateway gw_prefill"] > 0
    assert stages["prefill-0 step"] > 0 and stages["decode-0 step"] > 0
    assert res["sections"]["max_rate"]["points"][0]["rate"] == 4
    assert res["sections"]["max_rate"]["points"][0]["stage_means_ms"]["decode-0 step"] > 0
    assert res["sections"]["max_rate"]["reused"]  # one disaggregated cluster served three sections


def test_cublas_workspace_section_sets_the_variable_before_its_run(monkeypatch) -> None:
    """decode_b1_cublas_workspace runs its row's function with CUBLAS_WORKSPACE_CONFIG set first
    (cuBLAS reads it at its first GEMM in the child; the engine leaves a set value alone)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded, so the section's value is undone after
    seen = []
    section = gpu.with_cublas_workspace(
        lambda ctx: seen.append((ctx, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))) or {"ok": 1})
    assert section("ctx") == {"ok": 1} and seen == [("ctx", ":4096:8")]
    names = {n for n in tb.SECTIONS if "cublas_workspace" in n}
    assert names == {"decode_b1_cublas_workspace"}
    assert all(tb.SECTIONS[n].where == "child" for n in names)  # never the bench's own process


def test_fused_rotary_sections_turn_it_on_before_their_run(monkeypatch) -> None:
    """The *_fused_rotary sections run their row's function with TANDEM_FUSED_ROTARY=1 set first,
    each in a child of its own."""
    from engine.attention import FUSED_ROTARY_ENV, fused_rotary_enabled

    monkeypatch.setenv(FUSED_ROTARY_ENV, "0")  # recorded, so the section's value is undone after
    seen = []
    section = gpu.with_fused_rotary(lambda ctx: seen.append((ctx, fused_rotary_enabled())) or {"ok": 1})
    assert section("ctx") == {"ok": 1} and seen == [("ctx", True)]
    names = {n for n in tb.SECTIONS if n.endswith("_fused_rotary")}
    assert names == {"decode_b1_fused_rotary", "offline_bf16_fused_rotary", "offline_fp8_fused_rotary"}
    assert all(tb.SECTIONS[n].where == "child" for n in names)
    monkeypatch.setenv(FUSED_ROTARY_ENV, "yes")
    with pytest.raises(ValueError, match=FUSED_ROTARY_ENV):
        fused_rotary_enabled()


def test_balance_rounds_sections_turn_it_on_before_their_run(monkeypatch) -> None:
    """The *_balance_rounds sections run their row's function with balance_rounds in every
    default decode tuning, each in a child of its own."""
    import torch

    from tandem_kernels.decode_attention import TUNING_ENV, default_tuning

    monkeypatch.setenv(TUNING_ENV, "")  # recorded, so the section's value is undone after
    assert not default_tuning(torch.bfloat16, 1680, 132).balance_rounds
    seen = []
    section = gpu.with_balanced_rounds(
        lambda ctx: seen.append([default_tuning(dt, p, 132).balance_rounds
                                 for dt in (torch.bfloat16, torch.float8_e4m3fn) for p in (8, 1680, 4000)]) or {"ok": 1})
    assert section("ctx") == {"ok": 1} and seen == [[True] * 6]
    names = {n for n in tb.SECTIONS if n.endswith("_balance_rounds")}
    assert names == {"offline_bf16_balance_rounds", "offline_fp8kv_balance_rounds"}
    assert all(tb.SECTIONS[n].where == "child" for n in names)


def test_untimed_buckets_section_turns_timing_off_before_its_run(monkeypatch) -> None:
    """offline_bf16_untimed_buckets builds its engine with TANDEM_TIMED_BUCKETS=0 (every decode
    graph up to the cap, as before timed buckets), in a child of its own."""
    from engine.cuda_graphs import TIMED_BUCKETS_ENV, timed_buckets_enabled

    monkeypatch.setenv(TIMED_BUCKETS_ENV, "1")  # recorded, so the section's value is undone after
    seen = []
    monkeypatch.setattr(gpu, "run_offline", lambda ctx, kv, quantization: seen.append(
        (kv, quantization, timed_buckets_enabled())) or {"ok": 1})
    assert gpu.run_offline_bf16_untimed_buckets("ctx") == {"ok": 1}
    assert seen == [("auto", None, False)]
    assert tb.SECTIONS["offline_bf16_untimed_buckets"].where == "child"


def test_group_s_runs_the_sweep_before_the_fused_sections_and_compares_with_decode_b1():
    r = run("--dry-run", "--only", "S")
    assert r.returncode == 0, r.stderr
    names = [line.split()[0] for line in r.stdout.splitlines()[1:-1]]
    assert names[:2] == ["ceilings", "decode_b1"] and "gpu_parity" in names and "decode_b4" in names
    assert names.index("gemv_sweep") < min(names.index(n) for n in names if "fused" in n)
    assert names.index("gemv_sweep_fp8") < min(names.index(n) for n in names if "fp8_fused" in n)
    assert names.index("gemv_sweep_b4") < min(names.index(n) for n in names if n.startswith("decode_b4_"))
    assert names.index("gemv_sweep_fp8_b4") < names.index("decode_b4_fp8_fused_all")
    assert "offline_bf16" not in names


def test_the_four_row_sweep_times_separate_norm_only_where_a_norm_is_in_front(monkeypatch, tmp_path):
    from bench import kernel_bench

    calls = []

    def fake_sweep(rows_list, weights, fp8, tilings):
        calls.append((rows_list, weights, fp8, tilings))
        key = "rows [weight, rows, tiling, us, GB/s, err]"
        out = [[w, 4, None, 50.0, 1, 0.0] for w in weights]  # cuBLAS's row, timed by both calls
        for i, t in enumerate(tilings):  # the normed gate_up fastest with separate_norm
            out += [[w, 4, dataclasses.asdict(t), 40.0 - i - 20 * (t.separate_norm and w == "gate_up"), 1, 0.0]
                    for w in weights]
        return {key: out}

    monkeypatch.setattr(gpu, "need_cuda", lambda: None)
    monkeypatch.setattr(kernel_bench, "gemv_sweep", fake_sweep)
    res = gpu.run_gemv_sweep_b4(Context(argparse.Namespace(), tmp_path, tmp_path, {}, 0.0), fp8=True)
    assert [c[1] for c in calls] == [gpu.GEMV_AB_WEIGHTS, gpu.GEMV_B4_NORMED] and all(c[2] for c in calls)
    assert all(c[0] == (4,) for c in calls) and not any(t.separate_norm for t in calls[0][3])
    assert all(t.separate_norm for t in calls[1][3])
    rows = next(v for k, v in res.items() if k.startswith("rows"))
    assert sum(1 for r in rows if r[2] is None) == len(gpu.GEMV_AB_WEIGHTS)  # cuBLAS once a weight
    picks = res["best_tilings_by_rows"]["4"]
    assert picks["gate_up"]["separate_norm"] and not picks["down"].get("separate_norm")
    assert set(picks) == set(gpu.GEMV_AB_WEIGHTS)


def test_best_tilings_takes_each_weights_fastest_tiling_at_one_row():
    t = {"block_n": 8, "block_k": 512, "num_warps": 4, "late_reduce": False, "prefetch": True}
    rows = [  # [weight, rows, tiling (None: unfused), us, GB/s, err]
        ["qkv", 1, None, 19.0, 2600, 0.0],
        ["qkv", 1, t, 15.5, 3200, 1e-3],
        ["qkv", 1, {**t, "block_n": 4, "late_reduce": True}, 14.2, 3500, 1e-3],
        ["qkv", 1, {**t, "block_k": 1024}, "CompilationError(...)", None, None],
        ["qkv", 4, t, 9.0, 5500, 1e-3],  # 4 rows: not the batch-1 choice
        ["down", 1, None, 32.0, 3700, 0.0],
        ["down", 1, {**t, "num_warps": 8, "prefetch": False}, 36.0, 3300, 1e-3],
    ]
    got = gpu.best_tilings(rows)
    assert got["best_tilings"] == {"qkv": {**t, "block_n": 4, "late_reduce": True},
                                   "down": {**t, "num_warps": 8, "prefetch": False}}
    assert got["gemv_us_at_1_row"] == {"qkv": {"cublas": 19.0, "fused": 14.2}, "down": {"cublas": 32.0, "fused": 36.0}}
    assert got["best_tilings_by_rows"]["1"] == got["best_tilings"] and got["best_tilings_by_rows"]["4"] == {"qkv": t}
    assert got["gemv_us_by_rows"]["4"] == {"qkv": {"fused": 9.0}}
    # What TANDEM_GEMV_TILING takes: {projection: GemvTiling fields}.
    from tandem_kernels.gemv import GemvTiling

    assert GemvTiling(**got["best_tilings"]["qkv"]).late_reduce


def test_small_batch_rows_are_each_variant_against_its_batch_default():
    sections = {
        "decode_b1": {"decode_b1_ms_per_token": 4.5},
        "decode_b1_fused_qkv_o": {"decode_b1_ms_per_token": 4.2},
        "decode_b1_attn_prefetch": {"error": "RuntimeError: ..."},
        "decode_b4": {"decode_b4_ms_per_step": 4.8},
        "decode_b4_fused_qkv_o": {"decode_b4_ms_per_step": 5.0},
    }
    got = summary.small_batch(sections, tb.GROUPS["S"])
    assert set(got) == {"decode_b1", "decode_b1_fused_qkv_o", "decode_b4", "decode_b4_fused_qkv_o"}
    assert got["decode_b1_fused_qkv_o"] == {"ms": 4.2, "vs_default": round(4.5 / 4.2, 3)}
    assert got["decode_b4_fused_qkv_o"]["vs_default"] < 1 < got["decode_b1_fused_qkv_o"]["vs_default"]
    assert got["decode_b1"]["vs_default"] == 1.0


def test_a_fused_gemv_section_takes_the_sweeps_tilings_from_the_runs_earlier_results(monkeypatch, tmp_path):
    """The wiring only (the measurement needs a GPU): what the child's environment holds when
    h200_bench.decode_b1 runs, and what the section adds to its result."""
    import argparse

    from bench import h200_bench
    from engine.model import FUSED_GEMV_ENV, FUSED_GEMV_ROWS_ENV
    from tandem_kernels.decode_attention import TUNING_ENV
    from tandem_kernels.gemv import TILING_ENV

    seen = {}

    def fake_decode_b1(model_dir, cfg, ceil, fused=None, batch=1, prompt_len=128, quantization=None):
        seen.update(fused=fused, batch=batch, prompt_len=prompt_len, quantization=quantization,
                    env={k: os.environ.get(k) for k in (FUSED_GEMV_ENV, FUSED_GEMV_ROWS_ENV, TILING_ENV, TUNING_ENV)})
        return {f"decode_b{batch}_ms_per_step": 4.0}

    monkeypatch.setattr(gpu, "need_cuda", lambda: None)
    monkeypatch.setattr(h200_bench, "decode_b1", fake_decode_b1)
    for name in (FUSED_GEMV_ENV, FUSED_GEMV_ROWS_ENV, TILING_ENV, TUNING_ENV):  # the sections' settings go at teardown
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    tilings = {"qkv": {"block_n": 4, "block_k": 1024, "num_warps": 4, "prefetch": True}}
    at_4 = {"qkv": {"block_n": 2, "block_k": 1024, "wide_rows": True}}
    ctx = Context(argparse.Namespace(), tmp_path, tmp_path, {"copy_GBps": 4000.0}, 0.0,
                     earlier={"gemv_sweep": {"best_tilings": tilings, "best_tilings_by_rows": {"4": at_4}}})
    tb.SECTIONS["decode_b4_fused_qkv_o"].fn(ctx)  # the sweep's fastest at 4 rows, where it has them
    assert json.loads(seen["env"][TILING_ENV]) == at_4
    at_4_b4 = {"gate_up": {"block_n": 8, "block_k": 512, "separate_norm": True}}
    ctx.earlier["gemv_sweep"] = {"best_tilings": tilings}
    ctx.earlier["gemv_sweep_b4"] = {"best_tilings_by_rows": {"4": at_4_b4}}
    tb.SECTIONS["decode_b4_fused_qkv_o"].fn(ctx)  # the four-row sweep's picks where the main sweep has none
    assert json.loads(seen["env"][TILING_ENV]) == at_4_b4
    tb.SECTIONS["decode_b2_fused_all"].fn(ctx)  # ... only at its own row count
    assert json.loads(seen["env"][TILING_ENV]) == tilings
    del ctx.earlier["gemv_sweep_b4"]
    res = tb.SECTIONS["decode_b4_fused_qkv_o"].fn(ctx)
    assert seen["fused"] is True and seen["batch"] == 4 and seen["env"][FUSED_GEMV_ROWS_ENV] == "4"
    assert seen["env"][FUSED_GEMV_ENV] == "qkv,o_proj" and json.loads(seen["env"][TILING_ENV]) == tilings
    assert seen["env"][TUNING_ENV] is None
    assert res["gemv_tilings"] == tilings and res["fused_gemv_projections"] == "qkv,o_proj"
    assert seen["quantization"] is None
    monkeypatch.delenv(TILING_ENV)  # each section runs in a child of its own
    tb.SECTIONS["decode_b2_fp8_fused_all"].fn(ctx)  # FP8 weights at two rows, all four fused
    assert seen["quantization"] == "fp8" and seen["batch"] == 2 and seen["env"][FUSED_GEMV_ROWS_ENV] == "2"
    # FP8 sections take the FP8 sweep's tilings, never the bf16 sweep's.
    assert seen["env"][TILING_ENV] is None
    fp8_at_2 = {"down": {"block_n": 4, "block_k": 1024, "flat_row": True, "stages": 3}}
    ctx.earlier["gemv_sweep_fp8"] = {"best_tilings": tilings, "best_tilings_by_rows": {"2": fp8_at_2}}
    res = tb.SECTIONS["decode_b2_fp8_fused_all"].fn(ctx)
    assert json.loads(seen["env"][TILING_ENV]) == fp8_at_2 and res["gemv_tilings"] == fp8_at_2
    res = tb.SECTIONS["decode_b1_fp8_fused_all"].fn(ctx)  # one row: the FP8 sweep's one-row picks
    assert seen["quantization"] == "fp8" and seen["batch"] == 1 and seen["fused"] is True
    assert json.loads(seen["env"][TILING_ENV]) == tilings and seen["env"][FUSED_GEMV_ENV] == "qkv,o_proj,gate_up,down"
    # The prefetch section sets only the decode tuning: the engine's default GEMVs (fused None).
    for name in (FUSED_GEMV_ENV, FUSED_GEMV_ROWS_ENV, TILING_ENV, TUNING_ENV):
        monkeypatch.delenv(name, raising=False)
    tb.SECTIONS["decode_b1_attn_prefetch"].fn(Context(argparse.Namespace(), tmp_path, tmp_path, {}, 0.0))
    assert seen["fused"] is None and seen["batch"] == 1
    assert json.loads(seen["env"][TUNING_ENV]) == gpu.SMALL_BATCH_TUNING and seen["env"][FUSED_GEMV_ENV] is None
    assert seen["prompt_len"] == 128
    # The online TPOT's shape: 4 sequences of 1,024-token prompts, the engine's own tuning.
    monkeypatch.delenv(TUNING_ENV, raising=False)
    tb.SECTIONS["decode_b4_ctx1024"].fn(Context(argparse.Namespace(), tmp_path, tmp_path, {}, 0.0))
    assert seen["batch"] == 4 and seen["prompt_len"] == 1024 and seen["fused"] is None
    assert seen["env"][TUNING_ENV] is None


def test_a_run_reads_its_fractions_against_ceilings_measured_on_its_own_gpu():
    h100 = "NVIDIA H100 80GB HBM3"
    measured = {"copy_GBps": 3001.0, "matmul_bf16_TFLOPs": 700.0, "device": h100}
    assert gpu.run_ceilings_for(measured, h100) is measured
    assert gpu.run_ceilings_for(measured, None) is measured  # no nvidia-smi: what was measured stands
    merged_h200 = {**measured, "copy_GBps": 4240.0, "device": "NVIDIA H200"}
    on_h100 = gpu.run_ceilings_for(merged_h200, h100)  # an H100 run that merged an H200 file
    assert on_h100["copy_GBps"] == gpu.KNOWN_CEILINGS["H100"]["copy_GBps"]
    assert "NVIDIA H200" in on_h100["assumed"] and on_h100["device"] == h100
    none = gpu.run_ceilings_for({"error": "CUDA is not available"}, "NVIDIA H200")
    assert none["copy_GBps"] == gpu.KNOWN_CEILINGS["H200"]["copy_GBps"] and "no ceilings" in none["assumed"]
    assert gpu.run_ceilings_for(None, "Some Other GPU")["copy_GBps"] == gpu.KNOWN_CEILINGS["H200"]["copy_GBps"]


def test_nvidia_smi_names_the_gpu_it_is_asked_about(tmp_path, monkeypatch):
    from entrypoints import nvidia_smi

    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\necho "$@" >> "$0.args"\necho "NVIDIA H100 80GB HBM3"\necho "NVIDIA H200"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    nvidia_smi._asked.cache_clear()
    assert nvidia_smi.name("1") == "NVIDIA H100 80GB HBM3"  # the first line: the GPU asked about
    assert "--query-gpu=name" in (tmp_path / "nvidia-smi.args").read_text()
    assert "-i 1" in (tmp_path / "nvidia-smi.args").read_text()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert gpu.this_gpu_name() == "NVIDIA H100 80GB HBM3"
    nvidia_smi._asked.cache_clear()

"""TANDEM_PROFILE_DIR / _STEPS / _WORKERS (worker.step_profiler): a real worker process profiles
the engine steps it was asked for and writes a trace and an operator table; a worker not named
writes nothing; a bad step spec names the variable."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, WorkerPoolConfig
from harness import GatewayThread, start_workers, stop_workers, wait_idle
from tandem import Client
from bench import trace_steps
from worker.step_profiler import ENV_DIR, ENV_STEPS, ENV_WORKERS, parse_steps

WAIT = 60.0


def test_step_specs() -> None:
    assert parse_steps("3:5") == (3, 5) and parse_steps("4") == (0, 4) and parse_steps("0:1") == (0, 1)
    for bad in ("", "x", "3:", "3:0", "-1:2", "1:2:3"):
        with pytest.raises(ValueError, match=ENV_STEPS):
            parse_steps(bad)


def test_a_worker_profiles_the_steps_it_was_asked_for(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    model_dir = tiny_models["llama"]
    out = tmp_path / "prof"
    env = {ENV_DIR: str(out), ENV_STEPS: "1:3"}
    flags = ["--num-kv-blocks", "64", "--max-running", "4"]
    profiled, other = start_workers([("both", [*flags, "--worker-id", "both-a"], {**env, ENV_WORKERS: "both-a"}),
                                     ("both", [*flags, "--worker-id", "both-b"], {**env, ENV_WORKERS: "both-a"})],
                                    model_dir, tmp_path / "w")
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0,
                                     workers=WorkerPoolConfig(both=(profiled.address, other.address))))
    try:
        assert gw.wait_ready(WAIT)
        with Client(gw.target, timeout=WAIT) as c:
            for prompt in ("Once upon a time", "The cat sat"):  # one on each worker at least once
                for _ in range(2):
                    assert len(c.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids) == 12
    finally:
        gw.stop()
    for w in (profiled, other):
        wait_idle(w, WAIT)
    stop_workers([profiled, other])
    assert sorted(p.name for p in out.iterdir()) == ["both-a-steps1-3.json", "both-a-steps1-3.txt"]
    table = (out / "both-a-steps1-3.txt").read_text()
    assert table.startswith("both-a: engine steps 1..3 (3)")
    assert "aten::" in table  # the model's operators, with their totals
    trace = json.loads((out / "both-a-steps1-3.json").read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    steps = trace_steps.analyze(trace)  # each profiled step is a range of its own
    assert len(steps) == 3 and all(s["host_ms"] > 0 for s in steps)

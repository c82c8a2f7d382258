"""bench/long_prompt.py on the CPU with a tiny model: a prompt over the prefill worker's context
(--prefill-max-model-len) is placed on the decode worker (routing reason long_prompt), one of
ordinary length on the prefill worker, and each round's figures are recorded."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_long_prompt_goes_to_the_decode_worker_and_the_ordinary_one_does_not(tmp_path, tiny_models) -> None:
    out = tmp_path / "long.json"
    cmd = [sys.executable, str(REPO / "bench" / "long_prompt.py"), "--model", str(tiny_models["llama"]),
           "--long-len", "300", "--streams", "3", "--stream-in", "40", "--stream-out", "128",
           "--up-args", "--prefill-max-model-len 128", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["exit_code"] == 0
    assert "max 128 per prompt; the decode worker prefills longer ones" in "\n".join(result["banner"])
    long, ordinary = result["long"], result["ordinary"]
    assert long["prompt_tokens"] == 300 and ordinary["prompt_tokens"] == 40
    assert long["routed"].get("long_prompt") == 1 and "long_prompt" not in ordinary["routed"]
    assert sum(ordinary["routed"].values()) == 4  # three streams and the ordinary prompt, by the prefill worker
    assert long["ttft_ms"] > 0 and ordinary["ttft_ms"] > 0

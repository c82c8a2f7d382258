"""A prefill worker's own context (`tandem up --prefill-max-model-len`, and by default
SHARED_PREFILL_MAX_MODEL_LEN where it shares a GPU with a decode worker): what each child is
handed, the flag's errors, and a real cluster in which a longer prompt is prefilled by the decode
worker with the offline engine's tokens."""
from __future__ import annotations

import re
import urllib.request

import pytest

from engine import LLM
from entrypoints.cluster import free_port
from entrypoints.placement import SHARED_PREFILL_MAX_MODEL_LEN
from tandem import Client, SamplingParams
from tests.test_launcher import start_up, stop


def _contexts(*argv: str, visible: int = 1, model: str = "/models/m") -> dict[str, str | None]:
    """Each child's --max-model-len (the gateway's --max-context), None where it has none."""
    from entrypoints.launcher import build_children, placement_for
    from entrypoints.up_flags import parse_args

    a = parse_args(list(argv))
    out = {}
    for c in build_children(a, model, placement=placement_for(a, visible=visible)):
        flag = "--max-context" if c.name == "gateway" else "--max-model-len"
        out[c.name] = c.argv[c.argv.index(flag) + 1] if flag in c.argv else None
    return out


def test_a_prefill_worker_sharing_a_gpu_gets_a_shorter_context(tiny_models, monkeypatch) -> None:
    from entrypoints import launcher

    monkeypatch.setattr(launcher, "gpu_can_share_memory", lambda gpu: True)  # these GPUs are placed, not real
    cap = str(SHARED_PREFILL_MAX_MODEL_LEN)
    # A model whose context is not known (no config here): the cap, for the prefill worker only.
    assert _contexts() == {"prefill-0": cap, "decode-0": None, "gateway": None}
    assert _contexts("--max-model-len", "131072") == {"prefill-0": cap, "decode-0": "131072", "gateway": "131072"}
    assert _contexts("--max-model-len", "4096") == {"prefill-0": "4096", "decode-0": "4096", "gateway": "4096"}
    assert _contexts(visible=2) == {"prefill-0": None, "decode-0": None, "gateway": None}  # a GPU each
    assert _contexts(visible=0) == {"prefill-0": None, "decode-0": None, "gateway": None}  # the CPU
    assert _contexts("--colocated", visible=1) == {"worker-0": None, "gateway": None}
    # A model of a shorter context than the cap: nothing to say.
    assert _contexts(model=str(tiny_models["llama"]))["prefill-0"] is None
    # The flag reaches every prefill worker, wherever it runs.
    mine = {"prefill-0": "1000", "decode-0": None, "gateway": None}
    assert _contexts("--prefill-max-model-len", "1000", visible=2) == mine
    assert _contexts("--prefill-max-model-len", "1000", visible=0) == mine


@pytest.mark.parametrize("argv,flag", [(["--prefill-max-model-len", "0"], "--prefill-max-model-len"),
                                       (["--max-model-len", "-5"], "--max-model-len"),
                                       (["--max-model-len", "100", "--prefill-max-model-len", "200"],
                                        "--prefill-max-model-len 200")])
def test_a_bad_context_names_the_flag(argv, flag, capsys) -> None:
    from entrypoints.up_flags import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert flag in capsys.readouterr().err


def _metric(port: int, name: str, labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(rf"^{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_prompt_longer_than_the_prefill_workers_context_is_prefilled_by_the_decode_worker(
        tmp_path, tiny_models) -> None:
    model = tiny_models["llama"]
    metrics = free_port()
    proc, port, _ = start_up(tmp_path, "--model", str(model), "--prefill-max-model-len", "64", "--no-agent",
                             "--metrics-port", str(metrics))
    assert "max 64 per prompt; the decode worker prefills longer ones" in proc.printed
    llm = LLM(str(model), num_kv_blocks=64, max_running=4)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    short, long = [7 + i % 50 for i in range(40)], [11 + (i * 7) % 200 for i in range(150)]
    try:
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            for prompt in (short, long, short[:63], long[:64]):
                got = client.generate(prompt, params=greedy)
                assert got.token_ids == llm.generate([prompt], greedy)[0].token_ids, len(prompt)
        count = {w: _metric(metrics, "tandem_gateway_prefill_requests_total", f'worker="{w}"')
                 for w in ("prefill-0", "decode-0")}
        assert count == {"prefill-0": 2, "decode-0": 2}  # 40 and 63 tokens; 150 and 64 need a context over 64
        assert _metric(metrics, "tandem_gateway_routing_decisions_total", 'reason="long_prompt"') == 2
    finally:
        assert stop(proc) == 0

"""PrefillAlone (engine.scheduler): where prefill graphs are captured, waiting prompts that one
graph holds get a step of their own beside running decodes, never two such steps running, and a
larger backlog (or a prompt still being chunked) mixes as before. Outputs are the same tokens as
with mixed steps. (The rule is set by hand here: graphs need CUDA.)"""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.scheduler import PrefillAlone

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (n,), generator=g).tolist()


def _engine(model_dir, rule: PrefillAlone | None, overlap: bool = False, **kw) -> Engine:
    cfg = dict(num_kv_blocks=128, max_running=8, max_batched_tokens=256, device="cpu", overlap_schedule=overlap)
    cfg.update(kw)
    e = Engine(EngineConfig(str(model_dir), **cfg))
    e.prefill_alone = rule
    return e


def _kinds(engine: Engine, steps: int) -> list[tuple[int, int]]:
    """(decode rows, prompt rows) of each of the next `steps` steps' plans."""
    seen: list[tuple[int, int]] = []
    observe = engine._schedule

    def spy():
        out = observe()
        prompts = sum(1 for s in out.scheduled if s.num_new_tokens > 1)
        seen.append((len(out.scheduled) - prompts, prompts))
        return out
    engine._schedule = spy
    for _ in range(steps):
        engine.step()
    engine._schedule = observe
    return seen


def test_a_waiting_prompt_runs_alone_beside_decodes_then_they_move(model_dir) -> None:
    e = _engine(model_dir, PrefillAlone(max_tokens=64, max_seqs=4))
    params = SamplingParams(max_tokens=12, **GREEDY)
    for i in range(3):
        e.admit(_prompt(20, i), params, f"d{i}")
    e.step()  # their prompts (nothing running yet: the usual step)
    e.step()
    e.admit(_prompt(30, 7), params, "new")
    e.admit(_prompt(9, 8), params, "new2")
    assert _kinds(e, 3) == [(0, 2), (5, 0), (5, 0)]  # the prompts alone, then everyone decodes


def test_never_two_alone_steps_running(model_dir) -> None:
    e = _engine(model_dir, PrefillAlone(max_tokens=64, max_seqs=4))
    params = SamplingParams(max_tokens=12, **GREEDY)
    e.admit(_prompt(20, 1), params, "d")
    e.step()
    e.step()
    e.admit(_prompt(30, 2), params, "a")
    assert _kinds(e, 1) == [(0, 1)]
    e.admit(_prompt(25, 3), params, "b")  # comes right after an alone step: it mixes
    assert _kinds(e, 1) == [(2, 1)]


@pytest.mark.parametrize("why", ["backlog", "seqs", "no rule", "chunking"])
def test_what_mixes_as_before(model_dir, why: str) -> None:
    rule = None if why == "no rule" else PrefillAlone(max_tokens=64, max_seqs=1 if why == "seqs" else 4)
    e = _engine(model_dir, rule, max_batched_tokens=48 if why == "chunking" else 256)
    params = SamplingParams(max_tokens=12, **GREEDY)
    e.admit(_prompt(20, 1), params, "d")
    e.step()
    e.step()
    if why == "chunking":  # a 100-token prompt takes three steps of 48 tokens
        e.admit(_prompt(100, 2), params, "long")
        e.step()
        e.admit(_prompt(10, 3), params, "short")
        kinds = _kinds(e, 1)
        assert kinds[0][0] == 1 and kinds[0][1] >= 1  # the decode moves with the chunk
        return
    n = {"backlog": (40, 40), "seqs": (10, 10), "no rule": (10,)}[why]  # 80 > 64 tokens; 2 > 1 seqs
    for i, length in enumerate(n):
        e.admit(_prompt(length, 10 + i), params, f"w{i}")
    assert _kinds(e, 1) == [(1, len(n))]


@pytest.mark.parametrize("overlap", [False, True])
def test_the_tokens_are_those_of_mixed_steps(model_dir, overlap: bool) -> None:
    """Prompts arriving while others decode, with and without the rule: the same greedy tokens."""
    def run(rule):
        e = _engine(model_dir, rule, overlap=overlap)
        got: dict[str, list[int]] = {}
        arrivals = {0: 3, 2: 1, 3: 2, 7: 1, 8: 1}  # step -> prompts arriving before it
        k = 0
        for step in range(60):
            for _ in range(arrivals.get(step, 0)):
                e.admit(_prompt(5 + 7 * k, 100 + k), SamplingParams(max_tokens=6 + k, **GREEDY), f"r{k}")
                k += 1
            for out in e.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if step > 8 and not e.has_unfinished():
                break
        assert not e.has_unfinished()
        assert e.num_free_blocks_after_reset() == e.num_total_blocks
        return got
    mixed = run(None)
    assert run(PrefillAlone(max_tokens=128, max_seqs=4)) == mixed
    assert len(mixed) == 8 and all(len(v) == 6 + int(k[1:]) for k, v in mixed.items())

"""The engine's request lifecycle calls (admit, reserve, activate, release, abort, get, stats)
and its config checks, on a tiny random Llama."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.outputs import DuplicateRequestError, FinishReason

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.mark.parametrize("field, value", [
    ("block_size", 24), ("block_size", 128), ("max_running", 0), ("max_batched_tokens", 0),
    ("kv_cache_dtype", "fp16"), ("load_format", "npz"), ("gpu_memory_fraction", 0.0),
    ("gpu_memory_fraction", 1.5), ("swap_space_gb", -1.0), ("num_kv_blocks", 0), ("dtype", "int8"),
])
def test_engine_config_names_the_invalid_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig("some/model", **{field: value})
    cfg = EngineConfig("some/model")
    with pytest.raises(AttributeError):
        cfg.block_size = 32  # frozen


def test_duplicates_and_resumes_go_through_admit(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64)
    e = llm.engine
    prompt = list(range(3, 23))
    full = llm.generate([prompt], GREEDY)[0].token_ids
    req = e.admit(prompt + full[:3], GREEDY, "resumed", num_output_tokens=3)
    assert e.knows("resumed") and e.get("resumed") == req
    with pytest.raises(DuplicateRequestError, match="request_id"):
        e.admit(prompt, GREEDY, "resumed")
    with pytest.raises(ValueError, match="num_output_tokens"):
        e.admit(prompt, GREEDY, "bad", num_output_tokens=len(prompt))
    while e.has_unfinished():
        e.step()
    assert req.finished and req.output_token_ids == full and req.num_prompt_tokens == len(prompt)
    assert not e.knows("resumed") and e.get("resumed") is None
    assert e.stats().held == 0 and e.num_free_blocks_after_reset() == e.num_total_blocks


def test_reserve_activate_release(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64)
    e = llm.engine
    prompt = list(range(40, 75))
    got = e.reserve("r1", prompt, SamplingParams(max_tokens=4))
    assert got is not None and len(got[1]) == -(-len(prompt) // 16) - got[0]
    assert e.knows("r1") and e.get("r1") is None and e.stats().held == 1
    with pytest.raises(DuplicateRequestError):
        e.reserve("r1", prompt, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="first_token_id"):
        e.activate("r1", -1)
    with pytest.raises(LookupError):
        e.activate("nope", 5)
    first = e.activate("r1", 5, params=GREEDY.replace(max_tokens=3))
    assert not first.finished and first.new_token_ids == [5] and e.stats().held == 0
    outs = [first]
    while e.has_unfinished():
        outs += e.step()
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outs) == 3
    assert e.reserve("r2", prompt, SamplingParams(max_tokens=4)) is not None
    assert e.release("r2") and not e.knows("r2") and not e.release("r2")
    assert e.num_free_blocks_after_reset() == e.num_total_blocks

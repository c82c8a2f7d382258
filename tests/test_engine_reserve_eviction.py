"""A decode engine's Reserve when making room evicts the very blocks its prefix match found:
it matches again and reserves (it used to raise "match is stale", which reached the client
as INVALID_ARGUMENT), or answers None (no room) when the cache cannot hold the prompt."""
from __future__ import annotations

from engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_reserve_survives_evicting_its_own_prefix_match(tiny_models) -> None:
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=12)
    e = llm.engine
    older, newer = list(range(3, 51)), list(range(100, 148))
    llm.generate([older], GREEDY)
    llm.generate([newer], GREEDY)  # `older`'s cached blocks are now the least recently used
    free = e.num_free_blocks
    assert e.cache.evictable_blocks > 0
    prompt = older + [7] * 112  # matches `older`'s blocks and needs more than the free ones
    got = e.reserve("r", prompt, SamplingParams(max_tokens=1), 1)
    assert got is not None, (free, e.num_free_blocks)
    cached, dst = got
    assert cached * 16 + len(dst) * 16 >= len(prompt)
    e.release("r")
    assert e.num_free_blocks + e.cache.evictable_blocks == 12  # nothing leaked

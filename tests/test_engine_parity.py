"""Greedy tokens and logits of our engine against transformers, for every supported family."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "llama3", "mistral", "qwen2", "qwen3", "glm", "glm4"]
PROMPT_LENS = (5, 16, 17, 33, 40)  # cross block boundaries of 16


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(family, tiny_models):
    gen = torch.Generator().manual_seed(hash(family) % 1000)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    llm = LLM(tiny_models[family], num_kv_blocks=64, max_batched_tokens=48)  # forces chunked prefill
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    ref = hf_model(tiny_models[family])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref, prompt, 24)
        assert out.finish_reason == "length"
    assert len({t for o in outs for t in o.token_ids}) > 10  # varied tokens, not one repeated
    assert llm.engine.num_free_blocks_after_reset() == llm.engine.num_total_blocks


@pytest.mark.parametrize("family", ["llama3", "qwen3", "glm4"])  # plain, q/k norms, interleaved partial rotary
def test_fused_rotary_decode_gives_the_same_tokens(family, tiny_models, monkeypatch):
    """TANDEM_FUSED_ROTARY=1 (a decode step's rotary and K/V store inside decode attention) gives
    transformers' greedy tokens too, through the engine's decode path (the reference kernels here;
    tests/test_kernels.py checks the Triton kernel)."""
    from engine.attention import FUSED_ROTARY_ENV

    monkeypatch.setenv(FUSED_ROTARY_ENV, "1")
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 16, 30)]
    outs = LLM(tiny_models[family], num_kv_blocks=64).generate(
        prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    ref = hf_model(tiny_models[family])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref, prompt, 12)


@pytest.mark.parametrize("new_kv", ["1", "0"])
@pytest.mark.parametrize("family", ["llama3", "qwen3", "glm4"])
def test_prefill_gives_the_same_tokens_over_the_new_kv_or_the_cache(family, new_kv, tiny_models, monkeypatch):
    """Prefill attention over the prompt's own K/V as computed (TANDEM_EXTEND_NEW_KV=1, the
    default; the context before them from the cache) and over every key from the cache (0) both
    give transformers' greedy tokens, a prompt prefilled in chunks included (the reference kernels
    here; tests/test_kernels.py checks the Triton one). A value other than 0 or 1 is named."""
    from engine.attention import EXTEND_NEW_KV_ENV, extend_new_kv_enabled

    monkeypatch.delenv(EXTEND_NEW_KV_ENV, raising=False)
    assert extend_new_kv_enabled()
    monkeypatch.setenv(EXTEND_NEW_KV_ENV, new_kv)
    assert extend_new_kv_enabled() == (new_kv == "1")
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 40)]
    outs = LLM(tiny_models[family], num_kv_blocks=64, max_batched_tokens=16).generate(
        prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    ref = hf_model(tiny_models[family])
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref, prompt, 8)
    monkeypatch.setenv(EXTEND_NEW_KV_ENV, "yes")
    with pytest.raises(ValueError, match=EXTEND_NEW_KV_ENV):
        extend_new_kv_enabled()


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_logits_match_transformers(family, tiny_models):
    llm = LLM(tiny_models[family], num_kv_blocks=64)
    engine = llm.engine
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 17, 32)]
    seqs, block = [], 0
    for i, p in enumerate(prompts):
        s = Sequence(f"r{i}", p, SamplingParams(temperature=0))
        nblocks = -(-len(p) // engine.config.block_size)
        s.block_table = list(range(block, block + nblocks))
        block += nblocks
        seqs.append(s)
    batch = engine.runner.prepare(SchedulerOutput([ScheduledSeq(s, s.num_tokens) for s in seqs]))
    with torch.no_grad():
        hidden = engine.model(batch.input_ids, batch.positions, engine.kv_cache.layers, batch.meta)
        ours = engine.model.logits(hidden)
        ref_model = hf_model(tiny_models[family])
        ref = torch.cat([ref_model(torch.tensor([p])).logits[0] for p in prompts])
    scale = ref.abs().max()
    assert (ours - ref).abs().max() <= 1e-4 * scale

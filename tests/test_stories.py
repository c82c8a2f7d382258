"""stories260K (a real trained model) converted by our converter: same greedy tokens as transformers, English text."""
from __future__ import annotations

import re

import pytest
import torch

from engine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")


def test_stories_greedy_matches_transformers_and_reads_as_english(stories_dir):
    llm = LLM(stories_dir, num_kv_blocks=128)
    prompts = ["Once upon a time", "The little dog", "Lily and Ben went to the park. They"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=60, temperature=0))
    hf = transformers.AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([llm.tokenizer.encode(prompt)])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False, pad_token_id=0)
        ref_ids = ref[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref_ids[: len(out.token_ids)]
        if out.finish_reason == "stop":  # hit EOS: transformers stopped there too
            assert len(ref_ids) == len(out.token_ids)
    text = outs[0].text
    words = re.findall(r"[A-Za-z']+", text)
    assert len(words) >= 20
    common = {"the", "a", "and", "was", "to", "he", "she", "they", "it", "of", "her", "his", "with", "in", "said", "day"}
    assert sum(w.lower() in common for w in words) >= 5, text
    assert llm.engine.num_free_blocks_after_reset() == llm.engine.num_total_blocks

"""The gpt-fast peer of bench/gptfast_peer.py computes what our engine computes: on the same
weights its greedy tokens equal `engine.LLM`'s, so timing it against our batch-1 decode compares
equal work. CPU, eager (no torch.compile), tiny random Llama models at init 0.4."""
from __future__ import annotations

import pytest
import torch

from bench.gptfast_peer import GptFastLlama, PeerDecoder, load_peer
from engine import LLM, SamplingParams
from engine.config import ModelConfig

pytest.importorskip("transformers")

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    from engine.demo import make_random_model

    # llama3 RoPE scaling with an original context of 64, so positions past it use the scaled bands.
    return make_random_model(tmp_path_factory.mktemp("peer") / "llama3", "llama3", seed=3)


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in (1, 7, 33, 70)[:n]]


def test_greedy_tokens_equal_the_engine_on_checkpoint_weights(llama3_dir):
    prompts = _prompts(4, seed=11)
    llm = LLM(str(llama3_dir), num_kv_blocks=64, max_running=4)
    ours = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    model, config = load_peer(llama3_dir, torch.float32, "cpu")
    peer = PeerDecoder(model, config, max_seq_len=128, compile=False)
    for prompt, out in zip(prompts, ours):
        assert peer.generate(prompt, NEW_TOKENS) == out.token_ids
    assert len({t for o in ours for t in o.token_ids}) > 10  # varied tokens: a real comparison


def test_shares_the_engine_dummy_weights(tmp_path):
    """Dummy weights (the bench's 8B path, here at a tiny shape): the peer reads the very tensors
    our engine draws, and generates the engine's tokens on them."""
    from bench.h200_bench import write_model
    from engine.demo import tiny_config

    cfg = tiny_config("llama3", torch_dtype="float32", tie_word_embeddings=True)
    model_dir = write_model(tmp_path / "dummy", cfg)
    llm = LLM(str(model_dir), load_format="dummy", num_kv_blocks=64, max_running=2)
    peer = GptFastLlama.from_engine_model(llm.engine.model, ModelConfig.from_dir(model_dir))
    assert peer.output.weight.data_ptr() == llm.engine.model.embed_tokens.weight.data_ptr()  # tied, shared
    gate_up = llm.engine.model.layers[1].mlp.gate_up_proj.weight
    assert torch.equal(torch.cat([peer.layers[1].feed_forward.w1.weight, peer.layers[1].feed_forward.w3.weight]),
                       gate_up)
    # Dummy weights at std 0.02 give near-ties; scale every matrix so greedy tokens are decided
    # clearly (both models read the same storage, so both see the change).
    with torch.no_grad():
        for name, p in llm.engine.model.named_parameters():
            if "norm" not in name:
                p.mul_(20.0)
    decoder = PeerDecoder(peer, ModelConfig.from_dir(model_dir), max_seq_len=96, compile=False)
    prompts = _prompts(3, seed=5)
    ours = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, ours):
        assert decoder.generate(prompt, NEW_TOKENS) == out.token_ids


def test_refuses_what_it_cannot_run(tmp_path, llama3_dir):
    from engine.demo import make_random_model

    qwen3 = make_random_model(tmp_path / "qwen3", "qwen3")
    with pytest.raises(ValueError, match="qk_norm"):
        load_peer(qwen3, torch.float32, "cpu")
    model, config = load_peer(llama3_dir, torch.float32, "cpu")
    decoder = PeerDecoder(model, config, max_seq_len=16, compile=False)
    with pytest.raises(ValueError, match="max_seq_len"):
        decoder.generate(list(range(10)), 10)

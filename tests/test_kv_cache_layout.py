"""A KV cache stored head-major (EngineConfig.kv_cache_layout "hnd", engine/kv_cache.py): the same
indices as the default layout, each head's slots of a block together in memory; swapping and
an engine's tokens are the default's. The Triton kernels on it: tests/test_kernels.py
head_major_cache."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import KVCache


def config(layers: int = 2, kv_heads: int = 3, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=64, hidden_size=kv_heads * head_dim, intermediate_size=32,
                       num_layers=layers, num_heads=kv_heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       rms_norm_eps=1e-6, max_position_embeddings=128, rope_theta=10000.0, rope_scaling=None)


def test_head_major_storage_under_the_same_indices():
    cfg, blocks, bs = config(), 5, 16
    flat = KVCache(cfg, blocks, bs, torch.float32, torch.device("cpu"))
    head = KVCache(cfg, blocks, bs, torch.float32, torch.device("cpu"), layout="hnd")
    for (fk, fv), (hk, hv) in zip(flat.layers, head.layers):
        assert fk.shape == hk.shape == (blocks, bs, cfg.num_kv_heads, cfg.head_dim)
        assert fk.is_contiguous() and not hk.is_contiguous()
        # a head's slots of one block are one run: slot to slot is one head_dim, head to head a block's slots
        assert hk.stride() == (cfg.num_kv_heads * bs * cfg.head_dim, cfg.head_dim, bs * cfg.head_dim, 1)
        values = torch.randn(fk.shape)
        fk.copy_(values)
        hk.copy_(values)
        assert torch.equal(fk[3, 7, 2], hk[3, 7, 2]) and torch.equal(fk, hk)
    assert head.stacked.shape == (cfg.num_layers, 2, blocks, cfg.num_kv_heads, bs, cfg.head_dim)
    assert head.stacked.untyped_storage().nbytes() == flat.stacked.untyped_storage().nbytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
def test_swap_out_and_back_in(layout, dtype):
    cfg = config()
    cache = KVCache(cfg, 6, 16, dtype, torch.device("cpu"), num_host_blocks=4, layout=layout)
    for k, v in cache.layers:
        k.copy_(torch.randn(k.shape).to(dtype))
        v.copy_(torch.randn(v.shape).to(dtype))
    before = [(k[[1, 4]].clone(), v[[1, 4]].clone()) for k, v in cache.layers]
    cache.swap_out([1, 4], [2, 0])
    for k, v in cache.layers:
        k.zero_()
        v.zero_()
    cache.swap_in([2, 0], [5, 3])
    for (k, v), (k_was, v_was) in zip(cache.layers, before):
        assert torch.equal(k[[5, 3]].view(torch.uint8), k_was.view(torch.uint8))
        assert torch.equal(v[[5, 3]].view(torch.uint8), v_was.view(torch.uint8))
        assert k_was.float().abs().sum() > 0


def test_a_bad_layout_is_named(tiny_models):
    with pytest.raises(ValueError, match="kv_cache_layout"):
        EngineConfig(model_path=str(tiny_models["llama"]), kv_cache_layout="hdn")
    with pytest.raises(ValueError, match="kv_cache_layout"):
        KVCache(config(), 2, 16, torch.float32, torch.device("cpu"), layout="HND")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_engine_on_a_head_major_cache_gives_the_same_tokens(tiny_models, family):
    """Greedy tokens equal the default layout's: prompts that share a prefix (a cache hit) and a
    pool small enough that requests are preempted and resumed."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 256, (37,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 256, (3 + 5 * i,), generator=g).tolist() for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(num_kv_blocks=12, max_running=6, max_batched_tokens=64)
    want = [o.token_ids for o in LLM(tiny_models[family], **kw).generate(prompts, params)]
    head_major = LLM(tiny_models[family], kv_cache_layout="hnd", **kw)
    got = [o.token_ids for o in head_major.generate(prompts, params)]
    assert got == want
    assert head_major.engine.stats().num_preemptions > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_blocks_move_between_layouts_by_index(dtype):
    """A prefill worker's cache and a decode worker's may be stored differently: staging gathers
    blocks in index order ([n, block_size, kv_heads, head_dim]) and the sink writes them by index,
    so blocks land equal both ways. (A host cache not stored in index order is copied whole to
    stage from: head-major storage is for the GPU.)"""
    from kvtransfer.sinks import TensorKVSink
    from kvtransfer.staging import stage_layer, tensor_from_buffer

    cfg = config()
    flat = KVCache(cfg, 8, 16, dtype, torch.device("cpu"))
    head = KVCache(cfg, 8, 16, dtype, torch.device("cpu"), layout="hnd")
    for (k, v), _ in zip(flat.layers, head.layers):
        k.copy_(torch.randn(k.shape).to(dtype))
        v.copy_(torch.randn(v.shape).to(dtype))
    for src, dst in ((flat, head), (head, flat)):
        sink = TensorKVSink([k for k, _ in dst.layers], [v for _, v in dst.layers])
        for layer, (k, v) in enumerate(src.layers):
            staged = stage_layer(k, v, [6, 1, 3])
            got_k = tensor_from_buffer(memoryview(staged.k_bytes()), staged.dtype, staged.shape)
            got_v = tensor_from_buffer(memoryview(staged.v_bytes()), staged.dtype, staged.shape)
            sink.write(layer, [0, 7, 2], got_k, got_v)
            dk, dv = dst.layers[layer]
            assert torch.equal(dk[[0, 7, 2]].view(torch.uint8), k[[6, 1, 3]].view(torch.uint8))
            assert torch.equal(dv[[0, 7, 2]].view(torch.uint8), v[[6, 1, 3]].view(torch.uint8))

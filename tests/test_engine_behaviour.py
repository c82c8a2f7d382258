"""Engine behaviour through the offline API: prefix cache, preemption, sampling, stops, no leaks."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tandem.types import Tier

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


def random_prompts(n: int, lens, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


def assert_no_leak(llm: LLM) -> None:
    e = llm.engine
    assert not e.has_unfinished()
    assert e.stats().held == 0
    assert e.num_free_blocks_after_reset() == e.num_total_blocks


def test_prefix_cache_on_off_identical_and_reports_hits(model_dir):
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 256, (37,), generator=g).tolist()  # 2 full blocks + 5 tokens
    prompts = [shared + torch.randint(0, 256, (k,), generator=g).tolist() for k in (3, 9, 20)]
    on = LLM(model_dir, num_kv_blocks=64, enable_prefix_cache=True)
    off = LLM(model_dir, num_kv_blocks=64, enable_prefix_cache=False)
    first = on.generate(prompts[0], GREEDY)[0]
    assert first.cached_tokens == 0
    rest_on = on.generate(prompts[1:], GREEDY)
    rest_off = off.generate(prompts[1:], GREEDY)
    assert [o.token_ids for o in rest_on] == [o.token_ids for o in rest_off]
    assert off.generate(prompts[0], GREEDY)[0].token_ids == first.token_ids
    full_shared_blocks = len(shared) // 16
    for o in rest_on:
        assert o.cached_tokens >= full_shared_blocks * 16
    assert all(o.cached_tokens == 0 for o in rest_off)
    stats = on.engine.cache.stats()
    assert stats.hit_tokens > 0 and 0 < stats.hit_ratio < 1
    assert_no_leak(on)
    assert_no_leak(off)


def test_repeated_prompt_hits_cache_and_keeps_output(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64)
    prompt = random_prompts(1, [50], seed=11)[0]
    a = llm.generate(prompt, GREEDY)[0]
    b = llm.generate(prompt, GREEDY)[0]
    assert a.token_ids == b.token_ids
    assert b.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert_no_leak(llm)


@pytest.mark.parametrize("swap_space_gb", [0.0, 0.05], ids=["recompute", "swap"])
def test_preemption_keeps_outputs(model_dir, swap_space_gb):
    prompts = random_prompts(6, [20, 31, 40], seed=5)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    big = LLM(model_dir, num_kv_blocks=256)
    reference = [o.token_ids for o in big.generate(prompts, params)]
    # Each request needs up to 5 blocks by its end; 12 blocks cannot hold six at once.
    small = LLM(model_dir, num_kv_blocks=12, swap_space_gb=swap_space_gb, enable_prefix_cache=False)
    outs = small.generate(prompts, params)
    stats = small.engine.stats()
    assert stats.num_preemptions > 0
    if swap_space_gb:
        assert stats.num_swaps_out > 0
    else:
        assert stats.num_recomputes > 0
    assert [o.token_ids for o in outs] == reference
    assert_no_leak(small)
    host = small.engine._scheduler.host_allocator  # the scheduler's own state: no public view
    assert host is None or host.num_used == 0


def test_batch_tier_is_preempted_first(model_dir):
    llm = LLM(model_dir, num_kv_blocks=12, swap_space_gb=0.0, enable_prefix_cache=False)
    prompts = random_prompts(6, [20, 31, 40], seed=6)
    tiers = [Tier.BATCH, Tier.INTERACTIVE] * 3
    engine = llm.engine
    preempted: list[Tier] = []
    orig = engine._scheduler._preempt

    def spy(seq, out):
        preempted.append(seq.tier)
        return orig(seq, out)

    engine._scheduler._preempt = spy
    llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), tier=tiers)
    assert preempted and preempted[0] is Tier.BATCH
    assert preempted.count(Tier.BATCH) >= preempted.count(Tier.INTERACTIVE)
    assert_no_leak(llm)


def test_seeded_sampling_reproducible_and_topk1_is_greedy(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64)
    prompts = random_prompts(3, [10, 23], seed=8)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(prompts, sp)]
    b = [o.token_ids for o in llm.generate(prompts[::-1], sp)][::-1]  # other batch order
    assert a == b
    c = [o.token_ids for o in llm.generate(prompts, sp.replace(seed=99))]
    assert a != c
    greedy = [o.token_ids for o in llm.generate(prompts, GREEDY.replace(max_tokens=16))]
    topk1 = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.8, top_k=1, ignore_eos=True))]
    assert topk1 == greedy
    assert_no_leak(llm)


def test_stop_strings_cut_exactly(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64)
    prompt = "hello there"
    free = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]  # a stop string we know the greedy text contains
    cut = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    assert len(cut.token_ids) < len(free.token_ids)
    assert_no_leak(llm)


def test_stop_token_ids_and_max_tokens(model_dir):
    llm = LLM(model_dir, num_kv_blocks=64)
    prompt = random_prompts(1, [12], seed=9)[0]
    free = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    target = free.token_ids[5]
    stopped = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[target]))[0]
    first = free.token_ids.index(target)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == target
    later = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                stop_token_ids=[target], min_tokens=first + 2))[0]
    assert len(later.token_ids) > first + 1
    assert_no_leak(llm)


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0), ("top_k", -2),
     ("min_p", 2.0), ("repetition_penalty", 0.0), ("seed", -5), ("logprobs", 100), ("stop_token_ids", [100000])],
)
def test_invalid_params_name_the_field(model_dir, field, value):
    llm = LLM(model_dir, num_kv_blocks=16)
    with pytest.raises(ValueError, match=field):
        llm.generate("hi", SamplingParams(**{field: value}))
    assert_no_leak(llm)


def test_invalid_prompts_name_the_field(model_dir):
    llm = LLM(model_dir, num_kv_blocks=16)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2, 999]])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=400))  # 16 blocks of 16 cannot hold it
    with pytest.raises(ValueError, match="block_size"):
        LLM(model_dir, block_size=24)
    assert_no_leak(llm)


def test_logprobs_match_log_softmax_of_greedy_choice(model_dir):
    llm = LLM(model_dir, num_kv_blocks=16)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok
        assert lp.top[0][0] == tok and abs(lp.top[0][1] - lp.logprob) < 1e-6
        assert len(lp.top) == 3 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_mixed_batches_send_one_token_sequences_to_the_decode_kernel(model_dir, monkeypatch):
    """A step that decodes some sequences while prefilling others runs the decodes through the
    decode kernel and the chunks through extend attention; the tokens equal those of running
    the whole mixed batch through extend attention."""
    import engine.attention as attention
    from tandem_kernels import ops

    prompts = random_prompts(6, [40, 7, 23, 61, 5, 33], seed=5)
    params = [GREEDY.replace(max_tokens=6 + 3 * i) for i in range(6)]

    def run() -> list[list[int]]:
        llm = LLM(model_dir, num_kv_blocks=128, max_batched_tokens=24, max_running=6)
        outs = llm.generate(prompts, params)
        assert_no_leak(llm)
        return [o.token_ids for o in outs]

    seen: list[int] = []
    split_attend = attention.attend

    def recording(q, k_cache, v_cache, meta, scale, new_kv=None):
        if not meta.is_decode:
            seen.append(meta.num_decode_seqs)
        return split_attend(q, k_cache, v_cache, meta, scale, new_kv)

    monkeypatch.setattr("engine.model.attend", recording)
    split = run()
    assert any(n > 0 for n in seen), "no mixed step had leading one-token sequences"

    def all_extend(q, k_cache, v_cache, meta, scale, new_kv=None):
        if meta.is_decode:
            return split_attend(q, k_cache, v_cache, meta, scale, new_kv)
        return ops.extend_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                    scale, meta.k_scale, meta.v_scale, new_kv=new_kv)

    monkeypatch.setattr("engine.model.attend", all_extend)
    assert run() == split


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "glm4"])
def test_fused_decode_gemvs_keep_the_tokens(tiny_models, family, monkeypatch):
    """With fused_decode_gemv, all four projections fused and steps of up to three tokens
    fusing, decode steps run each layer as four fused GEMVs (norms and SiLU folded in); tokens
    equal the unfused engine's (q/k norms, qkv bias and sandwich norms included)."""
    prompts = random_prompts(3, [9, 30, 17], seed=7)
    plain = LLM(tiny_models[family], num_kv_blocks=64)
    monkeypatch.setenv("TANDEM_FUSED_GEMV", "qkv,o_proj,gate_up,down")
    monkeypatch.setenv("TANDEM_FUSED_GEMV_ROWS", "3")
    fused = LLM(tiny_models[family], num_kv_blocks=64, fused_decode_gemv=True)
    layers = fused.engine.model.layers
    assert all(len(layer.fused_decode) == 4 and layer.fused_rows == 3 for layer in layers)
    for n in (1, 3):  # a batch of one and a batch of three
        want = [o.token_ids for o in plain.generate(prompts[:n], GREEDY)]
        assert [o.token_ids for o in fused.generate(prompts[:n], GREEDY)] == want
    assert_no_leak(fused)


@pytest.mark.parametrize("projections", [("qkv",), ("qkv", "o_proj"), ("o_proj", "down"), ("gate_up",)])
def test_some_projections_fused_keep_the_tokens(tiny_models, monkeypatch, projections):
    """TANDEM_FUSED_GEMV fuses only the projections it names; the others run their unfused ops
    in the same layer, and the tokens stay the unfused engine's (qwen3: q/k norms, qkv bias)."""
    prompts = random_prompts(3, [9, 30, 17], seed=11)
    want = [o.token_ids for o in LLM(tiny_models["qwen3"], num_kv_blocks=64).generate(prompts, GREEDY)]
    monkeypatch.setenv("TANDEM_FUSED_GEMV", ",".join(projections))
    fused = LLM(tiny_models["qwen3"], num_kv_blocks=64, fused_decode_gemv=True)
    assert all(layer.fused_decode == frozenset(projections) for layer in fused.engine.model.layers)
    assert [o.token_ids for o in fused.generate(prompts, GREEDY)] == want


def test_fused_gemv_names_a_bad_projection(tiny_models, monkeypatch):
    monkeypatch.setenv("TANDEM_FUSED_GEMV", "qkv,mlp")
    with pytest.raises(ValueError, match="TANDEM_FUSED_GEMV"):
        LLM(tiny_models["llama"], num_kv_blocks=64, fused_decode_gemv=True)


@pytest.mark.parametrize("rows", ["0", "9", "two"])
def test_fused_gemv_rows_names_a_bad_value(tiny_models, monkeypatch, rows):
    monkeypatch.setenv("TANDEM_FUSED_GEMV_ROWS", rows)
    with pytest.raises(ValueError, match="TANDEM_FUSED_GEMV_ROWS"):
        LLM(tiny_models["llama"], num_kv_blocks=64, fused_decode_gemv=True)


def test_fused_decode_gemv_defaults(tiny_models):
    """By default (fused_decode_gemv None) a CPU engine fuses nothing; asked to, it fuses all four
    projections in steps of one token, and a step of two tokens runs them unfused."""
    from engine.attention import AttentionMetadata

    assert not any(layer.fused_decode for layer in LLM(tiny_models["llama"], num_kv_blocks=64).engine.model.layers)
    layer = LLM(tiny_models["llama"], num_kv_blocks=64, fused_decode_gemv=True).engine.model.layers[0]
    assert layer.fused_decode == frozenset({"qkv", "o_proj", "gate_up", "down"}) and layer.fused_rows == 1
    meta = AttentionMetadata(*(torch.zeros(1, dtype=torch.int32),) * 4, is_decode=True)
    assert layer.fused_projections(torch.zeros(1, 8), meta) == layer.fused_decode
    assert layer.fused_projections(torch.zeros(2, 8), meta) == frozenset()


def test_fused_decode_gemvs_by_gpu(monkeypatch):
    """Which projections fuse by default, and their tiles, follow the GPU's name: an H100 all
    four, an H200 o_proj and down (at their own tiles), a GPU not measured none; True fuses all
    four anywhere (unmeasured GPUs at the fallback tiles), TANDEM_FUSED_GEMV names replace both."""
    from engine import model
    from tandem_kernels import gemv_tilings as gt

    assert gt.device_tilings("NVIDIA H100 80GB HBM3") is gt.DEVICE_TILINGS["H100"]
    assert gt.device_tilings("NVIDIA H200") is gt.DEVICE_TILINGS["H200"]
    assert gt.device_tilings("NVIDIA A100-SXM4-80GB") == {} and gt.device_tilings("") == {}
    assert frozenset(gt.DEVICE_TILINGS["H100"]) == frozenset(model.GEMV_PROJECTIONS)
    assert frozenset(gt.DEVICE_TILINGS["H200"]) == {"o_proj", "down"}
    assert gt.default_fused_projections(torch.device("cpu")) == frozenset()
    assert gt.tiling_for("down", "cpu") == gt.FALLBACK_TILINGS["down"]
    monkeypatch.setattr(gt, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert gt.tiling_for("down", "cuda") == gt.DEVICE_TILINGS["H100"]["down"] != gt.FALLBACK_TILINGS["down"]
    # FP8 weights: all four fused on the H100 (at their own tiles), none where no FP8 tiles were measured
    cuda = torch.device("cuda", 0)
    assert model.fused_decode_projections(None, cuda, fp8_weights=True) == frozenset(model.GEMV_PROJECTIONS)
    assert gt.tiling_for("down", "cuda", fp8=True) == gt.FP8_DEVICE_TILINGS["H100"]["down"] != gt.tiling_for("down", "cuda")
    # ... and at up to four rows there, from three rows at the several-row tiles; bf16 at one
    assert gt.default_fused_rows(cuda, fp8=True) == 4 and gt.default_fused_rows(cuda) == 1
    assert model.fused_gemv_rows(gt.default_fused_rows(cuda, fp8=True)) == 4
    from_rows, several = gt.FP8_SEVERAL_ROW_TILINGS["H100"]
    for projection in model.GEMV_PROJECTIONS:
        one_row = gt.FP8_DEVICE_TILINGS["H100"][projection]
        assert gt.tiling_for(projection, cuda, fp8=True, rows=from_rows - 1) == one_row
        assert gt.tiling_for(projection, cuda, fp8=True, rows=from_rows) == several[projection] != one_row
    assert gt.tiling_for("qkv", cuda, fp8=True, rows=4).separate_norm
    assert gt.tiling_for("qkv", cuda, rows=4) == gt.DEVICE_TILINGS["H100"]["qkv"]  # bf16: one table
    monkeypatch.setenv(model.FUSED_GEMV_ROWS_ENV, "3")
    assert model.fused_gemv_rows(2) == 3
    monkeypatch.delenv(model.FUSED_GEMV_ROWS_ENV)
    monkeypatch.setattr(gt, "device_name", lambda device: "NVIDIA H200")
    assert gt.tiling_for("qkv", "cuda") == gt.FALLBACK_TILINGS["qkv"]  # not fused there by default
    assert model.fused_decode_projections(None, cuda, fp8_weights=True) == frozenset()
    assert gt.default_fused_rows(cuda, fp8=True) == 1 == gt.default_fused_rows(torch.device("cpu"), fp8=True)
    assert gt.tiling_for("down", "cuda", fp8=True) == gt.tiling_for("down", "cuda")  # the bf16 tile, if asked
    assert model.fused_decode_projections(None, cuda) == {"o_proj", "down"}
    assert model.fused_decode_projections(None, torch.device("cpu")) == frozenset()
    assert model.fused_decode_projections(True, torch.device("cpu")) == frozenset(model.GEMV_PROJECTIONS)
    assert model.fused_decode_projections(False, cuda) == frozenset()
    monkeypatch.setattr(gt, "device_name", lambda device: "NVIDIA L40S")
    assert model.fused_decode_projections(None, cuda) == frozenset()
    monkeypatch.setenv(model.FUSED_GEMV_ENV, "qkv")
    assert model.fused_decode_projections(None, cuda) == {"qkv"} == model.fused_decode_projections(True, cuda)
    assert model.fused_decode_projections(False, cuda) == frozenset()

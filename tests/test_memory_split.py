"""A prefill worker's share of a GPU it shares with a decode worker, from what it needs
(entrypoints.memory_split): the need adds up what the worker's memory plan takes, the ratio
gives the prefill worker exactly that share through the placement, and `tandem up` uses it when
it can read the GPU's size from nvidia-smi (here a stand-in script on PATH: no GPU on CI) and
the fixed ratio otherwise or when --prefill-memory-ratio is given."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from bench.h200_bench import LLAMA31_8B
from engine.config import ModelConfig
from engine.memory import NON_TORCH_BYTES, SAMPLER_BYTES_PER_LOGIT, estimate_step
from entrypoints.memory_split import CUDA_VISIBLE_SHARE, MARGIN_BYTES, prefill_memory_ratio, prefill_need_bytes
from entrypoints.nvidia_smi import parse_compute_cap, parse_memory_mib
from entrypoints.placement import MIN_PREFILL_MEMORY_RATIO, SHARED_PREFILL_MAX_MODEL_LEN, place
from worker.config import PREFILL_GRAPH_TOKENS

GiB = 1 << 30
H200_MIB = 143771


def _need(**kw) -> int:
    args = {"dtype": torch.bfloat16, "kv_cache_dtype": "auto", "max_model_len": None, "max_batched_tokens": 4096, **kw}
    return prefill_need_bytes(ModelConfig.from_dict(LLAMA31_8B), **args)


def test_the_need_covers_weights_one_longest_request_and_a_step() -> None:
    mc = ModelConfig.from_dict(LLAMA31_8B)
    weights = mc.num_params() * 2
    kv_per_token = 2 * mc.num_layers * mc.kv_size * 2  # K and V, every layer, bf16: 128 KiB
    assert kv_per_token == 128 << 10
    need = _need()
    floor = weights + (131072 + 4096) * kv_per_token + NON_TORCH_BYTES + MARGIN_BYTES
    # Plus a step's activations and sampler rows, both for the sequences the KV derives (135,168
    # tokens over 2,048 a sequence: 66), as the worker plans them (engine.memory.fitted_batch).
    row = mc.vocab_size * SAMPLER_BYTES_PER_LOGIT
    logits_row = estimate_step(mc, torch.bfloat16, 4096, 512).per_row
    assert floor + 66 * row + GiB < need < floor + 66 * row + 2.5 * GiB
    assert _need(max_running=66) == need  # the rows derived, as if given
    assert _need(max_running=512) == need + (512 - 66) * (row + logits_row)  # not the device's ceiling
    assert _need(max_model_len=8192) == need - (131072 - 8192) * kv_per_token - (66 - 6) * (row + logits_row)
    assert _need(max_model_len=10**7) == need  # capped at the model's context
    assert need - _need(kv_cache_dtype="fp8") == pytest.approx((131072 + 4096) * kv_per_token / 2, rel=0.01)
    assert _need(tp=2) < need / 2 + 3 * GiB  # each rank holds half the weights and half the KV heads
    # prefill graphs: their pool holds a step of that many tokens' activations, plus each graph
    with_graphs = _need(prefill_graph_tokens=2048)
    assert need + 0.2 * GiB < with_graphs < need + 3 * GiB
    assert _need(prefill_graph_tokens=2048, tp=2) == _need(tp=2)  # tensor-parallel workers capture none


@pytest.mark.parametrize("prefills,decodes", [(1, 1), (2, 1), (1, 2)])
def test_the_ratio_gives_each_prefill_worker_its_need(prefills: int, decodes: int) -> None:
    gpu = H200_MIB << 20
    need = _need()
    ratio = prefill_memory_ratio(need, gpu, 0.9, prefills, decodes)
    pl = place([0], prefill=prefills, decode=decodes, prefill_memory_ratio=ratio)
    for w in pl.workers:
        share = w.memory_fraction * gpu * CUDA_VISIBLE_SHARE
        if w.role == "prefill":
            assert share == pytest.approx(need, abs=gpu * 5e-5)  # shares are rounded to 4 decimals
        else:
            assert share > need / (1 if prefills == 1 else 2)
    assert sum(w.memory_fraction for w in pl.workers) == pytest.approx(0.9, abs=3e-4)


def test_the_ratio_is_clamped() -> None:
    gpu = 80 * GiB
    assert prefill_memory_ratio(60 * GiB, gpu, 0.9) == 1.0  # never more than a decode worker's share
    assert prefill_memory_ratio(200 * GiB, gpu, 0.9) == 1.0
    assert prefill_memory_ratio(1 << 20, gpu, 0.9) == MIN_PREFILL_MEMORY_RATIO


def test_nvidia_smi_output_is_parsed_or_refused() -> None:
    assert parse_memory_mib("143771\n") == H200_MIB << 20
    assert parse_memory_mib("81559\n81559\n") == 81559 << 20
    for bad in ("", "[N/A]", "0", "-5", "12.5"):
        assert parse_memory_mib(bad) is None
    assert parse_compute_cap("9.0\n") == (9, 0) and parse_compute_cap("8.9\n8.0\n") == (8, 9)
    assert parse_compute_cap("10.0") == (10, 0) > (8, 9)
    for bad in ("", "[N/A]", "9", "9.", ".0", "x.y"):
        assert parse_compute_cap(bad) is None


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "llama31-8b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA31_8B))
    return d


@pytest.fixture
def nvidia_smi(tmp_path: Path, monkeypatch) -> Path:
    """An `nvidia-smi` on PATH that answers the memory query as an H200 does and logs its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'smi.log'}\necho {H200_MIB}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "smi.log"


def test_tandem_up_gives_the_prefill_worker_what_it_needs(model_dir: Path, nvidia_smi: Path, monkeypatch) -> None:
    from entrypoints import launcher
    from entrypoints.launcher import placement_for
    from entrypoints.up_flags import parse_args

    monkeypatch.setattr(launcher, "gpu_can_share_memory", lambda gpu: True)

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    # A prefill worker of the model's whole context, with weights of its own.
    whole = ["--no-share-weights", "--prefill-max-model-len", "131072"]
    own = placement_for(parse_args(whole), visible=1, model=str(model_dir))
    assert "-i 3" in nvidia_smi.read_text()  # the physical GPU, as the workers will see it
    pre, dec = own.worker("prefill-0").memory_fraction, own.worker("decode-0").memory_fraction
    need = _need(prefill_graph_tokens=PREFILL_GRAPH_TOKENS)  # the worker's default graphs
    assert pre * (H200_MIB << 20) * CUDA_VISIBLE_SHARE == pytest.approx(need, abs=(H200_MIB << 20) * 5e-5)
    assert pre + dec == pytest.approx(0.9, abs=2e-4) and 0.6 < dec < 0.7  # §11: 60% with the fixed ratio
    # By default the two share one copy of the weights, charged to the decode worker: the prefill
    # worker's share holds none of them.
    one = placement_for(parse_args(whole[1:]), visible=1, model=str(model_dir))
    pre_one = one.worker("prefill-0").memory_fraction
    need_one = _need(prefill_graph_tokens=PREFILL_GRAPH_TOKENS, shared_weights=True)
    assert pre_one * (H200_MIB << 20) * CUDA_VISIBLE_SHARE == pytest.approx(need_one, abs=(H200_MIB << 20) * 5e-5)
    assert pre_one + one.worker("decode-0").memory_fraction == pytest.approx(0.9, abs=2e-4) and pre_one < pre - 0.1
    # By default a prefill worker sharing the GPU takes prompts of up to SHARED_PREFILL_MAX_MODEL_LEN
    # tokens (the decode worker prefills longer ones): its share holds KV for that, not 131,072.
    default = placement_for(parse_args([]), visible=1, model=str(model_dir))
    need_default = _need(prefill_graph_tokens=PREFILL_GRAPH_TOKENS, shared_weights=True,
                         max_model_len=SHARED_PREFILL_MAX_MODEL_LEN)
    assert default.worker("prefill-0").memory_fraction * (H200_MIB << 20) * CUDA_VISIBLE_SHARE \
        == pytest.approx(need_default, abs=(H200_MIB << 20) * 5e-5)
    assert default.worker("decode-0").memory_fraction > one.worker("decode-0").memory_fraction + 0.05
    mine = placement_for(parse_args(["--prefill-max-model-len", "8192"]), visible=1, model=str(model_dir))
    assert mine.worker("decode-0").memory_fraction > default.worker("decode-0").memory_fraction
    short = placement_for(parse_args(["--max-model-len", "8192", "--no-share-weights"]), visible=1, model=str(model_dir))
    assert short.worker("decode-0").memory_fraction > dec + 0.05
    assert short.worker("decode-0").memory_fraction == pytest.approx(  # 8,192 is below the cap: the cluster's
        placement_for(parse_args(["--max-model-len", "8192", "--prefill-max-model-len", "8192", "--no-share-weights"]),
                      visible=1, model=str(model_dir)).worker("decode-0").memory_fraction)
    fixed = placement_for(parse_args(["--prefill-memory-ratio", "0.5"]), visible=1, model=str(model_dir))
    assert fixed.worker("decode-0").memory_fraction == pytest.approx(0.6)
    apart = placement_for(parse_args([]), visible=2, model=str(model_dir))  # nothing shared: nothing to derive
    assert apart.worker("decode-0").memory_fraction == apart.worker("prefill-0").memory_fraction == 0.9
    assert len(nvidia_smi.read_text().splitlines()) == 1  # asked once for the GPU, however often it is sized


def test_without_nvidia_smi_the_fixed_ratio_stays(model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from entrypoints.launcher import placement_for
    from entrypoints.up_flags import parse_args

    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi here
    pl = placement_for(parse_args([]), visible=1, model=str(model_dir))
    assert pl.worker("prefill-0").memory_fraction == pytest.approx(0.3)
    assert pl.worker("decode-0").memory_fraction == pytest.approx(0.6)


def test_a_model_that_cannot_be_read_keeps_the_fixed_ratio(tmp_path: Path, nvidia_smi: Path) -> None:
    """The workers name what is wrong with the model; placement does not fail on it first."""
    from entrypoints.launcher import placement_for
    from entrypoints.up_flags import parse_args

    empty = tmp_path / "empty"
    empty.mkdir()
    pl = placement_for(parse_args([]), visible=1, model=str(empty))
    assert pl.worker("prefill-0").memory_fraction == pytest.approx(0.3)


H100_MIB = 81559


def test_tandem_up_fits_the_context_to_a_gpu_that_cannot_hold_the_models(model_dir: Path, tmp_path: Path,
                                                                          monkeypatch) -> None:
    """Given no --max-model-len, --no-share-weights and a prefill worker of the whole context,
    `tandem up` on one 80 GB H100 halves Llama-3.1-8B's 131,072-token context until a prefill and
    a decode worker sharing the GPU can each hold a request of it (65,536), and the placement
    then gives the decode worker room for one; with one copy of the weights (the default), a
    prefill worker of a shorter context (the default), on an H200, with --max-model-len, or with
    nothing shared, it keeps what it was given."""
    from entrypoints import launcher
    from entrypoints.launcher import fitted_max_model_len, placement_for
    from entrypoints.up_flags import parse_args
    from entrypoints.memory_split import DECODE_GRAPH_BYTES

    monkeypatch.setattr(launcher, "gpu_can_share_memory", lambda gpu: True)

    def smi(mib: int) -> None:
        bin_dir = tmp_path / f"bin{mib}"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {mib}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")

    smi(H100_MIB)
    assert fitted_max_model_len(parse_args([]), str(model_dir), visible=1) is None  # one copy: it fits
    # A prefill worker of SHARED_PREFILL_MAX_MODEL_LEN (the default) leaves the decode worker room
    # for one request of the whole context even with two copies.
    assert fitted_max_model_len(parse_args(["--no-share-weights"]), str(model_dir), visible=1) is None
    a = parse_args(["--no-share-weights", "--prefill-max-model-len", "131072"])
    assert fitted_max_model_len(a, str(model_dir), visible=1) == 65536
    a.max_model_len = a.prefill_max_model_len = 65536
    decode = placement_for(a, visible=1, model=str(model_dir)).worker("decode-0").memory_fraction
    room = decode * (H100_MIB << 20) * CUDA_VISIBLE_SHARE
    assert room >= _need(max_model_len=65536) + DECODE_GRAPH_BYTES  # one request of it, and its step
    budget = 0.9 * (H100_MIB << 20) * CUDA_VISIBLE_SHARE  # the whole context would not have fit both
    assert _need(prefill_graph_tokens=PREFILL_GRAPH_TOKENS) + _need() + DECODE_GRAPH_BYTES > budget
    assert fitted_max_model_len(parse_args(["--max-model-len", "131072", "--no-share-weights"]), str(model_dir),
                                visible=1) is None
    whole = ["--no-share-weights", "--prefill-max-model-len", "131072"]
    assert fitted_max_model_len(parse_args(whole), str(model_dir), visible=2) is None  # a GPU each
    assert fitted_max_model_len(parse_args(["--colocated", "--no-share-weights"]), str(model_dir), visible=1) is None
    smi(H200_MIB)
    assert fitted_max_model_len(parse_args(whole), str(model_dir), visible=1) is None


def test_shared_weights_leave_the_prefill_worker_no_weights_and_the_decode_worker_more(model_dir: Path,
                                                                                      tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """With one copy of the weights (the default on a GPU) the prefill worker's need holds no
    weights, the decode worker's share grows by them, and on an 80 GB H100 Llama-3.1-8B's whole
    context fits the pair again."""
    from entrypoints.launcher import fitted_max_model_len, placement_for
    from entrypoints.up_flags import parse_args

    mc = ModelConfig.from_dict(LLAMA31_8B)
    assert _need() - _need(shared_weights=True) == mc.num_params() * 2
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {H100_MIB}\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert fitted_max_model_len(parse_args(["--share-weights"]), str(model_dir), visible=1) is None
    a = parse_args(["--max-model-len", "65536", "--no-share-weights"])
    b = parse_args(["--max-model-len", "65536", "--share-weights"])
    own = placement_for(a, visible=1, model=str(model_dir)).worker("decode-0").memory_fraction
    shared = placement_for(b, visible=1, model=str(model_dir)).worker("decode-0").memory_fraction
    gained = (shared - own) * (H100_MIB << 20) * CUDA_VISIBLE_SHARE
    assert gained == pytest.approx(mc.num_params() * 2, rel=1e-3)  # the prefill worker's copy, now K/V


def test_fp8_weights_count_a_byte_for_each_projection_weight(tiny_models) -> None:
    """engine.memory.weight_bytes with fp8: the bytes the quantized model's parameters take
    (e4m3 projections, a float32 scale per output channel), against the bf16 model's, for every
    family (num_params leaves out biases and q/k norms: the difference is what is compared)."""
    from engine.memory import weight_bytes
    from engine.weights import model_without_weights

    def held(config: ModelConfig, quantization: str | None) -> int:
        model = model_without_weights(config, torch.bfloat16, quantization=quantization)
        return sum(p.numel() * p.element_size() for p in model.parameters())

    for family, path in tiny_models.items():
        config = ModelConfig.from_dir(path)
        saved = weight_bytes(config, torch.bfloat16) - weight_bytes(config, torch.bfloat16, fp8=True)
        assert saved == held(config, None) - held(config, "fp8") > 0, family
    llama = ModelConfig.from_dir(tiny_models["llama"])
    assert weight_bytes(llama, torch.bfloat16, fp8=True) == held(llama, "fp8")
    mc = ModelConfig.from_dict(LLAMA31_8B)  # 16.1 GB in bf16, 9.1 with e4m3 projections
    assert 9.0e9 < weight_bytes(mc, torch.bfloat16, fp8=True) < 9.2e9 < 16e9 < weight_bytes(mc, torch.bfloat16)


def test_tandem_up_sizes_fp8_weights_as_e4m3(model_dir: Path, nvidia_smi: Path, tmp_path: Path, monkeypatch) -> None:
    """`tandem up --quantization fp8` (or an FP8 checkpoint, without the flag) sizes the prefill
    worker's own copy of the weights, and the decode worker's shared one, at their e4m3 size."""
    from engine.memory import weight_bytes
    from entrypoints import launcher
    from entrypoints.launcher import placement_for
    from entrypoints.up_flags import parse_args

    monkeypatch.setattr(launcher, "gpu_can_share_memory", lambda gpu: True)
    mc = ModelConfig.from_dict(LLAMA31_8B)
    saved = weight_bytes(mc, torch.bfloat16) - weight_bytes(mc, torch.bfloat16, fp8=True)
    gpu = (H200_MIB << 20) * CUDA_VISIBLE_SHARE

    def prefill_share(model: Path, *flags: str) -> float:
        return placement_for(parse_args(list(flags)), visible=1, model=str(model)).worker("prefill-0").memory_fraction

    bf16 = prefill_share(model_dir, "--no-share-weights")
    fp8 = prefill_share(model_dir, "--no-share-weights", "--quantization", "fp8")
    assert (bf16 - fp8) * gpu == pytest.approx(saved, abs=gpu * 2e-4)
    checkpoint = tmp_path / "llama31-8b-fp8"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(
        {**LLAMA31_8B, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}))
    assert prefill_share(checkpoint, "--no-share-weights") == fp8
    # One shared copy: the prefill worker holds none either way, so its share is the same.
    assert prefill_share(model_dir, "--quantization", "fp8") == prefill_share(model_dir)

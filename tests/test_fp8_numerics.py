"""FP8 weights on the CPU reference path: the rewritten model computes exactly the float32
emulation of W8A8 (per-channel weight scales, per-token activation scales), stays within a
stated tolerance of the unquantized model, and FP8 checkpoints of every supported format load.

Models: the tiny random models of tests/conftest.py (init 0.4, so tokens vary and the top
logits do not tie). Such a model amplifies perturbations far more than a trained one (bf16
alone moves its logits ~4% where e4m3's 3 mantissa bits move them ~30%), so the tolerances
against the unquantized model below are loose; the emulation test is the tight one.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine import LLM, EngineConfig, SamplingParams
from engine.quant.fp8 import (DEFERRED_MAX_ROWS, DEFERRED_SCALES_ENV, Fp8Linear, Fp8Product, Fp8RMSNorm,
                              convert_to_fp8, quantize_weight_per_channel)
from engine.scheduler import ScheduledSeq, SchedulerOutput
from engine.sequence import Sequence
from tandem_kernels import reference as ref

pytest.importorskip("transformers")

# Stated tolerances (see the module docstring for why they are loose on these models).
LOGIT_REL_TOL = 0.5  # ||fp8 - unquantized|| / ||unquantized|| over all prompt positions
FIRST_TOKEN_AGREEMENT = 0.55  # greedy first token equal on at least this share of prompts
EMULATION_REL_TOL = 2e-3  # fp8 model vs its float32 emulation: summation order, and the rare e4m3
# rounding it flips (fp8 vs unquantized is ~0.3 on these models)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(4, 50, (n,), generator=g)]


def prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits at every position of `prompt`, one prefill through the engine's model and cache."""
    engine = llm.engine
    seq = Sequence("probe", prompt, SamplingParams(temperature=0))
    seq.block_table = list(range(-(-len(prompt) // engine.config.block_size)))
    batch = engine.runner.prepare(SchedulerOutput([ScheduledSeq(seq, len(prompt))]))
    with torch.no_grad():
        return engine.model.logits(engine.model(batch.input_ids, batch.positions, engine.kv_cache.layers, batch.meta))


def projections(model) -> list[nn.Module]:
    return [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]


def emulate_fp8(model) -> None:
    """Turn a float32 model into the float32 emulation of W8A8: dequantized per-channel weights,
    each projection's input rounded through per-token e4m3 and back."""
    def fake_quant(_module, args):
        q, scale = ref.quantize_fp8_per_token(args[0])
        return ((q.float() * scale).to(args[0].dtype),)

    for m in projections(model):
        q, scale = quantize_weight_per_channel(m.weight.data)
        m.weight.data = q.float() * scale[:, None]
        m.register_forward_pre_hook(fake_quant)


@pytest.mark.parametrize("family", ["llama", "qwen2", "glm4"])
def test_fp8_model_is_its_float32_emulation(family, tiny_models):
    fp8 = LLM(tiny_models[family], num_kv_blocks=64, quantization="fp8")
    layer = fp8.engine.model.layers[0]
    assert all(isinstance(m, Fp8Linear) and m.weight.dtype == torch.float8_e4m3fn for m in projections(fp8.engine.model))
    assert isinstance(layer.input_layernorm, Fp8RMSNorm) and isinstance(layer.post_attention_layernorm, Fp8RMSNorm)
    emulated = LLM(tiny_models[family], num_kv_blocks=64)
    emulate_fp8(emulated.engine.model)
    for p in prompts(4, seed=3):
        got, want = prefill_logits(fp8, p), prefill_logits(emulated, p)
        assert ((got - want).norm() / want.norm()).item() < EMULATION_REL_TOL


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp8_logits_and_greedy_tokens_near_unquantized(family, tiny_models):
    plain = LLM(tiny_models[family], num_kv_blocks=128)
    fp8 = LLM(tiny_models[family], num_kv_blocks=128, quantization="fp8")
    ps = prompts(40, seed=11)
    errs = []
    for p in ps[:8]:
        a, b = prefill_logits(plain, p), prefill_logits(fp8, p)
        errs.append(((a - b).norm() / a.norm()).item())
    assert max(errs) < LOGIT_REL_TOL, errs
    assert min(errs) > 1e-4  # the weights really are quantized
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want, got = plain.generate(ps, params), fp8.generate(ps, params)
    same = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(want, got))
    assert same >= FIRST_TOKEN_AGREEMENT * len(ps), f"{same}/{len(ps)} first tokens agree"
    assert len({t for o in got for t in o.token_ids}) > 20  # varied output, not one repeated token
    assert fp8.engine.num_free_blocks_after_reset() == fp8.engine.num_total_blocks


@pytest.mark.parametrize("family", ["llama", "glm4"])
def test_scales_are_deferred_where_our_kernels_read_the_output(family, tiny_models, monkeypatch):
    """o_proj, gate_up and down_proj hand their unscaled product to the norm / activation after
    them, which apply the scales; not qkv, not the last down_proj (the final norm is not FP8), not
    where a sandwich norm (GLM-4) reads the output. The logits are those of the scaled GEMMs."""
    monkeypatch.setenv(DEFERRED_SCALES_ENV, "1")
    fp8 = LLM(tiny_models[family], num_kv_blocks=64, quantization="fp8")
    model = fp8.engine.model
    n = len(model.layers)
    deferring = {name for name, m in model.named_modules() if isinstance(m, Fp8Linear) and m.defers_scales}
    readers = ("mlp.gate_up_proj",) if family == "glm4" else ("self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    assert deferring == {f"layers.{i}.{r}" for i in range(n) for r in readers} - {f"layers.{n - 1}.mlp.down_proj"}
    products = []
    for m in projections(model):
        m.register_forward_hook(lambda _m, _a, out: products.append(isinstance(out, Fp8Product)))
    monkeypatch.delenv(DEFERRED_SCALES_ENV)  # the default: every projection applies its own scales
    scaled = LLM(tiny_models[family], num_kv_blocks=64, quantization="fp8")
    assert not any(m.defers_scales for m in projections(scaled.engine.model))
    for p in prompts(3, seed=5):
        got, want = prefill_logits(fp8, p), prefill_logits(scaled, p)
        assert ((got - want).norm() / want.norm()).item() < EMULATION_REL_TOL
    assert sum(products) == 3 * len(deferring)  # every deferring projection handed on a product
    # Above DEFERRED_MAX_ROWS rows the projection applies its own scales.
    x = torch.randn(DEFERRED_MAX_ROWS + 1, model.layers[0].mlp.gate_up_proj.in_features)
    assert isinstance(model.layers[0].mlp.gate_up_proj(x), torch.Tensor)


def test_quantization_field_and_flag_are_validated(tiny_models):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model_path="m", quantization="int4")
    from worker.config import build_parser, config_from_args

    args = build_parser("decode").parse_args(["--model", str(tiny_models["llama"]), "--quantization", "fp8"])
    assert config_from_args(args, "decode").engine.quantization == "fp8"
    with pytest.raises(SystemExit):
        build_parser("decode").parse_args(["--model", "m", "--quantization", "int8"])


def test_fp8_is_refused_naming_the_flag_on_gpus_without_e4m3(monkeypatch):
    """An A100 (8.0) cannot build the e4m3 kernels: the flag that asked for FP8 is named before
    anything loads; Ada / Hopper (8.9 / 9.0) and CPUs (the references) pass."""
    from tandem_kernels import ops

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(ops, "_capability", lambda index: (8, 0))
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8\): FP8 \(e4m3\) needs .* 8\.9 or newer.* is 8\.0"):
        ops.require_fp8_device(gpu, "kv_cache_dtype 'fp8' (--kv-cache-dtype fp8)")
    for cap in ((8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(ops, "_capability", lambda index, cap=cap: cap)
        ops.require_fp8_device(gpu, "quantization 'fp8' (--quantization fp8)")
    monkeypatch.setattr(ops, "_capability", lambda index: (7, 5))
    ops.require_fp8_device(torch.device("cpu"), "quantization 'fp8' (--quantization fp8)")


def test_tensor_parallel_projections_are_refused_naming_the_flag(tiny_models):
    from parallel.layers import ColumnParallelLinear

    llm = LLM(tiny_models["llama"], num_kv_blocks=16)
    attn = llm.engine.model.layers[0].self_attn
    attn.qkv_proj = ColumnParallelLinear.from_linear(attn.qkv_proj, [(0, attn.qkv_proj.out_features)])
    with pytest.raises(ValueError, match="--tp"):
        convert_to_fp8(llm.engine.model)


# ---- FP8 checkpoints as users have them ------------------------------------------------------

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8_checkpoint(src: Path, dst: Path, scheme: str, ignore: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Copy `src` as an FP8 checkpoint: scheme "channel" (compressed-tensors, [N, 1] scales),
    "tensor" (quant_method fp8, scalar scales and static input scales), "block" (fp8 with
    weight_block_size [16, 32], weight_scale_inv). Returns each quantized weight dequantized."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out, dequant = {}, {}
    for name, w in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEARS) or module.removeprefix("model.") in ignore:
            out[name] = w
            continue
        if scheme == "channel":
            q, s = quantize_weight_per_channel(w)
            out[module + ".weight_scale"] = s[:, None]
            dequant[module] = q.float() * s[:, None]
        elif scheme == "tensor":
            s = (w.abs().max() / 448).float()
            q = (w / s).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[module + ".weight_scale"], out[module + ".input_scale"] = s, torch.tensor(0.05)
            dequant[module] = q.float() * s
        else:
            n, k = w.shape
            blocks = w.reshape(-1, 16, k // 32, 32).abs().amax(dim=(1, 3)) / 448  # [n/16, k/32]
            full = blocks.repeat_interleave(16, 0).repeat_interleave(32, 1)
            q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[module + ".weight_scale_inv"] = blocks
            dequant[module] = q.float() * full
        out[name] = q
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", *ignore],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
        "tensor": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head", *ignore]},
        "block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32]},
    }[scheme]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dequant


def loaded_dequant(llm: LLM) -> dict[str, torch.Tensor]:
    """Each checkpoint module's weight as the loaded model holds it, dequantized."""
    cfg = llm.engine.model_config
    out = {}
    for i, layer in enumerate(llm.engine.model.layers):
        parts = {"self_attn.qkv_proj": [("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)],
                 "self_attn.o_proj": [("o_proj", None)], "mlp.gate_up_proj": [("gate_proj", cfg.intermediate_size),
                                                                            ("up_proj", cfg.intermediate_size)],
                 "mlp.down_proj": [("down_proj", None)]}
        for path, pieces in parts.items():
            owner, attr = path.split(".")
            m = getattr(getattr(layer, owner), attr)
            w = m.weight.float() * m.weight_scale[:, None] if isinstance(m, Fp8Linear) else m.weight.float()
            row = 0
            for name, rows in pieces:
                rows = rows or w.shape[0]
                out[f"model.layers.{i}.{owner}.{name}"] = w[row:row + rows]
                row += rows
    return out


@pytest.mark.parametrize("scheme", ["channel", "tensor", "block"])
def test_fp8_checkpoints_load_as_fp8(scheme, tiny_models, tmp_path):
    src = Path(tiny_models["llama"])
    ignore = ("layers.1.mlp.down_proj",) if scheme == "tensor" else ()
    dequant = write_fp8_checkpoint(src, tmp_path / scheme, scheme, ignore)
    llm = LLM(tmp_path / scheme, num_kv_blocks=64)
    model = llm.engine.model
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 8 - len(ignore)
    if ignore:
        assert type(model.layers[1].mlp.down_proj) is nn.Linear
    loaded = loaded_dequant(llm)
    for module, w in dequant.items():
        if scheme == "block":  # block scales folded into per-channel ones: one more e4m3 rounding
            torch.testing.assert_close(loaded[module], w, atol=2.0 ** -9 * w.abs().max().item(), rtol=0.07)
        else:
            torch.testing.assert_close(loaded[module], w, atol=1e-7, rtol=1e-6)
    if scheme == "channel":  # the same weights --quantization fp8 makes of the unquantized model
        at_load = LLM(src, num_kv_blocks=64, quantization="fp8")
        for p in prompts(3, seed=5):
            torch.testing.assert_close(prefill_logits(llm, p), prefill_logits(at_load, p), atol=1e-5, rtol=1e-5)
    out = llm.generate(prompts(3, seed=6), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 5 for o in out)


def test_unsupported_quantization_config_is_refused(tiny_models, tmp_path):
    dst = tmp_path / "awq"
    shutil.copytree(tiny_models["llama"], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantization_config"):
        LLM(dst, num_kv_blocks=16)


@pytest.mark.parametrize("family", ["llama", "qwen2", "glm4"])
def test_fused_decode_streams_fp8_weights_unquantized_activations(family, tiny_models, monkeypatch):
    """At decode steps of up to fused_rows tokens an FP8 layer runs its four projections as fused
    GEMVs over the e4m3 weights as stored, the activations unquantized (W8A16): each phase equals
    the same layer with the dequantized weights in float32 and no activation rounding; the step
    above fused_rows keeps W8A8. A layer fuses all four or none (its unfused norms hand on FP8
    activations), so a partial set fuses nothing."""
    monkeypatch.setenv("TANDEM_FUSED_GEMV_ROWS", "2")
    fp8 = LLM(tiny_models[family], num_kv_blocks=64, quantization="fp8", fused_decode_gemv=True)
    model = fp8.engine.model
    assert all(layer.fused_decode == {"qkv", "o_proj", "gate_up", "down"} for layer in model.layers)
    plain = LLM(tiny_models[family], num_kv_blocks=64, fused_decode_gemv=False).engine.model
    for fp8_proj, proj in zip(projections(model), projections(plain)):
        proj.weight.data = fp8_proj.weight.float() * fp8_proj.weight_scale[:, None]
    hidden = model.config.hidden_size
    device = model.embed_tokens.weight.device
    g = torch.Generator().manual_seed(5)
    for i in (0, len(model.layers) - 1):
        layer, ref_layer = model.layers[i], plain.layers[i]
        for rows in (1, 2, 3):
            x, residual = (torch.randn(rows, hidden, generator=g).to(device) for _ in range(2))
            fused = layer.fused_decode if rows <= layer.fused_rows else frozenset()  # fused_projections' rule
            qkv, res = layer.before_attention(x, residual, fused)
            want_qkv, want_res = ref_layer.before_attention(x, residual, frozenset())
            a = torch.randn(rows, layer.self_attn.o_proj.in_features, generator=g).to(device)
            out, res2 = layer.after_attention(a, residual, fused)
            want_out, want_res2 = ref_layer.after_attention(a, residual, frozenset())
            tol = 1e-4 if fused else 0.5  # above fused_rows: W8A8, activations rounded to e4m3
            for got, want in ((qkv, want_qkv), (res, want_res), (out, want_out), (res2, want_res2)):
                assert ((got - want).norm() / want.norm()).item() < tol, (family, i, rows)
            if not fused:
                assert ((out - want_out).norm() / want_out.norm()).item() > 1e-4  # W8A8 really differs
    monkeypatch.setenv("TANDEM_FUSED_GEMV", "o_proj,down")
    partial = LLM(tiny_models[family], num_kv_blocks=64, quantization="fp8", fused_decode_gemv=True)
    assert all(layer.fused_decode == frozenset() for layer in partial.engine.model.layers)
    tokens = fp8.generate(prompts(3, seed=2), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in tokens)

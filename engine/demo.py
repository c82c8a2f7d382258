"""The built-in demo model: a small random-weight Llama with a byte-level tokenizer, made on first use.

Its text is not meaningful; it exists so `tandem up` and the tests run with no download.
The same builders make the tiny random models of every family that the parity tests use.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BYTE_VOCAB = 256
BOS, EOS = "<s>", "</s>"


def write_byte_tokenizer(out_dir: Path, vocab_size: int = 258) -> None:
    """A byte-level BPE tokenizer (256 byte tokens, then <s>=256 and </s>=257) with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_to_char = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    assert set(byte_to_char.values()) == set(alphabet)
    vocab = {byte_to_char[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 256)])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}",
    }, indent=1))


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte → printable character table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


FAMILY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "llama3": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    },
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32},
    "glm": {"architectures": ["GlmForCausalLM"], "model_type": "glm", "partial_rotary_factor": 0.5},
    "glm4": {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "partial_rotary_factor": 0.5},
}


def tiny_config(family: str, **overrides: Any) -> dict[str, Any]:
    cfg = {
        "vocab_size": 258, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": None, "torch_dtype": "float32",
    }
    cfg.update(FAMILY_CONFIGS[family])
    cfg.update(overrides)
    return cfg


def make_random_model(out_dir: Path, family: str = "llama", init_std: float = 0.4, seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight Hugging Face model directory of `family` (needs transformers)."""
    import torch
    import transformers

    cfg_dict = tiny_config(family, **overrides)
    cfg_cls = transformers.AutoConfig.for_model(cfg_dict["model_type"])
    cfg = type(cfg_cls).from_dict({k: v for k, v in cfg_dict.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # non-trivial norm weights catch a skipped norm
            else:
                p.normal_(0.0, init_std)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    write_byte_tokenizer(out_dir, cfg_dict["vocab_size"])
    return out_dir


def demo_model_dir(cache_dir: Path | None = None) -> Path:
    """The demo model's directory, created on first use (random Llama, byte tokenizer, no transformers needed)."""
    base = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "tandem" / "demo-llama"
    if (base / "model.safetensors").is_file() and (base / "tokenizer.json").is_file():
        return base
    import numpy as np
    from safetensors.numpy import save_file

    cfg = tiny_config("llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=32, max_position_embeddings=2048)
    rng = np.random.default_rng(0)
    h, i, v, q, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], 8 * 32, 4 * 32
    tensors = {"model.embed_tokens.weight": rng.normal(0, 0.4, (v, h)), "model.norm.weight": np.ones(h),
               "lm_head.weight": rng.normal(0, 0.1, (v, h))}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, q), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
        for name, shape in shapes.items():
            tensors[p + name + ".weight"] = rng.normal(0, 1.0 / np.sqrt(shape[1]), shape)
        tensors[p + "input_layernorm.weight"] = np.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(h)
    tmp = base.with_name(base.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(t, dtype=np.float32) for k, t in tensors.items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    write_byte_tokenizer(tmp)
    (tmp / "README.md").write_text("Tandem demo model: random weights, byte-level tokenizer. Its text is not meaningful.\n")
    tmp.replace(base) if not base.exists() else None
    logger.info("demo model written to %s", base)
    return base

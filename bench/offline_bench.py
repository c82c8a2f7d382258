"""Offline throughput: our engine vs transformers' `generate` on the same weights, in the same run.

    python bench/offline_bench.py [--models stories,llama100m] [--batches 1,8,32] [--out FILE]

Models: stories260K (converted from ../shared/models by our converter) and a ~100M-parameter
random Llama (written once with transformers so both sides load identical weights).
Each cell: prompts of --prompt-len random tokens, --gen-len greedy tokens, EOS ignored; output
tokens per second of wall time, ours and transformers', and their ratio.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "models" / "stories260K"

LLAMA_100M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 768,
    "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "torch_dtype": "float32",
}


def make_models(work: Path, names: list[str]) -> dict[str, Path]:
    import transformers

    from engine.demo import write_byte_tokenizer

    out: dict[str, Path] = {}
    if "stories" in names and (STORIES / "stories260K.bin").is_file():
        from engine.convert.llama2c import convert_llama2c

        out["stories260K"] = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", work / "stories")
    if "llama100m" in names:
        d = work / "llama100m"
        cfg = transformers.LlamaConfig(**{k: v for k, v in LLAMA_100M.items() if k not in ("model_type", "architectures")})
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(d)
        write_byte_tokenizer(d)
        out["llama100m"] = d
    return out


def bench_ours(path: Path, prompts: list[list[int]], gen_len: int) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(str(path), max_running=max(len(prompts), 1), max_batched_tokens=8192, num_kv_blocks=2048)
    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], params.replace(max_tokens=2))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs) / dt


def bench_transformers(path: Path, prompts: list[list[int]], gen_len: int) -> float:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding needed
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        model.generate(ids[:1], max_new_tokens=2, min_new_tokens=2, **{**kw, "attention_mask": torch.ones_like(ids[:1])})
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len, **kw)
        dt = time.perf_counter() - t
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / dt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="stories,llama100m")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--out", default=None, help="write the JSON results here")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {"host": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "prompt_len": a.prompt_len, "gen_len": a.gen_len, "cells": []}
    with tempfile.TemporaryDirectory() as tmp:
        models = make_models(Path(tmp), a.models.split(","))
        for name, path in models.items():
            vocab = json.loads((path / "config.json").read_text())["vocab_size"]
            for b in (int(x) for x in a.batches.split(",")):
                g = torch.Generator().manual_seed(b)
                prompts = torch.randint(3, min(vocab, 256), (b, a.prompt_len), generator=g).tolist()
                ours = bench_ours(path, prompts, a.gen_len)
                ref = bench_transformers(path, prompts, a.gen_len)
                cell = {"model": name, "batch": b, "ours_tok_s": round(ours, 1), "transformers_tok_s": round(ref, 1),
                        "ratio": round(ours / ref, 2)}
                results["cells"].append(cell)
                print(json.dumps(cell), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

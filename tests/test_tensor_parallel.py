"""Tensor parallelism on CPU: two real processes (gloo) against the unsharded model in this process.

Tiny random Llama (KV heads split over the ranks) and Qwen2 (qkv bias, one KV head replicated
on both ranks, tied embeddings, a vocabulary that does not split evenly). The TP=2 logits of a
packed prefill must match TP=1 at every position, and greedy generation through an Engine built
for each rank (rank 0 scheduling, rank 1 following) must give the same tokens, with each rank's
KV cache holding only its KV heads.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.weights import load_model
from parallel import (
    TPGroup,
    apply_tensor_parallel,
    check_shardable,
    kv_head_range,
    load_tensor_parallel_model,
    shard_config,
)
from parallel.runner import prefill_step, run_step
from tandem.types import SamplingParams

WORLD = 2
BLOCK_SIZE = 16
PROMPTS = [[256, *range(72, 91)], [256, 7, 9, 200, 13], [256, *range(30, 66)]]
TABLES = [[9, 3], [11], [5, 21, 13]]  # odd, unordered block ids
MAX_TOKENS = 6
ENGINE_KW = dict(device="cpu", num_kv_blocks=48, block_size=BLOCK_SIZE, max_running=8, cuda_graphs=False,
                 swap_space_gb=0.0)
# Too few blocks for all three to finish: the scheduler swaps one out and back in (rank 0 tells rank 1).
TIGHT_KW = {**ENGINE_KW, "num_kv_blocks": 7, "swap_space_gb": 0.001}
TIGHT_TOKENS = 16
# Block counts derived from a small memory budget (not capped by max_running * context).
DERIVED_KW = {**ENGINE_KW, "num_kv_blocks": None, "cpu_kv_cache_gb": 2**-10, "max_running": 256}
FAMILIES = {
    "llama": dict(family="llama"),  # 4 heads, 2 KV heads: one KV head per rank
    "qwen2": dict(family="qwen2", num_key_value_heads=1, tie_word_embeddings=True, vocab_size=259),
}


def packed_logits(model, config: ModelConfig, world: int) -> torch.Tensor:
    cache = KVCache(shard_config(config, world), 24, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        return run_step(model, cache, prefill_step(PROMPTS, TABLES, BLOCK_SIZE, torch.device("cpu"), all_rows=True))


def greedy_tokens(llm, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def _rank_main(rank: int, init_method: str, model_dirs: dict[str, str], out: Any) -> None:
    """One tensor-parallel rank (spawned): packed logits, then per-rank engines, per family."""
    from engine import LLM, Engine, EngineConfig
    from parallel import init_tensor_parallel, load_tensor_parallel_model
    from parallel.runner import shard_for

    tp = init_tensor_parallel(rank, WORLD, init_method, backend="gloo")
    try:
        for name, path in model_dirs.items():
            config = ModelConfig.from_dir(path)
            model = load_tensor_parallel_model(path, config, torch.float32, torch.device("cpu"), tp)
            # numpy travels through the queue by value (a tensor would be shared through a file
            # descriptor that dies with this process)
            result: dict[str, Any] = {"logits": packed_logits(model, config, WORLD).numpy()}
            runs = (("tokens", ENGINE_KW, MAX_TOKENS), ("tight", TIGHT_KW, TIGHT_TOKENS), ("derived", DERIVED_KW, 0))
            for key, kw, max_tokens in runs:
                if rank == 0:
                    llm = LLM(path, shard=shard_for(tp), **kw)
                    engine = llm.engine
                    if key == "tokens":  # the LM head on padded rows, as on a GPU (every rank runs them)
                        engine.runner.bucket_logits(engine.max_running)
                    if max_tokens:
                        result[key] = greedy_tokens(llm, max_tokens)
                        result[f"{key}_swaps"] = engine.stats().num_swaps_out
                    llm.close()
                else:
                    engine = Engine(EngineConfig(path, **kw), shard_for(tp))
                    try:
                        engine.step()
                    except RuntimeError as e:
                        result[f"{key}_step_refused"] = str(e)
                    result[f"{key}_steps"] = engine.follow()
                result[f"{key}_kv_shape"] = tuple(engine.kv_cache.layers[0][0].shape)
                result[f"{key}_blocks"] = engine.num_total_blocks
                result[f"{key}_qkv_rows"] = engine.model.layers[0].self_attn.qkv_proj.weight.shape[0]
            out.put((name, rank, result))
    finally:
        torch.distributed.destroy_process_group()
    _exit_cleanly(out)


def _exit_cleanly(out: Any) -> None:
    """End a spawned rank that finished its work: flush its results to the parent, then exit 0
    without the interpreter's teardown, where torch's gloo threads have been seen to abort the
    process ("terminate called without an active exception") after everything was done."""
    out.close()
    out.join_thread()
    os._exit(0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engine.demo import make_random_model

    base = tmp_path_factory.mktemp("tp")
    return {name: make_random_model(base / name, seed=i + 3, **kw) for i, (name, kw) in enumerate(FAMILIES.items())}


@pytest.fixture(scope="module")
def tp_runs(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path_factory.mktemp('tp-init') / 'rendezvous'}"
    dirs = {name: str(p) for name, p in models.items()}
    procs = [ctx.Process(target=_rank_main, args=(r, init, dirs, out), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    runs: dict[str, dict[int, dict]] = {}
    try:
        deadline = time.monotonic() + 240
        while sum(map(len, runs.values())) < WORLD * len(dirs):
            try:
                name, rank, result = out.get(timeout=1.0)
                runs.setdefault(name, {})[rank] = result
            except queue.Empty:
                crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if crashed or time.monotonic() > deadline:
                    pytest.fail(f"tensor-parallel ranks failed (exit codes {crashed}) or did not report in time")
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD
    return runs


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp2_logits_match_tp1_at_every_packed_position(name: str, models: dict[str, Path], tp_runs) -> None:
    config = ModelConfig.from_dir(models[name])
    ref = packed_logits(load_model(models[name], config, torch.float32, torch.device("cpu")), config, 1)
    got, other = (torch.from_numpy(tp_runs[name][r]["logits"]) for r in (0, 1))
    assert got.shape == ref.shape == (sum(map(len, PROMPTS)), config.vocab_size)
    assert torch.equal(got, other)  # every rank ends with the same gathered logits
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp2_engine_greedy_tokens_match_tp1(name: str, models: dict[str, Path], tp_runs) -> None:
    from engine import LLM

    ref = greedy_tokens(LLM(str(models[name]), **ENGINE_KW))
    got = tp_runs[name][0]["tokens"]
    assert got == ref
    assert len({t for seq in ref for t in seq}) > 3  # varied output, so a wrong shard would show
    # one prefill step for the batch, then one decode step per further token
    assert tp_runs[name][1]["tokens_steps"] >= MAX_TOKENS


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp2_swaps_run_on_every_rank_and_keep_the_tokens(name: str, models: dict[str, Path], tp_runs) -> None:
    from engine import LLM

    llm = LLM(str(models[name]), **TIGHT_KW)
    ref = greedy_tokens(llm, TIGHT_TOKENS)
    run = tp_runs[name][0]
    assert run["tight_swaps"] >= 1 and llm.engine.stats().num_swaps_out >= 1
    assert run["tight"] == ref


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp2_engine_holds_only_its_shard_and_its_kv_heads(name: str, models: dict[str, Path], tp_runs) -> None:
    from engine import LLM

    config = ModelConfig.from_dir(models[name])
    full = LLM(str(models[name]), **ENGINE_KW).engine
    full_shape = tuple(full.kv_cache.layers[0][0].shape)
    assert full_shape == (ENGINE_KW["num_kv_blocks"], BLOCK_SIZE, config.num_kv_heads, config.head_dim)
    full_qkv_rows = full.model.layers[0].self_attn.qkv_proj.weight.shape[0]
    # KV heads split over the ranks, or one replicated head on each when there are fewer than ranks
    local_kv_heads = max(1, config.num_kv_heads // WORLD)
    for rank in range(WORLD):
        run = tp_runs[name][rank]
        assert run["tokens_kv_shape"] == (ENGINE_KW["num_kv_blocks"], BLOCK_SIZE, local_kv_heads, config.head_dim)
        assert run["tokens_qkv_rows"] == (config.num_heads // WORLD + 2 * local_kv_heads) * config.head_dim < full_qkv_rows
    # Derived from the memory budget, the block count follows the smaller per-rank block and agrees across ranks.
    derived = LLM(str(models[name]), **DERIVED_KW).engine.num_total_blocks
    tp_blocks = tp_runs[name][0]["derived_blocks"]
    assert tp_runs[name][1]["derived_blocks"] == tp_blocks
    assert tp_runs[name][1]["derived_steps"] == 0
    assert "follow()" in tp_runs[name][1]["tokens_step_refused"]  # a follower's step comes from rank 0
    if local_kv_heads < config.num_kv_heads:
        assert tp_blocks >= 2 * derived
    else:
        assert tp_blocks == derived


def test_kv_head_assignment_gives_every_query_head_its_kv_head() -> None:
    for heads, kv_heads, world in [(4, 2, 2), (8, 2, 4), (8, 1, 2), (8, 2, 8), (32, 8, 8), (32, 8, 2), (16, 4, 8)]:
        group = heads // kv_heads
        per_rank = heads // world
        for rank in range(world):
            start, count = kv_head_range(kv_heads, rank, world)
            local_group = per_rank // count
            for j in range(per_rank):  # the kernel maps local query head j to local KV head j // local_group
                assert start + j // local_group == (rank * per_rank + j) // group


def test_unshardable_configs_name_the_field(models: dict[str, Path]) -> None:
    config = ModelConfig.from_dir(models["llama"])  # 4 heads, 2 KV heads, MLP 128
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_shardable(config, 3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_shardable(dataclasses.replace(config, num_heads=12, num_kv_heads=3), 4)
    with pytest.raises(ValueError, match="intermediate_size"):
        check_shardable(dataclasses.replace(config, intermediate_size=130), 4)
    with pytest.raises(ValueError, match="rank"):
        TPGroup(2, 2)
    model = load_model(models["llama"], config, torch.float32, torch.device("cpu"))
    assert apply_tensor_parallel(model, 0, 1) is model and type(model).__name__ == "CausalLM"


def test_per_rank_dummy_shard_equals_sharding_the_full_dummy_model(models: dict[str, Path]) -> None:
    config = ModelConfig.from_dir(models["qwen2"])
    for rank in range(WORLD):  # no collective runs while loading, so no process group is needed
        full = apply_tensor_parallel(load_model(models["qwen2"], config, torch.float32, torch.device("cpu"), "dummy"),
                                     rank, WORLD)
        shard = load_tensor_parallel_model(models["qwen2"], config, torch.float32, torch.device("cpu"),
                                           TPGroup(rank, WORLD), "dummy")
        want, got = full.state_dict(), shard.state_dict()
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)
        qkv = got["layers.0.self_attn.qkv_proj.weight"]
        assert qkv.shape[0] < load_model(models["qwen2"], config, torch.float32, torch.device("cpu"),
                                         "dummy").layers[0].self_attn.qkv_proj.weight.shape[0]


def test_streamed_checkpoint_shard_equals_sharding_the_full_model(tiny_models: dict[str, Path]) -> None:
    """The per-rank loader never builds the full model, yet for every family (merged and split
    qkv / gate_up checkpoints, biases, q/k norms, tied embeddings) each rank's shard equals the
    full model's, sharded."""
    for family, path in tiny_models.items():
        config = ModelConfig.from_dir(path)
        for rank in range(WORLD):
            full = apply_tensor_parallel(load_model(path, config, torch.float32, torch.device("cpu")), rank, WORLD)
            shard = load_tensor_parallel_model(path, config, torch.float32, torch.device("cpu"), TPGroup(rank, WORLD))
            want, got = full.state_dict(), shard.state_dict()
            assert want.keys() == got.keys(), family
            assert [k for k in want if not torch.equal(want[k], got[k])] == [], family
            assert torch.equal(full.cos_sin_cache, shard.cos_sin_cache)


def test_checkpoint_errors_name_the_tensor(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    """A checkpoint with a tensor missing, an unknown tensor, or a wrong shape fails with the
    tensor's name, in the plain loader and the per-rank one alike."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_models["llama"]
    config = ModelConfig.from_dir(src)
    tensors = load_file(str(src / "model.safetensors"))
    k_proj = next(k for k in tensors if k.endswith("layers.0.self_attn.k_proj.weight"))
    cases = {
        "lacks": {k: v for k, v in tensors.items() if k != k_proj},
        "no place": {**tensors, "model.layers.0.mystery.weight": torch.zeros(2, 2)},
        "k_proj": {**tensors, k_proj: torch.zeros(3, tensors[k_proj].shape[1])},
    }
    for expected, content in cases.items():
        d = tmp_path / expected.replace(" ", "_")
        shutil.copytree(src, d)
        save_file(content, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=expected):
            load_model(d, config, torch.float32, torch.device("cpu"))
        with pytest.raises(ValueError, match=expected):
            load_tensor_parallel_model(d, config, torch.float32, torch.device("cpu"), TPGroup(0, WORLD))


def test_an_engine_without_tp_imports_no_parallel_module() -> None:
    import subprocess
    import sys

    code = ("import sys, engine.engine, engine.llm; "
            "print(sorted(m for m in sys.modules if m == 'parallel' or m.startswith('parallel.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""engine/nano_batch.py on the CPU: a decode batch run as two halves, phase by phase, computes
what the model's forward computes and writes the same cache slots (the streams are the GPU's;
here the phases run in the same order, one after another)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.attention import AttentionMetadata
from engine.nano_batch import (NANO_BATCH_ENV, nano_batch_enabled, nano_batch_mode, overlapped_forward,
                               overlapped_wins, split_meta)
from tests.same_cache import assert_same_writes, from_the_same_cache


def _decode_step(lens: list[int], block_size: int, num_blocks: int, vocab: int, rng: random.Random):
    """A decode step of sequences whose contexts (this step's token included) are `lens`, each on
    distinct random blocks."""
    need = [-(-n // block_size) for n in lens]
    blocks = rng.sample(range(num_blocks), sum(need))
    tables = torch.zeros((len(lens), max(need)), dtype=torch.int32)
    slots, at = [], 0
    for i, (n, nb) in enumerate(zip(lens, need)):
        row = blocks[at:at + nb]
        at += nb
        tables[i, :nb] = torch.tensor(row, dtype=torch.int32)
        slots.append(row[(n - 1) // block_size] * block_size + (n - 1) % block_size)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables,
                             query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), is_decode=True)
    ids = torch.tensor([rng.randrange(vocab) for _ in lens])
    return ids, torch.tensor([n - 1 for n in lens]), meta


@pytest.mark.parametrize("family, options", [
    ("llama", {}), ("qwen3", {}), ("glm4", {}),  # plain; q/k norms; sandwich norms
    ("llama", {"quantization": "fp8"}),  # FP8 weights: quantized activations and products between the phases
    ("llama", {"fused_decode_gemv": True}),  # halves of one row (n = 2) take the fused GEMVs
])
def test_two_halves_compute_what_the_forward_computes(tiny_models: dict[str, Path], family: str, options: dict):
    llm = LLM(str(tiny_models[family]), num_kv_blocks=128, max_model_len=512, **options)
    runner = llm.engine.runner
    model, layers = runner.model, runner.kv_cache.layers
    for k, v in layers:  # contexts to attend over
        k.copy_(torch.randn_like(k.float()).to(k.dtype))
        v.copy_(torch.randn_like(v.float()).to(v.dtype))
    rng = random.Random()
    for n in (2, 7, 12):  # even, odd (halves of 3 and 4), and larger
        lens = [rng.randint(1, 90) for _ in range(n)]
        ids, pos, meta = _decode_step(lens, runner.kv_cache.block_size, layers[0][0].shape[0],
                                      model.config.vocab_size, rng)
        want, want_kv, got, before = from_the_same_cache(
            layers, lambda: model(ids, pos, layers, meta), lambda: overlapped_forward(model, ids, pos, layers, meta))
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{family} {options} n={n}: {m}")
        assert_same_writes(layers, want_kv, before, meta.slot_mapping, tol=1e-4)  # the step's own K/V, same slots


def test_split_meta_takes_its_rows(tiny_models: dict[str, Path]):
    rng = random.Random(0)
    _, _, meta = _decode_step([5, 40, 17, 3, 60], 16, 64, 100, rng)
    tail = split_meta(meta, slice(2, 5))
    assert torch.equal(tail.seq_lens, meta.seq_lens[2:]) and torch.equal(tail.block_tables, meta.block_tables[2:])
    assert torch.equal(tail.slot_mapping, meta.slot_mapping[2:])
    assert tail.query_start_loc.tolist() == [0, 1, 2, 3] and tail.is_decode
    meta.is_decode = False
    with pytest.raises(ValueError, match="decode"):
        split_meta(meta, slice(0, 2))


def test_one_row_does_not_split(tiny_models: dict[str, Path]):
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=32, max_model_len=256)
    runner = llm.engine.runner
    ids, pos, meta = _decode_step([9], runner.kv_cache.block_size, 32, 100, random.Random(0))
    with pytest.raises(ValueError, match="at least 2 rows"):
        overlapped_forward(runner.model, ids, pos, runner.kv_cache.layers, meta)


def test_the_switch_is_off_by_default_and_names_itself_when_bad(monkeypatch):
    monkeypatch.setenv(NANO_BATCH_ENV, "0")
    monkeypatch.delenv(NANO_BATCH_ENV)
    assert nano_batch_mode() == "0" and nano_batch_enabled() is False
    for mode in ("1", "auto"):
        monkeypatch.setenv(NANO_BATCH_ENV, mode)
        assert nano_batch_mode() == mode and nano_batch_enabled() is True
    monkeypatch.setenv(NANO_BATCH_ENV, "yes")
    with pytest.raises(ValueError, match=NANO_BATCH_ENV):
        nano_batch_enabled()


def test_auto_keeps_the_overlapped_graph_only_where_it_wins_past_the_margin():
    plain = {128: 10.0, 256: 20.0, 384: 30.0, 512: 40.0}
    overlapped = {128: 10.5, 256: 19.9, 384: 27.0, 512: 36.0, 640: 1.0}  # 640: no plain graph to beat
    assert overlapped_wins(plain, overlapped, margin=0.02) == [384, 512]  # 256: within the margin
    assert overlapped_wins(plain, overlapped, margin=0.0) == [256, 384, 512]
    assert overlapped_wins(plain, {}, margin=0.02) == []


def test_the_probe_runs_its_three_variants_on_a_tiny_model(tiny_models: dict[str, Path], tmp_path):
    from bench import nano_batch_probe as probe

    out = tmp_path / "rows.json"
    rc = probe.main(["--model", str(tiny_models["llama"]), "--config", "bf16:fp8:6:40", "--config", "fp8:auto:5:20",
                     "--out", str(out)])
    assert rc == 0
    rows = __import__("json").loads(out.read_text())["rows"]
    assert [(r["weights"], r["kv"], r["batch"]) for r in rows] == [("bf16", "fp8", 6), ("fp8", "auto", 5)]
    for r in rows:
        assert set(r["ms"]) == {"plain", "halves", "overlapped"} and all(v > 0 for v in r["ms"].values())
        assert r["greedy_same"] == 1.0 and r["hidden_rel_diff"] < 1e-3  # the CPU runs the phases in order


@pytest.mark.parametrize("config", ["bf16:fp8:6", "int4:auto:6:40", "bf16:fp16:6:40", "bf16:auto:1:40",
                                    "bf16:auto:x:40"])
def test_the_probe_names_a_bad_config(config, capsys):
    from bench import nano_batch_probe as probe

    with pytest.raises(SystemExit) as exc:
        probe.main(["--config", config])
    assert exc.value.code == 2 and "--config" in capsys.readouterr().err


def test_auto_times_every_row_at_a_full_context_and_puts_the_padding_back(tiny_models: dict[str, Path]):
    from engine.cuda_graphs import DecodeGraphs
    from engine.nano_batch import TIMING_CONTEXT

    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=200, max_model_len=4096)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_cache, max_batch=8, max_model_len=4096)  # no capture on a CPU
    bs = runner.kv_cache.block_size
    with graphs.full_context(6):
        per_row = TIMING_CONTEXT // bs
        assert graphs.seq_lens[:6].tolist() == [per_row * bs] * 6
        tables = graphs.block_tables[:6, :per_row]
        assert int(tables.max()) < runner.kv_cache.num_blocks
        # distinct blocks while the pool has them (200 here: every row's first blocks differ)
        assert len(set(tables[:, 0].tolist())) == 6 and len(set(tables[0].tolist())) == per_row
        assert bool((graphs.slot_mapping == -1).all())  # the timed replays store nothing
    assert bool((graphs.block_tables == 0).all()) and bool((graphs.seq_lens == 1).all())
    short = DecodeGraphs(runner.model, runner.kv_cache, max_batch=8, max_model_len=100)
    with short.full_context(2):  # no more than the tables hold
        assert short.seq_lens[:2].tolist() == [short.max_blocks * bs] * 2

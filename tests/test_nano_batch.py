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
from engine.nano_batch import NANO_BATCH_ENV, nano_batch_enabled, overlapped_forward, split_meta


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
    ("llama", {"fused_decode_gemv": True}),  # halves of a few rows take the fused GEMVs
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
        before = [(k.clone(), v.clone()) for k, v in layers]
        with torch.inference_mode():
            want = model(ids, pos, layers, meta)
            want_kv = [(k.clone(), v.clone()) for k, v in layers]
            for (k, v), (k0, v0) in zip(layers, before):
                k.copy_(k0)
                v.copy_(v0)
            got = overlapped_forward(model, ids, pos, layers, meta)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{family} {options} n={n}: {m}")
        written = torch.zeros(layers[0][0].flatten(0, 1).shape[0], dtype=torch.bool)
        written[meta.slot_mapping] = True
        for (k, v), (wk, wv), (k0, _) in zip(layers, want_kv, before):  # the step's own K/V, in the same slots
            torch.testing.assert_close(k.float(), wk.float(), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v.float(), wv.float(), atol=1e-4, rtol=1e-4)
            assert torch.equal(k.flatten(0, 1)[~written].float(), k0.flatten(0, 1)[~written].float())


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
    monkeypatch.delenv(NANO_BATCH_ENV, raising=False)
    assert nano_batch_enabled() is False
    monkeypatch.setenv(NANO_BATCH_ENV, "1")
    assert nano_batch_enabled() is True
    monkeypatch.setenv(NANO_BATCH_ENV, "yes")
    with pytest.raises(ValueError, match=NANO_BATCH_ENV):
        nano_batch_enabled()


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

"""Prefill graphs (engine/prefill_graphs.py): which steps replay one, and that the padded layout a
graph runs on computes what the step computes unpadded (the model run eagerly on the staged
buffers, on the CPU; the capture itself needs CUDA and is checked on the device by
bench/h200_bench.py's gpu_parity). Bad settings name their field or flag."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig
from engine.attention import AttentionMetadata
from engine.prefill_graphs import DEFAULT_BUCKETS, MAX_SEQS, PrefillGraphs, buckets_up_to
from engine.scheduler import PrefillAlone
from tests.same_cache import assert_same_writes, from_the_same_cache
from worker.config import PREFILL_GRAPH_TOKENS, build_parser, config_from_args


def test_buckets() -> None:
    assert buckets_up_to(0) == []
    for top in (1, 16, 100, 1024, 2048, 3000):
        got = buckets_up_to(top)
        assert got[-1] == top and got == sorted(set(got)) and all(b <= top for b in got)
        assert [b for b in DEFAULT_BUCKETS if b < top] == got[:-1]


def _step(seqs: list[tuple[int, int]], bs: int, rng: random.Random, vocab: int, num_blocks: int):
    """A prefill step of sequences (new tokens, cached prefix) on distinct random blocks."""
    need = [-(-(q + p) // bs) for q, p in seqs]
    blocks = rng.sample(range(num_blocks), sum(need))
    width = max(need)
    tables = torch.zeros((len(seqs), width), dtype=torch.int32)
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    at = 0
    for i, ((q, p), nb) in enumerate(zip(seqs, need)):
        row = blocks[at : at + nb]
        at += nb
        tables[i, :nb] = torch.tensor(row, dtype=torch.int32)
        ids += [rng.randrange(vocab) for _ in range(q)]
        pos += list(range(p, p + q))
        slots += [row[t // bs] * bs + t % bs for t in range(p, p + q)]
        qsl.append(qsl[-1] + q)
        lens.append(p + q)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables,
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(lens, dtype=torch.int32), is_decode=False)
    return torch.tensor(ids), torch.tensor(pos), meta


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_padded_step_computes_what_the_step_computes(tiny_models: dict[str, Path], family: str) -> None:
    llm = LLM(str(tiny_models[family]), num_kv_blocks=96, max_model_len=512)
    runner = llm.engine.runner
    model, kv = runner.model, runner.kv_cache
    graphs = PrefillGraphs(model, kv, max_tokens=256, max_model_len=512)
    rng = random.Random()
    layers = kv.layers
    for _ in range(3):
        seqs = [(rng.randint(1, 60), rng.choice([0, 0, 16, 21])) for _ in range(rng.randint(1, 4))]
        ids, pos, meta = _step(seqs, kv.block_size, rng, model.config.vocab_size, kv.layers[0][0].shape[0])
        n = ids.shape[0]
        bucket = graphs.fits(n, meta)
        assert bucket == min(b for b in graphs.buckets if b >= n)
        sid, spos, smeta = graphs.stage(ids, pos, meta, bucket)
        assert sid.shape[0] == bucket and smeta.query_start_loc.shape[0] == MAX_SEQS + 1
        want, want_kv, got, before = from_the_same_cache(
            layers, lambda: model(ids, pos, layers, meta), lambda: model(sid, spos, layers, smeta)[:n])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert_same_writes(layers, want_kv, before, meta.slot_mapping, tol=1e-5)  # the same slots written, no other


def test_which_steps_replay_a_graph(tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=96, max_model_len=512)
    runner = llm.engine.runner
    graphs = PrefillGraphs(runner.model, runner.kv_cache, max_tokens=100, max_model_len=512)
    assert graphs.buckets[-1] == 100
    rng = random.Random()
    vocab, blocks = runner.model.config.vocab_size, runner.kv_cache.layers[0][0].shape[0]
    ids, pos, meta = _step([(40, 0), (30, 16)], 16, rng, vocab, blocks)
    assert graphs.fits(70, meta) == 100
    assert graphs.fits(101, meta) is None  # more tokens than the largest graph
    meta.num_decode_seqs = 1  # a mixed step: its one-token rows go to the decode kernel
    assert graphs.fits(70, meta) is None
    meta.num_decode_seqs = 0
    meta.is_decode = True
    assert graphs.fits(70, meta) is None
    many = _step([(1, 0)] * (MAX_SEQS + 1), 16, rng, vocab, blocks)[2]
    assert graphs.fits(MAX_SEQS + 1, many) is None
    wide = _step([(40, 0)], 16, rng, vocab, blocks)[2]
    wide.block_tables = torch.zeros((1, graphs.max_blocks + 1), dtype=torch.int32)
    assert graphs.fits(40, wide) is None


def test_bad_settings_name_their_field() -> None:
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(model_path="x", prefill_graph_tokens=-1)
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(model_path="x", prefill_graph_tokens=10**6)


def test_workers_that_prefill_capture_by_default() -> None:
    def tokens(role: str, *flags: str) -> int:
        args = build_parser(None).parse_args(["--model", "m", "--role", role, *flags])
        return config_from_args(args).engine.prefill_graph_tokens

    assert tokens("prefill") == tokens("both") == PREFILL_GRAPH_TOKENS
    assert tokens("decode") == 0
    assert tokens("prefill", "--no-cuda-graphs") == 0
    assert tokens("prefill", "--prefill-graph-tokens", "512") == 512
    assert tokens("both", "--prefill-graph-tokens", "0") == 0


def test_warm_up_compiles_the_eager_path_past_the_graphs(tiny_models: dict[str, Path]) -> None:
    """Warm-up steps must not go through the prefill graphs: the eager path (steps no graph
    takes) would otherwise compile in the first request's latency."""
    llm = LLM(str(tiny_models["llama"]), num_kv_blocks=96, max_model_len=512)
    runner = llm.engine.runner

    class Recorder:  # stands in for the captured graphs (the capture needs CUDA)
        def __init__(self) -> None:
            self.steps = 0

        def run(self, input_ids, positions, meta):
            self.steps += 1
            return None  # as for a step that fits no graph: the runner goes on eagerly

    recorder = Recorder()
    runner.prefill_graphs = recorder
    rule = PrefillAlone(max_tokens=512, max_seqs=32)  # set with the graphs, as on CUDA
    llm.engine.prefill_alone = rule
    mixed: list[bool] = []
    schedule = llm.engine._schedule

    def spy():
        out = schedule()
        mixed.append(any(s.num_new_tokens == 1 for s in out.scheduled) and any(s.num_new_tokens > 1 for s in out.scheduled))
        return out
    llm.engine._schedule = spy
    assert llm.engine.warm_up() > 0
    llm.engine._schedule = schedule
    assert recorder.steps == 0 and runner.prefill_graphs is recorder
    assert any(mixed)  # prompts beside decodes: the rule was set aside too
    assert llm.engine.prefill_alone is rule
    llm.generate([[5, 6, 7, 8]], None)
    assert recorder.steps > 0  # outside warm-up, prefill steps offer themselves to the graphs

"""The LM head over a bucketed number of rows (ModelRunner.bucket_logits, on by default on CUDA):
the sampled rows are padded to one of the decode graphs' batch sizes, so a GPU meets few row
counts and warm-up runs each; the padding changes no output."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import DEFAULT_BUCKETS, TIMED_BUCKETS_ENV


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3 + 7 * i % 29,), generator=g).tolist() for i in range(n)]


def record_rows(llm: LLM) -> list[tuple[int, int]]:
    """(sampled rows, rows the LM head runs on) of each step from now on."""
    seen: list[tuple[int, int]] = []
    runner = llm.engine.runner
    prepare, logits = runner.prepare, runner.model.logits

    def recording_prepare(*args, **kwargs):
        batch = prepare(*args, **kwargs)
        seen.append((len(batch.sample_index), batch.sample_rows.numel()))
        return batch

    def recording_logits(hidden: torch.Tensor) -> torch.Tensor:
        assert hidden.shape[0] == seen[-1][1]
        return logits(hidden)

    runner.prepare, runner.model.logits = recording_prepare, recording_logits
    return seen


def test_buckets_are_the_graph_sizes_up_to_max_rows(model_dir, monkeypatch):
    llm = LLM(model_dir, num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.logits_buckets is None  # a CPU engine runs the LM head on what it samples
    monkeypatch.setenv(TIMED_BUCKETS_ENV, "0")
    buckets = runner.bucket_logits(419)
    assert buckets == sorted(buckets) and buckets[-1] == 419 and buckets[0] == 1
    assert set(buckets[:-1]) == {b for b in DEFAULT_BUCKETS if b < 419}
    assert runner.bucket_logits(512)[-1] == 512 and 419 not in runner.logits_buckets
    past = runner.bucket_logits(2000)  # past the largest graph: every 256 rows, then the cap
    assert past[past.index(1024):] == [1024, 1280, 1536, 1792, 2000]
    # Timed (the default), the spare buckets above the cap are candidates too; warm-up times
    # them all on a GPU and keeps the fastest (ModelRunner.keep_fastest_logits).
    monkeypatch.setenv(TIMED_BUCKETS_ENV, "1")
    assert runner.bucket_logits(419) == buckets + [448, 512]
    times = {b: 1.0 + b / 1000 for b in runner.logits_buckets}
    times[419], times[448] = 3.0, 3.0  # 419 rows slower than 512
    kept = runner.keep_fastest_logits(times)
    assert kept == runner.logits_buckets and kept[-2:] == [384, 512]


@pytest.mark.parametrize("overlap", [False, True])
def test_padded_rows_change_no_output(model_dir, overlap):
    """Seven sequences (greedy, seeded sampling, logprobs) leave and join the batch: every
    sampled row count is padded to a bucket, and every output equals the unpadded engine's."""
    ps = prompts(11)
    params = [SamplingParams(max_tokens=3 + i % 6, temperature=0 if i % 3 else 0.8, seed=None if i % 3 else i,
                             logprobs=2, ignore_eos=True) for i in range(len(ps))]
    kwargs = dict(num_kv_blocks=96, max_running=7, max_batched_tokens=64, overlap_schedule=overlap)
    plain, padded = LLM(model_dir, **kwargs), LLM(model_dir, **kwargs)
    buckets = padded.engine.runner.bucket_logits(padded.engine.max_running)
    rows = record_rows(padded)
    want, got = plain.generate(ps, params), padded.generate(ps, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [(o.token_ids, o.text, o.finish_reason)
                                                                    for o in want]
    for a, b in zip(got, want):
        assert [lp.token_id for lp in a.logprobs] == [lp.token_id for lp in b.logprobs]
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)
    assert buckets == [1, 2, 4, 7, 8]  # 8: a spare above the cap, timed on a GPU (no batch needs it)
    assert all(padded == min(b for b in buckets if b >= n) for n, padded in rows if n)
    assert {n for n, padded in rows if padded > n}  # some steps ran padded (5 or 6 rows as 7, 3 as 4)

def test_warm_up_runs_the_lm_head_at_every_bucket(model_dir):
    from engine.warm_up import _warm_logits

    llm = LLM(model_dir, num_kv_blocks=64, max_running=24)
    runner = llm.engine.runner
    seen: list[int] = []
    logits = runner.model.logits
    runner.model.logits = lambda hidden: seen.append(hidden.shape[0]) or logits(hidden)
    _warm_logits(llm.engine)  # no buckets (a CPU engine): nothing runs
    assert seen == []
    buckets = runner.bucket_logits(llm.engine.max_running)
    _warm_logits(llm.engine)
    assert seen == buckets == [1, 2, 4, 8, 16, 24, 32]

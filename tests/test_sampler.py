"""Tests for the token sampler against simple per-row references on fresh random logits."""
from __future__ import annotations

import math
import random

import pytest
import torch

from engine.sampler import Sampler, SamplingRow, step_seed
from tandem.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _logits(batch: int, vocab: int, seed: int, scale: float = 3.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, vocab, generator=gen) * scale).to(dtype)


def _row(params: SamplingParams, prompt=(1, 2, 3), output=(), eos=frozenset()) -> SamplingRow:
    return SamplingRow(
        params=params.validate(),
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=frozenset(eos),
    )


def _ref_probs(logits: list[float], temperature: float) -> list[float]:
    scaled = [v / temperature for v in logits]
    top = max(scaled)
    exps = [math.exp(v - top) for v in scaled]
    total = sum(exps)
    return [e / total for e in exps]


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = _logits(16, 500, seed=1, dtype=dtype)
    out = Sampler(500)(logits, [_row(GREEDY) for _ in range(16)])
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, seed=5, top_p=0.8),
                                    SamplingParams(temperature=1.2, seed=9, top_k=40, logprobs=3),
                                    SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2)])
def test_bf16_logits_sample_as_their_float32_widening(params):
    """The model hands the sampler its own dtype (CausalLM.logits): every row, sampled, penalised
    or with log-probs, gets what the same values widened to float32 would give."""
    logits = _logits(6, 700, seed=4, dtype=torch.bfloat16)
    rows = [_row(params, prompt=(5, 9, 11), output=(3, 5)) for _ in range(6)]
    got, want = Sampler(700, seed=1)(logits, rows), Sampler(700, seed=1)(logits.float(), rows)
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs


def test_greedy_ties_pick_lowest_index():
    logits = torch.zeros(2, 20)
    logits[0, [7, 3, 12]] = 5.0
    logits[1, [19, 4]] = 2.0
    out = Sampler(20)(logits, [_row(GREEDY), _row(SamplingParams(top_k=1, presence_penalty=0.5))])
    assert out.token_ids == [3, 4]


def test_top_k_1_equals_greedy_in_mixed_batch():
    logits = _logits(12, 300, seed=2)
    top1, nucleus = SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=0.8, top_p=0.9)
    rows = [_row(top1 if i % 2 else nucleus) for i in range(12)]
    out = Sampler(300, seed=0)(logits, rows)
    expected = logits.argmax(dim=-1).tolist()
    assert [out.token_ids[i] for i in range(1, 12, 2)] == [expected[i] for i in range(1, 12, 2)]


# ---------------------------------------------------------------- seeds


def test_same_seed_same_tokens_across_samplers():
    logits = _logits(6, 400, seed=3, scale=1.0)
    rows = [_row(SamplingParams(temperature=1.0, seed=100 + i), output=[5] * i) for i in range(6)]
    a = Sampler(400, seed=1)(logits, rows)
    b = Sampler(400, seed=2)(logits, rows)
    assert a.token_ids == b.token_ids


def test_different_seeds_differ():
    logits = _logits(1, 400, seed=4, scale=0.5).expand(64, 400)
    sampler = Sampler(400)
    rows = [_row(SamplingParams(seed=s)) for s in range(64)]
    tokens = sampler(logits, rows).token_ids
    assert len(set(tokens)) > 32  # near-flat distribution over 400 tokens
    # The same seed at different steps draws differently too.
    steps = [_row(SamplingParams(seed=7), output=[0] * i) for i in range(64)]
    assert len(set(sampler(logits, steps).token_ids)) > 32


def test_seeded_row_independent_of_batch():
    vocab = 256
    sampler = Sampler(vocab)
    for step in range(20):
        logits = _logits(5, vocab + 16, seed=100 + step, scale=1.0)
        seeded = _row(SamplingParams(temperature=0.9, top_p=0.95, seed=1234), output=list(range(step)))
        alone = sampler(logits[2:3], [seeded]).token_ids[0]
        others = [
            _row(GREEDY),
            _row(SamplingParams(temperature=1.5, top_k=3, min_p=0.1)),
            seeded,
            _row(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4), output=[1, 2, 2]),
            _row(SamplingParams(temperature=0.5, seed=99, logprobs=2)),
        ]
        in_batch = sampler(logits, others).token_ids[2]
        # A fresh sampler (another process, or a recompute after preemption) agrees too.
        again = Sampler(vocab, seed=5)(logits[2:3].clone(), [seeded]).token_ids[0]
        assert alone == in_batch == again


def test_step_seed_is_stable_and_mixes():
    assert step_seed(1, 0) == step_seed(1, 0)
    values = {step_seed(s, i) for s in range(20) for i in range(20)}
    assert len(values) == 400
    assert all(0 <= v < 2**63 for v in values)


def test_unseeded_rows_reproducible_with_sampler_seed():
    logits = _logits(32, 100, seed=5, scale=0.5)
    rows = [_row(SamplingParams()) for _ in range(32)]
    assert Sampler(100, seed=11)(logits, rows).token_ids == Sampler(100, seed=11)(logits, rows).token_ids
    assert Sampler(100, seed=11)(logits, rows).token_ids != Sampler(100, seed=12)(logits, rows).token_ids


# ---------------------------------------------------------------- filters


def test_top_k_stays_within_k_best():
    vocab, batch = 60, 3000
    logits = _logits(batch, vocab, seed=6, scale=1.0)
    rng = random.Random(6)
    ks = [rng.randint(2, 8) for _ in range(batch)]
    out = Sampler(vocab, seed=0)(logits, [_row(SamplingParams(top_k=k, temperature=2.0)) for k in ks])
    rank_hist = [0] * vocab
    for i, (tok, row) in enumerate(zip(out.token_ids, logits.tolist())):
        order = sorted(range(vocab), key=lambda t: -row[t])
        rank = order.index(tok)
        assert rank < ks[i], f"row {i}: token of rank {rank} with top_k={ks[i]}"
        rank_hist[rank] += 1
    assert rank_hist[1] > 100  # not collapsed onto the argmax


def _nucleus(probs: list[float], top_p: float, slack: float = 1e-5) -> set[int]:
    """Tokens in the smallest most-likely set with mass >= top_p (plus float slack at the edge)."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    keep, before = set(), 0.0
    for t in order:
        if before >= top_p + slack:
            break
        keep.add(t)
        before += probs[t]
    return keep


@pytest.mark.parametrize("top_k", [0, 10])
def test_top_p_stays_within_nucleus(top_k):
    vocab, batch = 50, 2000
    logits = _logits(batch, vocab, seed=7, scale=1.5)
    rng = random.Random(7)
    cases = [(rng.uniform(0.2, 0.95), rng.choice([0.7, 1.0, 1.6])) for _ in range(batch)]
    rows = [
        _row(SamplingParams(top_p=p, temperature=t, top_k=top_k, seed=i if i % 3 == 0 else None))
        for i, (p, t) in enumerate(cases)
    ]
    out = Sampler(vocab, seed=1)(logits, rows)
    outside_top1 = 0
    for i, tok in enumerate(out.token_ids):
        p, t = cases[i]
        row = logits[i].tolist()
        if top_k:
            cut = sorted(row, reverse=True)[top_k - 1]
            row = [v if v >= cut else -math.inf for v in row]
        probs = _ref_probs(row, t)
        assert tok in _nucleus(probs, p), f"row {i}: token {tok} outside the top_p={p} nucleus"
        outside_top1 += tok != max(range(vocab), key=lambda v: probs[v])
    assert outside_top1 > 200


@pytest.mark.parametrize("top_p", [1.0, 0.9999])
def test_min_p_drops_unlikely_tokens(top_p):
    # top_p < 1 routes through the sorting filter; min-p's test p >= min_p * p_max is
    # unchanged by the renormalisation after top-p, so the same check holds.
    vocab, batch = 40, 2000
    logits = _logits(batch, vocab, seed=8, scale=1.0)
    rng = random.Random(8)
    cases = [(rng.uniform(0.05, 0.6), rng.choice([0.8, 1.5])) for _ in range(batch)]
    rows = [_row(SamplingParams(min_p=m, temperature=t, top_p=top_p)) for m, t in cases]
    out = Sampler(vocab, seed=2)(logits, rows)
    outside_top1 = 0
    for i, tok in enumerate(out.token_ids):
        m, t = cases[i]
        probs = _ref_probs(logits[i].tolist(), t)
        assert probs[tok] >= m * max(probs) * (1 - 1e-5), f"row {i}: p={probs[tok]} below min_p={m} of max"
        outside_top1 += probs[tok] < max(probs)
    assert outside_top1 > 200


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_matches_softmax_distribution(seeded):
    vocab, draws, temperature = 8, 12000, 0.7
    base = [0.3, -1.0, 1.2, 0.0, 0.8, -0.4, 1.0, -2.0]
    logits = torch.tensor([base]).expand(draws, vocab)
    rows = [_row(SamplingParams(temperature=temperature, seed=i if seeded else None)) for i in range(draws)]
    tokens = Sampler(vocab, seed=3)(logits, rows).token_ids
    counts = [tokens.count(t) for t in range(vocab)]
    # df = 7: P(chi2 > 40) is about 1e-6.
    assert _chi_square(counts, _ref_probs(base, temperature)) < 40.0
    assert _chi_square(counts, _ref_probs(base, 1.0)) > 100.0


# ---------------------------------------------------------------- penalties


def _ref_penalized(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    out = list(logits)
    prompt = [t for t in prompt if t < len(logits)]
    output = [t for t in output if t < len(logits)]
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.presence_penalty + p.frequency_penalty * output.count(t)
    return out


@pytest.mark.parametrize("sampled", [False, True])
def test_penalties_match_reference(sampled):
    vocab, batch = 30, 200
    logits = _logits(batch, vocab + 2, seed=9, scale=1.0)
    rng = random.Random(9)
    rows, refs = [], []
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        if i % 2:
            output.append(vocab + 1)  # outside the vocabulary: nothing to penalise
        p = SamplingParams(
            repetition_penalty=rng.choice([1.0, 0.7, 1.3, 2.0]),
            presence_penalty=rng.choice([0.0, 0.5, -0.4, 1.5]),
            frequency_penalty=rng.choice([0.0, 0.3, -0.2, 1.0]),
            # min_p=1 keeps only the best token, so sampled rows become deterministic.
            **({"temperature": 1.0, "min_p": 1.0} if sampled else {"temperature": 0.0}),
        )
        rows.append(_row(p, prompt=prompt, output=output))
        refs.append(_ref_penalized(logits[i, :vocab].tolist(), p, prompt, output))
    out = Sampler(vocab, seed=4)(logits, rows)
    changed = checked = 0
    for i, tok in enumerate(out.token_ids):
        ranked = sorted(range(vocab), key=lambda t: -refs[i][t])
        if refs[i][ranked[0]] - refs[i][ranked[1]] < 1e-4:
            continue  # too close to call between float32 and float64
        checked += 1
        assert tok == ranked[0], f"row {i}: {tok} != reference {ranked[0]}"
        changed += ranked[0] != int(logits[i, :vocab].argmax())
    assert checked > batch * 0.9
    assert changed > 20  # the penalties really moved the answer


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, min_tokens=2),
        SamplingParams(temperature=0.7, top_k=5, min_p=0.1),
        SamplingParams(temperature=1.0, top_p=0.8, min_p=0.1),
    ],
)
def test_input_logits_left_unmodified(params):
    logits = _logits(4, 64, seed=10)
    before = logits.clone()
    Sampler(64)(logits, [_row(params, output=[1, 2], eos={0}) for _ in range(4)])
    assert torch.equal(logits, before)


def test_min_tokens_blocks_eos_and_stop_ids():
    vocab = 50
    logits = _logits(6, vocab, seed=11, scale=1.0)
    logits[:, [0, 7, 9]] = 30.0  # eos 0 and stop ids 7, 9 dominate
    variants = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7, 9)),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[7, 9], seed=1),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7, 9), ignore_eos=True),
    ]
    rows = [_row(p, output=[5, 6], eos={0}) for p in variants]  # 2 < min_tokens
    rows += [_row(p, output=[5, 6, 8], eos={0}) for p in variants]  # min_tokens reached
    out = Sampler(vocab, seed=5)(logits, rows)
    for tok in out.token_ids[:3]:
        assert tok not in (0, 7, 9)
    for tok in out.token_ids[3:]:
        assert tok in (0, 7, 9)


# ---------------------------------------------------------------- logprobs and padding


def test_logprobs_come_from_raw_logits():
    vocab = 80
    logits = _logits(5, vocab + 8, seed=12, dtype=torch.bfloat16)
    logits[:, vocab:] = 50.0  # padding must not enter the normalisation
    params = [
        SamplingParams(temperature=0.0, logprobs=3, repetition_penalty=1.8),
        SamplingParams(temperature=0.6, logprobs=0, presence_penalty=1.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.2, top_k=5, logprobs=5, seed=3),
        SamplingParams(temperature=0.0, logprobs=1),
    ]
    out = Sampler(vocab, seed=6)(logits, [_row(p, output=[1, 2, 3]) for p in params])
    ref = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
    assert out.logprobs[2] is None
    for i, p in enumerate(params):
        lp = out.logprobs[i]
        if p.logprobs is None:
            continue
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-5)
        assert len(lp.top) == p.logprobs
        want_vals, want_ids = ref[i].topk(p.logprobs) if p.logprobs else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == want_ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(want_vals.tolist(), abs=1e-5)


def test_padding_columns_never_sampled():
    vocab, pad = 40, 24
    logits = _logits(300, vocab + pad, seed=13, scale=1.0)
    logits[:, vocab:] = 1e4
    kinds = [
        GREEDY,
        SamplingParams(),
        SamplingParams(top_p=0.5, seed=1),
        SamplingParams(top_k=3, repetition_penalty=1.2),
        SamplingParams(min_p=0.2, frequency_penalty=1.0),
    ]
    # Out-of-vocabulary ids in the history are ignored by the penalties.
    rows = [_row(kinds[i % 5], prompt=[vocab + 3, 1], output=[vocab + 1, 2] + [0] * i) for i in range(300)]
    out = Sampler(vocab, seed=7)(logits, rows)
    assert all(0 <= t < vocab for t in out.token_ids)


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(0)
    sampler = Sampler(10)
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(10), [_row(GREEDY)])
    with pytest.raises(ValueError, match="rows"):
        sampler(torch.zeros(2, 10), [_row(GREEDY)])
    with pytest.raises(ValueError, match="logits"):
        sampler(torch.zeros(1, 9), [_row(GREEDY)])
    assert sampler(torch.zeros(0, 10), []).token_ids == []


def test_a_sequence_keeps_its_sampling_row_until_its_lists_or_params_change():
    """ModelRunner._rows reuses a sequence's SamplingRow from step to step: tokens appended to
    its output show through it; replacing the output or prompt list (a resumed request's split)
    or the params (activation) gives a fresh row that reads the new ones."""
    from engine.model_runner import _sampling_row
    from engine.sequence import Sequence

    eos = frozenset({2})
    seq = Sequence("r", [5, 6, 7], SamplingParams(temperature=0.0))
    row = _sampling_row(seq, eos)
    seq.output_token_ids.append(9)
    assert _sampling_row(seq, eos) is row and list(row.output_token_ids) == [9]
    seq.prompt_token_ids, seq.output_token_ids = [5, 6], [7, 9]
    moved = _sampling_row(seq, eos)
    assert moved is not row and (list(moved.prompt_token_ids), list(moved.output_token_ids)) == ([5, 6], [7, 9])
    seq.params = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    again = _sampling_row(seq, eos)
    assert again is not moved and again.params.repetition_penalty == 1.3
    assert _sampling_row(seq, frozenset({3})).eos_token_ids == frozenset({3})


# ---------------------------------------------------------------- the host never waits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: only a GPU copy can make the host wait")
def test_launch_queues_every_kind_of_row_without_a_host_wait():
    """Sampled (a seeded one among them), filtered, penalised, min_tokens-masked and partly
    log-prob rows are all queued without a synchronizing call (engine/uploads.py: an upload from pageable memory would make
    the host wait for the step queued before it, and the device idle after it)."""
    rows = [_row(SamplingParams(temperature=0.8, top_p=0.9, seed=5)),
            _row(SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=2), output=(4, 5)),
            _row(SamplingParams(temperature=1.0, top_k=7, min_tokens=3, presence_penalty=0.5), output=(7,), eos={2}),
            _row(GREEDY)]
    logits = _logits(4, 500, seed=3).cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = Sampler(500, seed=2).launch(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = pending.result()
    assert out.token_ids[3] == int(logits[3].argmax())
    assert out.logprobs[1] is not None and len(out.logprobs[1].top) == 2
    assert out.token_ids[2] != 2  # masked until min_tokens


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, repetition_penalty=2.0),
                                    SamplingParams(temperature=0.0, frequency_penalty=2.0),
                                    SamplingParams(temperature=0.0, presence_penalty=2.0),
                                    SamplingParams(temperature=0.6, seed=4, min_tokens=4, frequency_penalty=0.5)])
def test_a_pending_token_is_penalised_and_counted_as_if_it_were_in_the_outputs(params):
    """A row whose last token is still on the device (the overlapped engine's pending token,
    read from the step's tokens at `pending_row`) samples what it would with that token in its
    outputs: penalties see it, min_tokens and a seed's position count it."""
    vocab = 60
    logits = _logits(3, vocab, seed=8, scale=1.0)
    logits[:, 7] = logits.max(dim=1).values + 0.5  # the pending token leads unless penalised
    step_tokens = torch.tensor([3, 7, 9])  # the step in flight sampled 7 at row 1
    pending = [SamplingRow(params.validate(), [1, 2], [4, 5], frozenset({2}), pending=1, pending_row=1)
               for _ in range(3)]
    known = [_row(params, prompt=(1, 2), output=(4, 5, 7), eos={2}) for _ in range(3)]
    got = Sampler(vocab, seed=1).launch(logits, pending, step_tokens).result()
    want = Sampler(vocab, seed=1).launch(logits, known).result()
    assert got.token_ids == want.token_ids
    if params.greedy:
        assert 7 not in got.token_ids  # the penalty applied to the pending token
    with pytest.raises(ValueError, match="pending_tokens"):
        Sampler(vocab).launch(logits, pending)


def test_a_rows_output_tensor_follows_its_growing_list():
    """The penalties' output ids are kept between steps and extended by what was appended; a
    list that got shorter, or is not a list, is read anew."""
    outputs = [5, 6]
    row = _row(GREEDY, output=())
    row.output_token_ids = outputs
    assert row.output_tensor().tolist() == [5, 6]
    for t in range(40):  # past the first capacity
        outputs.append(t)
        assert row.output_tensor().tolist() == outputs
    del outputs[3:]
    assert row.output_tensor().tolist() == [5, 6, 0]
    row.output_token_ids = (9, 8)
    assert row.output_tensor().tolist() == [9, 8]


def test_top_p_keeps_or_drops_equal_logits_together():
    """Tokens of equal logit straddling the top-p edge are kept together: the mass strictly
    above each is what top-p tests, not where a sort happened to put it."""
    vocab, draws = 30, 3000
    row = [-4.0] * vocab
    row[5], row[11], row[20] = 3.0, 2.0, 2.0  # 11 and 20 tie; p(5) ~0.56 of the mass, top_p just above it
    logits = torch.tensor([row]).expand(draws, vocab).to(torch.bfloat16)
    probs = _ref_probs(row, 1.0)
    out = Sampler(vocab, seed=4)(logits, [_row(SamplingParams(temperature=1.0, top_p=probs[5] + 0.01))] * draws)
    counts = {t: out.token_ids.count(t) for t in set(out.token_ids)}
    assert set(counts) == {5, 11, 20}, counts
    assert min(counts.values()) > 300, counts

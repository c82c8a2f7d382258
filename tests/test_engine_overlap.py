"""The overlapped engine step (schedule step n+1 while step n runs) gives exactly the outputs of
the synchronous step: same tokens, logprobs, texts and finish reasons, no leaked blocks, in
every situation that touches the pending token (stops, lengths, the context end, preemption,
seeds and min_tokens that count it, penalties that read it on the device, aborts while a step is
in flight)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import FinishReason, StepOutput


@pytest.fixture(scope="module")
def model_dir(tiny_models):
    return tiny_models["llama"]


def prompts(n: int, lens: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (lens[i % len(lens)],), generator=g).tolist() for i in range(n)]


def both(model_dir, **kwargs) -> tuple[LLM, LLM]:
    return LLM(model_dir, overlap_schedule=False, **kwargs), LLM(model_dir, overlap_schedule=True, **kwargs)


def summary(outs) -> list[tuple]:
    """Everything but logprob values, which `logprobs()` compares with a tolerance (a batch of
    another shape rounds differently)."""
    return [(o.token_ids, o.finish_reason, o.stop_reason, o.text,
             None if o.logprobs is None else [lp.token_id for lp in o.logprobs]) for o in outs]


def logprobs(outs) -> list[float]:
    return [lp.logprob for o in outs if o.logprobs for lp in o.logprobs]


def assert_clean(llm: LLM) -> None:
    e = llm.engine
    assert not e.has_unfinished()
    assert e._inflight is None and not e._ready
    assert all(s.num_pending == 0 for s in e._scheduler.running)  # the overlap's own state
    assert e.num_free_blocks_after_reset() == e.num_total_blocks


def test_overlap_is_on_only_where_asked(model_dir):
    sync, overlap = both(model_dir, num_kv_blocks=32)
    assert overlap.engine.overlap and not sync.engine.overlap
    assert not LLM(model_dir, num_kv_blocks=32).engine.overlap  # default: CUDA only


def test_greedy_batches_with_admissions_match(model_dir):
    """More prompts than max_running, mixed lengths and max_tokens: sequences join and leave the
    batch while a step is in flight."""
    ps = prompts(11, (3, 17, 40, 9, 26))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1, 2, 7, 13, 5, 20, 3, 9, 1, 4, 16)]
    sync, overlap = both(model_dir, num_kv_blocks=96, max_running=4, max_batched_tokens=32)
    assert summary(overlap.generate(ps, params)) == summary(sync.generate(ps, params))
    assert_clean(overlap)
    # A sequence whose pending token is its last is not scheduled again: no wasted tokens.
    assert overlap.engine.stats().num_scheduled_tokens == sync.engine.stats().num_scheduled_tokens


def test_stops_while_in_flight_match(model_dir):
    """Stop tokens, stop strings and EOS end sequences whose next step is already running: that
    step's sample is dropped."""
    ps = prompts(6, (5, 21, 12))
    ref = LLM(model_dir, num_kv_blocks=96, overlap_schedule=False).generate(
        ps, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    params = [
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[ref[0].token_ids[3]], ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, stop=[ref[1].text[2:4]], ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, logprobs=2, stop_token_ids=[ref[2].token_ids[6]], ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[ref[5].token_ids[0]], ignore_eos=True),
    ]
    sync, overlap = both(model_dir, num_kv_blocks=96, max_running=8)
    want_outs, got_outs = sync.generate(ps, params), overlap.generate(ps, params)
    want = summary(want_outs)
    assert summary(got_outs) == want
    assert logprobs(got_outs) == pytest.approx(logprobs(want_outs), abs=1e-4)
    assert [w[1] for w in want].count("stop") >= 3
    assert want[0][0] == ref[0].token_ids[:4] and want[5][0] == ref[5].token_ids[:1]
    assert_clean(overlap)


def test_stops_logprobs_and_sampling_match(model_dir):
    ps = prompts(8, (5, 21, 12))
    ref = LLM(model_dir, num_kv_blocks=96, overlap_schedule=False).generate(
        ps, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    params = [
        SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[ref[0].token_ids[3]], ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, stop=[ref[1].text[2:5]] if len(ref[1].text) > 5 else None),
        SamplingParams(max_tokens=10, temperature=0, logprobs=3),
        SamplingParams(max_tokens=10, temperature=0.8, seed=7),  # seeded: its position counts the pending token
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(max_tokens=10, temperature=0, min_tokens=4, stop_token_ids=[ref[5].token_ids[1]]),
        SamplingParams(max_tokens=10, temperature=0),  # EOS honoured
        SamplingParams(max_tokens=10, temperature=0.7, top_k=5, seed=3, logprobs=1),
    ]
    sync, overlap = both(model_dir, num_kv_blocks=96, max_running=8)
    got_outs, want_outs = overlap.generate(ps, params), sync.generate(ps, params)
    got, want = summary(got_outs), summary(want_outs)
    assert got == want
    assert logprobs(got_outs) == pytest.approx(logprobs(want_outs), abs=1e-4)
    assert want[0][1] == "stop" and want[0][2] == ref[0].token_ids[3]
    assert_clean(overlap)


def test_seeded_penalised_and_min_tokens_rows_overlap_and_draw_what_synchronous_steps_draw(model_dir):
    """A seeded row's noise and a min_tokens mask depend on how many tokens came before the
    sample, penalties on which: the pending token is counted (SamplingRow.pending) and read on
    the device where a penalty needs it, so every step stays in flight."""
    ps = prompts(6, (6, 19))
    eos = LLM(model_dir, num_kv_blocks=96, overlap_schedule=False).engine.eos_token_ids
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=11),
              SamplingParams(max_tokens=12, temperature=1.2, top_p=0.9, seed=5, min_tokens=9),
              SamplingParams(max_tokens=12, temperature=0, min_tokens=12, stop_token_ids=sorted(eos)[:1]),
              SamplingParams(max_tokens=12, temperature=1.0, seed=2**40 + 3, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.5),
              SamplingParams(max_tokens=12, temperature=0.7, seed=9, frequency_penalty=1.5, presence_penalty=0.8)]
    sync, overlap = both(model_dir, num_kv_blocks=96, max_running=8)
    got_outs, want_outs = overlap.generate(ps, params), sync.generate(ps, params)
    assert summary(got_outs) == summary(want_outs)
    assert len(got_outs[2].token_ids) == 12  # nothing stops it before min_tokens
    eng = overlap.engine
    for p, sp in zip(ps, params):
        eng.admit(p, sp)
    in_flight = 0
    while eng.has_unfinished():
        eng.step()
        in_flight += eng._inflight is not None
    assert in_flight >= 10  # the decode steps stayed in flight
    assert_clean(overlap)
    # The penalties bite: without them the same prompts decode otherwise.
    plain = sync.generate(ps[4:], [SamplingParams(max_tokens=12, temperature=0),
                                   SamplingParams(max_tokens=12, temperature=0.7, seed=9)])
    assert [o.token_ids for o in plain] != [o.token_ids for o in want_outs[4:]]


def test_context_end_and_preemption_match(model_dir):
    """max_model_len ends sequences (the pending token fills the context), and a cache too
    small for the batch preempts while tokens are pending, by recompute and by swap."""
    ps = prompts(6, (30, 11, 45))
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    for swap_gb in (0.0, 0.01):
        sync, overlap = both(model_dir, num_kv_blocks=14, max_running=6, max_model_len=64, swap_space_gb=swap_gb)
        got, want = overlap.generate(ps, params), sync.generate(ps, params)
        assert summary(got) == summary(want)
        assert {o.finish_reason for o in want} == {"length"}
        assert max(len(p) + len(o.token_ids) for p, o in zip(ps, want)) == 64
        assert overlap.engine.stats().num_preemptions > 0
        assert_clean(overlap)


def test_abort_while_a_step_is_in_flight(model_dir):
    e = LLM(model_dir, num_kv_blocks=64, overlap_schedule=True).engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    keep, drop = (e.admit(p, params) for p in prompts(2, (9, 14)))
    outputs: list[StepOutput] = []
    while len(drop.output_token_ids) < 3:
        outputs += e.step()
    assert e._inflight is not None  # the next step is running on the device
    assert e.abort(drop.request_id)
    assert drop.finish_reason is FinishReason.ABORT
    while e.has_unfinished():
        outputs += e.step()
    assert keep.finish_reason is FinishReason.LENGTH and len(keep.output_token_ids) == 30
    streamed = [t for o in outputs if o.request_id == keep.request_id for t in o.new_token_ids]
    assert streamed == keep.output_token_ids  # every token reached the caller exactly once
    dropped = [t for o in outputs if o.request_id == drop.request_id for t in o.new_token_ids]
    assert dropped == drop.output_token_ids and len(dropped) < 30
    assert e.num_free_blocks_after_reset() == e.num_total_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_warm_up_runs_its_steps_and_leaves_no_trace(model_dir, overlap):
    """The start-up warm-up (on by default on CUDA) runs here by hand: afterwards nothing is
    queued or held, and generation gives what a fresh engine gives."""
    ps = prompts(5, (3, 17, 40))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    fresh = LLM(model_dir, overlap_schedule=overlap, num_kv_blocks=96, max_model_len=256)
    warmed = LLM(model_dir, overlap_schedule=overlap, num_kv_blocks=96, max_model_len=256)
    free_before = warmed.engine.num_free_blocks_after_reset()
    assert warmed.engine.warm_up() > 0
    assert_clean(warmed)
    assert warmed.engine.num_free_blocks_after_reset() == free_before
    assert summary(warmed.generate(ps, params)) == summary(fresh.generate(ps, params))


def test_workers_warm_up_unless_told_not_to():
    from worker.config import build_parser, config_from_args

    for argv, want in (([], True), (["--no-warm-up"], False)):
        args = build_parser("decode").parse_args(["--model", "m", *argv])
        assert config_from_args(args, "decode").engine_config().warm_up is want


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_reservation_never_gets_blocks_a_step_in_flight_writes(model_dir, prefix_cache):
    """A sequence that a step ends is scheduled in the next step anyway, which writes its last
    token's K/V while it runs. A Reserve made meanwhile (it does not wait for the device) must not
    get those blocks: a transport writes a reservation's blocks on its own stream. They go back
    to the pool once that step is done."""
    prompt = list(range(40, 60))  # 20 tokens + a few out: 2 blocks of 16
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    third = LLM(model_dir, num_kv_blocks=16).generate([prompt], greedy)[0].token_ids[2]
    llm = LLM(model_dir, num_kv_blocks=16, overlap_schedule=True, enable_prefix_cache=prefix_cache)
    e = llm.engine
    # Ends on a stop token, which the scheduler cannot see coming (a length it can: it would not
    # schedule the sequence again).
    params = SamplingParams(max_tokens=50, temperature=0, stop_token_ids=[third])
    e.admit(prompt, params, "a")
    blocks: list[int] = []
    while True:
        seq = e._scheduler.get("a")
        if seq is not None:
            blocks = list(seq.block_table)
        outs = e.step()
        if any(o.request_id == "a" and o.finished for o in outs):
            break
    assert e._inflight is not None and blocks  # "a" ended while the next step, holding it too, runs
    kept = {b for _seq, _match, held in e._scheduler.unreleased for b in held}
    assert kept == set(blocks)
    got = e.reserve("b", list(range(100, 130)), SamplingParams(max_tokens=4))  # 30 tokens: 2 blocks
    assert got is not None
    _cached, dest = got
    assert not set(dest) & set(blocks), (dest, blocks)  # LIFO would have handed out a's last block
    e.settle()
    assert not e._scheduler.unreleased
    assert e.release("b")
    assert e.num_free_blocks_after_reset() == e.num_total_blocks


@pytest.mark.parametrize("overlap", [False, True])
def test_steps_without_outputs_leave_the_requests_as_with_them(model_dir, overlap):
    """`step(outputs=False)` (LLM.generate's loop) returns only the outputs that end a request and
    changes nothing else: the requests end with the tokens, logprobs, texts and reasons that stepping with outputs gives,
    stop strings and seeds included."""
    ps = prompts(9, (3, 17, 40, 9))
    params = [SamplingParams(max_tokens=2 + i, temperature=0 if i % 2 else 0.9, seed=None if i % 2 else i,
                             logprobs=1 if i % 3 == 0 else None, stop=["e"] if i == 4 else None, ignore_eos=True)
              for i in range(len(ps))]
    ends = []
    for outputs in (True, False):
        llm = LLM(model_dir, num_kv_blocks=96, max_running=4, max_batched_tokens=32, overlap_schedule=overlap)
        e = llm.engine
        reqs = [e.admit(p, sp) for p, sp in zip(ps, params)]
        returned = []
        while e.has_unfinished():
            returned += e.step(outputs=outputs)
        # Without outputs a step returns only those that end a request: one each.
        ended = [o for o in returned if o.finished]
        assert sorted(o.request_id for o in ended) == sorted(r.request_id for r in reqs)
        assert (len(returned) > len(ended)) == outputs
        ends.append([(r.output_token_ids, e.output_text(r), r.finish_reason, r.stop_reason,
                      [(lp.token_id, round(lp.logprob, 4)) if lp else None for lp in r.output_logprobs]) for r in reqs])
        assert_clean(llm)
    assert ends[0] == ends[1]


def test_llm_keeps_no_kv_events(model_dir):
    """The prefix cache's events are for a worker's publisher; `LLM` has none, so it records
    none (they would grow by one per block for as long as the LLM lives)."""
    llm = LLM(model_dir, num_kv_blocks=96, max_running=4)
    llm.generate(prompts(6, (40, 17)), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    assert llm.engine.cache.cached_blocks > 0
    assert llm.engine.cache.drain_events() == []

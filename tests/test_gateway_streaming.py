"""The gateway's OutputAssembler: exactly-once token accounting across deltas, UTF-8-safe
text, stop strings cut exactly (armed after min_tokens), EOS / stop ids, max_tokens and the
context limit, on the byte-level demo tokenizer (token id = byte)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.demo import write_byte_tokenizer
from gateway.streaming import OutputAssembler
from tandem.tokenizer import Tokenizer
from tandem.types import SamplingParams
from tandem.wire import TokenLogprob

EOS = 257


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d: Path = tmp_path_factory.mktemp("bytetok")
    write_byte_tokenizer(d)
    return Tokenizer.from_dir(d)


def ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def run(tok: Tokenizer, tokens: list[int], split: int, prompt: str = "Q: ", context: int = 512, **params):
    """Feed `tokens` in deltas of `split`; return (text, token ids, final emission)."""
    asm = OutputAssembler(tok, ids(prompt), SamplingParams(**params), [EOS], context)
    text, out, last = [], [], None
    for i in range(0, len(tokens), split):
        em = asm.add(tokens[i:i + split])
        text.append(em.text)
        out.extend(em.token_ids)
        if em.finish_reason is not None:
            last = em
            break
    if last is None:
        last = asm.finish("stop", "eos")
        text.append(last.text)
    assert out == asm.output_ids and asm.delivered == len(out)
    return "".join(text), out, last


@pytest.mark.parametrize("split", [1, 2, 3, 100])
def test_stop_string_cut_exactly_whatever_the_deltas(tok: Tokenizer, split: int) -> None:
    tokens = ids("hello world and more")
    text, out, last = run(tok, tokens, split, stop=["lo w"], max_tokens=50)
    assert text == "hel"
    assert out == ids("hello w")  # tokens up to the one completing the stop string, no further
    assert (last.finish_reason, last.stop_reason, last.matched_stop) == ("stop", "stop_string", "lo w")


def test_text_before_min_tokens_is_not_matched(tok: Tokenizer) -> None:
    text, out, last = run(tok, ids("aaaa"), 1, stop=["a"], min_tokens=3, max_tokens=10)
    assert text == "aa" and out == ids("aaa") and last.stop_reason == "stop_string"


def test_eos_and_stop_token_ids(tok: Tokenizer) -> None:
    text, out, last = run(tok, ids("ab") + [EOS] + ids("cd"), 2, max_tokens=10)
    assert (text, out, last.stop_reason, last.matched_stop) == ("ab", ids("ab") + [EOS], "eos", None)
    text, out, last = run(tok, ids("ab") + [EOS] + ids("cd"), 2, max_tokens=5, ignore_eos=True)
    assert out == ids("ab") + [EOS] + ids("cd") and text == "abcd" and last.finish_reason == "length"
    text, out, last = run(tok, ids("abcd"), 1, stop_token_ids=[ord("c")], max_tokens=10)
    assert (text, last.stop_reason, last.matched_stop) == ("ab", "stop_token_id", ord("c"))
    text, out, last = run(tok, [EOS] + ids("xy"), 1, min_tokens=2, max_tokens=3)
    assert out == [EOS] + ids("xy") and last.finish_reason == "length"  # EOS before min_tokens ignored


def test_max_tokens_and_context_end_with_length(tok: Tokenizer) -> None:
    text, out, last = run(tok, ids("abcdefgh"), 3, max_tokens=4)
    assert (text, out, last.finish_reason) == ("abcd", ids("abcd"), "length")
    text, out, last = run(tok, ids("abcdefgh"), 3, prompt="0123", context=7, max_tokens=100)
    assert out == ids("abc") and last.finish_reason == "length"  # 4 prompt + 3 output = context


def test_nothing_after_the_end(tok: Tokenizer) -> None:
    asm = OutputAssembler(tok, ids("p"), SamplingParams(max_tokens=2), [EOS], 512)
    assert asm.add(ids("abc")).token_ids == ids("ab")
    after = asm.add(ids("d"))
    assert after.empty and asm.output_ids == ids("ab")
    assert asm.finish("abort").empty


def test_held_back_text_is_released_at_finish(tok: Tokenizer) -> None:
    asm = OutputAssembler(tok, ids("p"), SamplingParams(stop=["xyz"], max_tokens=10), [EOS], 512)
    assert asm.add(ids("abx")).text == "ab"  # "x" may start "xyz"
    final = asm.finish("abort", "aborted by request")
    assert (final.text, final.finish_reason, final.stop_reason) == ("x", "abort", "aborted by request")


def test_multibyte_characters_are_never_split(tok: Tokenizer) -> None:
    tokens = ids("é€!")
    asm = OutputAssembler(tok, ids("p"), SamplingParams(max_tokens=20), [EOS], 512)
    deltas = [asm.add([t]).text for t in tokens]
    assert "".join(deltas) == "é€!"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[0] == "" and deltas[1] == "é"


def test_text_can_be_left_out_but_stops_still_apply(tok: Tokenizer) -> None:
    asm = OutputAssembler(tok, ids("p"), SamplingParams(stop=["cd"], max_tokens=10), [EOS], 512, want_text=False)
    em = asm.add(ids("abcdef"))
    assert em.text == "" and em.token_ids == ids("abcd") and em.stop_reason == "stop_string"


def test_logprobs_travel_with_their_tokens(tok: Tokenizer) -> None:
    asm = OutputAssembler(tok, ids("p"), SamplingParams(logprobs=1, max_tokens=10), [EOS], 512)
    lps = [TokenLogprob(97, -0.5, ((97, -0.5),)), TokenLogprob(98, -1.0, ((99, -0.2),))]
    em = asm.add([97, 98], lps)
    assert em.logprobs == lps
    no_lp = OutputAssembler(tok, ids("p"), SamplingParams(max_tokens=10), [EOS], 512).add([97], lps[:1])
    assert no_lp.logprobs == []


def test_usage_counts_delivered_tokens_and_caps_cached(tok: Tokenizer) -> None:
    asm = OutputAssembler(tok, ids("prompt"), SamplingParams(max_tokens=10), [EOS], 512)
    asm.add(ids("abc"))
    u = asm.usage(cached_tokens=100)
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (6, 3, 6)

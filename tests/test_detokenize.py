"""Incremental detokenization and stop-string matching (tandem.detokenize)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from tandem.detokenize import IncrementalDetokenizer, StopMatcher
from tandem.tokenizer import Tokenizer

CORPUS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "Hello world, héllo naïve café — “quoted” text… 日本語 テキスト",
    "def main():\n    return 42  # comment\n\n",
    "Emoji time 😀🎉 and more emoji 🐶",
] * 20
TEXTS = [
    "Once upon a time, there was a cat.", "  leading spaces and trailing  ", "new\nlines\n\nhere",
    "emoji 😀🎉🐶 and rare 🦄 ones", "日本語のテキスト and Ж Ω ✓", "café — “quoted”…", "a", " ",
]


def _sentencepiece_style() -> Backend:
    trained = Backend(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tok


def _byte_level() -> Backend:
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\s*[\r\n]+|\s+(?!\S)|\s+| ?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+"),
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=350, special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


@pytest.fixture(scope="module", params=["sentencepiece", "bytelevel"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "sentencepiece":
        _sentencepiece_style().save(str(directory / "tokenizer.json"))
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    else:
        _byte_level().save(str(directory / "tokenizer.json"))
        config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(directory)


def stream(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [detok.push([token]) for token in output]
    return deltas + [detok.flush()]


def test_deltas_concatenate_to_decode_without_prompt(tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = stream(tokenizer, [], ids)
        assert "".join(deltas) == tokenizer.decode(ids) == text
        assert all(not d.endswith("\ufffd") for d in deltas)


def test_deltas_after_prompt_continue_the_prompt_text(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Once upon a time")
    for text in TEXTS:
        output = tokenizer.encode(" " + text, add_special_tokens=False)
        full, prefix = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
        assert full.startswith(prefix)
        assert "".join(stream(tokenizer, prompt, output)) == full[len(prefix):]


def test_sentencepiece_output_keeps_its_leading_space(tokenizer: Tokenizer) -> None:
    prompt, full = tokenizer.encode("Once upon a"), tokenizer.encode("Once upon a time")
    assert full[: len(prompt)] == prompt
    output = full[len(prompt):]
    assert tokenizer.decode(output) in ("time", " time")  # SentencePiece decoding alone drops the space
    assert "".join(stream(tokenizer, prompt, output)).startswith(" time")


def test_multibyte_character_held_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a 🦄 b", add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the emoji must span several tokens for this test"
    deltas = stream(tokenizer, [], ids)
    assert all("\ufffd" not in d for d in deltas)
    for i in range(len(ids)):
        prefix = tokenizer.decode(ids[: i + 1])
        if prefix.endswith("\ufffd"):
            assert deltas[i] == ""
        elif "🦄" in prefix and "🦄" not in tokenizer.decode(ids[:i]):
            assert "🦄" in deltas[i]
    assert "".join(deltas) == "a 🦄 b"


def test_dangling_partial_character_is_flushed(tokenizer: Tokenizer) -> None:
    emoji = tokenizer.encode("🦄", add_special_tokens=False)
    partial = emoji[:-1] if tokenizer.decode(emoji[:-1]).endswith("\ufffd") else emoji[:1]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    assert "\ufffd" not in detok.push(partial)
    assert detok.flush().endswith("\ufffd")


def test_pushing_several_tokens_at_once(tokenizer: Tokenizer) -> None:
    prompt, output = tokenizer.encode("Hello"), tokenizer.encode(" world 😀 and café", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    joined = detok.push(output[:3]) + detok.push(output[3:]) + detok.flush()
    assert joined == "".join(stream(tokenizer, prompt, output))
    assert detok.output_token_ids == output


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    eos = min(tokenizer.eos_token_ids)
    eos_text = tokenizer.convert_ids_to_tokens([eos])[0]
    output = tokenizer.encode(" done", add_special_tokens=False) + [eos]
    prompt = tokenizer.encode("We are")
    assert eos_text not in "".join(stream(tokenizer, prompt, output, skip=True))
    assert "".join(stream(tokenizer, prompt, output, skip=False)).endswith(eos_text)


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab c\néé😀日Ж.")), min_size=1, max_size=30),
       cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=6))
def test_chunking_does_not_change_the_stream(tokenizer: Tokenizer, text: str, cuts: list[int]) -> None:
    prompt = tokenizer.encode("Start:")
    output = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    bounds = sorted({0, len(output), *(c for c in cuts if c < len(output))})
    chunked = "".join(detok.push(output[a:b]) for a, b in zip(bounds, bounds[1:])) + detok.flush()
    assert chunked == "".join(stream(tokenizer, prompt, output))
    full, prefix = tokenizer.decode(prompt + output), tokenizer.decode(prompt)
    assert chunked == full[len(prefix):]


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab c\néé😀日Ж.")), min_size=0, max_size=30),
       prompt_text=st.sampled_from(["", "Start:", "日本", "😀"]), cut=st.integers(min_value=0, max_value=6),
       skip=st.booleans())
def test_finish_equals_pushing_one_by_one(tokenizer: Tokenizer, text: str, prompt_text: str, cut: int,
                                          skip: bool) -> None:
    """finish(ids) (two decodes) gives exactly what pushing the ids one by one and flushing gives,
    also for a prompt whose last tokens end inside a character and for an empty output."""
    prompt = tokenizer.encode(prompt_text) if prompt_text else []
    prompt = prompt[: max(0, len(prompt) - cut)] if cut < len(prompt) else prompt
    output = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    assert detok.finish(output) == "".join(stream(tokenizer, prompt, output, skip))
    assert detok.output_token_ids == output


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=299), max_size=12),
       prompt_text=st.sampled_from(["", "Hello world", "日本"]))
def test_finish_equals_pushing_one_by_one_for_any_ids(tokenizer: Tokenizer, ids: list[int], prompt_text: str) -> None:
    """Arbitrary ids, as a model may sample them: byte-fallback tokens that never form valid
    UTF-8, special tokens, a character cut off at the end."""
    prompt = tokenizer.encode(prompt_text) if prompt_text else []
    assert IncrementalDetokenizer(tokenizer, prompt).finish(ids) == "".join(stream(tokenizer, prompt, ids))


def reference_stream(tok: Tokenizer, prompt: list[int], output: list[int]) -> str:
    """The prefix/read-offset algorithm written plainly: every id stays in the window and both
    windows are decoded at every step."""
    ids = list(prompt[max(len(prompt) - 5, 0):])
    prefix, read, out = 0, len(ids), []
    for i, token in enumerate(output + [None]):
        final = token is None
        if not final:
            ids.append(token)
        before, after = tok.decode(ids[prefix:read]), tok.decode(ids[prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            out.append(after[len(before):])
            prefix, read = read, len(ids)
    return "".join(out)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), prompt_text=st.sampled_from(["", "Hello world", "日本"]))
def test_ids_past_the_vocabulary_decode_to_nothing(tokenizer: Tokenizer, data: st.DataObject, prompt_text: str) -> None:
    """A model's embedding table is often padded past its tokenizer's vocabulary, so a model can
    sample ids that have no entry. They are skipped (never held in the window), and the text is
    what the plain algorithm gives with them kept."""
    limit = tokenizer.id_limit
    ids = data.draw(st.lists(st.one_of(st.integers(0, limit - 1), st.integers(limit, limit + 1000)), max_size=24))
    prompt = tokenizer.encode(prompt_text) if prompt_text else []
    expected = reference_stream(tokenizer, prompt, ids)
    assert "".join(stream(tokenizer, prompt, ids)) == expected
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.finish(ids) == expected
    assert detok.output_token_ids == ids


# ----------------------------------------------------------------- StopMatcher


def reference_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Scan character by character; at the first position where some stop string ends, cut
    before the longest such stop string."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


def run_matcher(stops: list[str], deltas: list[str]) -> tuple[str, bool, list[str]]:
    matcher = StopMatcher(stops)
    emitted, pieces = "", []
    stopped = False
    for delta in deltas:
        out, stopped = matcher.feed(delta)
        pieces.append(out)
        emitted += out
        if stopped:
            break
    if not stopped:
        emitted += matcher.flush()
    return emitted, stopped, pieces


def test_stop_string_cut_exactly_and_excluded() -> None:
    emitted, stopped, pieces = run_matcher(["STOP"], ["Hello wor", "ld! STO", "P here"])
    assert (emitted, stopped) == ("Hello world! ", True)
    assert pieces[1] == "ld! "  # "STO" held back: it may still become "STOP"


def test_held_text_released_when_it_cannot_become_a_stop() -> None:
    matcher = StopMatcher(["\n\nUser:"])
    assert matcher.feed("answer\n") == ("answer", False)
    assert matcher.feed("\nUse") == ("", False)
    assert matcher.feed("d it") == ("\n\nUsed it", False)
    assert matcher.feed(" \n") == (" ", False)
    assert matcher.flush() == "\n"
    assert not matcher.stopped and matcher.stop_string is None


def test_first_completed_stop_wins() -> None:
    assert run_matcher(["abcd", "bc"], ["abcd"])[:2] == ("a", True)
    assert run_matcher(["abc", "bc"], ["xabc"])[:2] == ("x", True)
    matcher = StopMatcher(["world", "o"])
    assert matcher.feed("hello world") == ("hell", True)
    assert matcher.stop_string == "o"


def test_after_stop_nothing_more_is_emitted() -> None:
    matcher = StopMatcher(["."])
    assert matcher.feed("One. Two") == ("One", True)
    assert matcher.feed("more") == ("", True)
    assert matcher.flush() == ""


def test_no_stop_strings_pass_through() -> None:
    for stops in (None, []):
        matcher = StopMatcher(stops)
        assert matcher.feed("anything") == ("anything", False)
        assert matcher.flush() == ""


@pytest.mark.parametrize("bad", ["STOP", [""], ["ok", 3], 5])
def test_invalid_stop_strings_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="stop"):
        StopMatcher(bad)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="ab\nc", max_size=25),
       stops=st.lists(st.text(alphabet="ab\nc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(min_value=0, max_value=25), max_size=8))
def test_result_independent_of_delta_boundaries(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, stopped, _ = run_matcher(stops, deltas)
    assert (emitted, stopped) == reference_stop(text, stops)

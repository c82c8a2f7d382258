"""tandem.tokenizer against transformers on Llama-, Llama-3- and Qwen-style tokenizer directories.

The directories are built here with the `tokenizers` library (trained on a small corpus) in
the layouts those model families ship, so the tests need no downloads.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as Backend

from tandem.tokenizer import Tokenizer

CORPUS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "The quick brown fox jumps over the lazy dog! 1234567890 times?",
    "Hello world, hello tokenizer; héllo naïve café — “quoted” text… 日本語 テキスト",
    "def main():\n    return 42  # comment\n\n",
    "Emoji time 😀🎉 and more emoji 🐶",
] * 20
QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SAMPLES = [
    "Once upon a time", " leading space", "  two leading", "trailing  ", "new\nlines\n\n", "tabs\tand  spaces",
    "Numbers 3.14159 and 1,000,000", "héllo café — “quoted”…", "日本語のテキスト", "😀🎉 emoji 🐶🐱",
    "unseen chars: ЖΩ✓", "", " ", "it's they're we'll", "x" * 30, "mixed\r\nendings",
]
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role: ' + message.role) }}"
    "{%- endif %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Block tags without '-': the output depends on trim_blocks / lstrip_blocks.
LLAMA3_TEMPLATE = """{{ bos_token }}{% for message in messages %}
    {% if message['role'] == 'assistant' %}
<|start_header_id|>assistant<|end_header_id|>

{% generation %}{{ message['content'] | trim }}{% endgeneration %}<|eot_id|>
    {% else %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
{% if tools %}{{ tools | tojson }}{% endif %}"""


def _byte_level(specials: list[str]) -> Backend:
    tok = Backend(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _sentencepiece_style(prefix: str) -> Backend:
    """Llama-2 layout: <unk> <s> </s>, 256 byte tokens, merged pieces; ▁ for spaces."""
    trained = Backend(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Backend(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if prefix == "normalizer":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return tok


def _write(directory: Path, backend: Backend, files: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (directory / name).write_text(text, encoding="utf-8")
    return directory


def make_llama2(directory: Path, prefix: str = "metaspace", bos_post_processor: bool = True,
                config_extra: dict | None = None) -> Path:
    backend = _sentencepiece_style(prefix)
    if bos_post_processor:
        backend.post_processor = processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)])
    config = {"tokenizer_class": "LlamaTokenizer" if prefix == "metaspace" else "PreTrainedTokenizerFast",
              "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "normalized": False,
                            "rstrip": False, "single_word": False, "special": True},
              "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None, "legacy": False,
              "clean_up_tokenization_spaces": False, **(config_extra or {})}
    return _write(directory, backend, {"tokenizer_config.json": config})


def make_qwen(directory: Path) -> Path:
    backend = _byte_level(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False,
              "clean_up_tokenization_spaces": False, "chat_template": CHATML}
    generation = {"eos_token_id": [2, 0], "bos_token_id": 0}
    return _write(directory, backend, {"tokenizer_config.json": config, "generation_config.json": generation})


def make_llama3(directory: Path) -> Path:
    backend = _byte_level(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
                           "<|end_header_id|>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", 0)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|eot_id|>", "clean_up_tokenization_spaces": False, "chat_template": LLAMA3_TEMPLATE}
    return _write(directory, backend, {"tokenizer_config.json": config,
                                       "generation_config.json": {"eos_token_id": [1, 2]},
                                       "config.json": {"eos_token_id": 1, "bos_token_id": 0}})


MAKERS = {"llama2": make_llama2, "llama2-normalizer": lambda d: make_llama2(d, prefix="normalizer"),
          "qwen": make_qwen, "llama3": make_llama3}


@pytest.mark.parametrize("style", sorted(MAKERS))
def test_encode_decode_match_transformers(style: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    directory = MAKERS[style](tmp_path / style)
    ours = Tokenizer.from_dir(directory)
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    specials = sorted(ours.special_tokens.values())
    samples = SAMPLES + [f"{specials[0]}inline {specials[-1]} special", f"a{specials[-1]}b"]
    for text in samples:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == auto.encode(text, add_special_tokens=add), (text, add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    assert ours.bos_token_id == auto.bos_token_id or (ours.bos_token_id is not None and auto.bos_token_id is None)
    assert len(auto) == ours.vocab_size


def test_special_token_sets(tmp_path: Path) -> None:
    qwen = Tokenizer.from_dir(make_qwen(tmp_path / "qwen"))
    ids = {t: qwen.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert qwen.eos_token_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    assert qwen.special_token_ids == set(ids.values())
    assert qwen.pad_token_id == ids["<|endoftext|>"]
    assert qwen.bos_token_id == 0  # none in tokenizer_config: generation_config's is used
    llama3 = Tokenizer.from_dir(make_llama3(tmp_path / "llama3"))
    assert llama3.eos_token_ids == {llama3.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>")}
    assert llama3.bos_token_id == llama3.token_to_id("<|begin_of_text|>")


@pytest.mark.parametrize("post_bos", [True, False])
@pytest.mark.parametrize("flag", [None, True, False])
def test_bos_added_exactly_once_per_add_bos_token(post_bos: bool, flag: bool | None, tmp_path: Path) -> None:
    extra = {} if flag is None else {"add_bos_token": flag}
    tok = Tokenizer.from_dir(make_llama2(tmp_path / "t", bos_post_processor=post_bos, config_extra=extra))
    plain = tok.encode("Once upon a time", add_special_tokens=False)
    assert plain and tok.bos_token_id not in plain
    wants_bos = post_bos if flag is None else flag
    assert tok.encode("Once upon a time") == ([tok.bos_token_id] if wants_bos else []) + plain


def test_add_eos_token(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(make_llama2(tmp_path / "t", config_extra={"add_bos_token": True, "add_eos_token": True}))
    plain = tok.encode("hello", add_special_tokens=False)
    assert tok.encode("hello") == [tok.bos_token_id, *plain, tok.token_to_id("</s>")]


@pytest.mark.parametrize("style", ["qwen", "llama3"])
def test_chat_template_matches_transformers(style: str, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    directory = MAKERS[style](tmp_path / style)
    ours = Tokenizer.from_dir(directory)
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    conversations = [
        [{"role": "user", "content": "Hi there!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  2+2?  "},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    ]
    for messages in conversations:
        for add in (True, False):
            expected = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours.apply_chat_template(messages, add_generation_prompt=add) == expected
    extra = {"enable_thinking": False} if style == "qwen" else {"tools": [{"name": "f", "description": "é"}]}
    expected = auto.apply_chat_template(conversations[0], tokenize=False, add_generation_prompt=True, **extra)
    assert ours.apply_chat_template(conversations[0], **extra) == expected


def test_chat_template_errors(tmp_path: Path) -> None:
    qwen = Tokenizer.from_dir(make_qwen(tmp_path / "qwen"))
    with pytest.raises(ValueError, match="bad role: robot"):
        qwen.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="messages"):
        qwen.apply_chat_template("hello")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        qwen.apply_chat_template([{"content": "no role"}])
    no_template = Tokenizer.from_dir(make_llama2(tmp_path / "llama"))
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_sources_and_priority(tmp_path: Path) -> None:
    directory = make_qwen(tmp_path / "qwen")
    user = [{"role": "user", "content": "hi"}]
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT {{ bos_token }}"}]
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(chat_template=named, bos_token="<|endoftext|>")
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(directory).apply_chat_template(user) == "DEFAULT <|endoftext|>"
    (directory / "chat_template.json").write_text(json.dumps({"chat_template": "JSON {{ messages[0].content }}"}))
    assert Tokenizer.from_dir(directory).apply_chat_template(user) == "JSON hi"
    (directory / "chat_template.jinja").write_text("JINJA {{ add_generation_prompt }}")
    assert Tokenizer.from_dir(directory).apply_chat_template(user, add_generation_prompt=False) == "JINJA False"


def test_missing_or_malformed_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    broken_json = make_qwen(tmp_path / "a")
    (broken_json / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_dir(broken_json)
    bad_config = make_qwen(tmp_path / "b")
    (bad_config / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_dir(bad_config)
    bad_eos = make_qwen(tmp_path / "c")
    (bad_eos / "generation_config.json").write_text(json.dumps({"eos_token_id": "eos"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        Tokenizer.from_dir(bad_eos)
    out_of_range = make_qwen(tmp_path / "d")
    (out_of_range / "config.json").write_text(json.dumps({"eos_token_id": [10**6]}))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer.from_dir(out_of_range)
    bad_token = make_llama2(tmp_path / "e", config_extra={"eos_token": 7})
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer.from_dir(bad_token)


def test_bad_arguments(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(make_qwen(tmp_path / "qwen"))
    with pytest.raises(ValueError, match="text"):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        tok.decode([-1])


def test_import_stays_free_of_torch_and_transformers() -> None:
    code = ("import sys, tandem.tokenizer, tandem.detokenize; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1]).returncode == 0

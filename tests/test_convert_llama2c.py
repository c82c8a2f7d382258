"""The llama2.c converter against llama2.c's own algorithms, re-implemented here from run.c.

Encoding is checked against a pure-Python copy of run.c's `encode`, the converted weights
against a NumPy copy of run.c's `forward` (interleaved RoPE) on the raw checkpoint arrays,
and the output directory against transformers' loaders.
"""
from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from engine.convert import convert_llama2c, main_convert
from engine.convert.llama2c import read_llama2c_checkpoint
from tandem.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "stories260K"
CHECKPOINT = MODEL_DIR / "stories260K.bin"
TOKENIZER = MODEL_DIR / "tok512.bin"

pytestmark = pytest.mark.skipif(not CHECKPOINT.is_file() or not TOKENIZER.is_file(),
                                reason=f"test model not present at {MODEL_DIR}")


# ----------------------------------------------------------- llama2.c reference


def read_tok_bin(path: Path) -> tuple[list[bytes], list[float]]:
    data = path.read_bytes()
    pieces, scores, pos = [], [], 4
    while pos < len(data):
        score, length = struct.unpack_from("<fi", data, pos)
        pieces.append(data[pos + 8 : pos + 8 + length])
        scores.append(score)
        pos += 8 + length
    return pieces, scores


def llama2c_encode(text: str, pieces: list[bytes], scores: list[float]) -> list[int]:
    """run.c `encode(t, text, bos=1, eos=0)`."""
    lookup: dict[bytes, int] = {}
    for i, piece in enumerate(pieces):
        lookup.setdefault(piece, i)
    tokens = [1]
    if text:
        tokens.append(lookup[b" "])  # the dummy prefix
    data = text.encode("utf-8")
    i = 0
    while i < len(data):
        j = i + 1
        while j < len(data) and (data[j] & 0xC0) == 0x80 and j - i < 4:
            j += 1
        chunk = data[i:j]
        if chunk in lookup:
            tokens.append(lookup[chunk])
        else:
            tokens.extend(b + 3 for b in chunk)
        i = j
    while True:
        best_score, best_id, best_idx = -1e10, -1, -1
        for k in range(len(tokens) - 1):
            merged = lookup.get(pieces[tokens[k]] + pieces[tokens[k + 1]])
            if merged is not None and scores[merged] > best_score:
                best_score, best_id, best_idx = scores[merged], merged, k
        if best_idx == -1:
            return tokens
        tokens[best_idx : best_idx + 2] = [best_id]


def read_legacy_checkpoint(path: Path) -> tuple[dict[str, int], dict[str, np.ndarray]]:
    data = path.read_bytes()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack_from("<7i", data, 0)
    hp = dict(dim=dim, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=abs(vocab), seq_len=seq_len)
    floats = np.frombuffer(data, dtype="<f4", offset=28)
    kv = kv_heads * (dim // heads)
    shapes = [("emb", (abs(vocab), dim)), ("rms_att", (layers, dim)), ("wq", (layers, dim, dim)),
              ("wk", (layers, kv, dim)), ("wv", (layers, kv, dim)), ("wo", (layers, dim, dim)),
              ("rms_ffn", (layers, dim)), ("w1", (layers, hidden, dim)), ("w2", (layers, dim, hidden)),
              ("w3", (layers, hidden, dim)), ("rms_final", (dim,)), ("rope", (seq_len * dim // heads,))]
    if vocab < 0:
        shapes.append(("wcls", (abs(vocab), dim)))
    arrays, pos = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        arrays[name] = floats[pos : pos + n].reshape(shape).astype(np.float64)
        pos += n
    assert pos == len(floats)
    arrays.setdefault("wcls", arrays["emb"])
    return hp, arrays


def llama2c_forward(hp: dict[str, int], w: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """run.c `forward` for each position in turn; logits [len(tokens), vocab] in float64."""
    dim, heads, kv_heads = hp["dim"], hp["heads"], hp["kv_heads"]
    hs = dim // heads
    kv_dim = kv_heads * hs

    def rmsnorm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return weight * (x / np.sqrt(np.mean(x * x) + 1e-5))

    keys = np.zeros((hp["layers"], len(tokens), kv_dim))
    values = np.zeros_like(keys)
    logits = []
    for pos, token in enumerate(tokens):
        x = w["emb"][token].copy()
        for layer in range(hp["layers"]):
            xb = rmsnorm(x, w["rms_att"][layer])
            q, k, v = w["wq"][layer] @ xb, w["wk"][layer] @ xb, w["wv"][layer] @ xb
            for i in range(0, dim, 2):  # rotate interleaved pairs (v[i], v[i+1])
                freq = 1.0 / 10000.0 ** ((i % hs) / hs)
                c, s = np.cos(pos * freq), np.sin(pos * freq)
                for vec in ((q, k) if i < kv_dim else (q,)):
                    v0, v1 = vec[i], vec[i + 1]
                    vec[i], vec[i + 1] = v0 * c - v1 * s, v0 * s + v1 * c
            keys[layer, pos], values[layer, pos] = k, v
            out = np.zeros(dim)
            for h in range(heads):
                g = h // (heads // kv_heads)
                qh = q[h * hs : (h + 1) * hs]
                att = keys[layer, : pos + 1, g * hs : (g + 1) * hs] @ qh / np.sqrt(hs)
                att = np.exp(att - att.max())
                att /= att.sum()
                out[h * hs : (h + 1) * hs] = att @ values[layer, : pos + 1, g * hs : (g + 1) * hs]
            x = x + w["wo"][layer] @ out
            xb = rmsnorm(x, w["rms_ffn"][layer])
            gate = w["w1"][layer] @ xb
            x = x + w["w2"][layer] @ (gate / (1.0 + np.exp(-gate)) * (w["w3"][layer] @ xb))
        logits.append(w["wcls"] @ rmsnorm(x, w["rms_final"]))
    return np.stack(logits)


# --------------------------------------------------------------------- inputs

FIXED_STRINGS = [
    "Once upon a time, there was a little girl named Lily.",
    "Tim and Sam went to the park to play with a big red ball!",
    "\"Can I play too?\" asked the dog. \"Yes!\" said Lily.",
    "It's a dog's life, isn't it?",
    "  two leading spaces", "trailing spaces   ", "multiple   spaces    inside", " ", "  ", "a", "!",
    "new\nline", "\n\nstarts with newlines", "ends with newline\n", "tab\tseparated\tvalues",
    "Numbers: 0123456789, 3.14 and 1,000,000.", "2024-01-01 12:30", "$5 + 10% = ???",
    "Emoji 😀🎉 party 🐶🐱", "café naïve résumé — “quotes” ‘single’ …", "ñandú señor", "€100 ™",
    "日本語のテキスト", "Привет, мир!", "Γειά σου Κόσμε", "مرحبا", "ÀÉÎÕÜ àéîõü",
    "non\u00a0breaking and hair\u200aspace", "mixed\r\nwindows line", "x" * 40,
    "the the the the the", "Lily's friend, Timmy, saw a big red ball.", "[brackets] (parens) {braces} <angle>",
    "back\\slash and /slash | pipe ~ tilde ` tick", "ALL CAPS SENTENCE HERE", "CamelCaseWordsTogether",
    "snake_case_words_here", "email@example.com", "http://example.com/path?q=1&r=2", "Wow!!! Really??? Yes...",
]
WORDS = ("once upon a time there was little girl boy named Lily Tim Timmy Sue Ben she he they it "
         "saw big small red blue happy sad dog cat ball tree park mom dad friend play run jump "
         "wanted to with and the was very said loved went day sun home toy bird fish").split()
EXTRAS = ["😀", "🎉", "é", "ñ", "—", "…", "“", "”", "日", "本", "Ж", "\u00a0", "\u200a", "©", "½", "→"]


def varied_strings() -> list[str]:
    rng = random.Random(260)
    out = list(FIXED_STRINGS)
    while len(out) < 200:
        parts = []
        for _ in range(rng.randint(1, 14)):
            roll = rng.random()
            if roll < 0.6:
                word = rng.choice(WORDS)
                parts.append(word.capitalize() if rng.random() < 0.2 else word)
            elif roll < 0.7:
                parts.append(str(rng.randint(0, 10**rng.randint(1, 6))))
            elif roll < 0.85:
                parts.append(rng.choice(EXTRAS) * rng.randint(1, 2))
            else:
                parts.append(rng.choice([",", ".", "!", "?", "'", '"', ";", ":", "-", "(", ")"]))
        text = ""
        for part in parts:
            text += rng.choice([" ", " ", " ", "  ", "\n", "", "\t"]) + part
        out.append(text if rng.random() < 0.5 else text.lstrip())
    return out


# ---------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return convert_llama2c(CHECKPOINT, TOKENIZER, tmp_path_factory.mktemp("stories260K_hf"))


def test_writes_expected_files_and_config(converted: Path) -> None:
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "special_tokens_map.json"} <= names
    config = json.loads((converted / "config.json").read_text())
    header = struct.unpack_from("<7i", CHECKPOINT.read_bytes(), 0)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"],
            config["max_position_embeddings"]) == (*header[:5], abs(header[5]), header[6])
    assert config["tie_word_embeddings"] is (header[5] > 0)
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 10000.0
    assert (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"]) == (1, 2, "float32")


def test_encoding_matches_llama2c_and_round_trips(converted: Path) -> None:
    pieces, scores = read_tok_bin(TOKENIZER)
    tokenizer = Tokenizer.from_dir(converted)
    for text in varied_strings():
        ids = tokenizer.encode(text)
        assert ids == llama2c_encode(text, pieces, scores), text
        assert tokenizer.decode(ids) == text


def test_tokenizer_metadata(converted: Path) -> None:
    tokenizer = Tokenizer.from_dir(converted)
    assert tokenizer.vocab_size == len(read_tok_bin(TOKENIZER)[0])
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.special_token_ids == frozenset({0, 1, 2})
    assert tokenizer.convert_ids_to_tokens([1, 2, 3, 13]) == ["<s>", "</s>", "<0x00>", "<0x0A>"]


def test_transformers_loads_tokenizer_and_encodes_alike(converted: Path) -> None:
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(converted)
    ours = Tokenizer.from_dir(converted)
    for text in varied_strings():
        ids = ours.encode(text)
        assert auto.encode(text) == ids, text
        assert auto.decode(ids, skip_special_tokens=True) == ours.decode(ids)


@pytest.fixture(scope="module")
def untied_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stories checkpoint with a separate, random classifier (negative vocab in the header)."""
    data = bytearray(CHECKPOINT.read_bytes())
    header = list(struct.unpack_from("<7i", data, 0))
    header[5] = -abs(header[5])
    struct.pack_into("<7i", data, 0, *header)
    wcls = np.random.default_rng(7).normal(0.0, 0.1, size=(abs(header[5]), header[0])).astype("<f4")
    path = tmp_path_factory.mktemp("untied") / "untied.bin"
    path.write_bytes(bytes(data) + wcls.tobytes())
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_forward_matches_llama2c_reference(converted: Path, untied_checkpoint: Path, tied: bool,
                                           tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    checkpoint = CHECKPOINT if tied else untied_checkpoint
    out_dir = converted if tied else convert_llama2c(checkpoint, TOKENIZER, tmp_path / "hf")
    config = json.loads((out_dir / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    hp, arrays = read_legacy_checkpoint(checkpoint)
    tokens = Tokenizer.from_dir(out_dir).encode("Once upon a time, Lily saw a big dog.")
    expected = llama2c_forward(hp, arrays, tokens)

    model = transformers.LlamaForCausalLM.from_pretrained(out_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double().numpy()
    assert np.abs(logits - expected).max() < 1e-4
    if not tied:
        assert np.allclose(model.lm_head.weight.detach().numpy(), arrays["wcls"])


def test_greedy_generation_is_english(converted: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(converted).eval()
    tokenizer = Tokenizer.from_dir(converted)
    prompt = tokenizer.encode("Once upon a time")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False)
    text = tokenizer.decode(out[0, len(prompt):].tolist())
    words = re.findall(r"\S+", text)
    assert len(words) >= 25
    alphabetic = [w for w in (re.sub(r"[^\w']", "", w) for w in words) if w]
    assert sum(w.replace("'", "").isalpha() and w.isascii() for w in alphabetic) >= 0.9 * len(alphabetic)
    common = set("""a an the and but or so to of in on at with for from up down out was were is are be
        had has have he she it they we you i his her their them him there here this that then when
        one day time little big small girl boy mom dad friend friends named saw see said says play
        played playing loved love like liked wanted want went go going very happy sad good fun park
        ball dog cat tree toy toys home all not no yes too can could would will did do new red blue
        after as by into what who how lily tim timmy sue ben sam her him outside inside together
        asked looked found made make help helped came come run ran jump jumped because again""".split())
    assert sum(w.lower() in common for w in alphabetic) >= 0.5 * len(alphabetic)


def test_version1_checkpoint_converts_to_same_weights(converted: Path, tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    hp, w = read_legacy_checkpoint(CHECKPOINT)
    header = struct.pack("<Ii7iB", 0x616B3432, 1, hp["dim"], hp["hidden"], hp["layers"], hp["heads"],
                         hp["kv_heads"], hp["vocab"], hp["seq_len"], 1)
    order = ["rms_att", "rms_ffn", "rms_final", "emb", "wq", "wk", "wv", "wo", "w1", "w2", "w3"]
    body = b"".join(w[name].astype("<f4").tobytes() for name in order)
    v1 = tmp_path / "v1.bin"
    v1.write_bytes(header.ljust(256, b"\0") + body)
    out = convert_llama2c(v1, TOKENIZER, tmp_path / "hf")
    ours = safetensors_numpy.load_file(str(out / "model.safetensors"))
    reference = safetensors_numpy.load_file(str(converted / "model.safetensors"))
    assert ours.keys() == reference.keys()
    for name in reference:
        np.testing.assert_array_equal(ours[name], reference[name])


def test_reader_rejects_truncated_checkpoint(tmp_path: Path) -> None:
    broken = tmp_path / "broken.bin"
    broken.write_bytes(CHECKPOINT.read_bytes()[:-4])
    with pytest.raises(ValueError, match="broken.bin"):
        read_llama2c_checkpoint(broken)


def test_convert_rejects_tokenizer_of_other_vocabulary(tmp_path: Path) -> None:
    short = tmp_path / "short_tok.bin"
    data = TOKENIZER.read_bytes()
    short.write_bytes(data[: len(data) - 8 - len(read_tok_bin(TOKENIZER)[0][-1])])  # drop the last token
    with pytest.raises(ValueError, match="short_tok.bin"):
        convert_llama2c(CHECKPOINT, short, tmp_path / "out")


def test_cli_hook(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli_out"
    assert main_convert(["llama2c", str(CHECKPOINT), str(TOKENIZER), str(out)]) == 0
    pieces, scores = read_tok_bin(TOKENIZER)
    assert Tokenizer.from_dir(out).encode("Once upon a time") == llama2c_encode("Once upon a time", pieces, scores)
    assert (out / "model.safetensors").is_file()
    assert main_convert(["llama2c", str(tmp_path / "missing.bin"), str(TOKENIZER), str(out)]) == 2
    assert "missing.bin" in capsys.readouterr().err

"""Gateway admission checks: every GenerateRequest field is validated before queueing, with a
message naming the field; plus the torch-free model facts the gateway reads from the model
directory (identity equal to the engine's)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.demo import write_byte_tokenizer
from gateway.modelinfo import ServedModel, load_served_model
from gateway.validate import InvalidRequest, check_request_id, validate_request
from tandem import wire
from tandem.types import SamplingParams, Tier

CONTEXT = 64
VOCAB = 258


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> ServedModel:
    d = tmp_path_factory.mktemp("byte-model")
    write_byte_tokenizer(d)
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": VOCAB, "max_position_embeddings": CONTEXT,
        "eos_token_id": 257, "bos_token_id": 256, "torch_dtype": "float32",
    }))
    return load_served_model(d)


def roundtrip(prompt, params: SamplingParams | None = None, **kw) -> tuple[wire.GenerateInput, bool]:
    """Through the wire like a real request; returns the decoded input and max_tokens presence."""
    msg = wire.generate_request_to_proto(prompt, params or SamplingParams(), **kw)
    return wire.generate_request_from_proto(msg), msg.params.HasField("max_tokens")


def check(model: ServedModel, prompt, params: SamplingParams | None = None, **kw):
    inp, has_max = roundtrip(prompt, params, **kw)
    return validate_request(inp, model, max_tokens_set=has_max)


def test_model_facts_and_identity(model: ServedModel, tmp_path: Path) -> None:
    from tandem.hashing import model_identity

    assert model.vocab_size == VOCAB and model.max_context == CONTEXT and 257 in model.eos_token_ids
    d = tmp_path / "m"
    write_byte_tokenizer(d)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": VOCAB}))
    ids = {fmt: load_served_model(d, load_format=fmt).identity for fmt in ("auto", "dummy")}
    assert ids == {fmt: model_identity(d, fmt) for fmt in ids}  # the id the workers' engines use
    assert ids["auto"] != ids["dummy"] and ids["auto"].startswith("qwen2-")
    other = tmp_path / "m2"
    write_byte_tokenizer(other)
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": VOCAB, "hidden_size": 8}))
    assert model_identity(other) != ids["auto"]  # another config, another namespace
    assert load_served_model(d, max_context=100).max_context == 100  # capped below the default 2048


def test_valid_text_request_is_tokenized(model: ServedModel) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, stop=["x"])
    got = check(model, "hello", params, tier=Tier.BATCH, request_id="req-1.a:b_c")
    assert got.prompt_ids == tuple(model.tokenizer.encode("hello"))
    assert got.params == params and got.tier is Tier.BATCH and got.request_id == "req-1.a:b_c"
    assert got.stream_text is True


def test_token_id_prompt_is_used_as_is(model: ServedModel) -> None:
    got = check(model, [1, 2, 255, 257], SamplingParams(max_tokens=4))
    assert got.prompt_ids == (1, 2, 255, 257)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(model: ServedModel, prompt) -> None:
    inp = wire.GenerateInput(prompt=prompt if isinstance(prompt, str) else tuple(prompt), params=SamplingParams(),
                             tier=Tier.STANDARD, request_id="", stream_text=True)
    with pytest.raises(InvalidRequest, match="^prompt: must not be empty"):
        validate_request(inp, model)


def test_prompt_token_outside_vocabulary(model: ServedModel) -> None:
    with pytest.raises(InvalidRequest, match=r"^prompt: token id 258 at position 1 is outside the vocabulary"):
        check(model, [5, VOCAB, 6], SamplingParams(max_tokens=1))


def test_prompt_that_fills_the_context(model: ServedModel) -> None:
    with pytest.raises(InvalidRequest, match=f"^prompt: {CONTEXT} tokens leave no room"):
        check(model, [7] * CONTEXT, SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequest, match="^prompt: .* characters cannot fit"):
        check(model, "a" * (64 * CONTEXT + 1), SamplingParams(max_tokens=1))


def test_prompt_plus_max_tokens_beyond_context_rejects_max_tokens(model: ServedModel) -> None:
    with pytest.raises(InvalidRequest, match=r"^max_tokens: prompt \(60 tokens\) plus max_tokens \(5\)") as info:
        check(model, [7] * 60, SamplingParams(max_tokens=5))
    assert info.value.field == "max_tokens"
    assert check(model, [7] * 60, SamplingParams(max_tokens=4)).params.max_tokens == 4  # exactly fits


def test_unset_max_tokens_takes_what_the_context_leaves(model: ServedModel) -> None:
    inp = wire.generate_request_from_proto(wire.pb.GenerateRequest(token_ids=wire.pb.TokenIds(ids=[7] * 50)))
    got = validate_request(inp, model, max_tokens_set=False)
    assert got.params.max_tokens == CONTEXT - 50  # the default 128 would not fit
    assert got.tier is Tier.STANDARD  # TIER_UNSPECIFIED


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(max_tokens=-3), "max_tokens"),
    (SamplingParams(temperature=-0.5), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-1), "top_k"),
    (SamplingParams(min_p=1.5), "min_p"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty=-2.5), "frequency_penalty"),
    (SamplingParams(seed=-1), "seed"),
    (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
    (SamplingParams(stop=[""]), "stop"),
    (SamplingParams(stop=["s"] * 17), "stop"),
    (SamplingParams(stop=["x" * 257]), "stop"),
    (SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (SamplingParams(logprobs=21), "logprobs"),
])
def test_each_sampling_field(model: ServedModel, params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequest, match=f"^{field}: ") as info:
        check(model, "hi", params)
    assert info.value.field == field


def test_unknown_tier_value_is_named() -> None:
    with pytest.raises(ValueError, match="^tier: unknown tier value 9"):
        wire.generate_request_from_proto(wire.pb.GenerateRequest(text="hi", tier=9))


@pytest.mark.parametrize(("rid", "ok"), [
    ("", True), ("abc-DEF_0.1:2", True), ("x" * 128, True),
    ("x" * 129, False), ("has space", False), ("retry#1", False), ("é", False), ("a/b", False),
])
def test_request_id(model: ServedModel, rid: str, ok: bool) -> None:
    if ok:
        assert check_request_id(rid) == rid
        assert check(model, "hi", SamplingParams(max_tokens=1), request_id=rid).request_id == rid
    else:
        with pytest.raises(InvalidRequest, match="^request_id: "):
            check(model, "hi", SamplingParams(max_tokens=1), request_id=rid)


def test_gateway_imports_no_torch() -> None:
    import subprocess
    import sys

    code = ("import sys, gateway.server, entrypoints.gateway, entrypoints.cluster; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0

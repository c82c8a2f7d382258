"""Proto <-> Python adapters of tandem.wire: every SamplingParams field, unset vs zero,
tiers, finish reasons, chunks, requests, model info, and the health/reflection services."""
from __future__ import annotations

import asyncio
import dataclasses
import math
import struct
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem import wire
from tandem._proto.tandem.v1 import tandem_pb2 as pb
from tandem.types import SamplingParams, Tier

# Non-default (and edge) values for every SamplingParams field, including explicit zeros and
# values the gateway would reject: the wire must carry them unchanged, validation is not its job.
FIELD_VALUES: dict[str, list] = {
    "max_tokens": [0, 1, 7, 2**31 - 1],
    "temperature": [0.0, 0.7, 1e-9, 3.5],
    "top_k": [0, 1, 50],
    "top_p": [0.0, 0.95, 1.0],
    "min_p": [0.0, 0.05],
    "repetition_penalty": [0.0, 1.3],
    "presence_penalty": [-2.0, 0.0, 1.5],
    "frequency_penalty": [-1.25, 0.0, 2.0],
    "seed": [None, 0, 1, 2**63 - 1],
    "min_tokens": [0, 5],
    "stop": [(), ("a",), ("\n\n", "END", "ü€")],
    "stop_token_ids": [(), (0,), (2, 50256, 2**32 - 1)],
    "ignore_eos": [False, True],
    "logprobs": [None, 0, 5],
    "skip_special_tokens": [True, False],
}


def _defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def test_field_table_covers_every_sampling_param() -> None:
    assert set(FIELD_VALUES) == set(_defaults())


@pytest.mark.parametrize("name", sorted(FIELD_VALUES))
def test_each_field_round_trips(name: str) -> None:
    for value in FIELD_VALUES[name]:
        params = SamplingParams(**{name: value})
        msg = pb.SamplingParams.FromString(wire.params_to_proto(params).SerializeToString())
        back = wire.params_from_proto(msg)
        assert back == params, (name, value)
        assert getattr(back, name) == getattr(params, name)
        assert type(getattr(back, name)) is type(getattr(params, name)), (name, value)


def test_unset_fields_take_the_dataclass_defaults() -> None:
    back = wire.params_from_proto(pb.SamplingParams())
    assert back.to_dict() == _defaults()
    assert wire.params_from_proto(pb.GenerateRequest().params) == SamplingParams()


def test_explicit_zero_is_distinct_from_unset() -> None:
    zeros = pb.SamplingParams(temperature=0.0, top_p=0.0, repetition_penalty=0.0,
                              max_tokens=0, skip_special_tokens=False)
    back = wire.params_from_proto(pb.SamplingParams.FromString(zeros.SerializeToString()))
    assert (back.temperature, back.top_p, back.repetition_penalty, back.max_tokens) == (0.0, 0.0, 0.0, 0)
    assert back.skip_special_tokens is False
    # Fields not set in that message still take their defaults.
    assert back.top_k == _defaults()["top_k"] and back.min_p == _defaults()["min_p"]
    # Going the other way, zero is sent as present and None as absent.
    msg = wire.params_to_proto(SamplingParams(temperature=0.0, seed=0, logprobs=0))
    assert msg.HasField("temperature") and msg.temperature == 0.0
    assert msg.HasField("seed") and msg.seed == 0
    assert msg.HasField("logprobs") and msg.logprobs == 0
    msg = wire.params_to_proto(SamplingParams(seed=None, logprobs=None))
    assert not msg.HasField("seed") and not msg.HasField("logprobs")


_finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
_int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@settings(max_examples=150, deadline=None)
@given(st.builds(
    SamplingParams,
    max_tokens=_int32, temperature=_finite, top_k=_int32, top_p=_finite, min_p=_finite,
    repetition_penalty=_finite, presence_penalty=_finite, frequency_penalty=_finite,
    seed=st.none() | st.integers(min_value=-(2**63), max_value=2**63 - 1), min_tokens=_int32,
    stop=st.lists(st.text(max_size=8), max_size=4).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=4).map(tuple),
    ignore_eos=st.booleans(), logprobs=st.none() | _int32, skip_special_tokens=st.booleans(),
))
def test_any_params_round_trip(params: SamplingParams) -> None:
    data = wire.params_to_proto(params).SerializeToString()
    assert wire.params_from_proto(pb.SamplingParams.FromString(data)) == params


def test_unrepresentable_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        wire.params_to_proto(SamplingParams(max_tokens=2**40))
    with pytest.raises(ValueError, match="stop_token_ids"):
        wire.params_to_proto(SamplingParams(stop_token_ids=(-1,)))
    with pytest.raises(ValueError, match="temperature"):
        wire.params_to_proto(SamplingParams(temperature="hot"))  # type: ignore[arg-type]


def test_tier_mapping() -> None:
    for tier in Tier:
        value = wire.tier_to_proto(tier)
        assert pb.Tier.Name(value) == f"TIER_{tier.name}"
        assert wire.tier_from_proto(value) is tier
        assert wire.tier_to_proto(tier.name.lower()) == value
        assert wire.tier_to_proto(int(tier)) == value
    assert wire.tier_from_proto(pb.TIER_UNSPECIFIED) is Tier.STANDARD
    with pytest.raises(ValueError, match="tier"):
        wire.tier_from_proto(99)
    with pytest.raises(ValueError, match="tier"):
        wire.tier_to_proto("urgent")
    # An unknown enum value survives the wire (proto3 enums are open) and is rejected on decode.
    req = pb.GenerateRequest(text="x")
    req.tier = 42
    with pytest.raises(ValueError, match="tier"):
        wire.generate_request_from_proto(pb.GenerateRequest.FromString(req.SerializeToString()))


def test_finish_reason_mapping() -> None:
    assert wire.finish_reason_to_proto(None) == pb.FINISH_REASON_UNSPECIFIED
    assert wire.finish_reason_from_proto(pb.FINISH_REASON_UNSPECIFIED) is None
    for reason in wire.FINISH_REASONS:
        value = wire.finish_reason_to_proto(reason)
        assert pb.FinishReason.Name(value) == f"FINISH_REASON_{reason.upper()}"
        assert wire.finish_reason_from_proto(value) == reason
    assert {pb.FinishReason.Name(v) for v in pb.FinishReason.values()} == {
        "FINISH_REASON_UNSPECIFIED", *(f"FINISH_REASON_{r.upper()}" for r in wire.FINISH_REASONS)}
    with pytest.raises(ValueError, match="finish_reason"):
        wire.finish_reason_to_proto("eos")


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def test_chunk_round_trip() -> None:
    lps = [wire.TokenLogprob(5, -0.1, ((5, -0.1), (9, -2.7))), wire.TokenLogprob(0, -math.pi)]
    chunk = wire.Chunk(token_ids=[5, 0], text="é!", logprobs=lps, finish_reason="stop",
                       stop_reason="stop_token_id", matched_stop=0,
                       usage=wire.Usage(11, 2, 8), request_id="abc")
    back = wire.chunk_from_proto(pb.GenerateChunk.FromString(wire.chunk_to_proto(chunk).SerializeToString()))
    assert (back.token_ids, back.text, back.finish_reason, back.request_id) == ([5, 0], "é!", "stop", "abc")
    assert back.stop_reason == "stop_token_id" and back.matched_stop == 0
    assert back.usage == wire.Usage(prompt_tokens=11, completion_tokens=2, cached_tokens=8)
    assert [(lp.token_id, lp.logprob) for lp in back.logprobs] == [(5, _f32(-0.1)), (0, _f32(-math.pi))]
    assert back.logprobs[0].top == ((5, _f32(-0.1)), (9, _f32(-2.7)))
    assert back.finished

    stop_string = wire.Chunk(finish_reason="stop", stop_reason="stop_string", matched_stop="12")
    back = wire.chunk_from_proto(wire.chunk_to_proto(stop_string))
    assert back.matched_stop == "12"  # a stop *string* of digits stays a string

    middle = wire.chunk_from_proto(wire.chunk_to_proto(wire.Chunk(token_ids=[1], text="a")))
    assert middle.usage is None and middle.finish_reason is None and not middle.finished
    assert middle.matched_stop is None and middle.request_id == ""


def test_generate_request_round_trip() -> None:
    params = SamplingParams(max_tokens=9, temperature=0.0, stop=("\n",))
    msg = wire.generate_request_to_proto("hi there", params, Tier.BATCH, "rid-1")
    got = wire.generate_request_from_proto(pb.GenerateRequest.FromString(msg.SerializeToString()))
    assert got == wire.GenerateInput("hi there", params, Tier.BATCH, "rid-1", True)

    msg = wire.generate_request_to_proto([1, 2, 2**32 - 1], params, "interactive", stream_text=False)
    got = wire.generate_request_from_proto(pb.GenerateRequest.FromString(msg.SerializeToString()))
    assert got.prompt == (1, 2, 2**32 - 1) and got.tier is Tier.INTERACTIVE
    assert got.stream_text is False and got.request_id == ""

    empty = wire.generate_request_from_proto(pb.GenerateRequest())
    assert empty.prompt == "" and empty.stream_text is True and empty.tier is Tier.STANDARD
    with pytest.raises(ValueError, match="prompt"):
        wire.generate_request_to_proto([1, 2**32], params)


def test_model_info_round_trip() -> None:
    info = wire.ModelInfo("llama", "llama@abc123", 32000, 4096, 16, (2, 32000 - 1), "bfloat16", 2, 3)
    msg = pb.ModelInfo.FromString(wire.model_info_to_proto(info).SerializeToString())
    assert wire.model_info_from_proto(msg) == info


def _check_health_and_reflection(port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in (wire.TANDEM_SERVICE, ""):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        db = ProtoReflectionDescriptorDatabase(channel)
        assert wire.TANDEM_SERVICE in db.get_services()
        assert "grpc.health.v1.Health" in db.get_services()
        fd = db.FindFileContainingSymbol("tandem.v1.Tandem")
        assert fd.name == "tandem/v1/tandem.proto"
        assert [m.name for m in fd.service[0].method] == ["Generate", "Abort", "GetModelInfo"]


def test_health_and_reflection_on_a_sync_server() -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    servicer = wire.add_health_and_reflection(server, [wire.TANDEM_SERVICE])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        _check_health_and_reflection(port)
        servicer.enter_graceful_shutdown()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=wire.TANDEM_SERVICE), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        server.stop(0)


def test_health_and_reflection_on_an_aio_server() -> None:
    async def main() -> None:
        server = grpc.aio.server()
        servicer = wire.add_health_and_reflection(server, [wire.TANDEM_SERVICE, wire.DECODE_SERVICE])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            await asyncio.to_thread(_check_health_and_reflection, port)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                req = health_pb2.HealthCheckRequest(service=wire.DECODE_SERVICE)
                assert (await stub.Check(req, timeout=10)).status == health_pb2.HealthCheckResponse.SERVING
                await servicer.enter_graceful_shutdown()
                assert (await stub.Check(req, timeout=10)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_servicer_bases_make_every_rpc_abstract():
    """wire's servicer bases list every RPC of their service as abstract: a servicer missing one
    cannot be made (TypeError naming it), and each of ours defines them all."""
    from decode.service import DecodeService
    from gateway.admin import AdminService
    from gateway.service import TandemService
    from prefill.service import PrefillService
    from tandem._proto.tandem.v1 import admin_pb2, tandem_pb2, worker_pb2

    for base, module, service, ours in (
            (wire.TandemServicer, tandem_pb2, "Tandem", TandemService),
            (wire.AdminServicer, admin_pb2, "Admin", AdminService),
            (wire.PrefillWorkerServicer, worker_pb2, "PrefillWorker", PrefillService),
            (wire.DecodeWorkerServicer, worker_pb2, "DecodeWorker", DecodeService)):
        rpcs = {m.name for m in module.DESCRIPTOR.services_by_name[service].methods}
        assert base.__abstractmethods__ == rpcs and issubclass(ours, base)
        assert not ours.__abstractmethods__, (service, ours.__abstractmethods__)

    class Partial(wire.TandemServicer):
        async def Generate(self, request, context):
            return None

    with pytest.raises(TypeError, match="Abort"):
        Partial()

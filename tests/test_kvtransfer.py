"""KV-transfer building blocks without the network: wire headers, registry, sink, argument checks."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvtransfer import Transport, available_transports, get_transport, register_transport
from kvtransfer.frames import (
    KIND_COMMIT,
    KIND_LAYER,
    MAX_BLOCK_ID,
    PROTOCOL_VERSION,
    FrameError,
    FrameHeader,
    checksum,
    dtype_name,
)
from kvtransfer.sinks import TensorKVSink
from kvtransfer.staging import stage_layer, tensor_from_buffer
from kvtransfer.zmq_transport import ZmqReceiver, ZmqSender


def test_layer_header_roundtrip_keeps_every_field() -> None:
    header = FrameHeader(
        KIND_LAYER, "req-1", 3, layer=7, src_block_ids=(9, 1), dst_block_ids=(4, 0), dtype="bfloat16",
        shape=(2, 16, 2, 8), checksum_k=2**64 - 1, checksum_v=12345, checksum_alg="xxh3_64",
    )
    assert FrameHeader.decode(header.encode()) == header
    assert header.payload_nbytes == 2 * 16 * 2 * 8 * 2


def test_block_ids_roundtrip_across_the_uint32_range() -> None:
    gen = torch.Generator().manual_seed(7)
    ids = (0, MAX_BLOCK_ID, *torch.randint(0, 2**31 - 1, (200,), generator=gen).tolist())
    for src, dst in ((ids, ids[::-1]), ((), ())):
        header = FrameHeader(KIND_LAYER, "r", 0, layer=1, src_block_ids=src, dst_block_ids=dst, dtype="float32",
                             shape=(len(src), 16, 2, 8))
        decoded = FrameHeader.decode(header.encode())
        assert decoded.src_block_ids == src and decoded.dst_block_ids == dst
        assert all(type(i) is int for i in decoded.src_block_ids)


def test_commit_header_carries_meta() -> None:
    meta = {"first_token_id": 42, "logprobs": {"42": -0.25}, "num_tokens": 17}
    decoded = FrameHeader.decode(FrameHeader(KIND_COMMIT, "r", 5, meta=meta).encode())
    assert decoded.kind == KIND_COMMIT and decoded.meta == meta and decoded.seq == 5


def _layer_doc(**changes) -> bytes:
    doc = json.loads(FrameHeader(KIND_LAYER, "r", 0, layer=0, src_block_ids=(1, 2), dst_block_ids=(3, 4),
                                 dtype="float32", shape=(2, 16, 2, 8)).encode())
    return json.dumps({**doc, **changes}).encode()


@pytest.mark.parametrize(
    "doc, field",
    [
        (b"not json", "header"),
        (json.dumps({"v": 99, "kind": "layer", "rid": "r", "seq": 0}).encode(), "v"),
        (json.dumps({"v": PROTOCOL_VERSION, "kind": "bogus", "rid": "r", "seq": 0}).encode(), "kind"),
        (json.dumps({"v": PROTOCOL_VERSION, "kind": "commit", "rid": "", "seq": 0, "meta": {}}).encode(), "rid"),
        (json.dumps({"v": PROTOCOL_VERSION, "kind": "commit", "rid": "r", "seq": -1, "meta": {}}).encode(), "seq"),
        (json.dumps({"v": PROTOCOL_VERSION, "kind": "commit", "rid": "r", "seq": 0, "meta": []}).encode(), "meta"),
        (_layer_doc(dtype="complex64"), "dtype"),
        (_layer_doc(src=[1, 2]), "src"),  # the version-1 form: a list of numbers
        (_layer_doc(src="not base64!"), "src"),
        (_layer_doc(dst="AAAA"), "dst"),  # 3 bytes: not whole uint32s
    ],
)
def test_malformed_headers_are_rejected_naming_the_field(doc: bytes, field: str) -> None:
    with pytest.raises(FrameError, match=f"^{field}:"):
        FrameHeader.decode(doc)


def test_dtype_names_cover_torch_and_numpy() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(np.dtype(np.float16)) == "float16"
    assert dtype_name("float32") == "float32"
    with pytest.raises(ValueError, match="dtype"):
        dtype_name(torch.complex64)


def test_checksum_algorithms_differ_and_detect_a_flipped_byte() -> None:
    data = bytearray(np.random.default_rng(0).bytes(4096))
    before = checksum(data)
    assert checksum(data, "xxh3_64") != before
    data[100] ^= 1
    assert checksum(data) != before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_staging_gathers_blocks_and_views_back_bit_exact(dtype: torch.dtype) -> None:
    k = torch.randn(11, 4, 2, 8).to(dtype)
    v = torch.randn(11, 4, 2, 8).to(dtype)
    ids = [9, 2, 5]
    staged = stage_layer(k, v, ids)
    assert staged.shape == (3, 4, 2, 8) and staged.dtype == dtype_name(dtype)
    back = tensor_from_buffer(memoryview(staged.k_bytes()), staged.dtype, staged.shape)
    assert torch.equal(back, k[ids])
    k[9].zero_()  # the staging copy is independent of the cache
    assert torch.equal(tensor_from_buffer(memoryview(staged.v_bytes()), staged.dtype, staged.shape), v[ids])
    assert not torch.equal(back[0], k[9])


def test_staging_accepts_numpy_caches() -> None:
    k = np.random.default_rng(1).standard_normal((6, 4, 1, 8), dtype=np.float32)
    staged = stage_layer(k, k.copy(), [5, 0])
    back = tensor_from_buffer(memoryview(staged.k_bytes()), "float32", (2, 4, 1, 8))
    assert np.array_equal(back.numpy(), k[[5, 0]])


@pytest.mark.parametrize("stacked", [False, True])
def test_tensor_sink_writes_only_the_named_blocks(stacked: bool) -> None:
    layers, blocks = 2, 6
    k_cache = torch.randn(layers, blocks, 4, 2, 8).to(torch.bfloat16)
    v_cache = torch.randn(layers, blocks, 4, 2, 8).to(torch.bfloat16)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    sink = TensorKVSink(k_cache if stacked else list(k_cache), v_cache if stacked else list(v_cache))
    assert sink.block_shape == (4, 2, 8) and sink.dtype == "bfloat16"
    new_k, new_v = torch.randn(2, 4, 2, 8).to(torch.bfloat16), torch.randn(2, 4, 2, 8).to(torch.bfloat16)
    sink.write(1, [5, 2], new_k, new_v)
    assert torch.equal(k_cache[1, [5, 2]], new_k) and torch.equal(v_cache[1, [5, 2]], new_v)
    untouched = [0, 1, 3, 4]
    assert torch.equal(k_cache[1, untouched], before_k[1, untouched])
    assert torch.equal(k_cache[0], before_k[0]) and torch.equal(v_cache[0], before_v[0])
    with pytest.raises(ValueError, match="dst_block_ids"):
        sink.write(0, [blocks], new_k[:1], new_v[:1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_gpu_sink_uploads_host_sources_off_the_compute_stream(dtype) -> None:
    """Host sources land in a CUDA cache through the sink's own stream, also while the default
    stream is busy; wait_written waits for them; a source buffer may be reused after write.
    Device sources (CUDA IPC's) land too; an FP8 cache takes both."""
    layers, blocks = 3, 64
    k_cache = torch.zeros(layers, blocks, 16, 8, 128, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    sink = TensorKVSink(k_cache, v_cache)
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # queue work on the compute stream
        busy = busy @ busy / 64
    src = torch.randn(layers, 5, 16, 8, 128).to(dtype)
    want = src.clone()
    ids = [60, 3, 17, 9, 41]
    for layer in range(layers):
        sink.write(layer, ids, src[layer], src[layer].float().mul(2).to(dtype))
    src.zero_()  # the transport reuses its buffer
    sink.wait_written()
    for layer in range(layers):
        assert torch.equal(k_cache[layer, ids].cpu().float(), want[layer].float())
        assert torch.equal(v_cache[layer, ids].cpu().float(), want[layer].float() * 2)
    assert k_cache[:, [0, 1, 2]].float().abs().sum().item() == 0
    on_device = want[0].cuda()
    sink.write(0, [0, 1, 2, 4, 5], on_device, on_device)
    torch.cuda.synchronize()
    assert torch.equal(k_cache[0, [0, 1, 2, 4, 5]].float(), on_device.float())


def test_registry_resolves_zmq_and_rejects_unknown_names() -> None:
    transport = get_transport("zmq")
    assert transport.name == "zmq" and transport.sender_cls is ZmqSender and transport.receiver_cls is ZmqReceiver
    assert "zmq" in available_transports()
    with pytest.raises(ValueError, match="^transport: unknown KV transport 'carrier-pigeon'"):
        get_transport("carrier-pigeon")


def test_registry_accepts_a_new_transport() -> None:
    register_transport(Transport("zmq-alias-for-test", ZmqSender, ZmqReceiver))
    assert get_transport("zmq-alias-for-test").receiver_cls is ZmqReceiver
    with pytest.raises(ValueError, match="name"):
        register_transport(Transport("", ZmqSender, ZmqReceiver))


def _sink(blocks: int = 8, dtype: torch.dtype = torch.float32) -> TensorKVSink:
    return TensorKVSink([torch.zeros(blocks, 4, 2, 8, dtype=dtype)], [torch.zeros(blocks, 4, 2, 8, dtype=dtype)])


def test_receiver_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="^sink:"):
        ZmqReceiver(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^bind:"):
        ZmqReceiver(_sink(), bind="tcp://not-an-address")
    with ZmqReceiver(_sink()) as receiver:
        assert receiver.address.startswith("tcp://127.0.0.1:")
        receiver.expect("r", [1, 2], 1, 5.0)
        with pytest.raises(ValueError, match="^request_id:"):
            receiver.expect("r", [3], 1, 5.0)
        with pytest.raises(ValueError, match="^dst_block_ids:"):
            receiver.expect("s", [3, 3], 1, 5.0)
        with pytest.raises(ValueError, match="^num_layers:"):
            receiver.expect("s", [3], 0, 5.0)
        with pytest.raises(ValueError, match="^deadline_s:"):
            receiver.expect("s", [3], 1, 0)
        assert receiver.cancel("r") is True and receiver.cancel("r") is False


@pytest.mark.parametrize("transport", ["zmq", "cuda_ipc", "nccl"])
def test_every_transport_names_the_same_bad_arguments(transport: str) -> None:
    """The checks every receiver and sender share (kvtransfer.pending, kvtransfer.outgoing):
    each transport refuses the same bad arguments with the field's name, and starts with the
    same zeroed counters."""
    t = get_transport(transport)
    receiver_extra = {"backend": "gloo"} if transport == "nccl" else {}
    with pytest.raises(ValueError, match="^sink:"):
        t.create_receiver(object(), **receiver_extra)
    with pytest.raises(ValueError, match="^poll_interval_s:"):
        t.create_receiver(_sink(), poll_interval_s=0, **receiver_extra)
    if transport != "zmq":
        with pytest.raises(ValueError, match="^device:"):
            t.create_receiver(_sink(), device="not-a-device", **receiver_extra)
    with pytest.raises(ValueError, match="^send_timeout_s:"):
        t.create_sender(send_timeout_s=0)
    if transport != "cuda_ipc":  # it stages in its pools' slots, not under a byte budget
        with pytest.raises(ValueError, match="^max_staged_bytes:"):
            t.create_sender(max_staged_bytes=0)
    with t.create_receiver(_sink(), **receiver_extra) as receiver, t.create_sender() as sender:
        received, sent = receiver.stats(), sender.stats()
    for key in ("bytes_received", "frames_received", "frames_dropped", "transfers_ok", "transfers_failed",
                "transfer_seconds", "pending", "connections_refused"):
        assert received[key] == 0, key
    for key in ("bytes_sent", "frames_sent", "transfers_committed", "transfers_aborted", "transfers_failed",
                "send_seconds", "staged_bytes", "open_transfers", "broken_channels"):
        assert sent[key] == 0, key


def test_sender_rejects_bad_arguments() -> None:
    k = torch.randn(8, 4, 2, 8)
    with ZmqReceiver(_sink()) as receiver, ZmqSender() as sender:
        with pytest.raises(ValueError, match="^peer_address:"):
            sender.open("r", "http://example", 2)
        with pytest.raises(ValueError, match="^num_layers:"):
            sender.open("r", receiver.address, 0)
        sender.open("r", receiver.address, 2)
        with pytest.raises(ValueError, match="^request_id:"):
            sender.open("r", receiver.address, 2)
        with pytest.raises(ValueError, match="^request_id:"):
            sender.send_layer("nope", 0, k, k, [0], [0])
        with pytest.raises(ValueError, match="^layer:"):
            sender.send_layer("r", 2, k, k, [0], [0])
        with pytest.raises(ValueError, match="^dst_block_ids:"):
            sender.send_layer("r", 0, k, k, [0, 1], [0])
        with pytest.raises(ValueError, match="^dst_block_ids:"):
            sender.send_layer("r", 0, k, k, [0, 1], [3, 3])
        with pytest.raises(ValueError, match="^src_block_ids:"):
            sender.send_layer("r", 0, k, k, [8], [0])
        with pytest.raises(ValueError, match="^dst_block_ids:"):
            sender.send_layer("r", 0, k, k, [0], [MAX_BLOCK_ID + 1])
        with pytest.raises(ValueError, match="^src_v:"):
            sender.send_layer("r", 0, k, k[:4], [0], [0])
        with pytest.raises(ValueError, match="^src_k:"):
            sender.send_layer("r", 0, k[0], k[0], [0], [0])
        # send_layers (the base class's loop for this transport) checks its lists before any layer goes
        with pytest.raises(ValueError, match="^caches:"):
            sender.send_layers("r", [0, 1], [(k, k)], [1, 2], [3, 4])
        with pytest.raises(ValueError, match="^layers:"):
            sender.send_layers("r", [0, 0], [(k, k), (k, k)], [1, 2], [3, 4])
        sender.send_layer("r", 0, k, k, [1, 2], [3, 4])
        with pytest.raises(ValueError, match="^layer:"):
            sender.send_layer("r", 0, k, k, [1, 2], [3, 4])
        with pytest.raises(ValueError, match="^dst_block_ids:"):
            sender.send_layer("r", 1, k, k, [1, 2], [3, 5])
        with pytest.raises(ValueError, match="^request_id:"):
            sender.commit("r", {})
        sender.send_layer("r", 1, k, k, [1, 2], [4, 3])
        with pytest.raises(ValueError, match="^meta:"):
            sender.commit("r", {"x": object()})
        assert sender.abort("r") is True
        assert sender.abort("r") is False


def test_layers_with_the_ids_of_the_layer_before_are_checked_once_and_changes_are_still_caught() -> None:
    from kvtransfer.outgoing import Outgoing

    k = torch.randn(8, 4, 2, 8)
    state = Outgoing("r", "tcp://127.0.0.1:1", 4)
    src_ids, dst_ids = [1, 2, 5], [3, 4, 0]
    src, dst, nbytes = state.check_layer(0, k, k, src_ids, dst_ids)
    assert (src, dst, nbytes) == ((1, 2, 5), (3, 4, 0), 2 * 3 * k[0].nbytes)
    again = state.check_layer(1, k, k, list(src_ids), list(dst_ids))
    assert again[0] is src and again[1] is dst  # the checked ids are reused, not re-parsed
    src_ids[2] = 8  # the caller's list changed in place: out of range now
    with pytest.raises(ValueError, match="^src_block_ids:"):
        state.check_layer(2, k, k, src_ids, dst_ids)
    with pytest.raises(ValueError, match="^dst_block_ids: every layer"):
        state.check_layer(2, k, k, [1, 2, 5], [3, 4, 7])
    with pytest.raises(ValueError, match="^src_k:"):
        state.check_layer(2, k.half(), k.half(), [1, 2, 5], [3, 4, 0])
    assert state.check_layer(2, k, k, [2, 1, 5], [4, 3, 0])[:2] == ((2, 1, 5), (4, 3, 0))
    assert state.src_index((2, 1, 5), torch.device("cpu")).tolist() == [2, 1, 5]

"""ZMQ KV transport over real sockets (tcp:// on 127.0.0.1 and ipc://): threads and a spawned sender process."""
from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq

from kvtransfer import TransferResult, get_transport
from kvtransfer.frames import KIND_LAYER, FrameHeader, checksum
from kvtransfer.sinks import TensorKVSink
from kvtransfer.zmq_transport import CORRUPT_ENV, ZmqReceiver, ZmqSender

LAYERS = 3
SRC_BLOCKS, DST_BLOCKS = 40, 32
BLOCK = (16, 2, 8)  # block_size, kv_heads, head_dim
SRC_IDS = [37, 3, 21, 9, 38]
DST_IDS = [5, 30, 0, 17, 11]
WAIT_S = 20.0  # generous bound on any wait: CI hosts are slow, and no test measures time


def make_cache(blocks: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, *BLOCK, generator=gen).to(dtype).to(device) for _ in range(LAYERS)]


class Dest:
    """A decode-side cache filled with noise, plus a pristine copy to prove what was not written."""

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 99, device: str = "cpu") -> None:
        self.k = make_cache(DST_BLOCKS, dtype, seed, device)
        self.v = make_cache(DST_BLOCKS, dtype, seed + 1, device)
        self.k0 = [t.clone() for t in self.k]
        self.v0 = [t.clone() for t in self.v]
        self.sink = TensorKVSink(self.k, self.v)

    def holds(self, src_k: list[torch.Tensor], src_v: list[torch.Tensor], src_ids: list[int], dst_ids: list[int],
              layers: range = range(LAYERS)) -> bool:
        return all(
            torch.equal(self.k[i][dst_ids].cpu(), src_k[i][src_ids].cpu())
            and torch.equal(self.v[i][dst_ids].cpu(), src_v[i][src_ids].cpu())
            for i in layers
        )

    def untouched(self, blocks: list[int] | None = None, layers: range = range(LAYERS)) -> bool:
        sel = list(range(DST_BLOCKS)) if blocks is None else blocks
        return all(torch.equal(self.k[i][sel], self.k0[i][sel]) and torch.equal(self.v[i][sel], self.v0[i][sel])
                   for i in layers)


def others(dst_ids: list[int]) -> list[int]:
    return [b for b in range(DST_BLOCKS) if b not in dst_ids]


def wait_one(receiver: ZmqReceiver) -> TransferResult:
    results = receiver.poll_completed(timeout_s=WAIT_S)
    assert len(results) == 1, results
    return results[0]


def wait_until(cond, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)


def send_all(sender: ZmqSender, rid: str, address: str, k: list[torch.Tensor], v: list[torch.Tensor],
             src_ids: list[int], dst_ids: list[int], meta: dict | None = None) -> None:
    sender.open(rid, address, LAYERS)
    for layer in range(LAYERS):
        sender.send_layer(rid, layer, k[layer], v[layer], src_ids, dst_ids)
    result = sender.commit(rid, meta or {"first_token_id": 7}).result(timeout=WAIT_S)
    assert result.ok, result


@pytest.fixture(params=["tcp", "ipc"])
def endpoint(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "tcp://127.0.0.1:*" if request.param == "tcp" else f"ipc://{tmp_path}/kv.sock"


@pytest.fixture
def sender() -> Iterator[ZmqSender]:
    s = ZmqSender(send_timeout_s=5.0)
    yield s
    s.close(drain_timeout_s=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layers_land_bit_exact_in_the_destination_blocks(endpoint: str, dtype: torch.dtype,
                                                         sender: ZmqSender) -> None:
    dest = Dest(dtype)
    src_k, src_v = make_cache(SRC_BLOCKS, dtype, 1), make_cache(SRC_BLOCKS, dtype, 2)
    meta = {"first_token_id": 1234, "logprobs": {"token": 1234, "logprob": -0.5}, "num_tokens": 77}
    with ZmqReceiver(dest.sink, bind=endpoint) as receiver:
        receiver.expect("req-a", DST_IDS, LAYERS, deadline_s=WAIT_S)
        worker = threading.Thread(
            target=send_all, args=(sender, "req-a", receiver.address, src_k, src_v, SRC_IDS, DST_IDS, meta)
        )
        worker.start()
        result = wait_one(receiver)
        worker.join()
        stats = receiver.stats()
    assert result.ok and result.error is None and result.meta == meta
    assert result.layers_received == LAYERS
    assert dest.holds(src_k, src_v, SRC_IDS, DST_IDS)
    assert dest.untouched(others(DST_IDS))
    assert stats["transfers_ok"] == 1 and stats["bytes_received"] == result.bytes_received
    payload = 2 * LAYERS * len(SRC_IDS) * BLOCK[0] * BLOCK[1] * BLOCK[2] * dtype.itemsize
    assert sender.stats()["bytes_sent"] == result.bytes_received == payload


@pytest.mark.parametrize("how", ["constructor", "env"])
def test_corrupt_frame_fails_without_touching_the_cache_and_retry_succeeds(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if how == "env":
        monkeypatch.setenv(CORRUPT_ENV, "1")
    sender = ZmqSender(corrupt_once=True) if how == "constructor" else ZmqSender()
    dest = Dest(torch.bfloat16)
    src_k, src_v = make_cache(SRC_BLOCKS, torch.bfloat16, 3), make_cache(SRC_BLOCKS, torch.bfloat16, 4)
    with ZmqReceiver(dest.sink) as receiver, sender:
        receiver.expect("try-1", DST_IDS, LAYERS, deadline_s=WAIT_S)
        send_all(sender, "try-1", receiver.address, src_k, src_v, SRC_IDS, DST_IDS)
        failed = wait_one(receiver)
        assert not failed.ok and "checksum" in failed.error and failed.meta is None
        assert dest.untouched()
        receiver.expect("try-2", DST_IDS, LAYERS, deadline_s=WAIT_S)
        send_all(sender, "try-2", receiver.address, src_k, src_v, SRC_IDS, DST_IDS)
        retried = wait_one(receiver)
        stats = receiver.stats()
    assert retried.ok and dest.holds(src_k, src_v, SRC_IDS, DST_IDS)
    assert stats["checksum_failures"] == 1 and stats["transfers_failed"] == 1 and stats["transfers_ok"] == 1


def test_sender_stopping_midway_times_out_and_late_frames_are_dropped(sender: ZmqSender) -> None:
    dest = Dest()
    src_k, src_v = make_cache(SRC_BLOCKS, torch.float32, 5), make_cache(SRC_BLOCKS, torch.float32, 6)
    with ZmqReceiver(dest.sink, poll_interval_s=0.01) as receiver:
        receiver.expect("slow", DST_IDS, LAYERS, deadline_s=2.0)
        sender.open("slow", receiver.address, LAYERS)
        sender.send_layer("slow", 0, src_k[0], src_v[0], SRC_IDS, DST_IDS)
        wait_until(lambda: receiver.stats()["frames_received"] >= 1, "layer 0")
        result = wait_one(receiver)
        assert not result.ok and "timed out" in result.error and result.layers_received == 1
        assert dest.holds(src_k, src_v, SRC_IDS, DST_IDS, layers=range(1))  # verified before the timeout
        sender.send_layer("slow", 1, src_k[1], src_v[1], SRC_IDS, DST_IDS)  # after the result: ignored
        wait_until(lambda: receiver.stats()["frames_dropped"] >= 1, "the late frame")
        assert receiver.poll_completed() == []
    assert dest.untouched(layers=range(1, LAYERS))


def test_abort_fails_the_transfer_at_once(sender: ZmqSender) -> None:
    dest = Dest()
    src_k, src_v = make_cache(SRC_BLOCKS, torch.float32, 7), make_cache(SRC_BLOCKS, torch.float32, 8)
    with ZmqReceiver(dest.sink) as receiver:
        receiver.expect("gone", DST_IDS, LAYERS, deadline_s=600.0)
        sender.open("gone", receiver.address, LAYERS)
        sender.send_layer("gone", 0, src_k[0], src_v[0], SRC_IDS, DST_IDS)
        assert sender.abort("gone", reason="client cancelled")
        result = wait_one(receiver)  # long before the 600 s deadline
    assert not result.ok and "aborted by sender: client cancelled" in result.error
    assert dest.untouched(layers=range(1, LAYERS))


def test_frames_for_unknown_or_cancelled_requests_are_dropped(sender: ZmqSender) -> None:
    dest = Dest()
    src_k, src_v = make_cache(SRC_BLOCKS, torch.float32, 9), make_cache(SRC_BLOCKS, torch.float32, 10)
    with ZmqReceiver(dest.sink) as receiver:
        send_all(sender, "ghost", receiver.address, src_k, src_v, SRC_IDS, DST_IDS)
        receiver.expect("cancelled", DST_IDS, LAYERS, deadline_s=WAIT_S)
        assert receiver.cancel("cancelled")
        send_all(sender, "cancelled", receiver.address, src_k, src_v, SRC_IDS, DST_IDS)
        wait_until(lambda: receiver.stats()["frames_dropped"] == 2 * (LAYERS + 1), "the dropped frames")
        assert receiver.poll_completed() == [] and dest.untouched()
        receiver.expect("real", DST_IDS, LAYERS, deadline_s=WAIT_S)  # the receiver still works
        send_all(sender, "real", receiver.address, src_k, src_v, SRC_IDS, DST_IDS)
        assert wait_one(receiver).ok
    assert dest.holds(src_k, src_v, SRC_IDS, DST_IDS)


@pytest.mark.parametrize(
    "src_dtype, src_block, dst_ids, error",
    [
        (torch.float16, BLOCK, DST_IDS, "dtype mismatch"),
        (torch.float32, (16, 2, 4), DST_IDS, "shape mismatch"),
        (torch.float32, BLOCK, [5, 30, 0, 17, 12], "destination blocks mismatch"),
    ],
)
def test_unexpected_layout_fails_without_writing(src_dtype: torch.dtype, src_block: tuple[int, int, int],
                                                 dst_ids: list[int], error: str, sender: ZmqSender) -> None:
    dest = Dest(torch.float32)
    src = [torch.randn(SRC_BLOCKS, *src_block).to(src_dtype) for _ in range(LAYERS)]
    with ZmqReceiver(dest.sink) as receiver:
        receiver.expect("bad", DST_IDS, LAYERS, deadline_s=WAIT_S)
        send_all(sender, "bad", receiver.address, src, src, SRC_IDS, dst_ids)
        result = wait_one(receiver)
    assert not result.ok and error in result.error
    assert dest.untouched()


def test_sequence_gap_and_malformed_messages_from_a_raw_peer() -> None:
    dest = Dest()
    k = torch.randn(len(DST_IDS), *BLOCK)
    raw = k.view(torch.uint8).numpy().reshape(-1)
    ctx = zmq.Context()
    with ZmqReceiver(dest.sink) as receiver:
        push = ctx.socket(zmq.PUSH)
        push.connect(receiver.address)
        receiver.expect("gap", DST_IDS, LAYERS, deadline_s=WAIT_S)
        push.send_multipart([b"\x00garbage"])
        for seq, layer in ((0, 0), (2, 1)):  # seq 1 never comes
            header = FrameHeader(KIND_LAYER, "gap", seq, layer=layer, src_block_ids=tuple(SRC_IDS),
                                 dst_block_ids=tuple(DST_IDS), dtype="float32", shape=tuple(k.shape),
                                 checksum_k=checksum(raw), checksum_v=checksum(raw))
            push.send_multipart([header.encode(), raw, raw])
        result = wait_one(receiver)
        dropped = receiver.stats()["frames_dropped"]
        push.close(linger=0)
    ctx.term()
    assert not result.ok and "sequence gap" in result.error and result.layers_received == 1
    assert dropped == 1  # the garbage header
    assert torch.equal(dest.k[0][DST_IDS], k) and dest.untouched(layers=range(1, LAYERS))


def test_many_interleaved_transfers_from_two_senders(endpoint: str) -> None:
    dest = Dest(torch.bfloat16)
    src_k, src_v = make_cache(SRC_BLOCKS, torch.bfloat16, 11), make_cache(SRC_BLOCKS, torch.bfloat16, 12)
    plans = {f"r{i}": ([(7 * i + j) % SRC_BLOCKS for j in range(3)], [3 * i + j for j in range(3)]) for i in range(10)}
    with ZmqReceiver(dest.sink, bind=endpoint) as receiver:
        for rid, (_, dst) in plans.items():
            receiver.expect(rid, dst, LAYERS, deadline_s=WAIT_S)

        def run(rids: list[str]) -> None:
            with ZmqSender() as sender:
                for rid in rids:
                    sender.open(rid, receiver.address, LAYERS)
                for layer in range(LAYERS):  # round-robin: layer 0 of every request, then layer 1, ...
                    for rid in rids:
                        sender.send_layer(rid, layer, src_k[layer], src_v[layer], *plans[rid])
                futures = [sender.commit(rid, {"rid": rid}) for rid in rids]
                assert all(f.result(timeout=WAIT_S).ok for f in futures)

        threads = [threading.Thread(target=run, args=(list(plans)[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        results: list[TransferResult] = []
        wait_until(lambda: results.extend(receiver.poll_completed()) or len(results) == len(plans), "all transfers")
        for t in threads:
            t.join()
    assert sorted(r.request_id for r in results) == sorted(plans)
    assert all(r.ok and r.meta == {"rid": r.request_id} for r in results)
    for src, dst in plans.values():
        assert dest.holds(src_k, src_v, src, dst)
    assert dest.untouched([b for b in range(DST_BLOCKS) if b >= 30])


def test_send_to_a_peer_that_is_not_there_fails_the_commit() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()
    k = torch.randn(4, *BLOCK)
    with ZmqSender(send_timeout_s=0.3) as sender:
        sender.open("lost", dead, 1)
        sender.send_layer("lost", 0, k, k, [0, 1], [0, 1])
        result = sender.commit("lost", {}).result(timeout=WAIT_S)
        stats = sender.stats()
    assert not result.ok and "timed out" in result.error
    assert stats["transfers_failed"] == 1 and stats["bytes_sent"] == 0


def test_on_complete_callback_gets_results_instead_of_the_queue(sender: ZmqSender) -> None:
    dest = Dest()
    src_k, src_v = make_cache(SRC_BLOCKS, torch.float32, 13), make_cache(SRC_BLOCKS, torch.float32, 14)
    got: list[TransferResult] = []
    with ZmqReceiver(dest.sink, on_complete=got.append) as receiver:
        receiver.expect("cb", DST_IDS, LAYERS, deadline_s=WAIT_S)
        send_all(sender, "cb", receiver.address, src_k, src_v, SRC_IDS, DST_IDS)
        wait_until(lambda: len(got) == 1, "the callback")
        assert receiver.poll_completed() == []
    assert got[0].ok and got[0].request_id == "cb"


def _child_sender(address: str, seed: int, corrupt: bool) -> None:
    """Runs in a spawned process: the prefill side of a transfer."""
    src_k, src_v = make_cache(SRC_BLOCKS, torch.bfloat16, seed), make_cache(SRC_BLOCKS, torch.bfloat16, seed + 1)
    with get_transport("zmq").create_sender(corrupt_once=corrupt) as sender:
        for rid in (["bad", "good"] if corrupt else ["good"]):
            send_all(sender, rid, address, src_k, src_v, SRC_IDS, DST_IDS, {"pid_seed": seed})


def test_sender_in_a_separate_process(endpoint: str) -> None:
    dest = Dest(torch.bfloat16)
    receiver = get_transport("zmq").create_receiver(dest.sink, bind=endpoint)
    with receiver:
        receiver.expect("bad", DST_IDS, LAYERS, deadline_s=120.0)
        receiver.expect("good", DST_IDS, LAYERS, deadline_s=120.0)
        proc = mp.get_context("spawn").Process(target=_child_sender, args=(receiver.address, 21, True))
        proc.start()
        results: list[TransferResult] = []
        end = time.monotonic() + 120.0  # a spawned interpreter importing torch is slow on CI
        while len(results) < 2 and time.monotonic() < end:
            results.extend(receiver.poll_completed(timeout_s=1.0))
        proc.join(timeout=60)
    assert proc.exitcode == 0
    by_id = {r.request_id: r for r in results}
    assert not by_id["bad"].ok and "checksum" in by_id["bad"].error
    assert by_id["good"].ok and by_id["good"].meta == {"pid_seed": 21}
    assert dest.holds(make_cache(SRC_BLOCKS, torch.bfloat16, 21), make_cache(SRC_BLOCKS, torch.bfloat16, 22),
                      SRC_IDS, DST_IDS)
    assert dest.untouched(others(DST_IDS))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("src_device, dst_device", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_cuda_caches_go_through_pinned_staging(src_device: str, dst_device: str, sender: ZmqSender) -> None:
    dest = Dest(torch.bfloat16, device=dst_device)
    src_k = make_cache(SRC_BLOCKS, torch.bfloat16, 31, src_device)
    src_v = make_cache(SRC_BLOCKS, torch.bfloat16, 32, src_device)
    with ZmqReceiver(dest.sink) as receiver:
        receiver.expect("gpu", DST_IDS, LAYERS, deadline_s=WAIT_S)
        send_all(sender, "gpu", receiver.address, src_k, src_v, SRC_IDS, DST_IDS)
        result = wait_one(receiver)
    assert result.ok
    assert dest.holds(src_k, src_v, SRC_IDS, DST_IDS)
    assert dest.untouched(others(DST_IDS))

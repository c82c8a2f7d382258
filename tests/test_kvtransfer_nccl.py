"""NCCL KV transport between two real processes, run on CPU with the gloo backend.

The decode side (receiver) lives in the test process; the prefill side (sender) is one spawned
process that executes the steps each test asks for, so every payload crosses a process
boundary through torch.distributed point-to-point, with its header over ZMQ.
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvtransfer import TransferResult, get_transport
from kvtransfer.nccl_transport import NcclReceiver, NcclSender
from kvtransfer.sinks import TensorKVSink
from disagg_cluster import greedy_through_cluster
from spawned_prefill import Prefill

LAYERS = 4
SRC_BLOCKS, DST_BLOCKS = 41, 33
BLOCK = (16, 2, 8)  # block_size, kv_heads, head_dim
SRC_IDS = [37, 3, 21, 9, 39]
DST_IDS = [5, 31, 0, 17, 11]
WAIT_S = 30.0  # generous bound on any wait: CI hosts are slow, and no test measures time


def make_cache(blocks: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, *BLOCK, generator=gen).to(dtype) for _ in range(LAYERS)]


class Dest:
    """A decode-side cache filled with noise, plus a pristine copy to prove what was not written."""

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 99, device: str = "cpu") -> None:
        self.k = [t.to(device) for t in make_cache(DST_BLOCKS, dtype, seed)]
        self.v = [t.to(device) for t in make_cache(DST_BLOCKS, dtype, seed + 1)]
        self.k0, self.v0 = [t.cpu() for t in self.k], [t.cpu() for t in self.v]
        self.sink = TensorKVSink(self.k, self.v)

    def holds(self, seed: int, dtype: torch.dtype, layers: range = range(LAYERS)) -> bool:
        src_k, src_v = make_cache(SRC_BLOCKS, dtype, seed), make_cache(SRC_BLOCKS, dtype, seed + 1)
        return all(torch.equal(self.k[i].cpu()[DST_IDS], src_k[i][SRC_IDS])
                   and torch.equal(self.v[i].cpu()[DST_IDS], src_v[i][SRC_IDS]) for i in layers)

    def untouched(self, blocks: list[int] | None = None, layers: range = range(LAYERS)) -> bool:
        sel = list(range(DST_BLOCKS)) if blocks is None else blocks
        return all(torch.equal(self.k[i].cpu()[sel], self.k0[i][sel]) and torch.equal(self.v[i].cpu()[sel], self.v0[i][sel])
                   for i in layers)


OTHERS = [b for b in range(DST_BLOCKS) if b not in DST_IDS]


# -- the prefill process ------------------------------------------------------------------------

def _step(sender: NcclSender, op: str, kw: dict[str, Any]) -> Any:
    if op == "stats":
        return sender.stats()
    if op == "abort":
        return sender.abort(kw["rid"], kw.get("reason", "aborted by sender"))
    dtype = getattr(torch, kw.get("dtype", "float32"))
    src_k, src_v = make_cache(SRC_BLOCKS, dtype, kw["seed"]), make_cache(SRC_BLOCKS, dtype, kw["seed"] + 1)
    if kw.get("block") is not None:  # a layout the receiver does not expect
        src_k = src_v = [torch.randn(SRC_BLOCKS, *kw["block"]).to(dtype) for _ in range(LAYERS)]
    if sender.device is not None and sender.backend == "nccl":
        src_k, src_v = [t.to(sender.device) for t in src_k], [t.to(sender.device) for t in src_v]
    rid = kw["rid"]
    sender.open(rid, kw["address"], LAYERS)
    for layer in kw.get("layers", range(LAYERS)):
        sender.send_layer(rid, layer, src_k[layer], src_v[layer], SRC_IDS, kw.get("dst", DST_IDS))
    end = kw.get("end", "commit")
    if end == "commit":
        result = sender.commit(rid, kw.get("meta", {})).result(timeout=WAIT_S)
        return {"ok": result.ok, "error": result.error, "bytes_sent": result.bytes_sent}
    if end == "abort":
        return sender.abort(rid, kw["reason"])
    return "open"


def _sender_main(commands: Any, replies: Any, backend: str, device: str | None) -> None:
    """Runs in the spawned process: one NcclSender that executes the test's steps."""
    sender = NcclSender(backend=backend, device=device, send_timeout_s=3.0)
    try:
        while (cmd := commands.get()) is not None:
            op, kw = cmd
            try:
                replies.put(("ok", _step(sender, op, kw)))
            except Exception as exc:
                replies.put(("error", repr(exc)))
    finally:
        sender.close(drain_timeout_s=2.0)


def start_prefill(backend: str = "gloo", device: str | None = None) -> Prefill:
    return Prefill(_sender_main, backend, device)


@pytest.fixture(scope="module")
def prefill() -> Iterator[Prefill]:
    p = start_prefill()
    yield p
    assert p.close() == 0


def receiver_for(dest: Dest, **options: Any) -> NcclReceiver:
    return get_transport("nccl").create_receiver(dest.sink, bind="tcp://127.0.0.1:*", backend="gloo", **options)


def wait_one(receiver: NcclReceiver) -> TransferResult:
    results = receiver.poll_completed(timeout_s=WAIT_S)
    assert len(results) == 1, results
    return results[0]


def wait_until(cond, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)


# -- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_layers_cross_processes_bit_exact_into_odd_blocks(prefill: Prefill, dtype: str) -> None:
    dest = Dest(getattr(torch, dtype))
    meta = {"first_token_id": 4321, "logprobs": None, "num_tokens": 75}
    with receiver_for(dest) as receiver:
        receiver.expect("rt", DST_IDS, LAYERS, deadline_s=WAIT_S)
        sent = prefill("transfer", rid="rt", address=receiver.address, dtype=dtype, seed=1, meta=meta)
        result = wait_one(receiver)
        stats = receiver.stats()
    payload = 2 * LAYERS * len(SRC_IDS) * BLOCK[0] * BLOCK[1] * BLOCK[2] * getattr(torch, dtype).itemsize
    assert sent["ok"] and sent["bytes_sent"] == payload
    assert result.ok and result.meta == meta and result.layers_received == LAYERS
    assert result.bytes_received == payload == stats["bytes_received"]
    assert dest.holds(1, getattr(torch, dtype))
    assert dest.untouched(OTHERS)
    assert stats["transfers_ok"] == 1 and stats["channels_opened"] == 1


def test_layers_queued_together_travel_as_one_message_and_land_bit_exact(prefill: Prefill) -> None:
    """A new channel's handshake holds the first layers back, so they queue and share a payload."""
    dest = Dest()
    before = prefill("stats")["payload_messages"]
    with receiver_for(dest) as receiver:
        receiver.expect("batched", DST_IDS, LAYERS, deadline_s=WAIT_S)
        sent = prefill("transfer", rid="batched", address=receiver.address, seed=5, layers=[2, 0, 3, 1])
        result = wait_one(receiver)
    messages = prefill("stats")["payload_messages"] - before
    assert sent["ok"] and result.ok and result.layers_received == LAYERS
    assert dest.holds(5, torch.float32) and dest.untouched(OTHERS)
    assert 1 <= messages < LAYERS


def test_take_batch_joins_only_queued_layers_of_one_transfer_within_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    import collections

    from kvtransfer import nccl_send_channel as sc
    from kvtransfer.frames import KIND_COMMIT, KIND_LAYER
    from kvtransfer.outgoing import Item, Outgoing

    a, b = Outgoing("a", "tcp://x:1", 8), Outgoing("b", "tcp://x:1", 8)

    def layer(state: Outgoing, i: int, nbytes: int = 100) -> Item:
        return Item(state, KIND_LAYER, layer=i, staged=sc._Staged(torch.empty(0), "float32", (1,), nbytes))

    items = collections.deque([layer(a, 0), layer(a, 1), layer(b, 0), layer(a, 2), Item(a, KIND_COMMIT), layer(a, 3)])
    assert [(it.state.request_id, it.layer) for it in sc.take_batch(items)] == [("a", 0), ("a", 1)]
    assert [(it.state.request_id, it.layer) for it in sc.take_batch(items)] == [("b", 0)]
    assert [it.layer for it in sc.take_batch(items)] == [2]  # a commit is never joined
    assert [it.kind for it in sc.take_batch(items)] == [KIND_COMMIT]
    assert [it.layer for it in sc.take_batch(items)] == [3] and sc.take_batch(items) == []
    monkeypatch.setattr(sc, "COALESCE_MAX_BYTES", 250)
    monkeypatch.setattr(sc, "COALESCE_MAX_LAYERS", 3)
    items = collections.deque([layer(a, i) for i in range(4)] + [layer(a, 9, nbytes=300)])
    assert [it.layer for it in sc.take_batch(items)] == [0, 1]  # a third would make 300 bytes, past 250
    items = collections.deque([layer(a, i, nbytes=1) for i in range(5)])
    assert [it.layer for it in sc.take_batch(items)] == [0, 1, 2]  # at most 3 layers


def test_abort_fails_at_once_and_the_channel_keeps_working(prefill: Prefill) -> None:
    dest = Dest()
    with receiver_for(dest) as receiver:
        receiver.expect("gone", DST_IDS, LAYERS, deadline_s=600.0)
        assert prefill("transfer", rid="gone", address=receiver.address, seed=3, layers=[0], end="abort",
                       reason="client cancelled") is True
        aborted = wait_one(receiver)  # long before the 600 s deadline
        assert not aborted.ok and "aborted by sender: client cancelled" in aborted.error
        assert aborted.layers_received <= 1  # a layer still queued when the abort came is dropped
        assert dest.untouched(layers=range(1, LAYERS))
        receiver.expect("next", DST_IDS, LAYERS, deadline_s=WAIT_S)
        assert prefill("transfer", rid="next", address=receiver.address, seed=5)["ok"]
        assert wait_one(receiver).ok
        assert receiver.stats()["channels_opened"] == 1
    assert dest.holds(5, torch.float32) and dest.untouched(OTHERS)


def test_timeout_reports_failure_and_late_layers_never_land(prefill: Prefill) -> None:
    dest = Dest()
    with receiver_for(dest, poll_interval_s=0.01) as receiver:
        receiver.expect("slow", DST_IDS, LAYERS, deadline_s=1.5)
        prefill("transfer", rid="slow", address=receiver.address, seed=7, layers=[0, 1], end="none")
        result = wait_one(receiver)
        assert not result.ok and "timed out" in result.error and result.layers_received == 2
        assert dest.holds(7, torch.float32, layers=range(2)) and dest.untouched(layers=range(2, LAYERS))
        dropped = receiver.stats()["frames_dropped"]
        prefill("abort", rid="slow")  # the abort header reaches a receiver that forgot the request
        wait_until(lambda: receiver.stats()["frames_dropped"] > dropped, "the dropped abort")
        receiver.expect("after", DST_IDS, LAYERS, deadline_s=WAIT_S)
        assert prefill("transfer", rid="after", address=receiver.address, seed=9)["ok"]
        assert wait_one(receiver).ok
    assert dest.holds(9, torch.float32)


def test_unknown_cancelled_and_mismatched_payloads_are_drained_not_written(prefill: Prefill) -> None:
    dest = Dest()
    with receiver_for(dest) as receiver:
        prefill("transfer", rid="ghost", address=receiver.address, seed=11)  # never expected
        receiver.expect("cancelled", DST_IDS, LAYERS, deadline_s=WAIT_S)
        assert receiver.cancel("cancelled")
        prefill("transfer", rid="cancelled", address=receiver.address, seed=11)
        receiver.expect("misshaped", DST_IDS, LAYERS, deadline_s=WAIT_S)
        prefill("transfer", rid="misshaped", address=receiver.address, seed=11, block=(16, 2, 4))
        failed = wait_one(receiver)
        assert not failed.ok and "shape mismatch" in failed.error
        wait_until(lambda: receiver.stats()["frames_dropped"] >= 2 * (LAYERS + 1), "the dropped frames")
        assert dest.untouched()
        receiver.expect("real", DST_IDS, LAYERS, deadline_s=WAIT_S)  # payloads still line up with headers
        assert prefill("transfer", rid="real", address=receiver.address, seed=13)["ok"]
        assert wait_one(receiver).ok
        stats = receiver.stats()
    assert dest.holds(13, torch.float32) and dest.untouched(OTHERS)
    assert stats["channels_opened"] == 1 and stats["channels_broken"] == 0


def test_a_receiver_that_went_away_fails_the_send_and_a_new_one_works(prefill: Prefill) -> None:
    first = Dest()
    receiver = receiver_for(first)
    address = receiver.address
    receiver.expect("one", DST_IDS, LAYERS, deadline_s=WAIT_S)
    assert prefill("transfer", rid="one", address=address, seed=15)["ok"]
    assert wait_one(receiver).ok
    receiver.close()
    lost = prefill("transfer", rid="lost", address=address, seed=15)
    assert not lost["ok"] and lost["error"]
    second = Dest()
    with receiver_for(second) as again:
        again.expect("two", DST_IDS, LAYERS, deadline_s=WAIT_S)
        assert prefill("transfer", rid="two", address=again.address, seed=17)["ok"]
        assert wait_one(again).ok
    assert second.holds(17, torch.float32)
    assert prefill("stats")["broken_channels"] >= 1


def test_no_receiver_at_the_address_fails_the_commit_in_time() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()
    k = torch.randn(4, *BLOCK)
    with NcclSender(backend="gloo", send_timeout_s=0.3) as sender:
        sender.open("nowhere", dead, 1)
        sender.send_layer("nowhere", 0, k, k, [0, 1], [0, 1])
        result = sender.commit("nowhere", {}).result(timeout=WAIT_S)
        stats = sender.stats()
    assert not result.ok and "handshake" in result.error
    assert stats["transfers_failed"] == 1 and stats["bytes_sent"] == 0


def test_bad_options_name_the_field() -> None:
    dest = Dest()
    with pytest.raises(ValueError, match="backend"):
        NcclReceiver(dest.sink, backend="mpi")
    with pytest.raises(ValueError, match="send_timeout_s"):
        NcclSender(send_timeout_s=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="backend"):
            NcclSender(backend="nccl")
    with NcclSender(backend="gloo") as sender, pytest.raises(ValueError, match="peer_address"):
        sender.open("x", "http://nowhere", 1)
    with NcclReceiver(dest.sink, backend="gloo") as taken, pytest.raises(ValueError, match="store_address"):
        NcclReceiver(dest.sink, backend="gloo", store_address=f"127.0.0.1:{taken.store_port}")


def test_creating_an_nccl_group_turns_nvlink_multicast_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtransfer.nccl_group import ensure_nccl_env

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS", raising=False)
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ensure_nccl_env()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["NVSHMEM_DISABLE_NVLS"] == "1" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_disaggregated_workers_over_the_nccl_transport_match_the_offline_engine(tmp_path) -> None:
    """A prefill and a decode worker process (CPU, so the transport runs gloo) behind a gateway."""
    got, expected, decode_log = greedy_through_cluster(tmp_path, "nccl")
    assert got == expected
    assert "kv nccl channel" in decode_log and "(gloo" in decode_log and "Traceback" not in decode_log


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_nccl_between_two_gpus_lands_bit_exact(dtype: str) -> None:
    """The real thing: cuda:0 (prefill process) to cuda:1 (this process) through NCCL."""
    gpu = start_prefill(backend="nccl", device="cuda:0")
    try:
        dest = Dest(getattr(torch, dtype), device="cuda:1")
        with get_transport("nccl").create_receiver(dest.sink, bind="tcp://127.0.0.1:*") as receiver:
            assert receiver.backend == "nccl"
            for rid, seed in (("gpu-1", 21), ("gpu-2", 23)):
                receiver.expect(rid, DST_IDS, LAYERS, deadline_s=WAIT_S)
                assert gpu("transfer", rid=rid, address=receiver.address, dtype=dtype, seed=seed)["ok"]
                assert wait_one(receiver).ok
                torch.cuda.synchronize("cuda:1")
                assert dest.holds(seed, getattr(torch, dtype)) and dest.untouched(OTHERS)
    finally:
        assert gpu.close() == 0

"""IPC KV transport on CPU: payloads through a shared-memory pool, headers over real ZMQ sockets.

The decode side (receiver) lives in the test process; the prefill side (sender) is mostly one
spawned process that executes the steps each test asks for, so every payload crosses a process
boundary through the pool both map. A hand-built peer speaks the wire format directly to feed
the receiver what a correct sender never would.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zmq

from kvtransfer import KVTransferError, TransferResult, available_transports, get_transport
from kvtransfer import ipc_wire as wire
from kvtransfer.frames import KIND_LAYER, FrameHeader, checksum
from kvtransfer.ipc_transport import IpcReceiver, IpcSender
from kvtransfer.sinks import TensorKVSink
from disagg_cluster import greedy_through_cluster
from spawned_prefill import Prefill

LAYERS = 3
SRC_BLOCKS, DST_BLOCKS = 40, 32
BLOCK = (16, 2, 8)  # block_size, kv_heads, head_dim
# Block 39 stands for the prompt's partly filled last block: the transport copies all of it,
# the tail past num_tokens included, byte for byte.
SRC_IDS = [37, 3, 21, 9, 39]
DST_IDS = [5, 30, 0, 17, 11]
OTHERS = [b for b in range(DST_BLOCKS) if b not in DST_IDS]
SLOT_BYTES = 16384  # one float32 layer of 5 blocks (2 x 5120 bytes) per slot
SLOTS = 4
WAIT_S = 20.0  # generous bound on any wait: CI hosts are slow


def make_cache(blocks: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, *BLOCK, generator=gen).to(dtype) for _ in range(LAYERS)]


def fresh_seed() -> int:
    return secrets.randbits(31)


class Dest:
    """A decode-side cache filled with noise, plus a pristine copy to prove what was not written."""

    def __init__(self, dtype: torch.dtype = torch.float32, seed: int = 99, device: str = "cpu") -> None:
        self.dtype = dtype
        self.k = [t.to(device) for t in make_cache(DST_BLOCKS, dtype, seed)]
        self.v = [t.to(device) for t in make_cache(DST_BLOCKS, dtype, seed + 1)]
        self.k0, self.v0 = [t.cpu() for t in self.k], [t.cpu() for t in self.v]
        self.sink = TensorKVSink(self.k, self.v)

    def holds(self, seed: int, src_ids: list[int] = SRC_IDS, dst_ids: list[int] = DST_IDS,
              layers: range = range(LAYERS)) -> bool:
        src_k, src_v = make_cache(SRC_BLOCKS, self.dtype, seed), make_cache(SRC_BLOCKS, self.dtype, seed + 1)
        return all(torch.equal(self.k[i].cpu()[dst_ids], src_k[i][src_ids])
                   and torch.equal(self.v[i].cpu()[dst_ids], src_v[i][src_ids]) for i in layers)

    def untouched(self, blocks: list[int] | None = None, layers: range = range(LAYERS)) -> bool:
        sel = list(range(DST_BLOCKS)) if blocks is None else blocks
        return all(torch.equal(self.k[i].cpu()[sel], self.k0[i][sel]) and torch.equal(self.v[i].cpu()[sel], self.v0[i][sel])
                   for i in layers)


class SlowSink:
    """The decode cache behind a receiver that takes its time, so senders run out of slots."""

    def __init__(self, inner: TensorKVSink, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.block_shape, self.dtype, self.k_caches = inner.block_shape, inner.dtype, inner.k_caches

    def write(self, layer: int, dst_block_ids: Any, k: Any, v: Any) -> None:
        time.sleep(self.delay_s)
        self.inner.write(layer, dst_block_ids, k, v)


def wait_one(receiver: IpcReceiver) -> TransferResult:
    results = receiver.poll_completed(timeout_s=WAIT_S)
    assert len(results) == 1, results
    return results[0]


def wait_until(cond, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.01)


def send_all(sender: IpcSender, rid: str, address: str, seed: int, dtype: torch.dtype = torch.float32,
             src_ids: list[int] = SRC_IDS, dst_ids: list[int] = DST_IDS, meta: dict | None = None) -> Any:
    src_k, src_v = make_cache(SRC_BLOCKS, dtype, seed), make_cache(SRC_BLOCKS, dtype, seed + 1)
    sender.open(rid, address, LAYERS)
    for layer in range(LAYERS):
        sender.send_layer(rid, layer, src_k[layer], src_v[layer], src_ids, dst_ids)
    return sender.commit(rid, meta or {}).result(timeout=WAIT_S)


# -- the prefill process ------------------------------------------------------------------------

def _step(sender: IpcSender, op: str, kw: dict[str, Any]) -> Any:
    if op == "stats":
        return sender.stats()
    if op == "abort":
        return sender.abort(kw["rid"], kw.get("reason", "aborted by sender"))
    if op == "many":  # several transfers at once, one thread each
        errors: list[str] = []

        def one(job: dict[str, Any]) -> None:
            try:
                result = _step(sender, "transfer", {"address": kw["address"], **job})
                if not result["ok"]:
                    errors.append(result["error"])
            except Exception as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=one, args=(job,)) for job in kw["jobs"]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return errors
    dtype = getattr(torch, kw.get("dtype", "float32"))
    src_k, src_v = make_cache(SRC_BLOCKS, dtype, kw["seed"]), make_cache(SRC_BLOCKS, dtype, kw["seed"] + 1)
    if kw.get("block") is not None:  # a layout the receiver does not expect
        src_k = src_v = [torch.randn(SRC_BLOCKS, *kw["block"]).to(dtype) for _ in range(LAYERS)]
    if kw.get("device"):
        src_k, src_v = [t.to(kw["device"]) for t in src_k], [t.to(kw["device"]) for t in src_v]
    rid = kw["rid"]
    if kw.get("stacked"):  # one allocation, as the engine's KVCache: [layers, 2, blocks, ...]
        stacked = torch.stack([torch.stack(pair) for pair in zip(src_k, src_v)])
        src_k, src_v = [kv[0] for kv in stacked], [kv[1] for kv in stacked]
    if kw.get("open", True):
        sender.open(rid, kw["address"], LAYERS)
    layers = kw.get("layers", range(LAYERS))
    if kw.get("together"):
        sender.send_layers(rid, layers, [(src_k[i], src_v[i]) for i in layers], kw.get("src", SRC_IDS),
                           kw.get("dst", DST_IDS))
    for layer in () if kw.get("together") else layers:
        sender.send_layer(rid, layer, src_k[layer], src_v[layer], kw.get("src", SRC_IDS), kw.get("dst", DST_IDS))
    end = kw.get("end", "commit")
    if end == "commit":
        result = sender.commit(rid, kw.get("meta", {})).result(timeout=WAIT_S)
        return {"ok": result.ok, "error": result.error, "bytes_sent": result.bytes_sent}
    if end == "abort":
        return sender.abort(rid, kw["reason"])
    return "open"


def _sender_main(commands: Any, replies: Any, options: dict[str, Any]) -> None:
    """Runs in the spawned process: one IpcSender that executes the test's steps."""
    sender = get_transport("cuda_ipc").create_sender(**options)
    try:
        while (cmd := commands.get()) is not None:
            op, kw = cmd
            try:
                replies.put(("ok", _step(sender, op, kw)))
            except Exception as exc:
                replies.put(("error", repr(exc)))
    finally:
        sender.close(drain_timeout_s=2.0)


def start_prefill(**options: Any) -> Prefill:
    return Prefill(_sender_main, options)


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shm")


@pytest.fixture(scope="module")
def prefill(shm_dir: Path) -> Iterator[Prefill]:
    p = start_prefill(slots=SLOTS, slot_bytes=SLOT_BYTES, send_timeout_s=5.0, shm_dir=str(shm_dir))
    yield p
    assert p.close() == 0
    assert os.listdir(shm_dir) == []  # every pool file is gone once the sender closed


def slots_in_use(prefill: Prefill) -> float:
    return prefill("stats")["slots_in_use"]


# -- transfers between processes ----------------------------------------------------------------

def test_registry_resolves_ipc() -> None:
    transport = get_transport("cuda_ipc")
    assert transport.sender_cls is IpcSender and transport.receiver_cls is IpcReceiver
    assert "cuda_ipc" in available_transports()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers_from_another_process_land_byte_identical(prefill: Prefill, shm_dir: Path, dtype: str) -> None:
    dest, seed = Dest(getattr(torch, dtype)), fresh_seed()
    meta = {"first_token_id": 4321, "logprobs": None, "num_tokens": 4 * BLOCK[0] + 5}
    with get_transport("cuda_ipc").create_receiver(dest.sink) as receiver:
        receiver.expect("rt", DST_IDS, LAYERS, deadline_s=WAIT_S)
        sent = prefill("transfer", rid="rt", address=receiver.address, dtype=dtype, seed=seed, meta=meta)
        result = wait_one(receiver)
        stats = receiver.stats()
        # The pool's file is unlinked once the receiver mapped it, so a crash leaves nothing behind.
        wait_until(lambda: os.listdir(shm_dir) == [], "the pool file to be unlinked")
    payload = 2 * LAYERS * len(SRC_IDS) * BLOCK[0] * BLOCK[1] * BLOCK[2] * getattr(torch, dtype).itemsize
    assert sent["ok"] and sent["bytes_sent"] == payload
    assert result.ok and result.error is None and result.meta == meta and result.layers_received == LAYERS
    assert result.bytes_received == payload == stats["bytes_received"]
    assert dest.holds(seed) and dest.untouched(OTHERS)
    assert stats["transfers_ok"] == 1 and stats["channels_opened"] == 1 and stats["checksum_failures"] == 0


@pytest.mark.parametrize("slots", [SLOTS, 2])
def test_a_steps_layers_sent_together_land_byte_identical(shm_dir: Path, slots: int) -> None:
    """`send_layers`: one run of the pool for every layer, or layer by layer where the pool is
    smaller than the step (2 slots for 3 layers); the caches as the engine allocates them."""
    dest, seed = Dest(torch.bfloat16), fresh_seed()
    p = start_prefill(slots=slots, slot_bytes=SLOT_BYTES, send_timeout_s=5.0, shm_dir=str(shm_dir))
    try:
        with get_transport("cuda_ipc").create_receiver(dest.sink) as receiver:
            receiver.expect("st", DST_IDS, LAYERS, deadline_s=WAIT_S)
            sent = p("transfer", rid="st", address=receiver.address, dtype="bfloat16", seed=seed, together=True,
                     stacked=True)
            result = wait_one(receiver)
        wait_until(lambda: p("stats")["slots_in_use"] == 0, "every slot to be released")
        assert sent["ok"] and result.ok and result.layers_received == LAYERS, (sent, result.error)
        assert dest.holds(seed) and dest.untouched(OTHERS)
    finally:
        assert p.close() == 0


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A directory for ipc:// socket paths, which must stay under ~100 characters."""
    path = tempfile.mkdtemp(prefix="kvipc-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_concurrent_transfers_share_a_small_pool_without_mixing(prefill: Prefill, short_dir: str) -> None:
    dest = Dest()
    # 10 transfers x 3 layers through 4 slots, read by a slow receiver: senders wait for slots
    # and slots are reused many times over. Each transfer has its own source data and blocks.
    jobs = [{"rid": f"c{i}", "seed": fresh_seed(), "src": [(7 * i + j) % SRC_BLOCKS for j in range(3)],
             "dst": [3 * i + j for j in range(3)]} for i in range(10)]
    waits_before = prefill("stats")["pool_waits"]
    with IpcReceiver(SlowSink(dest.sink, 0.01), bind=f"ipc://{short_dir}/kv.sock") as receiver:
        for job in jobs:
            receiver.expect(job["rid"], job["dst"], LAYERS, deadline_s=WAIT_S)
        errors = prefill("many", address=receiver.address, jobs=jobs)
        results: list[TransferResult] = []
        wait_until(lambda: results.extend(receiver.poll_completed()) or len(results) == len(jobs), "all transfers")
        wait_until(lambda: slots_in_use(prefill) == 0, "every slot to be released")
    assert errors == []
    assert sorted(r.request_id for r in results) == sorted(j["rid"] for j in jobs)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    for job in jobs:
        assert dest.holds(job["seed"], job["src"], job["dst"])
    assert dest.untouched([b for b in range(DST_BLOCKS) if b >= 30])
    assert prefill("stats")["pool_waits"] > waits_before  # the pool really was the bottleneck


def test_abort_fails_at_once_and_frees_the_slots(prefill: Prefill) -> None:
    dest = Dest()
    with IpcReceiver(dest.sink) as receiver:
        receiver.expect("gone", DST_IDS, LAYERS, deadline_s=600.0)
        assert prefill("transfer", rid="gone", address=receiver.address, seed=fresh_seed(), layers=[0], end="abort",
                       reason="client cancelled") is True
        aborted = wait_one(receiver)  # long before the 600 s deadline
        wait_until(lambda: slots_in_use(prefill) == 0, "the aborted layer's slot")
        seed = fresh_seed()
        receiver.expect("next", DST_IDS, LAYERS, deadline_s=WAIT_S)
        assert prefill("transfer", rid="next", address=receiver.address, seed=seed)["ok"]
        assert wait_one(receiver).ok
    assert not aborted.ok and "aborted by sender: client cancelled" in aborted.error
    assert dest.holds(seed) and dest.untouched(OTHERS)


def test_deadline_fails_the_transfer_and_late_layers_still_free_their_slots(prefill: Prefill) -> None:
    dest, seed = Dest(), fresh_seed()
    with IpcReceiver(dest.sink, poll_interval_s=0.01) as receiver:
        receiver.expect("slow", DST_IDS, LAYERS, deadline_s=1.0)
        prefill("transfer", rid="slow", address=receiver.address, seed=seed, layers=[0], end="none")
        result = wait_one(receiver)
        assert not result.ok and "timed out" in result.error and result.layers_received == 1
        dropped = receiver.stats()["frames_dropped"]
        late = prefill("transfer", rid="slow", open=False, seed=seed, layers=[1, 2])  # after the result
        wait_until(lambda: receiver.stats()["frames_dropped"] == dropped + LAYERS, "the late frames")
        wait_until(lambda: slots_in_use(prefill) == 0, "the late layers' slots")
        assert receiver.poll_completed() == []
    assert late["ok"]  # handed to the transport; the receiver is the authority
    assert dest.holds(seed, layers=range(1)) and dest.untouched(layers=range(1, LAYERS))


@pytest.mark.parametrize(
    "kw, error",
    [
        ({"dtype": "float16"}, "dtype mismatch"),
        ({"block": (16, 2, 4)}, "shape mismatch"),
        ({"dst": [5, 30, 0, 17, 12]}, "destination blocks mismatch"),
    ],
)
def test_unexpected_layout_fails_that_transfer_only(prefill: Prefill, kw: dict[str, Any], error: str) -> None:
    dest, seed = Dest(), fresh_seed()
    with IpcReceiver(dest.sink) as receiver:
        receiver.expect("bad", DST_IDS, LAYERS, deadline_s=WAIT_S)
        prefill("transfer", rid="bad", address=receiver.address, seed=seed, **kw)
        failed = wait_one(receiver)
        assert dest.untouched()
        receiver.expect("good", DST_IDS, LAYERS, deadline_s=WAIT_S)
        assert prefill("transfer", rid="good", address=receiver.address, seed=seed)["ok"]
        assert wait_one(receiver).ok
        wait_until(lambda: slots_in_use(prefill) == 0, "every slot to be released")
    assert not failed.ok and error in failed.error
    assert dest.holds(seed) and dest.untouched(OTHERS)


# -- the sender in this process ---------------------------------------------------------------------

@pytest.fixture
def sender(tmp_path: Path) -> Iterator[IpcSender]:
    s = IpcSender(slots=SLOTS, slot_bytes=SLOT_BYTES, send_timeout_s=5.0, shm_dir=str(tmp_path))
    yield s
    s.close(drain_timeout_s=1.0)
    assert os.listdir(tmp_path) == []


def test_corrupted_layer_is_rejected_and_the_retry_lands(tmp_path: Path) -> None:
    dest, seed = Dest(torch.bfloat16), fresh_seed()
    with IpcReceiver(dest.sink) as receiver, IpcSender(corrupt_once=True, shm_dir=str(tmp_path)) as sender:
        receiver.expect("try-1", DST_IDS, LAYERS, deadline_s=WAIT_S)
        send_all(sender, "try-1", receiver.address, seed, torch.bfloat16)
        failed = wait_one(receiver)
        assert dest.untouched()
        receiver.expect("try-2", DST_IDS, LAYERS, deadline_s=WAIT_S)
        send_all(sender, "try-2", receiver.address, seed, torch.bfloat16)
        retried = wait_one(receiver)
        stats = receiver.stats()
    assert not failed.ok and "checksum" in failed.error
    assert retried.ok and dest.holds(seed)
    assert stats["checksum_failures"] == 1 and stats["transfers_failed"] == 1 and stats["transfers_ok"] == 1


def test_receiver_close_fails_the_senders_transfers_without_waiting(sender: IpcSender) -> None:
    dest, seed = Dest(), fresh_seed()
    src_k, src_v = make_cache(SRC_BLOCKS, torch.float32, seed), make_cache(SRC_BLOCKS, torch.float32, seed + 1)
    receiver = IpcReceiver(dest.sink)
    receiver.expect("cut", DST_IDS, LAYERS, deadline_s=WAIT_S)
    sender.open("cut", receiver.address, LAYERS)
    sender.send_layer("cut", 0, src_k[0], src_v[0], SRC_IDS, DST_IDS)
    wait_until(lambda: receiver.stats()["frames_received"] == 1, "layer 0")
    t0 = time.monotonic()
    receiver.close()
    assert time.monotonic() - t0 < 2.0
    # The receiver's goodbye (or its connection closing) breaks the channel: no send waits for
    # the 5 s timeout.
    wait_until(lambda: sender.stats()["broken_channels"] == 1, "the goodbye")
    with pytest.raises(KVTransferError, match="closed|went away"):
        sender.send_layer("cut", 1, src_k[1], src_v[1], SRC_IDS, DST_IDS)
    assert time.monotonic() - t0 < sender.send_timeout_s
    # A new receiver gets a new channel.
    with IpcReceiver(Dest().sink) as again:
        again.expect("again", DST_IDS, LAYERS, deadline_s=WAIT_S)
        assert send_all(sender, "again", again.address, seed).ok
        assert wait_one(again).ok


def test_sender_close_does_not_hang_the_receiver(tmp_path: Path) -> None:
    dest, seed = Dest(), fresh_seed()
    src_k, src_v = make_cache(SRC_BLOCKS, torch.float32, seed), make_cache(SRC_BLOCKS, torch.float32, seed + 1)
    with IpcReceiver(dest.sink, poll_interval_s=0.01) as receiver:
        receiver.expect("half", DST_IDS, LAYERS, deadline_s=1.0)
        sender = IpcSender(shm_dir=str(tmp_path))
        sender.open("half", receiver.address, LAYERS)
        sender.send_layer("half", 0, src_k[0], src_v[0], SRC_IDS, DST_IDS)
        wait_until(lambda: receiver.stats()["channels"] == 1, "the channel")
        # Layer 0 landed, so its pool was mapped first: the close below then leaves a transfer
        # half done (closing sooner unlinks the pool before the receiver maps it, which fails
        # the transfer at once instead).
        wait_until(lambda: receiver.stats()["frames_received"] >= 1, "layer 0")
        t0 = time.monotonic()
        sender.close()
        assert time.monotonic() - t0 < 3.0
        wait_until(lambda: receiver.stats()["channels"] == 0, "the goodbye")  # pool unmapped
        result = wait_one(receiver)
        assert not result.ok and "timed out" in result.error
        assert os.listdir(tmp_path) == []
        with pytest.raises(KVTransferError, match="closed"):
            sender.send_layer("half", 1, src_k[1], src_v[1], SRC_IDS, DST_IDS)
        with IpcSender(shm_dir=str(tmp_path)) as fresh:  # the receiver still serves others
            receiver.expect("whole", DST_IDS, LAYERS, deadline_s=WAIT_S)
            assert send_all(fresh, "whole", receiver.address, seed).ok
            assert wait_one(receiver).ok
    assert dest.holds(seed)


def _receiver_main(address_q: Any, results_q: Any) -> None:
    """Runs in a spawned process: a decode-side receiver, until it is killed."""
    dest = Dest()
    receiver = IpcReceiver(dest.sink, on_complete=lambda r: results_q.put((r.request_id, r.ok)))
    receiver.expect("before", DST_IDS, LAYERS, deadline_s=120.0)
    address_q.put(receiver.address)
    time.sleep(600)


def test_receiver_process_killed_makes_sends_fail_within_the_timeout(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    address_q, results_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver_main, args=(address_q, results_q), daemon=True)
    proc.start()
    try:
        address = address_q.get(timeout=120.0)
        with IpcSender(send_timeout_s=1.0, shm_dir=str(tmp_path)) as sender:
            assert send_all(sender, "before", address, fresh_seed()).ok
            assert results_q.get(timeout=WAIT_S) == ("before", True)
            proc.kill()
            proc.join(timeout=WAIT_S)
            t0 = time.monotonic()
            # A transfer counts as sent once it is handed to the socket; the first one after the
            # kill may be, before the sender's I/O thread has seen the connection close (a loaded
            # machine). The next one must fail.
            failure = None
            for attempt in range(2):
                try:
                    result = send_all(sender, f"after-{attempt}", address, fresh_seed())
                    failure = None if result.ok else result.error
                except KVTransferError as exc:
                    failure = str(exc)
                if failure is not None:
                    break
            elapsed = time.monotonic() - t0
            t1 = time.monotonic()
        assert time.monotonic() - t1 < 3.0  # close does not wait for the dead peer
    finally:
        if proc.is_alive():
            proc.kill()
    assert failure is not None and any(why in failure for why in ("timed out", "went away", "full")), failure
    assert elapsed < 2 * (3 * sender.send_timeout_s + 1.0)
    assert os.listdir(tmp_path) == []


def test_bad_options_and_arguments_name_the_field(sender: IpcSender) -> None:
    dest = Dest()
    with pytest.raises(ValueError, match="^sink:"):
        IpcReceiver(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^bind:"):
        IpcReceiver(dest.sink, bind="tcp://not-an-address")
    with pytest.raises(ValueError, match="^max_pool_bytes:"):
        IpcReceiver(dest.sink, max_pool_bytes=0)
    for options, field in (({"send_timeout_s": 0}, "send_timeout_s"), ({"slots": 0}, "slots"),
                           ({"slot_bytes": 1000}, "slot_bytes"), ({"shm_dir": "/no/such/dir"}, "shm_dir"),
                           ({"checksum_algorithm": "md5"}, "checksum")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            IpcSender(**options)
    k = torch.randn(SRC_BLOCKS, *BLOCK)
    with IpcReceiver(dest.sink) as receiver:
        receiver.expect("r", [1, 2], 1, 5.0)
        with pytest.raises(ValueError, match="^request_id:"):
            receiver.expect("r", [3], 1, 5.0)
        with pytest.raises(ValueError, match="^deadline_s:"):
            receiver.expect("s", [3], 1, 0)
        with pytest.raises(ValueError, match="^peer_address:"):
            sender.open("r", "http://example", LAYERS)
        with pytest.raises(ValueError, match="^peer_address:"):
            sender.open("r", "inproc://same-process-only", LAYERS)
        sender.open("nowhere", "tcp://not-an-address", 1)  # ZMQ rejects it only when connecting
        try:
            sender.send_layer("nowhere", 0, k, k, [0], [0])
            failure = sender.commit("nowhere", {}).result(timeout=WAIT_S).error
        except KVTransferError as exc:  # the channel broke before the layer was staged
            failure = str(exc)
        assert failure is not None and "cannot connect" in failure
        sender.open("r", receiver.address, LAYERS)
        with pytest.raises(ValueError, match="^request_id:"):
            sender.open("r", receiver.address, LAYERS)
        with pytest.raises(ValueError, match="^layer:"):
            sender.send_layer("r", LAYERS, k, k, [0], [0])
        with pytest.raises(ValueError, match="^src_block_ids:"):
            sender.send_layer("r", 0, k, k, [SRC_BLOCKS], [0])
        with pytest.raises(ValueError, match="^src_v:"):
            sender.send_layer("r", 0, k, k[:4], [0], [0])
        with pytest.raises(ValueError, match="^caches:"):
            sender.send_layers("r", [0, 1], [(k, k)], [1, 2], [3, 4])
        with pytest.raises(ValueError, match="^layers:"):
            sender.send_layers("r", [1, 1], [(k, k), (k, k)], [1, 2], [3, 4])
        with pytest.raises(ValueError, match="^layer:"):
            sender.send_layers("r", [1, LAYERS], [(k, k), (k, k)], [1, 2], [3, 4])
        big = torch.randn(SRC_BLOCKS, 64, 8, 16)  # 32 blocks of it need more than the whole pool
        sender.open("big", receiver.address, 1)
        with pytest.raises(KVTransferError, match="does not fit the staging pool"):
            sender.send_layer("big", 0, big, big, list(range(32)), list(range(32)))
        assert sender.abort("big")
        sender.send_layer("r", 0, k.numpy(), k.numpy(), [1, 2], [3, 4])  # numpy caches stage too
        with pytest.raises(ValueError, match="^layer:"):
            sender.send_layer("r", 0, k, k, [1, 2], [3, 4])
        with pytest.raises(ValueError, match="^request_id:"):
            sender.commit("r", {})
        assert sender.abort("r") is True and sender.abort("r") is False
        wait_until(lambda: sender.stats()["slots_in_use"] == 0, "the aborted layer's slot")


def test_a_layer_without_blocks_needs_no_slot(sender: IpcSender) -> None:
    dest = Dest()
    k = torch.randn(SRC_BLOCKS, *BLOCK)
    with IpcReceiver(dest.sink) as receiver:
        receiver.expect("empty", [], 2, deadline_s=WAIT_S)
        sender.open("empty", receiver.address, 2)
        for layer in range(2):
            sender.send_layer("empty", layer, k, k, [], [])
        assert sender.commit("empty", {"n": 0}).result(timeout=WAIT_S).ok
        result = wait_one(receiver)
    assert result.ok and result.layers_received == 2 and result.bytes_received == 0 and result.meta == {"n": 0}
    assert dest.untouched()


# -- a hand-built peer: what a correct sender never sends -----------------------------------------

class RawPeer:
    """Speaks the ipc wire format over its own DEALER, with a pool file it made itself."""

    def __init__(self, address: str, shm_dir: Path, identity: bytes = b"raw-peer", slots: int = 2) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.slots = slots
        self.path = shm_dir / "tandem-kv-raw.pool"
        self.path.write_bytes(bytes(slots * SLOT_BYTES))
        self.pool = np.memmap(self.path, dtype=np.uint8, mode="r+")

    def send(self, tag: bytes, *parts: bytes | dict) -> None:
        self.sock.send_multipart([tag, *(wire.encode(p) if isinstance(p, dict) else p for p in parts)])

    def reply(self) -> tuple[bytes, dict]:
        assert self.sock.poll(int(WAIT_S * 1000)), "no reply"
        tag, body = self.sock.recv_multipart()
        return tag, wire.decode(body, "reply")

    def describe(self, **changes: Any) -> dict:
        return {"kind": "shm", "slots": self.slots, "slot_bytes": SLOT_BYTES, "path": str(self.path), **changes}

    def layer(self, rid: str, seq: int, layer: int, data: torch.Tensor, extent: dict | None, slot: int = 0,
              bad_checksum: bool = False) -> None:
        """Write K = V = `data` into `slot` and announce it with `extent` (None: no extent part)."""
        raw = data.contiguous().view(torch.uint8).numpy().reshape(-1)
        off = slot * SLOT_BYTES
        self.pool[off:off + raw.size] = raw
        self.pool[off + wire.v_offset(raw.size):off + wire.v_offset(raw.size) + raw.size] = raw
        digest = checksum(raw) ^ int(bad_checksum)
        header = FrameHeader(KIND_LAYER, rid, seq, layer=layer, src_block_ids=tuple(SRC_IDS), dst_block_ids=tuple(DST_IDS),
                             dtype="float32", shape=tuple(data.shape), checksum_k=digest, checksum_v=digest)
        self.send(wire.FRAME, header.encode(), *([] if extent is None else [extent]))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
        del self.pool
        self.path.unlink(missing_ok=True)


def releases(peer: RawPeer, want: set[int]) -> set[int]:
    """Read the receiver's replies until the leases `want` have all been released."""
    got: set[int] = set()
    while not want <= got:
        tag, doc = peer.reply()
        assert tag == wire.RELEASE, (tag, doc)
        got |= set(doc["leases"])
    return got


def test_receiver_refuses_bad_channels_and_pools_naming_the_field(tmp_path: Path) -> None:
    dest = Dest()
    with IpcReceiver(dest.sink, max_pool_bytes=1 << 20) as receiver:
        peer = RawPeer(receiver.address, tmp_path)
        try:
            peer.send(wire.POOL, peer.describe())  # before hello
            tag, doc = peer.reply()
            assert tag == wire.REFUSE and doc["error"].startswith("channel:"), doc
            peer.send(wire.HELLO, {"v": 99, "channel": "raw"})
            tag, doc = peer.reply()
            assert tag == wire.REFUSE and doc["error"].startswith("v:"), doc
            peer.send(wire.HELLO, {"v": wire.IPC_VERSION, "channel": "raw"})
            link = tmp_path / "tandem-kv-link.pool"
            link.symlink_to(peer.path)
            cases = [
                (peer.describe(kind="rdma"), "kind:"),
                (peer.describe(slots=0), "slots:"),
                (peer.describe(slot_bytes=1000), "slot_bytes:"),
                (peer.describe(slots=1000), "slots:"),  # beyond max_pool_bytes
                (peer.describe(path="/etc/passwd"), "path:"),
                (peer.describe(path="relative/tandem-kv-x.pool"), "path:"),
                (peer.describe(path=str(tmp_path / "tandem-kv-missing.pool")), "path:"),
                (peer.describe(path=str(link)), "path:"),  # never follows a link
                (peer.describe(slots=1), "path:"),  # the file holds two slots' bytes
                (peer.describe(kind="cuda"), "kind:"),  # a GPU pool for a host cache
            ]
            for description, field in cases:
                peer.send(wire.POOL, description)
                tag, doc = peer.reply()
                assert tag == wire.REFUSE and doc["error"].startswith(field), (description, doc)
            peer.send(wire.POOL, peer.describe())
            assert peer.reply() == (wire.MAPPED, {})
            peer.send(wire.POOL, peer.describe())  # once per channel
            tag, doc = peer.reply()
            assert tag == wire.REFUSE and doc["error"].startswith("pool:"), doc
            stats = receiver.stats()
        finally:
            peer.close()
    assert stats["channels_opened"] == 1 and stats["channels_refused"] == len(cases) + 3


def test_a_bad_frame_fails_only_its_transfer_and_its_slot_comes_back(tmp_path: Path) -> None:
    dest = Dest()
    data = [torch.randn(len(DST_IDS), *BLOCK) for _ in range(LAYERS)]
    cases = [  # request id, seq, extent, bad checksum, expected error
        ("out-of-pool", 0, {"lease": 1, "slot": 1, "slots": 2}, False, "slot:"),
        ("no-slots", 0, {"slots": 0}, False, "slots:"),
        ("no-extent", 0, None, False, "extent:"),
        ("bad-extent", 0, {"lease": 4, "slot": -1, "slots": 1}, False, "slot:"),
        ("checksum", 0, {"lease": 5, "slot": 0, "slots": 1}, True, "checksum mismatch"),
        ("gap", 1, {"lease": 6, "slot": 0, "slots": 1}, False, "sequence gap"),
    ]
    with IpcReceiver(dest.sink) as receiver:
        peer = RawPeer(receiver.address, tmp_path)
        try:
            peer.send(wire.HELLO, {"v": wire.IPC_VERSION, "channel": "raw"})
            peer.send(wire.POOL, peer.describe())
            assert peer.reply() == (wire.MAPPED, {})
            for rid, seq, extent, bad_checksum, error in cases:
                receiver.expect(rid, DST_IDS, LAYERS, deadline_s=WAIT_S)
                peer.layer(rid, seq, 0, data[0], extent, bad_checksum=bad_checksum)
                result = wait_one(receiver)
                assert not result.ok and error in result.error, (rid, result.error)
            assert releases(peer, {1, 4, 5, 6}) >= {1, 4, 5, 6}  # even a rejected layer frees its slot
            assert dest.untouched()
            peer.send(wire.FRAME, b"\x00garbage", {"lease": 7, "slot": 0, "slots": 1})
            peer.layer("ghost", 0, 0, data[0], {"lease": 8, "slot": 0, "slots": 1})  # never expected
            assert releases(peer, {7, 8}) >= {7, 8}
            receiver.expect("fine", DST_IDS, LAYERS, deadline_s=WAIT_S)  # the channel still works
            for layer in range(LAYERS):
                peer.layer("fine", layer, layer, data[layer], {"lease": 10 + layer, "slot": 0, "slots": 1})
                releases(peer, {10 + layer})  # the slot is read: it may be rewritten
            peer.send(wire.FRAME, FrameHeader("commit", "fine", LAYERS, meta={"ok": 1}).encode())
            result = wait_one(receiver)
            stats = receiver.stats()
        finally:
            peer.close()
    assert result.ok and result.meta == {"ok": 1}
    assert all(torch.equal(dest.k[i][DST_IDS], data[i]) and torch.equal(dest.v[i][DST_IDS], data[i])
               for i in range(LAYERS))
    assert stats["frames_dropped"] == 2 and stats["transfers_failed"] == len(cases) and stats["checksum_failures"] == 1


def test_disaggregated_workers_over_the_ipc_transport_match_the_offline_engine(tmp_path: Path) -> None:
    """A prefill and a decode worker process (CPU, so the pool is shared memory) behind a gateway."""
    got, expected, decode_log = greedy_through_cluster(tmp_path, "cuda_ipc")
    assert got == expected
    assert "kv ipc channel" in decode_log and "shm pool" in decode_log and "Traceback" not in decode_log


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpu_pool_between_processes_lands_bit_exact(dtype: str, together: bool) -> None:
    """The real thing: a GPU cache in the prefill process, CUDA IPC pool and events, a GPU cache
    here (the same GPU, and a second one when there is one); `together`: a step's layers from
    one allocation in one `send_layers`."""
    gpu = start_prefill(slots=SLOTS, slot_bytes=SLOT_BYTES, send_timeout_s=5.0)
    try:
        for device in ["cuda:0"] + (["cuda:1"] if torch.cuda.device_count() > 1 else []):
            dest = Dest(getattr(torch, dtype), device=device)
            with IpcReceiver(dest.sink) as receiver:
                for i in range(4):  # more layers than slots: slots are reused
                    rid, seed = f"gpu-{device}-{i}", fresh_seed()
                    receiver.expect(rid, DST_IDS, LAYERS, deadline_s=WAIT_S)
                    sent = gpu("transfer", rid=rid, address=receiver.address, dtype=dtype, seed=seed, device="cuda:0",
                               together=together, stacked=together)
                    assert sent["ok"], sent
                    result = wait_one(receiver)
                    assert result.ok, result.error
                    torch.cuda.synchronize(device)
                    assert dest.holds(seed) and dest.untouched(OTHERS)
                wait_until(lambda: gpu("stats")["slots_in_use"] == 0, "every slot to be released")
    finally:
        assert gpu.close() == 0


def test_the_pool_finds_a_free_run_whenever_one_exists(tmp_path: Path) -> None:
    """Next-fit leasing (SendPool._find_run) against a plain scan, over random leases and
    releases: a free run of the asked length is found exactly when one exists, and a lease
    never overlaps another; `acquire_layers` gives back-to-back leases released one by one."""
    import random

    from kvtransfer.ipc_pool import SendPool

    pool = SendPool.create(torch.zeros(4, 4), 24, 4096, str(tmp_path))
    rng = random.Random(7)
    held: dict[int, set[int]] = {}
    try:
        for _ in range(3000):
            if held and rng.random() < 0.45:
                lease_id = rng.choice(list(held))
                assert pool.release(lease_id)
                del held[lease_id]
                continue
            n, count = rng.randint(1, 6), rng.choice([1, 1, 2, 3])  # count > 1: acquire_layers
            taken = set().union(*held.values()) if held else set()
            run = n * count
            exists = any(all(i not in taken for i in range(s, s + run)) for s in range(pool.slots - run + 1))
            try:
                leases = [pool.acquire(n, 0.0, lambda: None)] if count == 1 else \
                    pool.acquire_layers(n, count, 0.0, lambda: None)
            except KVTransferError:
                assert not exists, (run, sorted(taken))
                continue
            assert exists and len(leases) == count
            assert [lease.slot for lease in leases] == [leases[0].slot + i * n for i in range(count)]  # back to back
            for lease in leases:  # each its own lease, released on its own later
                got = set(range(lease.slot, lease.slot + lease.slots))
                assert lease.slots == n and not got & taken and max(got) < pool.slots
                assert lease.lease_id not in held
                held[lease.lease_id] = got
                taken |= got
        assert pool.in_use == sum(len(v) for v in held.values())
    finally:
        pool.unlink()


def test_a_prefill_workers_pool_holds_a_whole_step(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """worker.transfer.staging_options: one step of every layer's K and V (plus a partly filled
    slot for a few prompts a layer), in 1 MiB slots; options given explicitly still win; other
    transports get none."""
    from engine import Engine, EngineConfig
    from worker.transfer import STAGING_SLOT_BYTES, STAGING_SPARE_SLOTS, make_sender, staging_options

    engine = Engine(EngineConfig(str(tiny_models["llama"]), num_kv_blocks=32, max_running=4, max_batched_tokens=512,
                                 device="cpu"))
    k, _ = engine.kv_cache.layers[0]
    step_bytes = 2 * (512 // engine.config.block_size) * k[0].numel() * k.element_size()
    layers = len(engine.kv_cache.layers)
    opts = staging_options(engine)
    assert opts["slot_bytes"] == STAGING_SLOT_BYTES
    assert opts["slots"] == layers * (-(-step_bytes // STAGING_SLOT_BYTES) + STAGING_SPARE_SLOTS)
    assert opts["slots"] * opts["slot_bytes"] >= layers * step_bytes  # a whole step fits at once
    with make_sender("cuda_ipc", {"shm_dir": str(tmp_path)}, engine=engine) as sized:
        assert (sized.slots, sized.slot_bytes) == (opts["slots"], STAGING_SLOT_BYTES)
    with make_sender("cuda_ipc", {"shm_dir": str(tmp_path), "slots": 3}, engine=engine) as given:
        assert given.slots == 3
    make_sender("zmq", None, engine=engine).close()  # no pool options for a transport without one
    engine.close()

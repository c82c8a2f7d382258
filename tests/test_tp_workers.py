"""Tensor-parallel workers as real processes (CPU, gloo, KV over zmq): a TP=2 prefill worker
pushes each rank's KV heads to the same rank of a TP=2 decode worker, and the gateway's greedy
output equals the unsharded offline engine's; both ranks' shards arrive (byte counts); a TP=1
prefill worker is refused against a TP=2 decode worker with an error naming tp; --tp is
validated; a rank that dies takes its worker down loudly; SIGTERM drains and stops every rank.
"""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from engine.config import ModelConfig
from gateway.config import GatewayConfig, WorkerPoolConfig
from harness import GatewayThread, WorkerProcess, start_workers, stop_workers, wait_idle, wait_until
from tandem import Client, SamplingParams, wire
from tandem._proto.tandem.v1 import worker_pb2
from tandem.errors import TandemError

WAIT = 60.0  # bound on waits for server-side events; never a timing assertion
GREEDY = {"temperature": 0.0}
FLAGS = ["--num-kv-blocks", "64", "--max-running", "16", "--swap-space", "0.01"]
SYSTEM = "You are a helpful assistant. Answer briefly and precisely. " * 2  # several full blocks


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]  # 4 query heads, 2 KV heads: one KV head per rank at TP=2


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from engine import LLM

    return LLM(str(model_dir), num_kv_blocks=128, max_running=16, swap_space_gb=0.0)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory) -> dict[str, WorkerProcess]:
    """p2, d2: the TP=2 pair; p1: a TP=1 prefill worker; both2: a TP=2 role-both worker whose
    rank 1 one test kills."""
    p2, d2, p1, both2 = start_workers(
        [("prefill", ["--tp", "2", *FLAGS]), ("decode", ["--tp", "2", *FLAGS]), ("prefill", FLAGS),
         ("both", ["--tp", "2", *FLAGS, "--log-level", "INFO"])],
        model_dir, tmp_path_factory.mktemp("tp-workers"), timeout=WAIT * 2)
    workers = {"p2": p2, "d2": d2, "p1": p1, "both2": both2}
    yield workers
    stop_workers(list(workers.values()))


def gateway_for(model_dir: Path, prefill=(), decode=(), both=(), **kw) -> GatewayThread:
    pool = WorkerPoolConfig(prefill=tuple(w.address for w in prefill), decode=tuple(w.address for w in decode),
                            both=tuple(w.address for w in both))
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0, workers=pool, **kw))
    assert gw.wait_ready(WAIT)
    return gw


def full_block_bytes(model_dir: Path) -> int:
    """K and V of one block over every layer and every KV head (both ranks' shards), float32."""
    c = ModelConfig.from_dir(model_dir)
    return 2 * c.num_layers * 16 * c.num_kv_heads * c.head_dim * 4


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_tp2_pair_greedy_equals_unsharded_engine(model_dir: Path, llm, cluster) -> None:
    p2, d2 = cluster["p2"], cluster["d2"]
    assert p2.info["tp"] == d2.info["tp"] == 2 and len(d2.kv_address.split(",")) == 2
    gw = gateway_for(model_dir, [p2], [d2])
    try:
        with Client(gw.target, timeout=WAIT) as c:
            # A fresh 40-token prompt is 3 blocks: every rank's half of each must arrive.
            before_sent, before_recv = p2.stats().kv_bytes_sent, d2.stats().kv_bytes_received
            ids = [256, *range(60, 99)]
            got = c.generate(ids, max_tokens=8, **GREEDY)
            assert got.token_ids == llm.generate(ids, SamplingParams(max_tokens=8, **GREEDY))[0].token_ids
            want_bytes = 3 * full_block_bytes(model_dir)
            assert p2.stats().kv_bytes_sent - before_sent == want_bytes
            assert d2.stats().kv_bytes_received - before_recv == want_bytes
            # Text prompts, one reusing the previous one's prefix cached on both workers.
            for prompt in ["Hi", SYSTEM + "What is a KV cache?", SYSTEM + "What is a radix tree?"]:
                want = llm.generate(prompt, SamplingParams(max_tokens=12, **GREEDY))[0]
                got = c.generate(prompt, max_tokens=12, **GREEDY)
                assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            assert got.usage.cached_tokens >= 16
            many = [f"Question {i}: why is the sky {'blue' if i % 2 else 'grey'}?" for i in range(6)]
            want = llm.generate(many, SamplingParams(max_tokens=6, **GREEDY))
            with ThreadPoolExecutor(6) as pool:
                got = list(pool.map(lambda p: c.generate(p, max_tokens=6, **GREEDY), many))
            assert [g.token_ids for g in got] == [w.token_ids for w in want]
            assert len({t for w in want for t in w.token_ids}) > 3  # varied output: a missing shard would show
            one = c.generate("x", max_tokens=1, **GREEDY)  # first token ends it: D's reservation is released
            assert one.token_ids == llm.generate("x", SamplingParams(max_tokens=1, **GREEDY))[0].token_ids
    finally:
        gw.stop()
    for w in (p2, d2):
        stats = wait_idle(w, WAIT)
        assert stats.free_kv_blocks == stats.total_kv_blocks == 64


def test_tp2_pair_over_the_nccl_transport_in_gloo_mode(model_dir: Path, llm, tmp_path) -> None:
    """Each rank's pair group of the nccl transport lives beside the ranks' own process group."""
    nccl = ["--tp", "2", "--kv-transport", "nccl", *FLAGS]
    p, d = start_workers([("prefill", nccl), ("decode", nccl)], model_dir, tmp_path, timeout=WAIT * 2)
    try:
        gw = gateway_for(model_dir, [p], [d])
        try:
            with Client(gw.target, timeout=WAIT) as c:
                for prompt in ["Over NCCL's gloo mode", SYSTEM + "And again?"]:
                    want = llm.generate(prompt, SamplingParams(max_tokens=8, **GREEDY))[0]
                    assert c.generate(prompt, max_tokens=8, **GREEDY).token_ids == want.token_ids
        finally:
            gw.stop()
        for w in (p, d):
            wait_idle(w, WAIT)
        assert d.stats().kv_bytes_received == p.stats().kv_bytes_sent > 0
    finally:
        stop_workers([p, d])
    assert (p.proc.returncode, d.proc.returncode) == (0, 0)


def test_tp2_role_both_greedy_equals_unsharded_engine(model_dir: Path, llm, cluster) -> None:
    gw = gateway_for(model_dir, both=[cluster["both2"]])
    try:
        prompt = SYSTEM + "Colocated?"
        want = llm.generate(prompt, SamplingParams(max_tokens=10, **GREEDY))[0]
        with Client(gw.target, timeout=WAIT) as c:
            assert c.generate(prompt, max_tokens=10, **GREEDY).token_ids == want.token_ids
    finally:
        gw.stop()
    wait_idle(cluster["both2"], WAIT)


def test_mismatched_tp_degrees_are_refused_naming_tp(model_dir: Path, cluster) -> None:
    p1, p2, d2 = cluster["p1"], cluster["p2"], cluster["d2"]
    # Through the gateway: a TP=1 prefill worker cannot feed a TP=2 decode worker.
    gw = gateway_for(model_dir, [p1], [d2], max_retries=1)
    try:
        with Client(gw.target, timeout=WAIT) as c, pytest.raises(TandemError) as err:
            c.generate("mismatch", max_tokens=4, **GREEDY)
    finally:
        gw.stop()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "tp: decode worker" in err.value.details and "tensor parallel size 1" in err.value.details
    for w in (p1, d2):
        wait_idle(w, WAIT)  # the reservation was released, nothing leaked
    # Straight to the TP=2 prefill worker: a target with one KV address (a TP=1 decode worker).
    target = worker_pb2.KvTarget(worker_id="decode-tp1", kv_address="tcp://127.0.0.1:9", reservation_id=1,
                                 num_cached_blocks=0, dst_block_ids=[0])
    req = worker_pb2.PrefillRequest(request_id="r-mismatch", token_ids=[256, 1, 2], target=target)
    with grpc.insecure_channel(p2.address) as ch, pytest.raises(grpc.RpcError) as rpc_err:
        wire.PrefillWorkerStub(ch).Prefill(req, timeout=WAIT)
    assert rpc_err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert rpc_err.value.details().startswith("tp: decode worker decode-tp1 runs tensor parallel size 1")
    assert "this prefill worker runs tensor parallel size 2" in rpc_err.value.details()


def test_tp_flag_is_validated_naming_the_field(model_dir: Path, capsys) -> None:
    from engine import EngineConfig
    from entrypoints.worker import main
    from worker.config import TransferConfig, WorkerConfig

    cases = {"0": "tp: must be an integer >= 1, got 0",
             "3": "tp: 3 does not divide num_attention_heads (4)",
             "4": "tp: 4 does not divide num_key_value_heads (2)"}
    for tp, message in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            main(["--model", str(model_dir), "--tp", tp, "--port", "0"], role="decode")
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="tp: must be an integer >= 1"):
        WorkerConfig(role="prefill", engine=EngineConfig(str(model_dir)), tp=True)
    with pytest.raises(ValueError, match="kv_address: 3 comma-separated endpoints for tp 2"):
        WorkerConfig(role="decode", engine=EngineConfig(str(model_dir)), tp=2,
                     transfer=TransferConfig(address="tcp://a:1,tcp://a:2,tcp://a:3"))
    cfg = WorkerConfig(role="decode", engine=EngineConfig(str(model_dir)), tp=2,
                       transfer=TransferConfig(address="tcp://127.0.0.1:7000"))
    assert [cfg.rank_kv_address(r) for r in range(2)] == ["tcp://127.0.0.1:7000", "tcp://127.0.0.1:7001"]
    cfg = WorkerConfig(role="decode", engine=EngineConfig(str(model_dir)), tp=2,
                       transfer=TransferConfig(address="ipc:///tmp/kv"))
    assert cfg.rank_kv_address(1) == "ipc:///tmp/kv.rank1"


def test_a_dead_rank_stops_its_worker_loudly(cluster) -> None:
    both2 = cluster["both2"]
    (follower,) = both2.info["tp_pids"]
    os.kill(follower, signal.SIGKILL)
    code = both2.proc.wait(timeout=WAIT)
    assert code == 3
    assert f"tensor parallel rank 1 (pid {follower}) exited with code -9" in both2.log_tail(20000)


def test_sigterm_drains_and_stops_every_rank(cluster) -> None:
    for name in ("p2", "d2"):
        w = cluster[name]
        followers = w.info["tp_pids"]
        assert all(alive(pid) for pid in followers)
        assert w.stop(WAIT) == 0
        wait_until(lambda: not any(alive(pid) for pid in followers), WAIT, what=f"{name}'s other ranks to exit")

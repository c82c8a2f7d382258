"""Security of a cluster, tried as an attacker on the same host would (tandem/security.py):
real prefill and decode worker processes and a real gateway, all serving TLS with a self-signed
CA made here, requiring the cluster token on internal RPCs and the KV handshake and an API key
on the public gRPC and HTTP API.

- internal RPCs (worker Stats / Reserve, the gateway's Admin) without the token or with a wrong
  one: UNAUTHENTICATED; health stays open; reflection is off;
- the KV handshake: a sender with a wrong token never reaches a decode worker's receiver;
- public requests without the API key: refused over gRPC (UNAUTHENTICATED) and HTTP (401 with
  OpenAI's error body); with it, a request runs through prefill -> KV push -> decode;
- TLS: the SDK connects with the CA; a plaintext client, and one trusting another CA, cannot;
- a prefill worker asked to push to an address the gateway did not vouch for refuses;
- the supervisor socket needs the token; `tandem up` never puts a secret on a command line;
- the link between a tensor-parallel worker's ranks: a peer without the token, or with a wrong
  one, is refused at the handshake on either end and none of its messages is delivered.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import multiprocessing as mp
import queue
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from entrypoints.cluster import Cluster, ClusterProcess, worker_process
from gateway.config import GatewayConfig, GatewaySecurity, WorkerPoolConfig
from harness import GatewayThread
from kvtransfer import KVTransferError
from tandem import Client, SamplingParams, security, wire
from tandem._proto.tandem.v1 import admin_pb2, worker_pb2
from tandem.errors import TandemError
from tls_certs import TlsFiles, make_tls_files

WAIT = 60.0
TOKEN = security.generate_token()
WRONG_TOKEN = "not-the-token-" + "t" * 20
API_KEY = "sk-test-" + security.generate_token()
QUIET_S = 1.0  # how long a side must stay silent after an intruder was turned away


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def workers(tiny_models: dict[str, Path], tls: TlsFiles, tmp_path_factory) -> dict[str, ClusterProcess]:
    work = tmp_path_factory.mktemp("secure-workers")
    argv = ["--num-kv-blocks", "64", "--max-running", "8", "--tls-cert", tls.cert, "--tls-key", tls.key]
    procs = {role: worker_process(f"{role}0", role, tiny_models["llama"], work, argv, auth_token=TOKEN)
             for role in ("prefill", "decode")}
    for p in procs.values():
        p.tls_ca = tls.ca
    cluster = Cluster(procs.values())
    cluster.start(120)
    yield procs
    cluster.stop()


@pytest.fixture(scope="module")
def gateway(tiny_models: dict[str, Path], workers: dict[str, ClusterProcess], tls: TlsFiles):
    pool = WorkerPoolConfig(prefill=(workers["prefill"].address,), decode=(workers["decode"].address,))
    sec = GatewaySecurity(auth_token=TOKEN, api_key=API_KEY, tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca)
    gw = GatewayThread(GatewayConfig(model_dir=str(tiny_models["llama"]), port=0, http_port=0, workers=pool,
                                     security=sec))
    assert gw.wait_ready(WAIT)
    yield gw
    gw.stop()


def code_of(call, *args, **kw) -> grpc.StatusCode:
    try:
        call(*args, timeout=10, **kw)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_internal_rpcs_need_the_cluster_token(workers: dict[str, ClusterProcess], tls: TlsFiles) -> None:
    d = workers["decode"]
    with security.channel(d.address, tls_ca=tls.ca) as ch:
        stub = wire.DecodeWorkerStub(ch)
        reserve = worker_pb2.ReserveRequest(request_id="attacker", token_ids=list(range(40)), max_tokens=8)
        for md in ((), security.token_metadata("not-the-token-" + "x" * 20)):
            assert code_of(stub.Stats, worker_pb2.StatsRequest(), metadata=md) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(stub.Reserve, reserve, metadata=md) == grpc.StatusCode.UNAUTHENTICATED
        good = security.token_metadata(TOKEN)
        assert code_of(stub.Stats, worker_pb2.StatsRequest(), metadata=good) == grpc.StatusCode.OK
        # Health needs nothing (orchestrator probes); reflection is off unless asked for.
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(refl.ServerReflectionInfo(iter([request]), timeout=10, metadata=good))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert d.stats().total_kv_blocks == 64  # ClusterProcess sends the token it was given


def test_gateway_admin_needs_the_cluster_token(gateway: GatewayThread, tls: TlsFiles) -> None:
    with security.channel(gateway.target, tls_ca=tls.ca) as ch:
        admin = wire.AdminStub(ch)
        req = admin_pb2.ListWorkersRequest()
        assert code_of(admin.ListWorkers, req) == grpc.StatusCode.UNAUTHENTICATED
        # the API key opens the public service only, never Admin
        assert code_of(admin.ListWorkers, req, metadata=security.bearer_metadata(API_KEY)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert code_of(admin.Drain, admin_pb2.WorkerMarkRequest(worker="decode0")) == grpc.StatusCode.UNAUTHENTICATED
        reply = admin.ListWorkers(req, timeout=10, metadata=security.token_metadata(TOKEN))
    assert sorted(w.role for w in reply.workers) == ["decode", "prefill"]
    assert all(w.mark == "" for w in reply.workers)  # the refused Drain did nothing


def test_public_grpc_needs_the_api_key(gateway: GatewayThread, workers: dict[str, ClusterProcess],
                                       tls: TlsFiles) -> None:
    for key in (None, "sk-wrong-" + "y" * 20):
        with Client(gateway.target, tls_ca=tls.ca, api_key=key, timeout=20) as client:
            with pytest.raises(TandemError) as err:
                client.generate("Hello", max_tokens=4)
            assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    # With the key (and the CA), a request runs prefill -> token-checked KV push -> decode.
    before = workers["prefill"].stats()
    with Client(gateway.target, tls_ca=tls.ca, api_key=API_KEY, timeout=60) as client:
        out = client.generate([5, 6, 7, 8, 9] * 8, params=SamplingParams(max_tokens=6, temperature=0.0,
                                                                          ignore_eos=True))
    assert out.usage.completion_tokens == 6 and len(out.token_ids) == 6
    after = workers["prefill"].stats()
    assert after.kv_bytes_sent > before.kv_bytes_sent  # disaggregated: the KV crossed the handshake


def test_public_http_needs_the_api_key(gateway: GatewayThread, tls: TlsFiles) -> None:
    base = f"https://127.0.0.1:{gateway.gateway.http_port}"
    ctx = ssl.create_default_context(cafile=tls.ca)

    def get(path: str, key: str | None = None) -> tuple[int, dict]:
        req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=20, context=ctx) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    for key in (None, "sk-wrong-" + "z" * 20):
        status, body = get("/v1/models", key)
        assert status == 401
        assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "invalid_request_error"
    status, body = get("/v1/models", API_KEY)
    assert status == 200 and body["data"][0]["id"]
    assert get("/health")[0] == 200  # probes need no key
    with pytest.raises((OSError, http.client.HTTPException)):  # plaintext HTTP to the TLS port
        urllib.request.urlopen(f"http://127.0.0.1:{gateway.gateway.http_port}/health", timeout=5)


def test_tls_sdk_needs_the_ca(gateway: GatewayThread, tls: TlsFiles, tmp_path: Path) -> None:
    with Client(gateway.target, api_key=API_KEY, timeout=10) as plaintext:
        with pytest.raises(TandemError) as err:
            plaintext.model_info()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    other = make_tls_files(tmp_path / "other", name="another")
    with Client(gateway.target, api_key=API_KEY, tls_ca=other.ca, timeout=10) as wrong_ca:
        with pytest.raises(TandemError) as err:
            wrong_ca.model_info()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    with Client(gateway.target, api_key=API_KEY, tls_ca=tls.ca, timeout=10) as client:
        assert client.model_info().model


def test_kv_handshake_needs_the_cluster_token(workers: dict[str, ClusterProcess]) -> None:
    """A sender with a wrong token (or none) gets no connection to the decode worker's receiver:
    its send times out and nothing reaches the receiver."""
    import torch

    from kvtransfer.zmq_transport import ZmqSender

    kv_address = workers["decode"].kv_address
    k = torch.zeros(4, 16, 2, 8)
    for token in ("not-the-token-" + "w" * 20, None):
        with ZmqSender(send_timeout_s=1.0, auth_token=token) as sender:
            sender.open("attack#r1", kv_address, 1)
            sender.send_layer("attack#r1", 0, k, k, [0, 1], [0, 1])
            result = sender.commit("attack#r1", {}).result(timeout=WAIT)
        assert not result.ok and "timed out" in (result.error or "")


@pytest.mark.parametrize("transport", ["zmq", "cuda_ipc", "nccl"])
def test_kv_handshake_token_on_every_transport(transport: str) -> None:
    """Each transport (host memory on the CPU; nccl over gloo): the right token completes a
    transfer byte for byte; a wrong one fails at the handshake, is counted, and writes nothing."""
    import torch

    from kvtransfer import get_transport
    from kvtransfer.sinks import TensorKVSink

    t = get_transport(transport)
    dst_k, dst_v = [torch.zeros(8, 16, 2, 8)], [torch.zeros(8, 16, 2, 8)]
    src = torch.randn(8, 16, 2, 8)
    with t.create_receiver(TensorKVSink(dst_k, dst_v), bind="tcp://127.0.0.1:*", auth_token=TOKEN) as receiver:
        for rid, token in (("bad", "not-the-token-" + "v" * 20), ("ok", TOKEN)):
            receiver.expect(rid, [3, 4], 1, deadline_s=3.0)
            with t.create_sender(send_timeout_s=1.0, auth_token=token) as sender:
                sender.open(rid, receiver.address, 1)
                try:
                    sender.send_layer(rid, 0, src, src, [0, 1], [3, 4])
                    sent_ok = sender.commit(rid, {"n": 1}).result(timeout=WAIT).ok
                except KVTransferError:
                    sent_ok = False
            results = []
            deadline = time.monotonic() + WAIT
            while not results and time.monotonic() < deadline:
                results = receiver.poll_completed(0.5)
            assert results[0].request_id == rid
            if token == TOKEN:
                assert sent_ok and results[0].ok and torch.equal(dst_k[0][[3, 4]], src[[0, 1]])
            else:  # never connected; the deadline ended it, and nothing was written
                assert not sent_ok and not results[0].ok and not dst_k[0].any()
        assert receiver.stats()["connections_refused"] == 1


def test_prefill_refuses_an_unvouched_kv_target(workers: dict[str, ClusterProcess], tls: TlsFiles) -> None:
    p, d = workers["prefill"], workers["decode"]
    ctx = zmq.Context()
    trap = ctx.socket(zmq.PULL)  # the attacker's address
    trap_port = trap.bind_to_random_port("tcp://127.0.0.1")
    trap_address = f"tcp://127.0.0.1:{trap_port}"
    params = wire.params_to_proto(SamplingParams(max_tokens=4))
    sent_before = p.stats().kv_bytes_sent
    try:
        with security.channel(p.address, tls_ca=tls.ca) as ch:
            stub = wire.PrefillWorkerStub(ch)
            md = security.token_metadata(TOKEN)
            real = security.kv_voucher(TOKEN, "steer", 7, d.worker_id, d.kv_address)
            for voucher in ("", real, "0" * 64):  # none; one for another address; a forged one
                target = worker_pb2.KvTarget(worker_id=d.worker_id, kv_address=trap_address, reservation_id=7,
                                             dst_block_ids=[0, 1, 2], voucher=voucher)
                req = worker_pb2.PrefillRequest(request_id="steer", token_ids=list(range(1, 41)), params=params,
                                                target=target, timeout_ms=5000)
                with pytest.raises(grpc.RpcError) as err:
                    stub.Prefill(req, timeout=10, metadata=md)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "not vouched" in err.value.details()
                # The same target sent after the Prefill (target_follows) is refused too, and
                # the prefill waiting for it ends.
                rid = f"steer-follows-{len(voucher)}-{voucher[:1]}"
                follows = stub.Prefill.future(worker_pb2.PrefillRequest(
                    request_id=rid, token_ids=list(range(1, 41)), params=params, target_follows=True,
                    timeout_ms=5000), timeout=10, metadata=md)
                with pytest.raises(grpc.RpcError) as err:
                    stub.PrefillTarget(worker_pb2.PrefillTargetRequest(request_id=rid, target=target), timeout=10,
                                       metadata=md)
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "not vouched" in err.value.details()
                with pytest.raises(grpc.RpcError) as err:
                    follows.result(timeout=10)
                assert err.value.code() == grpc.StatusCode.ABORTED and "refused" in err.value.details()
        assert trap.poll(500) == 0  # nothing was pushed there
        assert p.stats().kv_bytes_sent == sent_before  # nor anywhere else
    finally:
        trap.close(0)
        ctx.term()


def test_supervisor_socket_needs_the_cluster_token() -> None:
    from agent.actions import SupervisorClient, SupervisorError
    from entrypoints.supervisor import SupervisorSocket

    sock = SupervisorSocket(Cluster([]), token=TOKEN)
    path = sock.start()
    try:
        with pytest.raises(SupervisorError, match="unauthenticated"):
            SupervisorClient(path).processes()
        with pytest.raises(SupervisorError, match="unauthenticated"):
            SupervisorClient(path, token="not-the-token-" + "u" * 20).processes()
        assert SupervisorClient(path, token=TOKEN).processes() == {}
    finally:
        sock.close()


# ---------------------------------------------------------------- the tensor-parallel link

HANDSHAKE_ENDED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # no token; a wrong one


def intrude(ctx: zmq.Context, address: str, token: str | None, kind: str, body: dict) -> int:
    """Connect a PUSH to `address` presenting `token` (None: no credentials), queue one
    [kind, JSON body] message on it and return the monitor event that ended its handshake.
    (A refusal can beat the send: ZMQ then drops the pipe, and the send finds none.)"""
    from kvtransfer.auth import secure_client

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, token)
    monitor = sock.get_monitor_socket(HANDSHAKE_ENDED)
    try:
        sock.connect(address)
        with contextlib.suppress(zmq.Again):
            sock.send_multipart([kind.encode(), json.dumps(body).encode()], zmq.NOBLOCK)
        assert monitor.poll(WAIT * 1000), f"no handshake with {address} within {WAIT:g}s"
        return recv_monitor_message(monitor)["event"]
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)


def tp_follower_peer(rank0_address: str, token: str) -> None:
    """Rank 1's end of a TP link, in its own process: every command it runs is echoed to rank 0
    as a RESULT (with this end's count of refused peers), until a "stop" command."""
    from worker.tp_link import HELLO, RESULT, FollowerLink

    stop = threading.Event()

    def on_command(kind: str, body: dict) -> None:
        if kind == "stop":
            stop.set()
        else:
            link.send(RESULT, {"echo": kind, "id": body.get("id"), "refused": link.refused})

    link = FollowerLink(1, rank0_address, on_command, auth_token=token)
    link.send(HELLO, {"command_address": link.command_address})
    try:
        assert stop.wait(WAIT), "rank 0 never said stop"
    finally:
        link.close()


def test_tp_link_needs_the_cluster_token() -> None:
    """Rank 0's end (hellos, results) and rank 1's (commands) each refuse an intruder without the
    token or with a wrong one at the handshake: none of its messages is delivered, and the ranks'
    own traffic (a real rank-1 process with the token) flows both ways after it."""
    from worker.tp_link import CANCEL, EXPECT, HELLO, RESULT, RankLink

    results: queue.Queue[dict] = queue.Queue()
    link = RankLink(2, auth_token=TOKEN)
    link.on_result = lambda rank, body: results.put(body)
    peer = mp.get_context("spawn").Process(target=tp_follower_peer, args=(link.address, TOKEN), daemon=True)
    ctx = zmq.Context()
    forged_hello = {"rank": 1, "command_address": "tcp://127.0.0.1:9"}

    def peer_alive() -> None:
        assert peer.exitcode is None, f"the rank-1 process exited with code {peer.exitcode}"

    try:
        for token in (None, WRONG_TOKEN):
            assert intrude(ctx, link.address, token, HELLO, forged_hello) in REFUSED
            assert intrude(ctx, link.address, token, RESULT, {"rank": 1, "id": "forged"}) in REFUSED
        time.sleep(QUIET_S)
        assert link.hellos == {} and results.empty()
        assert link.refused >= 2  # the wrong tokens; a peer with none fails before the check

        peer.start()
        hellos = link.wait_hellos(WAIT, peer_alive)
        assert hellos[1]["command_address"] != forged_hello["command_address"]
        link.request(EXPECT, {"id": "r1"}, WAIT)  # rank 1 ran it and acknowledged it
        assert results.get(timeout=WAIT)["id"] == "r1"

        for token in (None, WRONG_TOKEN):
            for kind in (EXPECT, CANCEL):
                assert intrude(ctx, hellos[1]["command_address"], token, kind, {"id": "forged", "seq": 1}) in REFUSED
        time.sleep(QUIET_S)
        assert results.empty()  # rank 1 echoes every command it runs: it ran none of those
        link.request(CANCEL, {"id": "r2"}, WAIT)
        echo = results.get(timeout=WAIT)
        assert (echo["echo"], echo["id"]) == (CANCEL, "r2") and echo["refused"] >= 2
        link.send("stop", {})
        peer.join(WAIT)
        assert peer.exitcode == 0
    finally:
        if peer.is_alive():
            peer.kill()
        ctx.term()
        link.close()


def test_tp_worker_ranks_share_the_token_off_the_command_line(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A TP=2 decode worker given the token: it became ready, so rank 1 (started by rank 0) holds
    the token rank 0's link requires, though its command line does not carry it; an intruder on
    that link (the address on rank 1's command line) is refused."""
    w = worker_process("decode-tp2", "decode", tiny_models["llama"], tmp_path, ["--tp", "2", "--num-kv-blocks", "32"],
                       auth_token=TOKEN)
    cluster = Cluster([w])
    ctx = zmq.Context()
    try:
        cluster.start(120)
        (rank1,) = w.info["tp_pids"]
        argv = Path(f"/proc/{rank1}/cmdline").read_bytes().split(b"\0")
        assert TOKEN.encode() not in b" ".join(argv)
        link_address = argv[argv.index(b"--link") + 1].decode()
        for token in (None, WRONG_TOKEN):
            assert intrude(ctx, link_address, token, "result", {"rank": 1, "id": "forged"}) in REFUSED
        assert w.stats().total_kv_blocks == 32  # still serving
    finally:
        ctx.term()
        cluster.stop()


def test_tandem_up_hands_secrets_over_off_the_command_line(tmp_path: Path) -> None:
    from entrypoints.launcher import build_children, placement_for
    from entrypoints.up_flags import parse_args

    a = parse_args(["--api-key", API_KEY])
    assert len(a.auth_token) >= 32  # generated
    children = build_children(a, "/models/m", placement=placement_for(a, visible=0), auth_token=a.auth_token)
    for c in children:
        cmd = " ".join(c.argv)
        assert a.auth_token not in cmd and API_KEY not in cmd
        assert c.auth_token == a.auth_token
    gateway = next(c for c in children if c.role == "gateway")
    assert gateway.env[security.API_KEY_ENV] == API_KEY
    token_file = tmp_path / "token"
    security.write_token_file(token_file, TOKEN)
    assert token_file.stat().st_mode & 0o077 == 0
    assert parse_args(["--auth-token-file", str(token_file)]).auth_token == TOKEN
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ValueError, match="auth-token-file"):
        security.load_token(tmp_path / "short")


def test_a_refused_peer_is_warned_about_once_a_while_not_on_every_retry(caplog, monkeypatch):
    import logging
    import time as _time

    import zmq

    from kvtransfer import auth

    ctx = zmq.Context()
    try:
        handler = auth.ZapHandler(ctx)
        domain = handler.register("right-token", "KV").encode()
        bad = [b"1.0", b"1", domain, b"10.0.0.7", b"", b"PLAIN", b"tandem", b"wrong-token"]
        monkeypatch.setattr(auth, "REFUSAL_LOG_S", 0.3)
        with caplog.at_level(logging.WARNING, logger="kvtransfer.auth"):
            answers = [handler._answer(list(bad)) for _ in range(5)]  # a peer retrying
            assert all(a[2] == b"400" for a in answers)
            assert len([r for r in caplog.records if "refused a KV connection" in r.getMessage()]) == 1
            _time.sleep(0.35)
            handler._answer(list(bad))
            warned = [r.getMessage() for r in caplog.records if "refused a KV connection" in r.getMessage()]
        assert len(warned) == 2 and "(4 more since the last warning)" in warned[1]
        assert handler.refused(domain.decode()) == 6  # every refusal is still counted
        ok = handler._answer([b"1.0", b"2", domain, b"10.0.0.8", b"", b"PLAIN", b"tandem", b"right-token"])
        assert ok[2] == b"200"
    finally:
        # term(), not destroy(): the handler's thread closes its own socket on ETERM (closing it
        # from here, while that thread waits in recv, aborts inside libzmq).
        ctx.term()

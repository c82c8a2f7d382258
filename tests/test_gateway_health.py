"""The gateway's health says SERVING only once its workers can serve: a prefill worker and a
decode worker when it has prefill workers (a role-both worker alone suffices)."""
from __future__ import annotations

from grpc_health.v1 import health_pb2, health_pb2_grpc

from entrypoints.cluster import ClusterProcess, free_port, healthy
from gateway.config import GatewayConfig, WorkerPoolConfig
from tests.harness import GatewayThread, wait_until


def status(target: str) -> int:
    import grpc

    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def worker(tmp_path, name: str, role: str, port: int, model) -> ClusterProcess:
    argv = ["--port", str(port), "--model", str(model), "--log-level", "WARNING"]
    if role == "decode":
        argv += ["--kv-address", f"tcp://127.0.0.1:{free_port()}"]
    return ClusterProcess(name, role, argv, port, log_path=tmp_path / f"{name}.log")


def test_not_serving_until_prefill_and_decode_are_up(tmp_path, stories_dir) -> None:
    prefill_port, decode_port = free_port(), free_port()
    pool = WorkerPoolConfig(prefill=(f"127.0.0.1:{prefill_port}",), decode=(f"127.0.0.1:{decode_port}",),
                            stats_interval_s=0.1)
    gw = GatewayThread(GatewayConfig(model_dir=str(stories_dir), port=0, workers=pool))
    started = []
    try:
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        assert status(gw.target) == not_serving  # no worker yet
        decode = worker(tmp_path, "decode", "decode", decode_port, stories_dir)
        started.append(decode)
        decode.start()
        wait_until(lambda: healthy(decode.address), 120, what="the decode worker")
        wait_until(lambda: gw.call(lambda: gw.gateway.registry.decode_workers()[0].up), 30, what="decode seen")
        assert status(gw.target) == not_serving  # decode alone: no prefill path
        prefill = worker(tmp_path, "prefill", "prefill", prefill_port, stories_dir)
        started.append(prefill)
        prefill.start()
        wait_until(lambda: status(gw.target) == health_pb2.HealthCheckResponse.SERVING, 120, what="SERVING")
        prefill.kill()  # the prefill path is gone: not serving again
        wait_until(lambda: status(gw.target) == not_serving, 30, what="NOT_SERVING after the prefill worker died")
    finally:
        gw.stop()
        for p in started:
            p.kill()

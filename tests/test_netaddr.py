"""What a worker bound to a wildcard host tells others: a host they can dial, in its ready file,
in the prefix index's worker registry (Redis) and in the KV endpoint prefill workers push to;
--advertise-host overrides it. Real worker processes; the advertised address answers health checks."""
from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest

from entrypoints.cluster import healthy
from harness import start_workers, stop_workers
from tandem import netaddr
from worker.config import WorkerConfig, build_parser, config_from_args


@pytest.mark.parametrize("host, wild", [("0.0.0.0", True), ("::", True), ("", True), ("127.0.0.1", False),
                                        ("decode-0", False), ("10.1.2.3", False)])
def test_wildcard_hosts(host, wild):
    assert netaddr.is_wildcard(host) is wild


def test_advertised_host_and_endpoints():
    ip = netaddr.primary_ip()
    assert ip and not netaddr.is_wildcard(ip)
    assert netaddr.advertised_host("0.0.0.0") == ip
    assert netaddr.advertised_host("0.0.0.0", "pod-7.decode") == "pod-7.decode"
    assert netaddr.advertised_host("127.0.0.1") == "127.0.0.1"
    assert netaddr.advertised_endpoint("tcp://0.0.0.0:5557", "10.0.0.9") == "tcp://10.0.0.9:5557"
    assert netaddr.advertised_endpoint("tcp://decode-0:5557", "10.0.0.9") == "tcp://decode-0:5557"
    assert netaddr.advertised_endpoint("ipc:///tmp/kv", "10.0.0.9") == "ipc:///tmp/kv"
    assert netaddr.advertised_endpoint("tcp://0.0.0.0:5557", "fd00::2") == "tcp://[fd00::2]:5557"
    assert netaddr.host_port("fd00::2", 50060) == "[fd00::2]:50060"


@pytest.mark.parametrize("value", ["0.0.0.0", "::", "tcp://x"])
def test_advertise_host_must_be_reachable(value, tiny_models):
    args = build_parser("decode").parse_args(["--model", str(tiny_models["llama"]), "--advertise-host", value])
    with pytest.raises(ValueError, match="advertise_host"):
        config_from_args(args, "decode")


def test_a_wildcard_bound_worker_advertises_a_routable_address(tiny_models: dict[str, Path], redis_url: str,
                                                               tmp_path) -> None:
    from kvindex import make_index

    ns = f"netaddr-{uuid.uuid4().hex[:8]}"
    common = ["--num-kv-blocks", "64", "--max-running", "4", "--redis-url", redis_url, "--namespace", ns,
              "--host", "0.0.0.0"]
    d, named = start_workers([("decode", common), ("decode", [*common, "--advertise-host", "127.0.0.1"])],
                             tiny_models["llama"], tmp_path)
    index = make_index(redis_url, ns)
    try:
        ip = netaddr.primary_ip()
        host, _, port = d.address.rpartition(":")
        assert host.strip("[]") == ip and int(port) > 0
        assert healthy(d.address)  # the advertised address answers
        assert d.kv_address.startswith("tcp://") and "0.0.0.0" not in d.kv_address
        assert netaddr.host_port(ip, 0)[:-2] in d.kv_address
        assert d.worker_id == f"decode-{ip}-{port}"
        assert named.address.startswith("127.0.0.1:") and named.kv_address.startswith("tcp://127.0.0.1:")
        registered = index.workers()
        assert registered[d.worker_id].address == d.address
        assert registered[named.worker_id].address == named.address
    finally:
        index.close()
        stop_workers([d, named])


def test_worker_config_keeps_the_flag(tiny_models):
    args = build_parser("prefill").parse_args(["--model", str(tiny_models["llama"]), "--host", "0.0.0.0",
                                                "--advertise-host", "prefill-0.prefill"])
    cfg = config_from_args(args, "prefill")
    assert cfg.advertise_host == "prefill-0.prefill"
    assert WorkerConfig.from_dict(dataclasses.asdict(cfg)).advertise_host == "prefill-0.prefill"

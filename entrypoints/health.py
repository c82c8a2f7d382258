"""`tandem health --target HOST:PORT`: ask a Tandem process's gRPC health service whether it serves.

Exit code 0 when the answer is SERVING, 1 otherwise (NOT_SERVING while starting or draining, no
answer, unknown service), 2 for bad flags. Containers use it as their health check (compose/,
deploy/k8s/ can use the kubelet's own gRPC probe instead). Torch-free and quick: it imports
only grpc and the health protos.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem health",
                                description="Exit 0 when the gRPC health service at --target says SERVING.")
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT of a gateway or worker")
    p.add_argument("--service", default="",
                   help="service name to ask about (default: the whole server, as the kubelet's gRPC probe asks)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    p.add_argument("--quiet", action="store_true", help="print nothing")
    p.add_argument("--tls-ca", default=None, help="PEM CA of the process's TLS certificate (when it serves TLS)")
    return p


def check(target: str, service: str = "", timeout: float = 3.0, tls_ca: str | None = None) -> str:
    """The status name the health service at `target` gives for `service` (SERVING, NOT_SERVING,
    SERVICE_UNKNOWN, ...), or "UNREACHABLE: <why>" when no answer came within `timeout` seconds."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.security import channel as open_channel

    try:
        with open_channel(target, tls_ca=tls_ca) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else None
        if code == grpc.StatusCode.NOT_FOUND:
            return "SERVICE_UNKNOWN"
        return f"UNREACHABLE: {code.name if code else exc}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    if ":" not in a.target:
        parser.error(f"--target: expected HOST:PORT, got {a.target!r}")
    if not a.timeout > 0:
        parser.error(f"--timeout: must be > 0, got {a.timeout}")
    try:
        status = check(a.target, a.service, a.timeout, a.tls_ca)
    except ValueError as exc:  # an unreadable --tls-ca
        parser.error(str(exc))
    if not a.quiet:
        print(f"{a.target}{' ' + a.service if a.service else ''}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())

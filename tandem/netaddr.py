"""The addresses a process binds and the ones it tells others to reach it at.

A server bound to a wildcard host (0.0.0.0, ::) listens on every interface, but "0.0.0.0:50060"
is no address another machine can dial: what a worker registers (the prefix index's worker
registry, its ready file) and the KV endpoint it hands to prefill workers name a routable host
instead. That host is `--advertise-host` where given (a pod IP, a DNS name), otherwise, for a
wildcard bind, this machine's primary IP (the source address of its default route: a
container's or pod's own IP), and otherwise the host bound.
"""
from __future__ import annotations

import socket

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})


def is_wildcard(host: str) -> bool:
    """Whether `host` binds every interface (and so names no one address)."""
    return host.strip() in WILDCARD_HOSTS


def primary_ip() -> str:
    """This machine's address on its default route, without sending a packet (a UDP socket's
    connect only picks the route); the loopback address where there is no route."""
    for family, probe in ((socket.AF_INET, ("10.254.254.254", 1)), (socket.AF_INET6, ("fd00::1", 1))):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(probe)
                ip = s.getsockname()[0]
        except OSError:
            continue
        if ip and not is_wildcard(ip):
            return ip
    return "127.0.0.1"


def advertised_host(bind_host: str, advertise: str | None = None) -> str:
    """The host others reach a server bound to `bind_host` at (module docstring)."""
    if advertise:
        return advertise
    return primary_ip() if is_wildcard(bind_host) else bind_host


def host_port(host: str, port: int) -> str:
    """"host:port", with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def advertised_endpoint(endpoint: str, host: str) -> str:
    """A "tcp://HOST:PORT" endpoint with a wildcard HOST replaced by `host`; other endpoints
    (a named host, ipc://) unchanged."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        return endpoint
    bound, _, port = rest.rpartition(":")
    return f"tcp://{host_port(host, int(port))}" if is_wildcard(bound) and port.isdigit() else endpoint

"""Gateway configuration: tiers (queue capacity, aging, default deadline), worker limits,
retries, routing and message-size limits, as frozen dataclasses composed into one
`GatewayConfig`. Values are checked at construction (ValueError naming the field)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from collections.abc import Mapping
from typing import Any

from gateway.liveness import LivenessConfig
from gateway.routing import RoutingConfig
from tandem.types import ROLES, Tier, check_int

DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_REQUEST_ID_CHARS = 128


@dataclass(frozen=True)
class TierConfig:
    """One priority tier.

    capacity: queued requests the tier holds; one more is refused with RESOURCE_EXHAUSTED.
    aging_s: a request queued longer than this is dispatched as if it were one tier higher
        (None: never promoted; INTERACTIVE has nowhere to go).
    default_deadline_s: deadline of a request whose call carries no gRPC deadline.
    """

    capacity: int = 1024
    aging_s: float | None = None
    default_deadline_s: float = 300.0

    def __post_init__(self) -> None:
        check_int("capacity", self.capacity, lo=1)
        if self.aging_s is not None:
            _check_positive("aging_s", self.aging_s)
        _check_positive("default_deadline_s", self.default_deadline_s)


def _default_tiers() -> Mapping[Tier, TierConfig]:
    return MappingProxyType({
        Tier.INTERACTIVE: TierConfig(capacity=1024, aging_s=None, default_deadline_s=120.0),
        Tier.STANDARD: TierConfig(capacity=1024, aging_s=5.0, default_deadline_s=600.0),
        Tier.BATCH: TierConfig(capacity=1024, aging_s=30.0, default_deadline_s=3600.0),
    })


@dataclass(frozen=True)
class WorkerPoolConfig:
    """Static worker addresses ("host:port") by role, and how the gateway watches them.

    max_inflight_per_decode: requests the gateway keeps on one decode-capable worker at a
        time (the rest wait in the tier queues, where priority applies); size it to the
        worker's max_running.
    stats_interval_s: Stats polling period; a worker whose Stats call fails (or takes longer
        than stats_timeout_s) is marked down and skipped until it answers again.
    local_prefill_tokens: a decode worker prefills a prompt itself (PrefillAndDecode, no
        transfer) when the prompt has at most this many tokens; 0 = always disaggregate
        while a prefill worker is up.
    prefill_target_follows: send a disaggregated request's Prefill together with its Reserve,
        the KV target following once the decode worker has reserved (the prefill worker
        computes meanwhile); False: the Prefill waits for the reservation.
    """

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    both: tuple[str, ...] = ()
    max_inflight_per_decode: int = 64
    stats_interval_s: float = 0.1
    stats_timeout_s: float = 1.0
    local_prefill_tokens: int = 0
    prefill_target_follows: bool = True

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for role in ROLES:
            addrs = getattr(self, role)
            if isinstance(addrs, str):
                raise ValueError(f"{role}: must be a sequence of addresses, got a string")
            object.__setattr__(self, role, tuple(addrs))
            for addr in getattr(self, role):
                if not isinstance(addr, str) or not addr or any(c.isspace() for c in addr) or ":" not in addr:
                    raise ValueError(f"{role}: worker address must look like host:port, got {addr!r}")
                if addr in seen:
                    raise ValueError(f"{role}: worker address {addr} is listed twice")
                seen.add(addr)
        check_int("max_inflight_per_decode", self.max_inflight_per_decode, lo=1)
        _check_positive("stats_interval_s", self.stats_interval_s)
        _check_positive("stats_timeout_s", self.stats_timeout_s)
        check_int("local_prefill_tokens", self.local_prefill_tokens, lo=0)

    @property
    def num_workers(self) -> int:
        return len(self.prefill) + len(self.decode) + len(self.both)


@dataclass(frozen=True)
class GatewaySecurity:
    """Who may call the gateway, and how it reaches its workers (tandem/security.py).

    auth_token: the cluster token: required on the Admin service (and reflection), sent on
        every call to a worker, and the key of the KV-push vouchers. None: all open (loopback).
    api_key: required as `authorization: Bearer <key>` on the public Tandem service and the
        HTTP API. None: the public port is open.
    tls_cert / tls_key: serve the gRPC port (and the HTTP port) over TLS.
    tls_ca: verify the workers' TLS certificates with this CA (the internal links use TLS).
    reflection: serve gRPC reflection (cluster token required when one is set).
    """

    auth_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    reflection: bool = False

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert: give both --tls-cert and --tls-key (or neither)")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway needs besides the model directory's files.

    max_retries: further attempts after a worker failure (UNAVAILABLE, failed KV transfer);
        then UNAVAILABLE (or FINISH_REASON_ERROR once output was sent).
    max_context: prompt + max_tokens must fit; None = the model's max_position_embeddings.
    block_size: the workers' KV block size (block hashes for the prefix index).
    index_url: None = embedded memory index fed by the workers' KvEvents; redis://... = read
        the shared index the workers publish to. namespace None = the model identity.
    http_port: serve the OpenAI-compatible HTTP API (and /metrics, /health) on this port;
        None = no HTTP; 0 = a free port.
    index_block_ttl_s: Redis index: the expiry a lookup renews on the blocks it reads; keep it
        equal to the workers' --index-block-ttl so a dead worker's entries expire on time.
    stream_interval: new tokens per chunk of a stream whose request does not set its own (1:
        every step; N: the first token at once, then N at a time, for fewer messages).
    """

    model_dir: str
    host: str = "127.0.0.1"
    port: int = 50051
    workers: WorkerPoolConfig = field(default_factory=WorkerPoolConfig)
    tiers: Mapping[Tier, TierConfig] = field(default_factory=_default_tiers)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    max_retries: int = 3
    max_context: int | None = None
    block_size: int = 16
    load_format: str = "auto"
    index_url: str | None = None
    namespace: str | None = None
    index_block_ttl_s: float = 3600.0
    metrics_port: int | None = None
    http_port: int | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_s: float = 10.0
    model_name: str | None = None
    stream_interval: int = 1  # tokens per chunk for streams that do not ask (GenerateRequest.stream_interval)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)  # stalls, suspects, the call bound
    security: GatewaySecurity = field(default_factory=GatewaySecurity)

    def __post_init__(self) -> None:
        if not isinstance(self.model_dir, str) or not self.model_dir:
            raise ValueError(f"model_dir: must be a non-empty path, got {self.model_dir!r}")
        check_int("port", self.port, lo=0, hi=65535)
        if self.metrics_port is not None:
            check_int("metrics_port", self.metrics_port, lo=0, hi=65535)
        if self.http_port is not None:
            check_int("http_port", self.http_port, lo=0, hi=65535)
        tiers = dict(self.tiers)
        missing = [t.name for t in Tier if t not in tiers]
        if missing:
            raise ValueError(f"tiers: missing configuration for {', '.join(missing)}")
        if any(not isinstance(v, TierConfig) for v in tiers.values()):
            raise ValueError("tiers: values must be TierConfig")
        object.__setattr__(self, "tiers", MappingProxyType({t: tiers[t] for t in Tier}))
        check_int("max_retries", self.max_retries, lo=0)
        if self.max_context is not None:
            check_int("max_context", self.max_context, lo=2)
        check_int("block_size", self.block_size, lo=1)
        check_int("stream_interval", self.stream_interval, lo=0)
        check_int("max_message_bytes", self.max_message_bytes, lo=1024)
        _check_positive("grace_s", self.grace_s)
        _check_positive("index_block_ttl_s", self.index_block_ttl_s)


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")

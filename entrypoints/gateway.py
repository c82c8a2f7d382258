"""`tandem gateway ...` (`python -m entrypoints gateway`): the gateway process's flags and main.

The gateway itself (gateway.server.Gateway, serve) knows nothing of flags; this module turns
them into a GatewayConfig (a ValueError names the flag's field) and runs it until SIGTERM.
"""
from __future__ import annotations

import argparse
import logging
import sys

from entrypoints import aio
from engine.demo import demo_model_dir  # torch-free
from gateway.config import GatewayConfig, GatewaySecurity, TierConfig, WorkerPoolConfig
from gateway.liveness import LivenessConfig
from gateway.modelinfo import load_served_model
from gateway.routing import POLICIES, RoutingConfig
from gateway.server import serve
from tandem import security
from tandem.grpc_logs import quiet_caller_gone
from tandem.hub import resolve_model
from tandem.types import Tier


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem gateway", description="Tandem gateway (public tandem.v1.Tandem).")
    p.add_argument("--model", help="Hugging Face model directory (tokenizer + config.json); default: the demo model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port (printed at start)")
    p.add_argument("--prefill", action="append", default=[], metavar="ADDR", help="prefill worker host:port")
    p.add_argument("--decode", action="append", default=[], metavar="ADDR", help="decode worker host:port")
    p.add_argument("--worker", action="append", default=[], metavar="ADDR", help="role-both worker host:port")
    p.add_argument("--redis-url", default=None, help="shared prefix index (workers publish); default: embedded")
    p.add_argument("--namespace", default=None, help="prefix-index namespace; default: the model identity")
    p.add_argument("--index-block-ttl", type=float, default=3600.0,
                   help="Redis index: expiry (s) a lookup renews on the blocks it reads; match the workers'")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--http-port", type=int, default=None,
                   help="serve the OpenAI-compatible HTTP API (/v1/..., /health, /metrics) on this port; 0 = free")
    p.add_argument("--routing", choices=POLICIES, default="cache_aware")
    p.add_argument("--block-size", type=int, default=16, help="the workers' KV block size")
    p.add_argument("--load-format", default="auto", help="the workers' load format (part of the model identity)")
    p.add_argument("--max-context", type=int, default=None, help="cap on prompt + max_tokens (the workers' max_model_len)")
    p.add_argument("--max-inflight-per-decode", type=int, default=64)
    p.add_argument("--local-prefill-tokens", type=int, default=0,
                   help="prompts up to this many tokens are prefilled on the decode worker")
    p.add_argument("--reserve-before-prefill", action="store_true",
                   help="send a prompt's Prefill only once its decode worker has reserved the KV blocks (default: "
                        "both at once, the KV target following the Prefill)")
    p.add_argument("--max-retries", type=int, default=3)
    p.add_argument("--stream-interval", type=int, default=1,
                   help="new tokens per chunk of a stream that does not ask for its own (1: every step; N: the "
                        "first token at once, then N at a time: fewer messages, less CPU per token)")
    p.add_argument("--queue-capacity", type=int, default=1024, help="requests each tier queue holds")
    p.add_argument("--max-message-mb", type=float, default=16.0)
    p.add_argument("--grace", type=float, default=10.0, help="seconds running streams get on shutdown")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--stall-timeout", type=float, default=3.0,
                   help="seconds without progress (at least 20 of the worker's steps) before a stream migrates")
    p.add_argument("--max-inflight-calls", type=int, default=None,
                   help="Generate calls held at once; more get RESOURCE_EXHAUSTED (default: queues + slots + 256)")
    p.add_argument("--auth-token-file", default=None,
                   help="the cluster token: required on Admin, sent to the workers (default: $TANDEM_AUTH_TOKEN_FILE "
                        "or $TANDEM_AUTH_TOKEN; none: internal RPCs open, for loopback only)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the public gRPC and HTTP API; @FILE reads it from "
                        "FILE (default: $TANDEM_API_KEY; none: open)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC and HTTP over TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA that signed the workers' certificates (they serve TLS)")
    p.add_argument("--reflection", action="store_true", help="serve gRPC server reflection (cluster token required)")
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """Raises ValueError naming the flag's field for a bad value."""
    model_dir = args.model
    if model_dir is None:
        model_dir = str(demo_model_dir())
    pool = WorkerPoolConfig(prefill=tuple(args.prefill), decode=tuple(args.decode), both=tuple(args.worker),
                            max_inflight_per_decode=args.max_inflight_per_decode,
                            local_prefill_tokens=args.local_prefill_tokens,
                            prefill_target_follows=not args.reserve_before_prefill)
    defaults = GatewayConfig(model_dir=model_dir).tiers
    tiers = {t: TierConfig(args.queue_capacity, defaults[t].aging_s, defaults[t].default_deadline_s) for t in Tier}
    return GatewayConfig(
        model_dir=model_dir, host=args.host, port=args.port, workers=pool, tiers=tiers,
        routing=RoutingConfig(policy=args.routing), max_retries=args.max_retries, max_context=args.max_context,
        block_size=args.block_size, load_format=args.load_format, index_url=args.redis_url,
        namespace=args.namespace, index_block_ttl_s=args.index_block_ttl, metrics_port=args.metrics_port,
        http_port=args.http_port, stream_interval=args.stream_interval,
        max_message_bytes=int(args.max_message_mb * 1024 * 1024), grace_s=args.grace,
        liveness=LivenessConfig(stall_timeout_s=args.stall_timeout, max_inflight_calls=args.max_inflight_calls),
        security=GatewaySecurity(auth_token=security.load_token(args.auth_token_file),
                                 api_key=security.load_api_key(args.api_key), tls_cert=args.tls_cert,
                                 tls_key=args.tls_key, tls_ca=args.tls_ca, reflection=args.reflection),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_caller_gone()  # gRPC's ERROR for a unary answer its caller no longer waits for
    try:
        if args.model is not None:  # a directory or a Hugging Face repo id
            args.model = resolve_model(args.model)
        config = config_from_args(args)
        if not config.workers.num_workers:
            raise ValueError("workers: give at least one --worker, or --prefill and --decode")
        if config.workers.prefill and not (config.workers.decode or config.workers.both):
            raise ValueError("decode: prefill workers need at least one --decode (or --worker) to decode")
        model = load_served_model(config.model_dir, load_format=config.load_format,
                                  max_context=config.max_context, name=config.model_name)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        aio.run(serve(config, model))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())

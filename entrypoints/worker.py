"""The worker processes: `tandem prefill`, `tandem decode` and `tandem worker --role prefill|decode|both`
(`python -m entrypoints prefill|decode|worker ...`).

`worker.server.WorkerServer` runs the engine, the gRPC server and the drain; this module hands it
the role's services (`add_role_services`: the prefill or decode servicer and its KV transport),
so that the worker package never imports prefill or decode.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

import grpc

from entrypoints import aio
from tandem import security, wire
from tandem.grpc_logs import quiet_caller_gone
from tandem.hub import resolve_model
from tandem.netaddr import advertised_endpoint
from worker.config import WorkerConfig, build_parser, config_from_args
from worker.runtime import WorkerRuntime
from worker.server import WorkerServer

logger = logging.getLogger(__name__)


def add_role_services(worker: WorkerServer, server: grpc.aio.Server, runtime: WorkerRuntime) -> list[str]:
    """Register the role's servicer on `server` and set up its KV transport (the worker's `sender`
    or `receiver` and `kv_address`, and `runtime.kv_stats`); returns the gRPC service names."""
    from worker.transfer import join_kv_addresses, make_receiver, make_sender, split_kv_addresses

    cfg = worker.config
    ranks = worker.ranks
    if cfg.role == "prefill":
        from prefill.service import PrefillService

        worker.sender = make_sender(cfg.transfer.transport, cfg.transfer.sender_options, worker.auth_token,
                                    worker.engine)
        rank_sends = None
        if ranks is not None:
            from prefill.tp_push import RankSends

            rank_sends = RankSends(ranks.world_size)
            ranks.link.on_result, ranks.link.on_tick = rank_sends.on_result, rank_sends.tick
        service = PrefillService(runtime, worker.sender, rank_sends, auth_token=worker.auth_token)
        if ranks is not None:
            worker.engine.runner.step_extras = service.pusher.step_extras
        wire.add_prefill_worker_servicer(service, server)

        def sent() -> dict[str, Any]:
            stats = dict(worker.sender.stats())
            if rank_sends is not None:
                stats["bytes_sent"] = stats.get("bytes_sent", 0) + rank_sends.bytes_sent
            return {"sent": stats}

        runtime.kv_stats = sent
        return [wire.PREFILL_SERVICE]
    from decode.service import DecodeService

    service = DecodeService(runtime, cfg.transfer.timeout_s)
    if cfg.role == "decode":
        bind = cfg.rank_kv_address(0) or f"tcp://{cfg.host}:*"
        if ranks is None:
            worker.receiver = make_receiver(cfg.transfer.transport, worker.engine, bind, service.on_transfer,
                                            worker.auth_token)
        else:
            from decode.tp_receiver import TPReceiver

            worker.receiver = TPReceiver(ranks.world_size, ranks.link, service.on_transfer)
            local = make_receiver(cfg.transfer.transport, worker.engine, bind, worker.receiver.on_rank0_result,
                                  worker.auth_token)
            worker.receiver.attach(local, ranks.kv_addresses(local.address))
            ranks.link.on_result = worker.receiver.on_rank_result
        service.receiver = worker.receiver
        worker.kv_address = join_kv_addresses([advertised_endpoint(a, worker.advertised_host)
                                               for a in split_kv_addresses(worker.receiver.address)])
        runtime.kv_stats = lambda: {"received": worker.receiver.stats()}
    wire.add_decode_worker_servicer(service, server)
    return [wire.DECODE_SERVICE]


GIL_SWITCH_INTERVAL_S = 0.0005
# Overrides GIL_SWITCH_INTERVAL_S, in microseconds (a measurement knob: how long the engine thread
# may wait for the GIL when the step before's forward ends, BENCHMARKS.md §36).
GIL_SWITCH_ENV = "TANDEM_GIL_SWITCH_US"


def gil_switch_interval_s() -> float:
    """The worker's GIL switch interval: GIL_SWITCH_ENV's microseconds, else GIL_SWITCH_INTERVAL_S."""
    value = os.environ.get(GIL_SWITCH_ENV, "").strip()
    if not value:
        return GIL_SWITCH_INTERVAL_S
    try:
        us = float(value)
    except ValueError:
        us = float("nan")
    if not 1 <= us <= 100_000:
        raise ValueError(f"{GIL_SWITCH_ENV} must be microseconds in [1, 100000], got {value!r}")
    return us / 1e6


def setup_logging(level: str, role: str) -> None:
    logging.basicConfig(level=level.upper(),
                        format=f"%(asctime)s %(levelname)s [{role}] %(name)s: %(message)s")
    quiet_caller_gone()  # gRPC's ERROR for a unary answer its caller no longer waits for


def run(config: WorkerConfig) -> int:
    """Build the engine and serve until drained; returns the exit code."""
    logger.info("starting %s worker: model %s, %s:%d", config.role, config.engine.model_path, config.host, config.port)
    # The engine thread holds the GIL for most of each step; the gRPC loop and the KV transfer
    # threads each need it for a moment per message. Hand it over after 0.5 ms rather than the
    # default 5 ms, or every layer of an incoming KV transfer waits up to 5 ms for the GIL.
    sys.setswitchinterval(gil_switch_interval_s())
    server = WorkerServer(config, add_role_services)
    try:
        aio.run(server.serve_forever())
    finally:
        if server.ranks is not None and not server._stopped.is_set():
            server.ranks.kill()  # start-up failed after the other ranks were started
    if server.exit_code:
        logger.error("%s worker stopped with exit code %d", config.role, server.exit_code)
    return server.exit_code


def main(argv: list[str] | None = None, role: str | None = None, prog: str | None = "tandem worker") -> int:
    """`main(["--role", "both", "--model", DIR, ...])`; `role` fixes the role (the prefill and
    decode entry points pass it) and drops the --role flag."""
    parser = build_parser(role, prog)
    args = parser.parse_args(argv)
    try:
        args.model = resolve_model(args.model, args.revision)
        config = config_from_args(args, role)
        config.check_tp()
        security.load_token(config.auth_token_file)  # a missing or short token file names its flag here
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(args.log_level, config.role)
    try:
        return run(config)
    except (ValueError, OSError) as exc:
        logger.error("%s worker failed to start: %s", config.role, exc)
        return 2


def prefill_main(argv: list[str] | None = None) -> int:
    """`tandem prefill --model DIR --port P --kv-transport zmq ...`: a prefill worker."""
    return main(argv, role="prefill", prog="tandem prefill")


def decode_main(argv: list[str] | None = None) -> int:
    """`tandem decode --model DIR --port P ...`: a decode worker."""
    return main(argv, role="decode", prog="tandem decode")


if __name__ == "__main__":
    sys.exit(main())

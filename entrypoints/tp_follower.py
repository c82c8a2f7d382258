"""A tensor-parallel worker's rank r > 0 (`python -m entrypoints.tp_follower`, started by rank 0's
`worker.tp_ranks.TPRanks`, which writes the worker config to its stdin; not meant to be run by hand).

It joins the process group, builds its Engine shard, sets up its part of the KV transfer
(decode: a receiver over its own cache shard, driven by rank 0's expect / cancel commands;
prefill: a sender that pushes its shard at the layer points rank 0's step extras name), says
hello to rank 0 over the TP link, then runs rank 0's steps until rank 0 releases it.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from tandem import security
from worker.tp_link import BYE, HELLO, RESULT, FollowerLink
from worker.tp_ranks import START_TIMEOUT_S, TP_GROUP_TIMEOUT_S, config_from_json

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 0.5


def _exit_with_parent() -> None:
    """Exit when rank 0 is gone (this process was re-parented), whatever the main thread does."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent:
                logger.error("rank 0 (pid %d) is gone; exiting", parent)
                os._exit(1)

    threading.Thread(target=watch, name="tp-parent", daemon=True).start()


def run(rank: int, world: int, store_address: str, link_address: str, config_json: str) -> int:
    import torch
    import torch.distributed as dist

    from engine.engine import Engine
    from kvtransfer.nccl_group import connect_store
    from parallel.comm import init_tensor_parallel
    from parallel.runner import TensorParallelShard
    from worker.transfer import make_receiver, make_sender

    config = config_from_json(config_json)
    token = security.load_token(config.auth_token_file)  # as rank 0 loaded it (worker.tp_ranks)
    backend = config.tp_backend
    device = torch.device("cuda", rank) if backend == "nccl" else None
    tp = init_tensor_parallel(rank, world, backend=backend, device=device, timeout_s=TP_GROUP_TIMEOUT_S,
                              store=connect_store(store_address, START_TIMEOUT_S))
    sender: Any = None
    receiver: Any = None
    link: FollowerLink | None = None
    try:
        engine = Engine(config.engine_config(rank), TensorParallelShard(tp))
        on_step = None
        kv_address = ""
        if config.role == "prefill":
            from prefill.tp_push import FollowerPusher

            sender = make_sender(config.transfer.transport, config.transfer.sender_options, token, engine)
            link = FollowerLink(rank, link_address, lambda kind, body: None, auth_token=token)
            on_step = FollowerPusher(rank, engine.kv_cache.layers, sender, lambda body: link.send(RESULT, body),
                                     config.transfer.push).on_step
        elif config.role == "decode":
            from decode.tp_receiver import FollowerReceiver

            holder: list[FollowerLink] = []
            follower = FollowerReceiver(lambda body: holder[0].send(RESULT, body))
            bind = config.rank_kv_address(rank) or f"tcp://{config.host}:*"
            receiver = make_receiver(config.transfer.transport, engine, bind, follower.on_transfer, token)
            follower.receiver = receiver
            link = FollowerLink(rank, link_address, follower.on_command, auth_token=token)
            holder.append(link)
            kv_address = receiver.address
        else:
            link = FollowerLink(rank, link_address, lambda kind, body: None, auth_token=token)
        link.send(HELLO, {"kv_address": kv_address, "command_address": link.command_address, "pid": os.getpid()})
        steps = engine.follow(on_step)
        link.send(BYE, {"steps": steps})
        return 0
    finally:
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()
        if link is not None:
            link.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m entrypoints.tp_follower", description=__doc__)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--store", required=True, help="HOST:PORT of rank 0's TCPStore")
    p.add_argument("--link", required=True, help="rank 0's TP link endpoint")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    # Rank 0 decides when this rank stops (after its drain); a terminal's Ctrl-C or a
    # process-group SIGTERM must not take one rank away under the others.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=a.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s [tp rank {a.rank}] %(name)s: %(message)s")
    _exit_with_parent()
    try:
        return run(a.rank, a.world, a.store, a.link, sys.stdin.read())  # the worker config as JSON
    except Exception:
        logger.exception("tensor parallel rank %d failed", a.rank)
        return 1


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Past the interpreter's teardown, where torch's collective threads have been seen to abort a
    # rank that had finished cleanly ("terminate called without an active exception").
    os._exit(code)

"""Rank 0's side of a tensor-parallel worker: start the other ranks, form the group, watch them.

The worker process a user starts (`--tp N`) is rank 0. `TPRanks(config)` hosts a TCPStore on a
free loopback port and the TP link (`worker.tp_link`), and starts ranks 1..N-1 as child
processes (`python -m entrypoints.tp_follower`, same config; on CUDA rank r on cuda:r). All N then
join one process group (nccl on CUDA, gloo on CPU) and build `Engine(config, shard)` together,
each with its `parallel.runner.TensorParallelShard`; rank 0 serves gRPC, the others follow its
steps and move their own KV shards (`entrypoints.tp_follower`). Each other rank says hello on the
link once ready, with its KV receiver address (decode).

The cluster token: rank 0 hands its own (`auth_token`) to the link; the other ranks load the
same one as rank 0 did (`security.load_token` of the config's `auth_token_file`, else the
environment they inherit), so it never appears on their command line.

Lifetime: rank 0 stops the others (`stop`: `Engine.close()` ends their step loop, they close
their transports and exit; stragglers are killed). The other ranks ignore SIGINT and SIGTERM
(Ctrl-C in a terminal reaches the whole process group; rank 0 drains first, then stops them)
and exit by themselves when rank 0 disappears. A rank that dies while rank 0 runs is fatal:
the watcher logs it, kills the remaining ranks (so no collective waits on them) and calls
`on_failure`, or ends rank 0 at once when none is set (during start-up). The group's timeout
is long because the other ranks wait in a broadcast for as long as the worker is idle; a dead
rank is caught by the watcher, not by that timeout.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from worker.config import WorkerConfig
from worker.tp_link import RankLink

logger = logging.getLogger(__name__)

TP_GROUP_TIMEOUT_S = 7 * 24 * 3600.0
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
WATCH_INTERVAL_S = 0.2
FAILURE_EXIT_CODE = 3
FAILURE_GRACE_S = 10.0  # after a rank died: time to fail in-flight RPCs before rank 0 exits regardless
# What ranks 1..N-1 run: the entry point, which wires the role's KV transfer into the rank.
FOLLOWER_MODULE = "entrypoints.tp_follower"


def config_to_json(config: WorkerConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> WorkerConfig:
    return WorkerConfig.from_dict(json.loads(text))


class TPRanks:
    """Ranks 1..tp-1 of rank 0's worker; `join()` then `wait_ready()`, finally `stop()`."""

    def __init__(self, config: WorkerConfig, log_level: str | None = None, auth_token: str | None = None) -> None:
        import torch.distributed as dist

        from kvtransfer.nccl_group import host_store

        config.check_tp()
        self.config = config
        self.world_size = config.tp
        self.failed: str | None = None
        self.on_failure: Callable[[str], None] | None = None
        self.hellos: dict[int, dict[str, Any]] = {}
        self._stopping = False
        self._joined = False
        self.link = RankLink(self.world_size, auth_token=auth_token)
        self.store: dist.TCPStore = host_store("127.0.0.1", 0, START_TIMEOUT_S)
        level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.procs: dict[int, subprocess.Popen] = {}
        try:
            for rank in range(1, self.world_size):
                cmd = [sys.executable, "-m", FOLLOWER_MODULE, "--rank", str(rank), "--world", str(self.world_size),
                       "--store", f"127.0.0.1:{self.store.port}", "--link", self.link.address,
                       "--log-level", str(level)]
                # The config goes through stdin: a command line is visible to every user (redis_url
                # may carry a password).
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
                self.procs[rank] = proc
                proc.stdin.write(config_to_json(config).encode())
                proc.stdin.close()
        except BaseException:
            self.kill()
            raise
        logger.info("tensor parallel: started ranks %s (pids %s)", list(self.procs),
                    [p.pid for p in self.procs.values()])
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, p in sorted(self.procs.items())]

    def join(self) -> Any:
        """Join the process group as rank 0; returns rank 0's engine shard
        (`parallel.runner.TensorParallelShard`, for `Engine(config, shard)`)."""
        import torch

        from parallel.comm import init_tensor_parallel
        from parallel.runner import TensorParallelShard

        backend = self.config.tp_backend
        device = torch.device("cuda", 0) if backend == "nccl" else None
        tp = init_tensor_parallel(0, self.world_size, backend=backend, device=device, timeout_s=TP_GROUP_TIMEOUT_S,
                                  store=self.store)
        self._joined = True
        return TensorParallelShard(tp)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict[int, dict[str, Any]]:
        """Every other rank's hello (rank -> {"kv_address", "pid", ...}) once all are ready."""
        self.hellos = self.link.wait_hellos(timeout_s, self._check_alive)
        return self.hellos

    def kv_addresses(self, rank0_address: str) -> list[str]:
        return [rank0_address] + [self.hellos[r]["kv_address"] for r in range(1, self.world_size)]

    def _check_alive(self) -> None:
        if self.failed:
            raise RuntimeError(self.failed)

    # ---- watching -------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopping:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None and not self._stopping:
                    self._fail(f"tensor parallel rank {rank} (pid {proc.pid}) exited with code {code}")
                    return
            time.sleep(WATCH_INTERVAL_S)

    def _fail(self, reason: str) -> None:
        self.failed = reason
        logger.error("%s; this worker cannot go on without it and stops", reason)
        self.kill()
        if self.on_failure is None:
            os._exit(FAILURE_EXIT_CODE)  # start-up: the main thread may sit in a collective with the dead rank
        timer = threading.Timer(FAILURE_GRACE_S, os._exit, (FAILURE_EXIT_CODE,))
        timer.daemon = True
        timer.start()
        self.on_failure(reason)

    # ---- stopping -------------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL every other rank still running (on purpose: the watcher stands down)."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()

    def stop(self, engine: Any = None, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Release the other ranks (`engine.close()`, unless a rank failed) and wait for them to
        exit; kill what is left after `timeout_s`. True when every rank exited cleanly."""
        self._stopping = True
        clean = self.failed is None
        if clean and engine is not None:
            try:
                engine.close()
            except Exception:
                logger.exception("tensor parallel: releasing the other ranks failed")
                clean = False
        deadline = time.monotonic() + timeout_s
        for rank, proc in self.procs.items():
            try:
                code = proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor parallel rank %d did not stop within %.0fs; killing it", rank, timeout_s)
                proc.kill()
                code = proc.wait()
            clean = clean and code == 0
        self.link.close()
        if self._joined:
            import torch.distributed as dist

            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:
                    logger.debug("destroy_process_group failed", exc_info=True)
        return clean

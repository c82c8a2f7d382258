"""TPGroup.await_broadcast: a follower rank waiting out a long idle spell sleeps instead of spinning,
and still gets rank 0's tensor (two real gloo processes)."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from pathlib import Path

import torch

IDLE_S = 1.0


def _rank_main(rank: int, init_method: str, out) -> None:
    from parallel import init_tensor_parallel

    tp = init_tensor_parallel(rank, 2, init_method, backend="gloo")
    try:
        x = torch.arange(8, dtype=torch.int64) * 7 if rank == 0 else torch.zeros(8, dtype=torch.int64)
        tp.broadcast(torch.zeros(1))  # both ranks are up: the idle spell starts now
        if rank == 0:
            time.sleep(IDLE_S)
            tp.broadcast(x)
            out.put((0, None, None, None))
        else:
            wall, cpu = time.monotonic(), time.process_time()
            got = tp.await_broadcast(x)
            out.put((1, got.tolist(), time.monotonic() - wall, time.process_time() - cpu))
    finally:
        torch.distributed.destroy_process_group()
    out.close()
    out.join_thread()
    os._exit(0)  # no interpreter teardown: gloo's threads can abort it after the work is done


def test_follower_sleeps_while_rank0_is_idle_and_gets_its_tensor(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank_main, args=(r, init, out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + 120
        while len(results) < 2:
            try:
                rank, *rest = out.get(timeout=1.0)
                results[rank] = rest
            except queue.Empty:
                crashed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not crashed and time.monotonic() < deadline, f"ranks failed: exit codes {crashed}"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    got, wall, cpu = results[1]
    assert got == [7 * i for i in range(8)]
    assert wall >= 0.8 * IDLE_S  # it really waited for rank 0
    assert cpu < 0.5 * wall, f"the waiting rank used {cpu:.2f}s of CPU in {wall:.2f}s"

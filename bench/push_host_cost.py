"""The prefill side's host time to push one step's KV: `send_layer` per layer against one
`send_layers` call, over the real ipc transport (a receiver in this process, ZMQ, a shared-memory
pool; any host).

    python bench/push_host_cost.py [--layers 32] [--transfers 20] [--rounds 3]

For each mode and round: the median over `--transfers` of the call's own time (what the engine
thread spends) and of the time until the commit is handed to the transport (when a prefill
worker answers its Prefill call). Small blocks, so the figures are the per-layer work, not copying.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from kvtransfer import get_transport  # noqa: E402
from kvtransfer.sinks import TensorKVSink  # noqa: E402

BLOCK = (16, 2, 8)  # block_size, kv_heads, head_dim


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--transfers", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    for flag in ("layers", "transfers", "rounds"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag}: must be at least 1")
    dst_k = [torch.zeros(64, *BLOCK) for _ in range(a.layers)]
    dst_v = [torch.zeros(64, *BLOCK) for _ in range(a.layers)]
    stacked = torch.randn(a.layers, 2, 64, *BLOCK)  # as engine.kv_cache.KVCache allocates it
    caches = [(kv[0], kv[1]) for kv in stacked]
    src, dst = list(range(8)), list(range(8, 16))
    transport = get_transport("cuda_ipc")
    rows = []
    with tempfile.TemporaryDirectory() as shm, transport.create_receiver(TensorKVSink(dst_k, dst_v)) as rx, \
            transport.create_sender(slots=4 * a.layers, slot_bytes=65536, shm_dir=shm) as tx:
        for rnd in range(a.rounds):
            for mode in ("send_layer", "send_layers"):
                calls, commits = [], []
                for i in range(a.transfers):
                    rid = f"{mode}-{rnd}-{i}"
                    rx.expect(rid, dst, a.layers, deadline_s=30)
                    tx.open(rid, rx.address, a.layers)
                    t0 = time.perf_counter()
                    if mode == "send_layer":
                        for layer, (k, v) in enumerate(caches):
                            tx.send_layer(rid, layer, k, v, src, dst)
                    else:
                        tx.send_layers(rid, range(a.layers), caches, src, dst)
                    t1 = time.perf_counter()
                    result = tx.commit(rid, {}).result(30)
                    t2 = time.perf_counter()
                    assert result.ok, result.error
                    while not rx.poll_completed(timeout_s=5):
                        pass
                    calls.append(t1 - t0)
                    commits.append(t2 - t0)
                landed = all(torch.equal(dst_k[i][dst], k[src]) and torch.equal(dst_v[i][dst], v[src])
                             for i, (k, v) in enumerate(caches))
                assert landed, f"{mode}: the blocks that arrived differ from the ones sent"
                rows.append({"round": rnd, "mode": mode, "call_ms": round(statistics.median(calls) * 1e3, 2),
                             "commit_handed_over_ms": round(statistics.median(commits) * 1e3, 2)})
                print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

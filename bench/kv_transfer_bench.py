"""KV-transfer throughput: the ZMQ transport against a raw loopback TCP socket, same bytes, same run.

The receiver runs in its own process (as the decode worker would). One transfer is
layers x (K, V) x blocks of [block_size, kv_heads, head_dim]; ZMQ includes gathering the
blocks, checksums on both ends (xxh64, the default, and xxh3_64) and writing into the destination cache, the raw socket
only moves contiguous bytes into a buffer. Runs alternate between the two; prints JSON.

    python bench/kv_transfer_bench.py [--layers 32 --blocks 64 --iters 7 --endpoint tcp]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from kvtransfer import get_transport  # noqa: E402
from kvtransfer.sinks import TensorKVSink  # noqa: E402


def _cache(args: argparse.Namespace, seed: int | None, device: str = "cpu") -> list[torch.Tensor]:
    dtype = getattr(torch, args.dtype)
    shape = (2 * args.blocks, args.block_size, args.kv_heads, args.head_dim)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(args.layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(args.layers)]


def _zmq_receiver(args: argparse.Namespace, endpoint: str, ctrl: Any, done: Any) -> None:
    sink = TensorKVSink(_cache(args, None, args.dst_device), _cache(args, None, args.dst_device))
    receiver = get_transport("zmq").create_receiver(sink, bind=endpoint)
    done.put(receiver.address)
    while (cmd := ctrl.get()) is not None:
        request_id, dst = cmd
        receiver.expect(request_id, dst, args.layers, deadline_s=120.0)
        done.put("ready")
        results = receiver.poll_completed(timeout_s=120.0)
        done.put((time.monotonic(), bool(results) and results[0].ok))
    receiver.close()


def _raw_receiver(nbytes: int, iters: int, done: Any) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    done.put(server.getsockname()[1])
    conn, _ = server.accept()
    buf = memoryview(bytearray(nbytes))
    for _ in range(iters):
        got = 0
        while got < nbytes:
            n = conn.recv_into(buf[got:], nbytes - got)
            if n == 0:
                return
            got += n
        done.put((time.monotonic(), True))
    conn.close()
    server.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    src_k, src_v = _cache(args, 1, args.src_device), _cache(args, 2, args.src_device)
    gen = torch.Generator().manual_seed(3)
    src_ids = torch.randperm(2 * args.blocks, generator=gen)[: args.blocks].tolist()
    dst_ids = torch.randperm(2 * args.blocks, generator=gen)[: args.blocks].tolist()
    layer_bytes = [src_k[0][src_ids].cpu().contiguous().view(torch.uint8).numpy().reshape(-1)] * 2
    nbytes = 2 * args.layers * layer_bytes[0].nbytes
    iters = args.iters + 1  # the first run of each is a warm-up

    tmp = tempfile.mkdtemp(prefix="kvbench-")
    endpoint = "tcp://127.0.0.1:*" if args.endpoint == "tcp" else f"ipc://{tmp}/kv.sock"
    zctrl, zdone = ctx.Queue(), ctx.Queue()
    zproc = ctx.Process(target=_zmq_receiver, args=(args, endpoint, zctrl, zdone), daemon=True)
    rdone = ctx.Queue()
    rproc = ctx.Process(target=_raw_receiver, args=(nbytes, iters, rdone), daemon=True)
    zproc.start()
    rproc.start()
    address = zdone.get(timeout=60)
    raw = socket.create_connection(("127.0.0.1", rdone.get(timeout=60)))
    senders = {alg: get_transport("zmq").create_sender(checksum_algorithm=alg) for alg in args.checksum}
    zmq_gbps: dict[str, list[float]] = {alg: [] for alg in args.checksum}
    raw_gbps: list[float] = []
    try:
        for it in range(iters):
            t0 = time.monotonic()
            for _ in range(args.layers):
                for part in layer_bytes:
                    raw.sendall(part)
            t_done, _ = rdone.get(timeout=120)
            raw_gbps.append(nbytes / (t_done - t0) / 1e9)

            for alg, sender in senders.items():
                rid = f"bench-{alg}-{it}"
                zctrl.put((rid, dst_ids))
                zdone.get(timeout=60)
                t0 = time.monotonic()
                sender.open(rid, address, args.layers)
                for layer in range(args.layers):
                    sender.send_layer(rid, layer, src_k[layer], src_v[layer], src_ids, dst_ids)
                sender.commit(rid, {"num_tokens": args.blocks * args.block_size})
                t_done, ok = zdone.get(timeout=120)
                if not ok:
                    raise RuntimeError(f"transfer {rid} failed")
                zmq_gbps[alg].append(nbytes / (t_done - t0) / 1e9)
    finally:
        zctrl.put(None)
        for sender in senders.values():
            sender.close()
        raw.close()
        zproc.join(30)
        rproc.join(30)
    raw_gbps = raw_gbps[1:]
    zmq_gbps = {alg: xs[1:] for alg, xs in zmq_gbps.items()}

    def summary(xs: list[float]) -> dict[str, Any]:
        return {
            "gbps_median": round(statistics.median(xs), 3),
            "gbps_best": round(max(xs), 3),
            "runs": [round(x, 3) for x in xs],
        }

    ratios = {alg: round(statistics.median(xs) / statistics.median(raw_gbps), 3) for alg, xs in zmq_gbps.items()}
    return {
        "config": {k: getattr(args, k) for k in (
            "layers", "blocks", "block_size", "kv_heads", "head_dim", "dtype", "endpoint", "src_device", "dst_device"
        )},
        "bytes_per_transfer": nbytes,
        "cpus": os.cpu_count(),
        "raw_tcp": summary(raw_gbps),
        "zmq": {alg: summary(xs) for alg, xs in zmq_gbps.items()},
        "ratio_median": ratios,
        "target_ratio": 0.8,
        "meets_target": {alg: r >= 0.8 for alg, r in ratios.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--endpoint", default="tcp", choices=["tcp", "ipc"])
    parser.add_argument("--src-device", default="cpu", help="prefill cache device (cuda: pinned staging)")
    parser.add_argument("--dst-device", default="cpu", help="decode cache device")
    parser.add_argument("--checksum", nargs="+", default=["xxh64", "xxh3_64"], choices=["xxh64", "xxh3_64"])
    print(json.dumps(run(parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()

"""Sample a running worker's threads with py-spy and say where its engine thread's time goes.

    python bench/spy_worker.py record --worker-id decode-0 [--after 22] [--seconds 12] --out FILE
    python bench/spy_worker.py summarize FILE [--top 25]

`record` waits for the process whose command line names `--worker-id ID` (as `tandem up`
starts them), waits `--after` seconds more (load is flowing by then), and runs
`py-spy record --threads --idle --nonblocking -f raw` on it for `--seconds` (py-spy on PATH,
permission to trace the process: root or CAP_SYS_PTRACE). Run it in the background beside a
benchmark that starts the cluster (`throughput_bench.py --only online`).
`summarize` prints each thread's share of the samples and the engine thread's (stacks through
worker/engine_loop.py) most frequent innermost frames: waiting for the device
(`synchronize`), for the GIL or a lock, or running Python.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def worker_pids(worker_id: str) -> list[int]:
    """Processes whose arguments hold `--worker-id worker_id` (this script's own excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(argv[i] == "--worker-id" and argv[i + 1] == worker_id for i in range(len(argv) - 1)):
            pids.append(int(entry.name))
    return sorted(pids)


def find_pid(worker_id: str, timeout_s: float) -> int | None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        pids = worker_pids(worker_id)
        if pids:
            return pids[0]
        time.sleep(0.5)
    return None


def record(a: argparse.Namespace) -> int:
    if shutil.which("py-spy") is None:
        print("record: py-spy is not on PATH", file=sys.stderr)
        return 2
    pid = find_pid(a.worker_id, a.wait)
    if pid is None:
        print(f"record: no process with --worker-id {a.worker_id} within {a.wait:g} s", file=sys.stderr)
        return 1
    time.sleep(a.after)
    cmd = ["py-spy", "record", "-p", str(pid), "-d", str(a.seconds), "-r", str(a.rate), "--threads", "--idle",
           "--nonblocking", "-f", "raw", "-o", a.out]
    print(f"{a.worker_id} pid {pid}: {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, timeout=a.seconds + 30).returncode


def summarize(path: Path, top: int) -> dict:
    threads: collections.Counter[str] = collections.Counter()
    engine: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        threads[frames[0]] += int(n)
        if any("engine_loop" in f for f in frames):
            engine[";".join(f.split(" (")[0] for f in frames[-3:])] += int(n)
    total = sum(engine.values())
    return {"threads": threads.most_common(12), "engine_samples": total,
            "engine_top": [(round(v / total, 3), k) for k, v in engine.most_common(top)] if total else []}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--worker-id", required=True)
    r.add_argument("--after", type=float, default=22.0)
    r.add_argument("--seconds", type=int, default=12)
    r.add_argument("--rate", type=int, default=250)
    r.add_argument("--wait", type=float, default=120.0, help="how long to wait for the process to appear")
    r.add_argument("--out", required=True)
    s = sub.add_parser("summarize")
    s.add_argument("file")
    s.add_argument("--top", type=int, default=25)
    a = p.parse_args()
    if a.cmd == "record":
        return record(a)
    result = summarize(Path(a.file), a.top)
    for name, n in result["threads"]:
        print(f"{n:>8} {name}")
    print(f"engine thread: {result['engine_samples']} samples")
    for share, frames in result["engine_top"]:
        print(f"{share:6.3f} {frames}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Host CPU per output token of each process and thread of a `tandem up` cluster under a burst.

    python bench/host_cost.py --model DIR [--colocated] [--prompts 256 --input-len 64 --output-len 64]
    python bench/host_cost.py --llama8b ...        # the Llama-3.1-8B shape, dummy weights (a GPU box)

Starts `tandem up` (bench/up_bench.py's start_up; dummy weights), sends one warm-up request, then
`--prompts` greedy requests at once through the SDK, and reads every thread's user + system CPU
time (/proc/PID/task/TID/stat) of the cluster's processes and of this client before and after.
The result is CPU microseconds per output token by process role and thread: the engine thread
is named after its role (`engine-decode`, ...), the gRPC event loop is the main thread
(`python`), the rest are gRPC's and the libraries' pools. On a GPU the engine thread's share is
the host work of each step; the main threads' shares are the serving path's cost per token,
which the engine does not pay offline. Linux only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import up_bench  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def children_of(pid: int) -> list[int]:
    """Every descendant of `pid` (by /proc's parent links)."""
    parents: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents[ppid].append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def role_of(pid: int) -> str | None:
    """The role of a `python -m entrypoints ROLE ...` process, or None for another process."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for i, a in enumerate(argv[:-1]):
        if a == b"entrypoints":
            role = argv[i + 1].decode()
            if role in ("prefill", "decode", "worker", "gateway", "agent", "tp-follower"):
                return role
    return None


def thread_cpu(pid: int) -> dict[str, float]:
    """{thread name: CPU seconds} of one process (threads of one name summed)."""
    out: dict[str, float] = defaultdict(float)
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] += (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime
    return dict(out)


def snapshot(up_pid: int) -> dict[str, dict[str, float]]:
    """{"ROLE (pid)": {thread: CPU s}} for the cluster's processes, and "client" for this one."""
    out = {"client": thread_cpu(os.getpid())}
    for pid in children_of(up_pid):
        role = role_of(pid)
        if role is not None:
            out[f"{role} ({pid})"] = thread_cpu(pid)
    return out


def per_token(before: dict, after: dict, tokens: int) -> dict[str, dict[str, float]]:
    """CPU microseconds per output token, by process and thread ("total" per process)."""
    out: dict[str, dict[str, float]] = {}
    for proc, threads in after.items():
        base = before.get(proc, {})
        row = {t: (cpu - base.get(t, 0.0)) * 1e6 / tokens for t, cpu in threads.items()}
        row = {t: round(v, 1) for t, v in sorted(row.items(), key=lambda kv: -kv[1]) if v > 0}
        row["total"] = round(sum(v for t, v in row.items()), 1)
        out[proc] = row
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    up_bench.add_model_source(p)
    p.add_argument("--colocated", action="store_true", help="tandem up --colocated (one role-both worker)")
    p.add_argument("--stream", action="store_true",
                   help="read each request as a stream (every step's tokens, as `tandem bench` and streaming clients "
                        "do) instead of `generate` (the whole output in one message)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--up-args", default="", help="more `tandem up` flags, space-separated")
    p.add_argument("--out", default=None, help="write the JSON here too")
    a = p.parse_args()
    for flag, v in (("--prompts", a.prompts), ("--input-len", a.input_len), ("--output-len", a.output_len)):
        if v < 1:
            p.error(f"{flag}: must be >= 1, got {v}")

    from entrypoints.cluster import free_port
    from tandem import AsyncClient

    with tempfile.TemporaryDirectory(prefix="host-cost-") as tmp:
        model_dir = up_bench.model_source(a, Path(tmp))
        prompts = up_bench.make_prompts(a.prompts, a.input_len, up_bench.vocab_size(model_dir))
        port = free_port()
        extra = (["--colocated"] if a.colocated else []) + a.up_args.split()
        proc, banner, _ = up_bench.start_up(model_dir, port, Path(tmp) / "logs", extra)
        try:
            async def run() -> tuple[dict, dict, int, float]:
                async with AsyncClient(f"127.0.0.1:{port}", timeout=3600) as client:
                    await client.generate(prompts[0], max_tokens=4, temperature=0.0, ignore_eos=True)
                    async def streamed(x: list[int]) -> int:
                        return sum([len(c.token_ids) async for c in client.stream(
                            x, max_tokens=a.output_len, temperature=0.0, ignore_eos=True)])

                    async def whole(x: list[int]) -> int:
                        out = await client.generate(x, max_tokens=a.output_len, temperature=0.0, ignore_eos=True)
                        return len(out.token_ids)

                    before, t = snapshot(proc.pid), time.perf_counter()
                    counts = await asyncio.gather(*((streamed if a.stream else whole)(x) for x in prompts))
                    dt = time.perf_counter() - t
                    return before, snapshot(proc.pid), sum(counts), dt

            before, after, tokens, dt = asyncio.run(run())
        finally:
            up_bench.stop(proc)
    result = {"mode": "colocated" if a.colocated else "disagg", "read": "stream" if a.stream else "generate",
              "prompts": a.prompts, "input_len": a.input_len,
              "output_len": a.output_len, "output_tokens": tokens, "seconds": round(dt, 3),
              "output_tok_s": round(tokens / dt, 1), "banner": banner,
              "cpu_us_per_token": per_token(before, after, tokens)}
    print(f"{result['mode']}, {result['read']}: {tokens} tokens in {dt:.2f} s ({tokens / dt:.0f} tok/s); CPU us per output token:")
    for proc_name, row in result["cpu_us_per_token"].items():
        threads = ", ".join(f"{t} {v:g}" for t, v in row.items() if t != "total")
        print(f"  {proc_name:<22} {row['total']:>8g}   {threads}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`tandem up` with its defaults on one GPU, against the offline engine on the same prompts.

    python bench/up_bench.py --out bench/results/up_h200.json [--num-prompts 512] [--input-len 1024] [--output-len 1024]

Runs, in order, each in its own processes:
1. `tandem up --model DIR --load-format dummy` (Llama-3.1-8B shape, dummy weights; no serving
   flag: the placement, memory shares, KV pool, max_running and KV transport are its own);
2. the same with `--colocated`;
3. the offline engine (`engine.LLM`, its defaults) in this process, after both clusters stopped.
The clusters get only --port and --log-dir besides (where to listen, where the logs go). Each
cluster's prompts go through the SDK (`tandem.AsyncClient`), all submitted at once, greedy, no
EOS. The JSON holds each printed banner (placement), throughput, start-up time and the ratios
against the offline engine. A failing part is recorded with its error and the log tail.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.h200_bench import LLAMA31_8B, write_model  # noqa: E402

NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
UP_TIMEOUT_S = 420.0


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def add_model_source(p: argparse.ArgumentParser) -> None:
    """`--model DIR` or `--llama8b` (one of them), for the scripts that serve a shape with dummy weights."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face model directory (dummy weights of its shape are served)")
    src.add_argument("--llama8b", action="store_true", help="the Llama-3.1-8B shape (bench/h200_bench.py)")


def model_source(a: argparse.Namespace, tmp: Path) -> Path:
    """The model directory `add_model_source`'s flags name (the 8B shape is written under `tmp`)."""
    return write_model(Path(tmp) / "llama31-8b", LLAMA31_8B) if a.llama8b else Path(a.model)


def vocab_size(model_dir: Path) -> int:
    """The model's vocabulary size (its config.json): prompts are token ids below it."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def make_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(128000, vocab - 2), (n, length), generator=g).tolist()


def start_up(model_dir: Path, port: int, log_dir: Path, extra: list[str],
             env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str], float]:
    """`tandem up` until it prints "Tandem is up" (`env`: more environment for it and its
    children); returns the process, its banner lines, seconds."""
    cmd = [sys.executable, "-m", "entrypoints", "up", "--model", str(model_dir), "--load-format", "dummy",
           "--port", str(port), "--log-dir", str(log_dir), *extra]
    log("starting:", " ".join(cmd[1:]))
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **NVLS_OFF, **(env or {}),
                                 "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    lines: list[str] = []
    deadline = time.time() + UP_TIMEOUT_S
    for line in proc.stdout:
        line = line.rstrip("\n")
        if " INFO " not in line:
            print("   up>", line, flush=True)
        lines.append(line)
        if "Tandem is up" in line:
            banner = [x for x in lines if x.startswith("  ") or "Tandem is up" in x]
            return proc, banner, time.perf_counter() - t
        if time.time() > deadline:
            break
    proc.kill()
    raise RuntimeError("tandem up did not come up:\n" + "\n".join(lines[-40:]))


def stop(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    return proc.returncode


def serve(model_dir: Path, prompts: list[list[int]], out_len: int, log_dir: Path, extra: list[str]) -> dict:
    from entrypoints.cluster import free_port
    from tandem import AsyncClient

    port = free_port()
    proc, banner, up_s = start_up(model_dir, port, log_dir, extra)
    try:
        async def run() -> tuple[int, int, float]:
            async with AsyncClient(f"127.0.0.1:{port}", timeout=3600) as client:
                await client.generate(prompts[0], max_tokens=4, temperature=0.0, ignore_eos=True)
                t = time.perf_counter()
                outs = await asyncio.gather(*(client.generate(x, max_tokens=out_len, temperature=0.0, ignore_eos=True)
                                              for x in prompts))
                return len(outs), sum(len(o.token_ids) for o in outs), time.perf_counter() - t

        done, n_out, dt = asyncio.run(run())
    finally:
        code = stop(proc)
    return {"banner": banner, "startup_s": round(up_s, 1), "completed": done, "prompts": len(prompts),
            "output_tokens": n_out, "seconds": round(dt, 2), "output_tok_s": round(n_out / dt, 1),
            "exit_code": code}


def offline(model_dir: Path, prompts: list[list[int]], out_len: int) -> dict:
    import torch

    from engine import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy")
    startup = time.perf_counter() - t
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], params.replace(max_tokens=8))
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    n_out = sum(len(o.token_ids) for o in outs)
    res = {"startup_s": round(startup, 1), "prompts": len(prompts), "output_tokens": n_out, "seconds": round(dt, 2),
           "output_tok_s": round(n_out / dt, 1), "kv_blocks": llm.engine.num_total_blocks,
           "max_running": llm.engine.max_running, "preemptions": llm.engine.stats().num_preemptions}
    del llm
    torch.cuda.empty_cache()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/up_h200.json", help="where the JSON goes")
    p.add_argument("--num-prompts", type=int, default=512, help="requests per run (shrink to fit a time budget)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=1024, help="output tokens")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: disagg, colocated, offline")
    a = p.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    result: dict = {"model": "Llama-3.1-8B shape, dummy weights", "num_prompts": a.num_prompts,
                    "input_len": a.input_len, "output_len": a.output_len}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="up-bench-") as tmp:
        tmp_path = Path(tmp)
        model_dir = write_model(tmp_path / "llama31-8b", LLAMA31_8B)
        prompts = make_prompts(a.num_prompts, a.input_len, LLAMA31_8B["vocab_size"])
        parts = [("disagg", lambda: serve(model_dir, prompts, a.output_len, tmp_path / "logs-disagg", [])),
                 ("colocated", lambda: serve(model_dir, prompts, a.output_len, tmp_path / "logs-colocated",
                                             ["--colocated"])),
                 ("offline", lambda: offline(model_dir, prompts, a.output_len))]
        for name, fn in parts:
            if name in skip:
                continue
            log(f"== {name}")
            t = time.perf_counter()
            try:
                result[name] = fn()
            except Exception as exc:
                logs = sorted((tmp_path / f"logs-{name}").glob("*.log"))
                result[name] = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:],
                                "log_tails": {f.name: f.read_text(errors="replace")[-3000:] for f in logs}}
            result[name]["wall_s"] = round(time.perf_counter() - t, 1)
            log(f"{name}: {json.dumps({k: v for k, v in result[name].items() if k not in ('traceback', 'log_tails')})}")
    base = result.get("offline", {}).get("output_tok_s")
    result["ratios"] = {f"{k}_vs_offline": round(result[k]["output_tok_s"] / base, 3)
                        for k in ("disagg", "colocated") if base and "output_tok_s" in result.get(k, {})}
    result["total_s"] = round(time.perf_counter() - t0, 1)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    log(f"wrote {out}: ratios {result['ratios']}, {result['total_s']} s in all")
    return 0 if all("error" not in result.get(k, {}) for k in ("disagg", "colocated", "offline") if k not in skip) else 1


if __name__ == "__main__":
    sys.exit(main())

"""A prompt longer than the prefill worker's context on `tandem up`'s defaults (a prefill and a
decode worker sharing one GPU): the decode worker prefills it itself (gateway placement reason
`long_prompt`). What that costs the requests decoding beside it, against a prompt of ordinary
length that the prefill worker computes.

    python bench/long_prompt.py --llama8b --out bench/results/long_prompt_h100.json [--long-len 65536]

Starts `tandem up --model DIR --load-format dummy` (no serving flag besides --port, --log-dir,
--metrics-port), then twice: `--streams` requests of `--stream-in` tokens in and `--stream-out`
out (greedy, no EOS) start together; once they are all decoding, one more request of 16 tokens
out arrives, first with a prompt of `--long-len` tokens, then (a fresh set of streams) with one
of `--stream-in`. Recorded for each: that request's TTFT, and the running streams' largest gap
between tokens and their mean gap while it was prefilled (from its arrival to its first token)
against before it; and the gateway's routing counter by reason, which says where each prompt was
computed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.up_bench import add_model_source, log, make_prompts, model_source, start_up, stop, vocab_size  # noqa: E402


async def _stream(client, prompt: list[int], max_tokens: int, times: list[float]) -> None:
    """Run one greedy request, appending each token's arrival time (monotonic) to `times`."""
    async for chunk in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        now = time.monotonic()
        times.extend([now] * len(chunk.token_ids))


def _gaps(times: list[float], start: float, end: float) -> list[float]:
    return [b - a for a, b in zip(times, times[1:]) if start <= a and b <= end]


async def _one_round(target: str, streams: list[list[int]], out_len: int, extra: list[int]) -> dict:
    """`streams` decoding, then `extra` arrives: its TTFT and the streams' gaps before and while
    it is prefilled."""
    from tandem import AsyncClient

    async with AsyncClient(target, timeout=3600) as client:
        times = [[] for _ in streams]
        tasks = [asyncio.ensure_future(_stream(client, p, out_len, t)) for p, t in zip(streams, times)]
        started = min(32, out_len // 2)
        while not all(len(t) >= started or task.done() for t, task in zip(times, tasks)):  # all decoding
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        arrived = time.monotonic()
        extra_times: list[float] = []
        await _stream(client, extra, 16, extra_times)
        first = extra_times[0]
        await asyncio.gather(*tasks)
    before = [g for t in times for g in _gaps(t, arrived - 0.3, arrived)]
    during = [g for t in times for g in _gaps(t, arrived, first)]
    ms = lambda xs: round(1000 * sum(xs) / len(xs), 2) if xs else None  # noqa: E731
    return {"prompt_tokens": len(extra), "ttft_ms": round(1000 * (first - arrived), 1),
            "streams_gap_mean_ms_before": ms(before), "streams_gap_mean_ms_during": ms(during),
            "streams_gap_max_ms_during": round(1000 * max(during), 1) if during else None,
            "streams_still_running": sum(1 for t in times if t[-1] > first)}


def _routing(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^tandem_gateway_routing_decisions_total\{[^}]*reason="([^"]+)"[^}]*\} (\S+)$', text, re.M)}


def _routed(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The routing decisions, by reason, counted between two `_routing` readings."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source(p)
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--long-len", type=int, default=65536, help="the long prompt's tokens")
    p.add_argument("--streams", type=int, default=8, help="requests decoding when it arrives")
    p.add_argument("--stream-in", type=int, default=1024)
    p.add_argument("--stream-out", type=int, default=512)
    p.add_argument("--up-args", default="", help="more `tandem up` flags, space-separated")
    a = p.parse_args()
    from entrypoints.cluster import free_port

    with tempfile.TemporaryDirectory(prefix="long-prompt-") as tmp:
        model = model_source(a, Path(tmp))
        vocab = vocab_size(model)
        port, metrics = free_port(), free_port()
        proc, banner, up_s = start_up(model, port, Path(tmp) / "logs",
                                      ["--metrics-port", str(metrics), "--no-agent", *a.up_args.split()])
        result: dict = {"command": " ".join(sys.argv), "banner": banner, "startup_s": round(up_s, 1)}
        try:
            target = f"127.0.0.1:{port}"
            streams = make_prompts(2 * a.streams + 1, a.stream_in, vocab)
            long = make_prompts(1, a.long_len, vocab)[0]
            asyncio.run(_one_round(target, streams[:1], 8, streams[-1][:64]))  # warm up
            before = _routing(metrics)
            result["long"] = asyncio.run(_one_round(target, streams[:a.streams], a.stream_out, long))
            after_long = _routing(metrics)
            result["ordinary"] = asyncio.run(_one_round(target, streams[a.streams:2 * a.streams], a.stream_out,
                                                        streams[-1]))
            after = _routing(metrics)
            result["long"]["routed"] = _routed(before, after_long)
            result["ordinary"]["routed"] = _routed(after_long, after)
        finally:
            result["exit_code"] = stop(proc)
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a decode step's time goes: host phases and GPU kernels at a few batch sizes.

    python bench/step_profile.py --batch 1,64,384 --ctx 1024 [--out step_profile.json]
    python bench/step_profile.py --mixed 0,256 --ctx 1024 --prefill-tokens 1024,8192

`--mixed` profiles steps that carry prefill instead: `batch` sequences decoding at `ctx`, then
fresh `ctx`-token prompts for `prefill-tokens` tokens arrive and the next step takes them (as
many as the step's token budget holds) beside the decodes; batch 0 is a prefill-only step.

Llama-3.1-8B shape, dummy bf16 weights. For each batch size, `batch` sequences are prefilled to
`ctx` tokens and then decode steps are timed two ways: as they run (wall ms per step), and with a
device synchronize around each phase (schedule, prepare, forward, logits, sample, postprocess) so
each phase's own host + GPU time shows (which also turns the overlapped step synchronous). The
top GPU kernels of one step come from torch.profiler, and so does the time a step leaves the
device idle (`gpu_idle_ms_per_step`: gaps between its kernels and copies, where the host did
not keep it fed), and torch's sync debug mode lists what in a step made the host wait for the
device (`synchronizing_calls`), and PyTorch's caching allocator what it did a step
(`allocator_per_step`: a retry frees cached blocks, which synchronizes the device). `--no-overlap`
runs synchronous steps; `--trace DIR` also writes a Chrome
trace of three steps with the host's calls beside the device's kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402


STAGE1_KERNELS = ("_decode_stage1", "_decode_stage1_warps")  # tandem_kernels.decode_stage1's kernels
_STEPS_RUN = 2  # the loops of `steps` steps that profile_batch runs (as they run, synced phases)


def timed(obj, name: str, acc: dict, sync: bool, key: str | None = None) -> None:
    """Replace `obj.name` with a wrapper adding each call's seconds to acc[key or name]; with
    `sync`, a device synchronize on both sides, so the time includes the call's device work."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        r = fn(*args, **kwargs)
        if sync:
            torch.cuda.synchronize()
        acc[key or name] += time.perf_counter() - t
        return r

    setattr(obj, name, wrapper)


class SchedulerPhases:
    """The scheduler's host time per step (engine.outputs.StepObserver); it runs no device work,
    so no synchronize is needed around it."""

    def __init__(self, acc: dict) -> None:
        self.acc = acc

    def on_schedule(self, plan, seconds: float) -> None:
        self.acc["schedule"] += seconds

    def on_postprocess(self, seconds: float) -> None:
        self.acc["postprocess"] += seconds


def profile_batch(model_dir: Path, batch: int, ctx: int, steps: int, overlap: bool | None = None,
                  kv_cache_dtype: str = "auto", trace_dir: Path | None = None, quantization: str | None = None,
                  fused_gemv: bool | None = None) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_running=batch, overlap_schedule=overlap,
              max_model_len=ctx + _STEPS_RUN * steps + 512, max_batched_tokens=8192, enable_prefix_cache=False,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization, fused_decode_gemv=fused_gemv)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    for p in torch.randint(0, min(128000, eng.model_config.vocab_size), (batch, ctx), generator=g).tolist():
        # enough tokens that no sequence ends before the last timed step (the first ones admitted
        # also decode while the rest prefill): every phase below sees the whole batch
        eng.admit(p, SamplingParams(max_tokens=_STEPS_RUN * steps + 448, temperature=0, ignore_eos=True))
    while eng.stats().queued_prefill_tokens:
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    timing = _timed_steps(eng, steps)
    allocator = _allocator_events(before, torch.cuda.memory_stats(), steps)

    from torch.profiler import ProfilerActivity, profile

    kernels, gpu_total, gpu_idle = [], None, None
    kv_bytes = _kv_bytes_per_step(eng)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                eng.step()
            torch.cuda.synchronize()
        kernels, gpu_total = _top_kernels(prof, 3)
        gpu_idle = _gpu_idle_ms(prof, 3)
        if trace_dir is not None:  # host and device on one timeline (the host side runs slower traced)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as traced:
                for _ in range(3):
                    eng.step()
                torch.cuda.synchronize()
            trace_dir.mkdir(parents=True, exist_ok=True)
            traced.export_chrome_trace(str(trace_dir / f"steps_b{batch}_ctx{ctx}_{kv_cache_dtype}.json"))
    except Exception as e:  # the profiler is a bonus: keep the timings without it
        kernels = [{"error": f"{type(e).__name__}: {e}"}]
    syncs = _synchronizing_calls(eng, 3)
    # last: the wrappers below synchronize around each phase and stay installed
    acc: dict[str, float] = defaultdict(float)
    runner = eng.runner
    eng.observer = SchedulerPhases(acc)
    for obj, names in ((eng, ("_process_samples",)),
                       (runner, ("prepare",)), (runner.sampler, ("launch",)), (runner.model, ("logits",))):
        for n in names:
            timed(obj, n, acc, sync=True)
    if runner.graphs is not None:
        timed(runner.graphs, "replay", acc, sync=True)
    for _ in range(steps):
        eng.step()
    phases = {k: round(v / steps * 1e3, 3) for k, v in acc.items()}

    overlap = eng.overlap
    running = len(eng.request_ids())
    for request_id in eng.request_ids():
        eng.abort(request_id)
    del llm, eng, runner
    torch.cuda.empty_cache()
    stage1 = next((k["us_per_step"] for k in kernels if k.get("name") in STAGE1_KERNELS), None)
    if running != batch:
        raise RuntimeError(f"{batch - running} of {batch} sequences ended before the last timed step")
    return {"batch": batch, "ctx": ctx, "kv_cache_dtype": kv_cache_dtype, "quantization": quantization,
            "overlap": overlap, "fused_gemv": fused_gemv,
            **timing, "gpu_ms_per_step": gpu_total, "gpu_idle_ms_per_step": gpu_idle,
            "decode_kv_gb_per_step": round(kv_bytes / 1e9, 2),
            "decode_stage1_tb_per_s": round(kv_bytes / stage1 / 1e6, 2) if stage1 else None,
            "synchronizing_calls": syncs, "allocator_per_step": allocator, "synced_phase_ms": phases,
            "top_kernels": kernels}


def _kv_bytes_per_step(eng) -> int:
    """Bytes of K and V a decode step of the running batch reads: every running sequence's
    context, in every layer, at the cache's element size."""
    cfg, cache = eng.model_config, eng.runner.kv_cache
    tokens = sum(seq.num_computed_tokens for seq in eng._scheduler.running)
    return 2 * tokens * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cache.stacked.element_size()


def _timed_steps(eng, steps: int) -> dict:
    """`steps` steps as they run (unsynchronized): the wall per step, and the part of it the host
    spent waiting for the device's samples (`PendingSamples.result`); the rest is the host's own
    work a step. A device-bound loop waits a good part of each step; a host-bound one hardly waits."""
    from engine.sampler import PendingSamples

    acc: dict[str, float] = defaultdict(float)
    original = PendingSamples.result
    timed(PendingSamples, "result", acc, sync=False)
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    finally:
        PendingSamples.result = original
    wait = acc["result"] / steps
    return {"wall_ms_per_step": round(wall * 1e3, 3), "sample_wait_ms_per_step": round(wait * 1e3, 3),
            "host_busy_ms_per_step": round((wall - wait) * 1e3, 3)}


def _top_kernels(prof, steps: int) -> tuple[list[dict], float]:
    events = prof.key_averages()
    kernels = [{"name": e.key[:90], "us_per_step": round(e.device_time_total / steps, 1), "calls": e.count // steps}
               for e in sorted(events, key=lambda e: -e.device_time_total)[:16]]
    gpu_total = round(sum(e.device_time_total for e in events if e.device_time_total) / steps / 1e3, 3)
    return kernels, gpu_total


def _allocator_events(before: dict, after: dict, steps: int) -> dict:
    """What PyTorch's caching allocator did a step between two memory_stats(): retries (a
    cudaMalloc that failed until cached blocks were freed, each free synchronizing the device)
    and cudaMalloc / cudaFree calls. Steady decode steps should show none."""
    keys = {"alloc_retries": "num_alloc_retries", "device_mallocs": "num_device_alloc",
            "device_frees": "num_device_free", "sync_all_streams": "num_sync_all_streams"}
    return {name: round((after.get(k, 0) - before.get(k, 0)) / steps, 3) for name, k in keys.items()}


def _synchronizing_calls(eng, steps: int) -> dict:
    """What in `steps` engine steps made the host wait for the device (torch's sync debug mode:
    .item(), pageable copies, nonzero, ...), each warning's first line with its count; an
    overlapped step should have one, the wait for the step before's samples."""
    import warnings

    found: dict[str, int] = defaultdict(int)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        found[str(w.message).splitlines()[0][:160]] += 1
    return dict(found)


def _gpu_idle_ms(prof, steps: int) -> float | None:
    """Milliseconds a step in which the device ran nothing (`idle_ms` of the profiled window's
    kernels and copies)."""
    return idle_ms([(e.time_range.start, e.time_range.end) for e in prof.events()
                    if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA"], steps)


def idle_ms(spans_us: list[tuple[float, float]], steps: int) -> float | None:
    """Of device activity spans (start, end) in microseconds: the milliseconds per step between
    the first start and the last end that no span covers (None without spans)."""
    spans = sorted((a, b) for a, b in spans_us if b > a)
    if not spans:
        return None
    busy, (cur_start, cur_end) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    window = max(end for _, end in spans) - spans[0][0]
    return round((window - busy) / steps / 1e3, 3)


def profile_mixed(model_dir: Path, batch: int, ctx: int, prefill_tokens: int, kv_cache_dtype: str = "auto",
                  repeats: int = 3, quantization: str | None = None) -> dict:
    """Time and profile a step carrying `prefill_tokens` of fresh prompts beside `batch` decodes."""
    from torch.profiler import ProfilerActivity, profile

    from engine import LLM, SamplingParams

    prompts_per_step = max(1, -(-prefill_tokens // ctx))
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_running=batch + prompts_per_step,
              max_model_len=ctx + 4096, max_batched_tokens=max(8192, prefill_tokens + batch), enable_prefix_cache=False,
              kv_cache_dtype=kv_cache_dtype, quantization=quantization)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    vocab = min(128000, eng.model_config.vocab_size)
    def admit(n: int, length: int, max_tokens: int = 1) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        for p in torch.randint(0, vocab, (n, length), generator=g).tolist():
            eng.admit(p, params)

    admit(batch, ctx, max_tokens=4096)
    while eng.stats().queued_prefill_tokens:
        eng.step()
    for _ in range(3):
        eng.step()

    def one_step() -> float:
        last = prefill_tokens - (prompts_per_step - 1) * ctx
        admit(prompts_per_step - 1, ctx)
        admit(1, last)
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        took = time.perf_counter() - t
        eng.step()  # the prompts (one token each) leave
        return took

    one_step()  # warm: shapes this step has not seen
    walls = [one_step() for _ in range(repeats)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        admit(prompts_per_step, min(ctx, prefill_tokens))
        torch.cuda.synchronize()
        eng.step()
        torch.cuda.synchronize()
    kernels, gpu_total = _top_kernels(prof, 1)
    for request_id in eng.request_ids():
        eng.abort(request_id)
    del llm, eng
    torch.cuda.empty_cache()
    return {"decode_batch": batch, "ctx": ctx, "prefill_tokens": prefill_tokens, "kv_cache_dtype": kv_cache_dtype,
            "quantization": quantization, "wall_ms_per_step": round(sorted(walls)[len(walls) // 2] * 1e3, 3), "gpu_ms_per_step": gpu_total,
            "top_kernels": kernels}


@contextlib.contextmanager
def decode_tuning(fields: str | None):
    """The decode kernel's default tunings (both cache dtypes, every batch) with `fields` (JSON)
    replaced, while inside."""
    import tandem_kernels.decode_attention as da

    names = ("FP8_TUNING", "FP8_WIDE_TUNING", "BF16_TUNING", "BF16_PREFETCH_TUNING", "FP8_PREFETCH_TUNING")
    saved = {name: getattr(da, name) for name in names}  # the small batches' prefetching tunings too
    if fields is not None:
        for name, t in saved.items():
            setattr(da, name, dataclasses.replace(t, **json.loads(fields)))
    try:
        yield
    finally:
        for name, t in saved.items():
            setattr(da, name, t)


def main() -> int:
    from bench.h200_bench import LLAMA31_8B, write_model

    p = argparse.ArgumentParser()
    p.add_argument("--batch", default="1,64,384")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default=None)
    p.add_argument("--no-overlap", action="store_true", help="synchronous engine steps")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights")
    p.add_argument("--mixed", default=None, help="decode batches for steps that carry prefill (0: prefill only)")
    p.add_argument("--prefill-tokens", default="1024,8192", help="prefill tokens per step, with --mixed")
    p.add_argument("--tuning", action="append", default=None, metavar="JSON",
                   help="profile with these DecodeTuning fields over the default (repeatable, one run each), "
                        "e.g. '{\"block_n\": 128, \"defer_sum\": true}'")
    p.add_argument("--fused-gemv", choices=["on", "off"], default=None,
                   help="EngineConfig.fused_decode_gemv (default: the engine's; TANDEM_FUSED_GEMV names the projections)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="also write a Chrome trace (host and device) of three decode steps per batch size here")
    a = p.parse_args()
    res = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "llama31-8b", LLAMA31_8B)
        if a.mixed is not None:
            for b in map(int, a.mixed.split(",")):
                for n in map(int, a.prefill_tokens.split(",")):
                    res.append(profile_mixed(model_dir, b, a.ctx, n, a.kv_cache_dtype, quantization=a.quantization))
                    print(json.dumps(res[-1]), flush=True)
        for tuning in a.tuning or [None]:
            for b in map(int, a.batch.split(",")) if a.mixed is None else ():
                with decode_tuning(tuning):
                    res.append(profile_batch(model_dir, b, a.ctx, a.steps, False if a.no_overlap else None,
                                             a.kv_cache_dtype, Path(a.trace) if a.trace else None, a.quantization,
                                             fused_gemv=None if a.fused_gemv is None else a.fused_gemv == "on"))
                if tuning is not None:
                    res[-1]["tuning"] = json.loads(tuning)
                print(json.dumps(res[-1]), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

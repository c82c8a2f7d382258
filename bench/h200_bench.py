"""The H200 benchmark: every figure of the GPU issue in one run, written to one JSON file.

    python bench/h200_bench.py --out bench/results/h200.json [--num-prompts 1000] [--skip ...]

Model: Llama-3.1-8B shape with dummy weights in bf16. Ceilings (device copy GB/s, bf16 matmul
TFLOP/s) are measured in the same run and every fraction is taken against them.
Sections: ceilings, kernels (bench/kernel_bench.py), gpu_parity, decode_b1, decode_b1_fused (with
the fused decode GEMVs), prefill, offline,
transformers (one static batch per size in --hf-batches), ours_on_hf_subset, services (KV through
CUDA IPC, as `tandem up` runs on a GPU host) and services_zmq (KV over ZMQ through host memory)
with the offline engine on the same prompts (overlapped and synchronous steps), fp8_offline.
Each is timed and guarded; a failure is recorded, not fatal. The services section needs pyzmq, redis and the
gRPC health/reflection wheels on the device: carry `.whl` (see the device notes) and install first.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 256, "eos_token_id": 257,  # the byte tokenizer's
    "torch_dtype": "bfloat16",
}


def log(*a) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def ceilings() -> dict:
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB each way
    a = torch.randn(n // 2, device="cuda", dtype=torch.float32).view(torch.bfloat16)
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a))
    copy_gbs = 2 * a.numel() * a.element_size() / ms / 1e6
    del a, b
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: x @ y)
    return {"copy_GBps": round(copy_gbs, 1), "matmul_bf16_TFLOPs": round(2 * m**3 / ms / 1e9, 1)}


def write_model(d: Path, cfg: dict) -> Path:
    from engine.demo import write_byte_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    write_byte_tokenizer(d)
    return d


def weight_bytes(cfg, fp8_projections: bool = False) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row is read);
    `fp8_projections`: the decoder layers' four projections at one byte a weight (--quantization
    fp8), the rest in bf16."""
    from engine.config import ModelConfig

    mc = ModelConfig.from_dict(cfg)
    total = (mc.num_params() - mc.vocab_size * mc.hidden_size) * 2
    if fp8_projections:
        total -= mc.num_layers * mc.projection_params()
    return total


def gpu_parity(tmp: Path, families: list[str]) -> dict:
    """Greedy tokens of our engine (Triton kernels, CUDA graphs) vs transformers, fp32, random tiny
    models; and of the engine with the fused decode GEMVs, and with prefill graphs, vs the same
    engine without."""
    import transformers

    from engine import LLM, SamplingParams
    from engine.demo import make_random_model

    res = {}
    for fam in families:
        d = make_random_model(tmp / f"tiny-{fam}", fam, hidden_size=256, intermediate_size=512,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=32)
        llm = LLM(str(d), num_kv_blocks=256, max_running=8, fused_decode_gemv=False)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 40, 77)]
        outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
        same = 0
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p], device="cuda")
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
            same += ref == o.token_ids
        res[fam] = f"{same}/{len(prompts)} identical"
        del llm, hf
        fused = LLM(str(d), num_kv_blocks=256, max_running=8, fused_decode_gemv=True)
        got = fused.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        res[f"{fam}_fused_decode_vs_unfused"] = (
            f"{sum(a.token_ids == b.token_ids for a, b in zip(got, outs))}/{len(prompts)} identical")
        del fused
        # Prefill graphs: the prompts one by one (a bucket each) and together (one padded step).
        graphed = LLM(str(d), num_kv_blocks=256, max_running=8, prefill_graph_tokens=256)
        alone = [graphed.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
                 for p in prompts]
        together = graphed.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        replays = graphed.engine.runner.prefill_graphs.replays
        # Prompts arriving while the ones before decode: each gets a step of its own, replayed
        # (the engine's prefill_alone rule).
        eng, arriving = graphed.engine, {}
        for i, p in enumerate(prompts):
            eng.admit(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), f"arriving-{i}")
            for _ in range(3):
                for o in eng.step():
                    arriving.setdefault(o.request_id, []).extend(o.new_token_ids)
        while eng.has_unfinished():
            for o in eng.step():
                arriving.setdefault(o.request_id, []).extend(o.new_token_ids)
        res[f"{fam}_prefill_graphs_vs_eager"] = (
            f"{sum(a.token_ids == b.token_ids for a, b in zip(alone, outs))}/{len(prompts)} identical alone, "
            f"{sum(a.token_ids == b.token_ids for a, b in zip(together, outs))}/{len(prompts)} together, "
            f"{sum(arriving.get(f'arriving-{i}') == o.token_ids for i, o in enumerate(outs))}/{len(prompts)} "
            f"arriving beside decodes (prefill alone: {eng.prefill_alone is not None}), "
            f"{replays} + {eng.runner.prefill_graphs.replays - replays} graph replays")
        del graphed
        torch.cuda.empty_cache()
    return res


def fp8_parity(tmp: Path) -> dict:
    """The FP8 paths that only the GPU runs, against the engine without them, greedy tokens of a
    random tiny Llama in bf16 (CUDA graphs; prompts of 5-77 tokens, and one of 600 so a step
    passes the deferred scales' row limit): FP8 weights with deferred scales
    (TANDEM_FP8_DEFERRED_SCALES=1) vs without (the default), and an FP8 cache with the decode
    kernel's two tunings each at every batch (FP8_WIDE_TUNING, the warp-split kernel full batches
    take, vs FP8_TUNING). Differences are summation order and one rounding, so most tokens agree.
    And that cache stored head-major (kv_cache_layout "hnd": the same kernels on the same values,
    identical tokens expected), and every decode graph kept untimed (TANDEM_TIMED_BUCKETS=0)
    against the timed buckets (a batch that replays a larger graph may meet another GEMM kernel:
    rounding). And decode steps with rotary and the K/V store inside the decode kernel
    (TANDEM_FUSED_ROTARY=1) against the default, on a bf16 and an FP8 cache (the same rotation,
    store and loop: identical tokens expected)."""
    from engine import LLM, SamplingParams
    from engine.attention import FUSED_ROTARY_ENV
    from engine.cuda_graphs import TIMED_BUCKETS_ENV
    from engine.demo import make_random_model
    from engine.quant.fp8 import DEFERRED_SCALES_ENV
    from tandem_kernels.decode_attention import FP8_TUNING, FP8_WIDE_TUNING, TUNING_ENV

    d = make_random_model(tmp / "tiny-fp8", "llama", hidden_size=256, intermediate_size=512,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 40, 77, 600)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def tokens(env: dict[str, str], **kw) -> list[list[int]]:
        os.environ.update(env)
        try:
            llm = LLM(str(d), dtype="bfloat16", num_kv_blocks=512, max_running=8, **kw)
            out = [o.token_ids for o in llm.generate(prompts, params)]
            del llm
            torch.cuda.empty_cache()
            return out
        finally:
            for k in env:
                os.environ.pop(k, None)

    def agree(a: list[list[int]], b: list[list[int]]) -> str:
        same = sum(x == y for x, y in zip(a, b))
        first = sum(x[0] == y[0] for x, y in zip(a, b))
        return f"{same}/{len(a)} identical, {first}/{len(a)} first tokens"

    scaled = tokens({}, quantization="fp8")
    deferred = tokens({DEFERRED_SCALES_ENV: "1"}, quantization="fp8")
    # Each tuning at every batch: the full batches' warp-split kernel against the 2-D tile.
    wide = {TUNING_ENV: json.dumps(dataclasses.asdict(FP8_WIDE_TUNING))}
    plain_kv = tokens({TUNING_ENV: json.dumps(dataclasses.asdict(FP8_TUNING))}, kv_cache_dtype="fp8")
    split_kv = tokens(wide, kv_cache_dtype="fp8")
    # The same kernels on a head-major cache read the same values: identical tokens expected.
    head_major = tokens(wide, kv_cache_dtype="fp8", kv_cache_layout="hnd")
    # Every decode graph kept, untimed, against the timed buckets (a batch may replay a larger graph,
    # whose GEMMs may round differently).
    untimed = tokens({TIMED_BUCKETS_ENV: "0", **wide}, kv_cache_dtype="fp8")
    fused_kv = tokens({FUSED_ROTARY_ENV: "1", **wide}, kv_cache_dtype="fp8")
    bf16, fused_bf16 = tokens({}), tokens({FUSED_ROTARY_ENV: "1"})
    return {"fp8_deferred_vs_scaled": agree(deferred, scaled), "fp8kv_warp_split_vs_2d_tile": agree(split_kv, plain_kv),
            "fp8kv_head_major_vs_default": agree(head_major, split_kv),
            "fp8kv_untimed_vs_timed_buckets": agree(untimed, split_kv),
            "fp8kv_fused_rotary_vs_default": agree(fused_kv, split_kv),
            "bf16_fused_rotary_vs_default": agree(fused_bf16, bf16),
            "varied": len({t for o in deferred for t in o})}


def decode_b1(model_dir: Path, cfg: dict, ceil: dict, fused: bool | None = None, batch: int = 1,
              prompt_len: int = 128, quantization: str | None = None) -> dict:
    """Decode time per step at `batch` sequences (`prompt_len`-token prompts, 200 timed steps
    after 5) against the weight-read floor (every weight read once a step; the KV the step
    reads, under 1% of it at 128 tokens, is left out: `kv_read_fraction` says how much it is);
    `fused`: EngineConfig.fused_decode_gemv (None: the engine's default). Batch 1 reports
    decode_b1_* keys, a larger batch decode_b<N>_*, a prompt other than 128 tokens
    decode_b<N>_ctx<len>_*, FP8 weights (`quantization` "fp8", the floor at their bytes) a
    `_fp8` after that; and the projections the engine ran as fused GEMVs
    (`fused_gemv_projections`, "" for none), and how long the device waited for the host between
    one step's end and the next forward's start (`*_device_idle_ms_per_step`, engine/device_idle.py),
    and the host's time to queue the decode graph (`*_graph_launch_host_us`)."""
    from engine import LLM, SamplingParams
    from engine.config import ModelConfig
    from engine.kv_cache import KVCache
    from tandem_kernels.ops import GEMV_PROJECTIONS

    max_len = max(4096, prompt_len + 512)
    blocks = max(512, -(-max_len // 16)) * batch
    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_running=batch, max_model_len=max_len,
              num_kv_blocks=blocks, fused_decode_gemv=fused, quantization=quantization)
    eng = llm.engine
    for i in range(batch):
        eng.admit(list(range(100 + i, 100 + i + prompt_len)),
                  SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True))
    for _ in range(100):  # the prompts' prefills (one step at these lengths)
        eng.step()
        stats = eng.stats()
        if stats.waiting == 0 and stats.queued_prefill_tokens == 0:
            break
    for _ in range(5):
        eng.step()
    idle_clock = eng.measure_device_idle()
    torch.cuda.synchronize()
    idle_clock.take()  # the gaps before the timed steps
    n = 200
    t = time.perf_counter()
    for _ in range(n):
        eng.step()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t) / n
    idle_s, gaps = idle_clock.take()
    launch_us = _graph_launch_host_us(eng, batch)
    floor = weight_bytes(cfg, quantization == "fp8") / (ceil["copy_GBps"] * 1e9)
    fused_projections = ",".join(p for p in GEMV_PROJECTIONS if p in eng.model.layers[0].fused_decode)
    for request_id in eng.request_ids():
        eng.abort(request_id)
    del llm
    torch.cuda.empty_cache()
    # the KV a step reads halfway through the timed steps (5 untimed before them)
    kv_bytes = batch * (prompt_len + 5 + n // 2) * KVCache.bytes_per_block(ModelConfig.from_dict(cfg), 1, torch.bfloat16)
    name = f"decode_b{batch}" + (f"_ctx{prompt_len}" if prompt_len != 128 else "") + ("_fp8" if quantization else "")
    return {f"{name}_ms_per_{'token' if batch == 1 else 'step'}": round(per_step * 1e3, 3),
            "weight_read_floor_ms": round(floor * 1e3, 3), f"{name}_roofline_fraction": round(floor / per_step, 3),
            "kv_read_fraction": round(kv_bytes / weight_bytes(cfg), 3), "fused_gemv_projections": fused_projections,
            f"{name}_device_idle_ms_per_step": round(idle_s * 1e3 / max(gaps, 1), 4),
            f"{name}_graph_launch_host_us": launch_us}


def _graph_launch_host_us(eng, batch: int, reps: int = 50) -> float | None:
    """The host's time to queue one replay of the decode graph at `batch` rows (µs, median of
    `reps`, the device drained before each): what a held launch adds after its wake-up. The
    replays rewrite the last staged step's K/V slots with the same values. None without graphs."""
    graphs = eng.runner.graphs
    bucket = graphs.bucket(batch) if graphs is not None else None
    if bucket is None or bucket not in graphs.graphs:
        return None
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        graphs.graphs[bucket].replay()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return round(sorted(times)[reps // 2] * 1e6, 1)


def prefill(model_dir: Path, cfg: dict, ceil: dict, tokens: int = 8192) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_running=4, max_model_len=16384,
              max_batched_tokens=tokens, num_kv_blocks=4096, cuda_graphs=False)
    eng = llm.engine
    times = []
    for i in range(4):
        prompt = torch.randint(0, 128000, (tokens + 1,)).tolist()
        request = eng.admit(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()  # exactly `tokens` tokens: the budget cuts the 8193-token prompt there
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        eng.abort(request.request_id)
    dt = sorted(times)[len(times) // 2]
    mc = eng.model_config
    linear = 2 * (mc.num_params() - mc.vocab_size * mc.hidden_size - mc.vocab_size * mc.hidden_size) * tokens
    attn = 2 * 2 * mc.num_layers * mc.num_heads * mc.head_dim * tokens * tokens / 2  # causal QK^T and PV
    flops = linear + attn
    del llm
    torch.cuda.empty_cache()
    return {"prefill_tokens": tokens, "prefill_ms": round(dt * 1e3, 2), "prefill_TFLOPs": round(flops / dt / 1e12, 1),
            "prefill_mfu": round(flops / dt / 1e12 / ceil["matmul_bf16_TFLOPs"], 3)}


def offline(model_dir: Path, num_prompts: int, in_len: int, out_len: int, kv: str = "auto",
            max_running: int = 384, budget_s: float | None = None, overlap: bool | None = None,
            quantization: str | None = None, kv_layout: str = "nhd") -> dict:
    """Offline throughput. With `budget_s`, a pilot of 64 prompts first estimates the rate and the
    prompt count is cut (never raised) so the main run fits the budget; the count used is reported."""
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), load_format="dummy", dtype="bfloat16", max_running=max_running,
              max_model_len=in_len + out_len + 16, max_batched_tokens=8192, kv_cache_dtype=kv,
              enable_prefix_cache=False, overlap_schedule=overlap, quantization=quantization,
              kv_cache_layout=kv_layout)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 128000, (num_prompts, in_len), generator=g).tolist()
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], params.replace(max_tokens=8))
    pilot = None
    if budget_s is not None and num_prompts > 64:
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts[:64], params)
        pilot = 64 * out_len / (time.perf_counter() - t)
        fit = int(budget_s * pilot * 1.3 / out_len)  # larger batches run faster than the pilot
        num_prompts = max(64, min(num_prompts, fit))
        prompts = prompts[:num_prompts]
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    n_out = sum(len(o.token_ids) for o in outs)
    res = {"prompts": num_prompts, "input_len": in_len, "output_len": out_len, "seconds": round(dt, 2),
           "output_tok_s": round(n_out / dt, 1), "kv_blocks": llm.engine.num_total_blocks,
           "preemptions": llm.engine.stats().num_preemptions, "pilot_tok_s": pilot,
           "overlap": llm.engine.overlap, "max_running": llm.engine.max_running, "kv_cache_layout": kv_layout}
    runner = llm.engine.runner
    if runner is not None and runner.graphs is not None:  # the decode graphs kept, each one's replay time
        res["decode_graph_buckets"] = runner.graphs.buckets
        res["decode_graph_replay_ms"] = {str(b): round(t, 3) for b, t in sorted(runner.graphs.replay_ms.items())}
    if runner is not None and runner.logits_buckets:
        res["logits_buckets"] = runner.logits_buckets
    del llm
    torch.cuda.empty_cache()
    return res


def transformers_offline(model_dir: Path, in_len: int, out_len: int, batches: list[int]) -> dict:
    """transformers' `generate` on one static batch of each size (prompts of the offline workload's
    shape, `out_len` new tokens each). It runs a workload batch after batch, each like this one,
    so its throughput on the whole workload is at most this (its later steps, over a longer
    cache, only get slower). `output_tok_s` is the best batch size's figure."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):  # random init on the GPU: on the host it takes minutes
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 128000, (max(batches), in_len), generator=g)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    by_batch: dict[str, float | str] = {}
    with torch.no_grad():
        x = prompts[:2].cuda()
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, **kw)
        for batch in batches:
            try:
                x = prompts[:batch].cuda()
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=out_len,
                                     min_new_tokens=out_len, **kw)
                torch.cuda.synchronize()
                by_batch[str(batch)] = round((out.shape[1] - in_len) * out.shape[0] / (time.perf_counter() - t), 1)
            except torch.cuda.OutOfMemoryError as exc:
                by_batch[str(batch)] = f"out of memory: {str(exc)[:120]}"
            torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    best = max((v, int(k)) for k, v in by_batch.items() if isinstance(v, float))
    return {"input_len": in_len, "output_len": out_len, "output_tok_s_by_batch": by_batch,
            "output_tok_s": best[0], "best_batch": best[1]}


def services(model_dir: Path, num_prompts: int, in_len: int, out_len: int, log_dir: Path, max_running: int = 384,
             kv_transport: str = "cuda_ipc") -> dict:
    """The offline workload through gateway + prefill + decode processes on the one GPU, against
    the offline engine on the same prompts in this run. KV moves through CUDA IPC, the transport
    `tandem up` picks on a GPU host (kv_transport="zmq": through host memory over ZMQ).
    Each part runs in its own process, as `tandem up` starts them; this process is the client.
    Needs pyzmq and the gRPC health/reflection packages (carry them as wheels)."""
    import asyncio

    from entrypoints.cluster import Cluster, ClusterProcess, free_port, worker_process
    from tandem import AsyncClient

    ctx = in_len + out_len + 16
    common = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", str(ctx), "--no-prefix-cache",
              "--kv-transport", kv_transport]
    log_dir.mkdir(parents=True, exist_ok=True)
    p = worker_process("prefill0", "prefill", model_dir, log_dir, [*common, "--num-kv-blocks", "4096", "--max-running",
                                                                   "64", "--max-batched-tokens", "8192"])
    d = worker_process("decode1", "decode", model_dir, log_dir, [*common, "--num-kv-blocks", "36000", "--max-running",
                                                                  str(max_running)])
    cluster = Cluster([p, d])
    cluster.start(timeout=600)
    port = free_port()
    target = f"127.0.0.1:{port}"
    try:
        cluster.add(ClusterProcess("gateway", "gateway", [
            "--port", str(port), "--model", str(model_dir), "--load-format", "dummy", "--max-context", str(ctx),
            "--max-inflight-per-decode", str(max_running), "--prefill", p.address, "--decode", d.address],
            port, log_path=log_dir / "gateway.log"), timeout=120)
        g = torch.Generator().manual_seed(0)
        vocab = min(128000, json.loads((model_dir / "config.json").read_text())["vocab_size"] - 2)
        prompts = torch.randint(0, vocab, (num_prompts, in_len), generator=g).tolist()

        async def run() -> tuple[int, float]:
            async with AsyncClient(target, timeout=3600) as client:
                for attempt in range(100):  # until the gateway has seen both workers
                    try:
                        await client.generate(prompts[0], max_tokens=4, temperature=0.0, ignore_eos=True)
                        break
                    except Exception:
                        if attempt == 99:
                            raise
                        await asyncio.sleep(0.5)
                t = time.perf_counter()
                outs = await asyncio.gather(*(client.generate(x, max_tokens=out_len, temperature=0.0, ignore_eos=True)
                                              for x in prompts))
                return sum(len(o.token_ids) for o in outs), time.perf_counter() - t

        n, dt = asyncio.run(run())
    finally:
        cluster.stop(30)
    return {"prompts": num_prompts, "input_len": in_len, "output_len": out_len, "seconds": round(dt, 2),
            "output_tok_s": round(n / dt, 1), "gateway": "own process", "kv_transport": kv_transport}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(REPO / "bench/results/h200.json"))
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--in-len", type=int, default=1024)
    p.add_argument("--out-len", type=int, default=1024)
    p.add_argument("--hf-prompts", type=int, default=64, help="prompts of ours_on_hf_subset")
    p.add_argument("--hf-batches", default="64,256", help="transformers' static batch sizes to try")
    p.add_argument("--hf-out-len", type=int, default=256)
    p.add_argument("--offline-budget-s", type=float, default=None, help="cut the prompt count to fit this")
    p.add_argument("--kernel-timeout-s", type=float, default=150.0)
    p.add_argument("--services-prompts", type=int, default=256)
    p.add_argument("--parity-families", default="llama,qwen3,glm4")
    p.add_argument("--log-dir", default=None, help="keep the services section's worker logs here")
    p.add_argument("--skip", default="", help="comma-separated sections to skip")
    p.add_argument("--only", default="", help="comma-separated sections to run")
    a = p.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    only = set(filter(None, a.only.split(",")))
    want = lambda s: (not only or s in only) and s not in skip  # noqa: E731
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def section(name, fn):
        if not want(name):
            return
        log("section", name)
        t = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # record and go on: one broken section must not hide the others
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        res.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t, 1)
        log(name, json.dumps(res[name])[:800])
        out.write_text(json.dumps(res, indent=1))

    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        model_dir = write_model(tmp / "llama31-8b", LLAMA31_8B)
        section("ceilings", ceilings)
        ceil = res.get("ceilings") or {"copy_GBps": 4300.0, "matmul_bf16_TFLOPs": 790.0}
        if "error" in ceil:
            ceil = {"copy_GBps": 4300.0, "matmul_bf16_TFLOPs": 790.0}
        section("kernels", lambda: json.loads(subprocess.run(
            [sys.executable, str(REPO / "bench/kernel_bench.py")], capture_output=True, text=True,
            timeout=a.kernel_timeout_s).stdout))
        section("gpu_parity", lambda: gpu_parity(tmp, a.parity_families.split(",")))
        section("fp8_parity", lambda: fp8_parity(tmp))
        section("decode_b1", lambda: decode_b1(model_dir, LLAMA31_8B, ceil))
        section("decode_b1_fused", lambda: decode_b1(model_dir, LLAMA31_8B, ceil, fused=True))
        section("prefill", lambda: prefill(model_dir, LLAMA31_8B, ceil))
        section("offline", lambda: offline(model_dir, a.num_prompts, a.in_len, a.out_len, budget_s=a.offline_budget_s))
        section("transformers", lambda: transformers_offline(model_dir, a.in_len, a.hf_out_len,
                                                             [int(x) for x in a.hf_batches.split(",")]))
        section("ours_on_hf_subset", lambda: offline(model_dir, a.hf_prompts, a.in_len, a.hf_out_len))
        section("services", lambda: services(model_dir, a.services_prompts, a.in_len, a.out_len,
                                             Path(a.log_dir) if a.log_dir else tmp / "svc-workers"))
        section("services_zmq", lambda: services(model_dir, a.services_prompts, a.in_len, a.out_len,
                                                 (Path(a.log_dir) if a.log_dir else tmp) / "svc-zmq",
                                                 kv_transport="zmq"))
        section("offline_services_subset", lambda: offline(model_dir, a.services_prompts, a.in_len, a.out_len))
        section("offline_sync_subset", lambda: offline(model_dir, a.services_prompts, a.in_len, a.out_len, overlap=False))
        section("fp8_offline", lambda: offline(model_dir, a.num_prompts, a.in_len, a.out_len, kv="fp8", budget_s=a.offline_budget_s))

    summary = {
        "decode_b1_roofline_fraction": res.get("decode_b1", {}).get("decode_b1_roofline_fraction"),
        "decode_attention_bw_fraction": res.get("kernels", {}).get("speed", {}).get("decode_attention_bf16", {}).get("frac_of_copy"),
        "decode_b1_fused_roofline_fraction": res.get("decode_b1_fused", {}).get("decode_b1_roofline_fraction"),
        "prefill_mfu": res.get("prefill", {}).get("prefill_mfu"),
        "offline_output_tok_s": res.get("offline", {}).get("output_tok_s"),
        "fp8_kv_offline_output_tok_s": res.get("fp8_offline", {}).get("output_tok_s"),
    }
    # Ours on the offline workload over transformers' best static batch of that workload's prompts
    # (its throughput on the whole workload is at most that); and both on the same 64 prompts.
    hf = res.get("transformers", {}).get("output_tok_s")
    ours = summary["offline_output_tok_s"]
    summary["vs_transformers"] = round(ours / hf, 2) if hf and ours else None
    ours_sub = res.get("ours_on_hf_subset", {}).get("output_tok_s")
    hf64 = res.get("transformers", {}).get("output_tok_s_by_batch", {}).get(str(a.hf_prompts))
    summary["vs_transformers_same_prompts"] = round(ours_sub / hf64, 2) if isinstance(hf64, float) and ours_sub else None
    svc = res.get("services", {}).get("output_tok_s")
    off = res.get("offline_services_subset", {}).get("output_tok_s")
    summary["services_vs_offline"] = round(svc / off, 2) if svc and off else None
    zmq = res.get("services_zmq", {}).get("output_tok_s")
    summary["services_zmq_vs_offline"] = round(zmq / off, 2) if zmq and off else None
    sync = res.get("offline_sync_subset", {}).get("output_tok_s")
    summary["overlap_speedup"] = round(off / sync, 3) if off and sync else None  # same prompts, same run
    res.update(summary)
    out.write_text(json.dumps(res, indent=1))
    log("SUMMARY", json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

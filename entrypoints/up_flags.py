"""`tandem up`'s flags and their checks: `parse_args` returns the namespace entrypoints/launcher.py
starts the cluster from, or exits with argparse's usage error naming the flag (a value out of
range, flags that do not go together, a TLS file that is not there). The key and token flags are
read here too: `api_key` holds the key itself and `auth_token` the cluster token (read from
--auth-token-file, else generated)."""
from __future__ import annotations

import argparse
from pathlib import Path

from engine.config import MAX_PREFILL_GRAPH_TOKENS
from entrypoints.cluster import free_port, keep_off
from entrypoints.placement import PREFILL_MEMORY_RATIO, SHARED_PREFILL_MAX_MODEL_LEN
from tandem.security import generate_token, load_api_key, load_token
from worker.config import KV_PUSH_MODES, PREFILL_GRAPH_TOKENS, HelpFormatter
from worker.gpu_turn import DEFAULT_HOLD, HOLD_MODES, MAX_WAIT_S, MPS_MAX_BATCH, check_max_batch, check_max_wait_ms


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem up", description="Start a local Tandem cluster and supervise it.",
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default=None,
                   help="model directory or Hugging Face repo id (default: the built-in demo model)")
    p.add_argument("--revision", default=None, help="the repo id's revision: branch, tag or commit (default: main)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"], help="dummy: random weights")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's)")
    p.add_argument("--prefill-workers", type=int, default=1, help="prefill workers (without --colocated)")
    p.add_argument("--decode-workers", type=int, default=1, help="decode workers (role-both ones with --colocated)")
    p.add_argument("--colocated", action="store_true",
                   help="run --decode-workers role-both workers, no disaggregation (default: disaggregated)")
    p.add_argument("--share-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="workers on one device keep one copy of the weights (the first loads them, the others "
                        "map them; a prefill worker's memory share then holds none, a decode worker's does): "
                        "more KV for the decode worker where prefill and decode share a GPU (needs --tp 1; "
                        "default: on where workers share a GPU that can share memory between processes, with --tp 1; "
                        "off on the CPU)")
    p.add_argument("--tp", "--tensor-parallel-size", type=int, default=1, dest="tp",
                   help="tensor-parallel ranks per worker (one GPU each on CUDA; each worker starts its own ranks)")
    p.add_argument("--gpus", default=None,
                   help="GPUs to use, e.g. 0,1 (default: every visible one; an empty string: the CPU)")
    p.add_argument("--gpu-memory-fraction", "--gpu-memory-utilization", type=float, default=0.90,
                   dest="gpu_memory_fraction",
                   help="share of each GPU's memory for the whole cluster on it (split among the workers sharing it)")
    p.add_argument("--prefill-memory-ratio", type=float, default=None,
                   help="where prefill and decode workers share a GPU: a prefill worker's memory against a decode "
                        "worker's (default: what the prefill worker needs — weights, one request of "
                        "--max-model-len, a step — and the rest to the decode worker, whose KV holds the running "
                        f"sequences; {PREFILL_MEMORY_RATIO:g} where the GPU's size cannot be read)")
    p.add_argument("--kv-transport", default="auto", choices=["auto", "zmq", "nccl", "cuda_ipc"],
                   help="prefill -> decode KV transport (auto: cuda_ipc on shared GPUs, nccl across GPUs, "
                        "zmq on the CPU)")
    p.add_argument("--kv-push", choices=("auto", *KV_PUSH_MODES), default="auto", dest="kv_push",
                   help="when prefill workers push a prompt's KV: layer = each layer as soon as it is computed "
                        "(overlaps the transfer with the forward), step = every layer once the forward has run "
                        "(one burst, no decode-side copies between the prefill's layers); auto = step where a "
                        "prefill worker shares its GPU with a decode worker, else layer")
    p.add_argument("--gpu-turn", action=argparse.BooleanOptionalAction, default=True, dest="gpu_turn",
                   help="where prefill and decode workers share a GPU, a decode worker waits for the prefill "
                        "worker's step, up to --gpu-turn-max-wait-ms (worker.gpu_turn); --no-gpu-turn lets it step "
                        "meanwhile (the GPU then time-slices between them, or under MPS runs both)")
    p.add_argument("--mps", action=argparse.BooleanOptionalAction, default=None,
                   help="run the prefill and decode workers that share a GPU under CUDA MPS: turns while the "
                        f"decode batch is small (--gpu-turn-max-batch {MPS_MAX_BATCH}), kernels side by side above "
                        "it: higher rates within the SLO at the turns' TTFT (entrypoints/mps.py; tandem up starts "
                        "its own MPS daemon per GPU). Default: where nvidia-cuda-mps-control is on PATH, --tp is 1 "
                        "and no MPS daemon of yours is in effect, else turns; --mps: an error where it cannot be had; "
                        "--no-mps: turns")
    p.add_argument("--gpu-turn-max-wait-ms", type=float, default=MAX_WAIT_S * 1000,
                   help="the longest a decode worker's step waits for a prefill worker's step on their GPU")
    p.add_argument("--gpu-turn-max-batch", type=int, default=None,
                   help="a decode worker takes turns (waits, holds) only while it runs at most this many sequences: "
                        "under MPS, prompts go first at low load and run beside the decode steps under load "
                        f"(default: {MPS_MAX_BATCH} under MPS, else no bound)")
    p.add_argument("--gpu-turn-hold", choices=HOLD_MODES, default=DEFAULT_HOLD,
                   help="when a decode worker sharing a GPU queues a step only once the one before has finished "
                        "and no prefill step holds the GPU: always (prompts go first: lower TTFT for ~0.3 ms "
                        "more per decode step on an H200), reserving (only while a prefill for it is near), off")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway binds")
    p.add_argument("--port", type=int, default=50051, help="the gateway's gRPC port")
    p.add_argument("--redis-url", default=None, help="share the prefix index through Redis (default: embedded)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks per worker (default: sized from its memory share)")
    p.add_argument("--max-running", "--max-num-seqs", type=int, default=None, dest="max_running",
                   help="running sequences per worker (default: from its KV pool and the context)")
    p.add_argument("--max-batched-tokens", "--max-num-batched-tokens", type=int, default=None,
                   dest="max_batched_tokens", help="per-step token budget of each worker (default: 4096)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings)")
    p.add_argument("--prefill-max-model-len", type=int, default=None,
                   help="every prefill worker's longest prompt: the decode worker prefills longer ones itself "
                        f"(default: {SHARED_PREFILL_MAX_MODEL_LEN} where a prefill worker shares a GPU with a decode "
                        "worker and the context is longer, so its memory share holds that, not one request of the "
                        "model's whole context; elsewhere --max-model-len)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="fp8: twice the KV tokens")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="fp8: every worker quantizes the weights to e4m3 at load (per-channel scales; half the "
                        "weight memory, faster decode). FP8 checkpoints load as FP8 without it")
    p.add_argument("--block-size", type=int, default=None, help="tokens per KV block (default: 16)")
    p.add_argument("--enable-prefix-cache", dest="enable_prefix_cache", action="store_true", default=True,
                   help="reuse the KV of shared prompt prefixes (default: on)")
    p.add_argument("--no-prefix-cache", dest="enable_prefix_cache", action="store_false",
                   help="disable the prefix cache (default: enabled)")
    p.add_argument("--swap-space-gb", "--swap-space", type=float, default=None, dest="swap_space_gb",
                   help="GiB of host memory per worker for preempted requests' KV (default: 1)")
    p.add_argument("--prefill-graph-tokens", type=int, default=None,
                   help="workers that prefill replay CUDA graphs for prefill steps of up to this many tokens "
                        f"(0: none; default: the workers', {PREFILL_GRAPH_TOKENS})")
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="every child serves Prometheus metrics on its own port (listed in the banner)")
    p.add_argument("--metrics-port", type=int, default=None, help="the gateway's Prometheus port (default: a free one)")
    p.add_argument("--http-port", type=int, default=None,
                   help="the gateway's OpenAI-compatible HTTP port (0: a free one; default: off)")
    p.add_argument("--routing", default=None, choices=["cache_aware", "round_robin", "load"],
                   help="prefill routing policy (default: cache_aware)")
    p.add_argument("--stream-interval", type=int, default=None,
                   help="new tokens per chunk of a stream that does not ask for its own (default: the gateway's, 1)")
    p.add_argument("--local-prefill-tokens", type=int, default=None,
                   help="prefill on the decode worker when it lacks fewer tokens than this (default: the gateway's)")
    p.add_argument("--reserve-before-prefill", action="store_true",
                   help="the gateway sends a prompt's Prefill only once the decode worker reserved its KV blocks "
                        "(default: both at once)")
    p.add_argument("--log-dir", default=None, help="write each child's log here (default: inherit the terminal)")
    p.add_argument("--auth-token-file", default=None,
                   help="the cluster token every process requires on its internal RPCs and KV handshake "
                        "(default: a fresh random one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the public gRPC and HTTP API; @FILE reads it "
                        "(default: $TANDEM_API_KEY; none: open)")
    p.add_argument("--tls-cert", default=None,
                   help="PEM certificate every gRPC port (and the HTTP port) serves TLS with; it must name the "
                        "hosts clients dial (e.g. 127.0.0.1). With --tls-key and --tls-ca")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA that signed --tls-cert (internal clients verify with it)")
    p.add_argument("--no-agent", action="store_true", help="do not start the infra agent (tandem agent)")
    p.add_argument("--agent-args", default="", help="extra flags for the agent, e.g. \"--dry-run --config a.json\"")
    p.add_argument("--demo-request", action="store_true",
                   help="send one request once healthy and print it (default: off)")
    p.add_argument("--exit-after-demo", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--restart-backoff", type=float, default=0.5, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    keep_off(a.port, a.metrics_port, a.http_port)  # the gateway binds them last, after every drawn port
    if a.http_port == 0:  # a fixed port, so a restarted gateway keeps its address
        a.http_port = free_port()
    for name in ("prefill_workers", "decode_workers", "tp"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 < a.gpu_memory_fraction <= 1:
        p.error(f"--gpu-memory-fraction must be in (0, 1], got {a.gpu_memory_fraction}")
    if a.quantization and a.tp > 1:
        p.error(f"--quantization {a.quantization}: FP8 weights need the whole model in one process, so --tp 1")
    if a.share_weights and a.tp > 1:
        p.error("--share-weights: the workers' weights are shared whole, so it needs --tp 1")
    if a.prefill_graph_tokens is not None and not 0 <= a.prefill_graph_tokens <= MAX_PREFILL_GRAPH_TOKENS:
        p.error(f"--prefill-graph-tokens must be in [0, {MAX_PREFILL_GRAPH_TOKENS}], got {a.prefill_graph_tokens}")
    for flag in ("max_model_len", "prefill_max_model_len"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(a, flag)}")
    if a.prefill_max_model_len and a.max_model_len and a.prefill_max_model_len > a.max_model_len:
        p.error(f"--prefill-max-model-len {a.prefill_max_model_len}: must be at most --max-model-len {a.max_model_len}")
    if a.mps and a.tp > 1:
        p.error("--mps: an MPS client runs on one GPU, so it needs --tp 1")
    try:
        check_max_wait_ms(a.gpu_turn_max_wait_ms, "--gpu-turn-max-wait-ms")
        check_max_batch(a.gpu_turn_max_batch, "--gpu-turn-max-batch")
    except ValueError as exc:
        p.error(str(exc))
    if len({bool(a.tls_cert), bool(a.tls_key), bool(a.tls_ca)}) > 1:
        p.error("--tls-cert: give --tls-cert, --tls-key and --tls-ca together (or none)")
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(a, flag) and not Path(getattr(a, flag)).is_file():
            p.error(f"--{flag.replace('_', '-')}: no such file {getattr(a, flag)!r}")
    try:
        a.api_key = load_api_key(a.api_key)
        a.auth_token = load_token(a.auth_token_file) if a.auth_token_file else generate_token()
    except ValueError as exc:
        p.error(str(exc))
    return a

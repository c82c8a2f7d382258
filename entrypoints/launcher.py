"""`tandem up`: start a gateway and its workers as separate OS processes on loopback, and supervise them.

Order: the flags are checked (entrypoints/up_flags.py) and the gateway's (and metrics) ports are
checked free before anything starts (a busy one is a one-line error naming the flag); `--model` is
resolved once
(a directory or a Hugging Face repo id, tandem/hub.py) and every child gets that directory; the
workers are placed on the visible GPUs (entrypoints/placement.py: CUDA_VISIBLE_DEVICES, its
memory share and the KV transport per worker) and started; once every worker is healthy (its
ready file names its own pid, and it listens on the port it was given) the gateway starts, its
per-decode-worker request cap set to what the workers run. The banner lists each worker's GPU,
memory share, KV blocks (and the tokens they hold), max running and metrics port, then
"Tandem is up".

Security (tandem/security.py): a cluster token is generated (or read from --auth-token-file) and
handed to every child in its environment, so every internal RPC, the supervisor socket and the KV
handshake require it; --api-key reaches the gateway the same way (never on a command line);
--tls-cert/--tls-key/--tls-ca make every gRPC port of the cluster serve TLS and every internal
client verify it. The token is also written, readable by its owner only, to the run directory
printed in the banner (for `tandem agent --auth-token-file` and admin tools).

Children run as `python -m entrypoints <role> ...` so `ps` shows each one's role; `entrypoints.cluster`
starts them, restarts a child that crashes (with backoff; after more than MAX_RESTARTS exits in
RESTART_WINDOW_S it stops the cluster and exits non-zero with the cause and the child's log
tail), and on Ctrl-C / SIGTERM stops the gateway first, then the workers.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import shlex
import shutil
import signal
import sys
import tempfile
from collections import Counter
from pathlib import Path

from entrypoints.cluster import (HEALTH_TIMEOUT_S, Cluster, ClusterError, ClusterProcess, free_port,
                                 port_in_use)
from entrypoints.mps import (MpsDaemon, MpsError, auto_unavailable, banner_row, restart_fault_sharers, start_daemons,
                             stop_daemons, turns_rows)
from entrypoints.placement import (PREFILL_MEMORY_RATIO, SHARED_PREFILL_MAX_MODEL_LEN, Placement, PlacementError,
                                   WorkerPlacement, parse_gpus, physical_gpus, place, visible_gpu_count)
from entrypoints.supervisor import SupervisorSocket, agent_process
from entrypoints.up_flags import parse_args
from tandem.security import API_KEY_ENV, write_token_file
from worker.config import PREFILL_GRAPH_TOKENS
from worker.gpu_turn import MPS_MAX_BATCH, create_turn_file

logger = logging.getLogger("tandem.up")


def placement_for(a: argparse.Namespace, visible: int | None = None, model: str | None = None) -> Placement:
    """Where each worker of `a` runs (PlacementError naming the flag when it cannot). Without
    --prefill-memory-ratio, a prefill worker sharing a GPU with a decode worker gets what it
    needs of it when `model` and the GPU's size are known (entrypoints.memory_split), else
    PREFILL_MEMORY_RATIO of a decode worker's share."""
    if a.prefill_memory_ratio is not None:
        return _placed(a, visible, a.prefill_memory_ratio)
    placement = _placed(a, visible, PREFILL_MEMORY_RATIO)
    if model is None:
        return placement
    from entrypoints.memory_split import shared_gpu_ratio

    ratio = shared_gpu_ratio(placement, model, physical_gpus, max_model_len=shared_prefill_max_model_len(a, model),
                             **_sizing(a, placement))
    return placement if ratio is None else _placed(a, visible, ratio)


def shared_prefill_max_model_len(a: argparse.Namespace, model: str) -> int:
    """The context of a prefill worker sharing a GPU with a decode worker: --prefill-max-model-len,
    else the cluster's (--max-model-len, else the model's) capped at SHARED_PREFILL_MAX_MODEL_LEN.
    A prompt longer than every prefill worker's context is prefilled by its decode worker
    (gateway.placement LONG_PROMPT), so the prefill worker's memory share need not hold one
    request of the model's whole context."""
    if a.prefill_max_model_len is not None:
        return a.prefill_max_model_len
    return min(cluster_context(a, model) or SHARED_PREFILL_MAX_MODEL_LEN, SHARED_PREFILL_MAX_MODEL_LEN)


def prefill_max_model_len(a: argparse.Namespace, placement: Placement, name: str, model: str) -> int | None:
    """The --max-model-len of prefill worker `name` where it differs from the cluster's:
    --prefill-max-model-len for every prefill worker, else shared_prefill_max_model_len for one
    sharing a GPU with a decode worker; None: the cluster's."""
    if a.prefill_max_model_len is None and not placement.gpu_partners(name):
        return None
    own = shared_prefill_max_model_len(a, model)
    return None if own == cluster_context(a, model) else own


def cluster_context(a: argparse.Namespace, model: str) -> int | None:
    """The context every decode worker and the gateway take: --max-model-len capped at `model`'s
    max_position_embeddings (2048 where its config.json names none, as engine.config reads it);
    --max-model-len alone where the config cannot be read (None without it)."""
    try:
        longest = int(model_config(model).get("max_position_embeddings", 2048))
    except (OSError, ValueError, TypeError):
        return a.max_model_len
    return min(a.max_model_len or longest, longest)


def fitted_max_model_len(a: argparse.Namespace, model: str, visible: int | None = None) -> int | None:
    """Without --max-model-len: the context every worker and the gateway take so that a prefill
    and a decode worker sharing a GPU can each hold one request of it (entrypoints.memory_split.
    fitting_max_model_len); None when the model's own context fits, or nothing tells."""
    if a.max_model_len is not None:
        return None
    from entrypoints.memory_split import fitting_max_model_len

    placement = _placed(a, visible, a.prefill_memory_ratio or PREFILL_MEMORY_RATIO)
    return fitting_max_model_len(placement, model, physical_gpus,
                                 prefill_max_model_len=shared_prefill_max_model_len(a, model), **_sizing(a, placement))


def _placed(a: argparse.Namespace, visible: int | None, ratio: float) -> Placement:
    """`a`'s workers placed on its GPUs (of `visible`; None: those this process sees) with a
    prefill worker's memory at `ratio` of a decode worker's."""
    gpus = parse_gpus(a.gpus, visible_gpu_count() if visible is None else visible)
    return place(gpus, prefill=a.prefill_workers, decode=a.decode_workers, tp=a.tp, colocated=a.colocated,
                 memory_fraction=a.gpu_memory_fraction, kv_transport=a.kv_transport, prefill_memory_ratio=ratio)


def shares_weights(a: argparse.Namespace, placement: Placement) -> bool:
    """Whether the workers of `placement` that share a device keep one copy of the weights:
    --share-weights / --no-share-weights, else (the default) where two or more workers share a
    GPU that can share memory between processes and each holds whole weights (--tp 1). On the CPU
    only when asked."""
    if a.share_weights is not None:
        return a.share_weights
    per_gpu = Counter(g for w in placement.workers for g in w.gpus)
    shared = [g for g, n in per_gpu.items() if n > 1]
    return a.tp == 1 and bool(shared) and all(gpu_can_share_memory(g) for g in shared)


@functools.lru_cache(maxsize=None)
def gpu_can_share_memory(gpu: int) -> bool:
    """Whether GPU `gpu` (an index this process sees) can hold memory other processes map
    (engine.cuda_vmm.can_share); where it cannot, the default keeps a copy of the weights each."""
    from engine.cuda_vmm import can_share

    return can_share(gpu)


def _sizing(a: argparse.Namespace, placement: Placement) -> dict:
    """The flags entrypoints.memory_split sizes a worker's need from, with the workers' defaults."""
    from engine.config import EngineConfig

    return dict(dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype, quantization=a.quantization,
                max_batched_tokens=a.max_batched_tokens or EngineConfig.max_batched_tokens,
                max_running=a.max_running, tp=a.tp, cluster_share=a.gpu_memory_fraction,
                prefill_graph_tokens=PREFILL_GRAPH_TOKENS if a.prefill_graph_tokens is None else a.prefill_graph_tokens,
                shared_weights=shares_weights(a, placement))


def model_config(model: str) -> dict:
    """`model`'s config.json as read once by this process, shared (read it, do not change it);
    OSError / ValueError where it cannot be read."""
    return _read_config(str(Path(model) / "config.json"))


@functools.lru_cache(maxsize=8)
def _read_config(path: str) -> dict:
    return json.loads(Path(path).read_text())


def fp8_checkpoint(model: str) -> bool:
    """Whether `model`'s config.json names an FP8 format the workers load as FP8
    (engine/quant/formats.py); False where it cannot be read or names one they refuse (they say why)."""
    from engine.quant.formats import checkpoint_fp8_format

    try:
        return checkpoint_fp8_format(model_config(model)) is not None
    except (OSError, ValueError):
        return False


def fp8_gpu_error(a: argparse.Namespace, placement: Placement, model: str) -> str | None:
    """The one-line error where FP8 is asked of (--quantization fp8, --kv-cache-dtype fp8, or an
    FP8 checkpoint) a placed GPU that nvidia-smi says is older than compute capability 8.9, before
    any worker starts (each would fail at start-up, and be restarted until the cluster gives up);
    None when every GPU can, or nothing tells (the workers then check for themselves)."""
    from entrypoints.nvidia_smi import compute_capability
    from tandem_kernels.ops import FP8_MIN_CAPABILITY

    asked = [flag for flag, on in (("--quantization fp8", a.quantization == "fp8"),
                                   ("--kv-cache-dtype fp8", a.kv_cache_dtype == "fp8"),
                                   ("the checkpoint (config.json quantization_config)", fp8_checkpoint(model))) if on]
    if not asked:
        return None
    for gpu in sorted({g for w in placement.workers for g in w.gpus}):
        cap = compute_capability(physical_gpus((gpu,)))
        if cap is not None and cap < FP8_MIN_CAPABILITY:
            need = ".".join(map(str, FP8_MIN_CAPABILITY))
            return (f"{' and '.join(asked)}: FP8 (e4m3) needs a GPU of compute capability {need} or newer (Ada, "
                    f"Hopper, Blackwell); GPU {gpu} is {cap[0]}.{cap[1]}. Serve the model in bf16 or fp16 instead")
    return None


def turn_max_batch(a: argparse.Namespace, under_mps: bool) -> int | None:
    """The decode batch up to which a decode worker sharing its GPU takes turns
    (--gpu-turn-max-batch): MPS_MAX_BATCH under MPS unless given, no bound (None) otherwise."""
    if a.gpu_turn_max_batch is not None:
        return a.gpu_turn_max_batch
    return MPS_MAX_BATCH if under_mps else None


def mps_daemons(a: argparse.Namespace, placement: Placement, run_dir: Path,
                log_dir: Path | None) -> tuple[dict[int, MpsDaemon], list[str]]:
    """The MPS daemons the cluster's shared GPUs run under (entrypoints.mps), by GPU, and the
    banner's lines for shared GPUs left without: `--mps` insists (MpsError where it cannot be had),
    `--no-mps` never starts one, neither starts them where `auto_unavailable` finds nothing
    against it (and runs in turns, saying why, where it does or a daemon fails to start)."""
    if a.mps:
        return start_daemons(placement, run_dir, log_dir), []
    if a.mps is False:
        return {}, []
    why = auto_unavailable(placement, a.tp)
    if why is None:
        try:
            return start_daemons(placement, run_dir, log_dir), []
        except MpsError as exc:
            logger.warning("running the workers sharing a GPU in turns, without MPS: %s", exc)
            why = "it did not start; the warning above says why"
    return {}, (turns_rows(placement, why) if why and a.gpu_turn else [])


def build_children(a: argparse.Namespace, model: str, log_dir: Path | None = None,
                   placement: Placement | None = None, ready_dir: Path | None = None,
                   auth_token: str | None = None, mps: dict[int, MpsDaemon] | None = None) -> list[ClusterProcess]:
    """The cluster's processes on fixed free ports (a restarted child keeps its address), the
    gateway last. `placement` None: placed on the GPUs this process sees. With `ready_dir`, each
    worker writes its ready file there (how `tandem up` knows the worker on a port is its own).
    `auth_token`: the cluster token every child gets (in its environment). `mps`: the MPS daemon
    of a GPU (entrypoints.mps), whose workers run under it."""
    mps = mps or {}
    placement = placement or placement_for(a)
    common = ["--model", model, "--load-format", a.load_format]
    if a.dtype:
        common += ["--dtype", a.dtype]
    if a.redis_url:
        common += ["--redis-url", a.redis_url]
    for flag, value in (("--num-kv-blocks", a.num_kv_blocks), ("--max-running", a.max_running),
                        ("--max-batched-tokens", a.max_batched_tokens),
                        ("--block-size", a.block_size), ("--swap-space-gb", a.swap_space_gb),
                        ("--prefill-graph-tokens", a.prefill_graph_tokens)):
        if value is not None:
            common += [flag, str(value)]
    if a.kv_cache_dtype != "auto":
        common += ["--kv-cache-dtype", a.kv_cache_dtype]
    if a.quantization:  # every worker: those sharing a device's weights must agree (engine/shared_weights.py)
        common += ["--quantization", a.quantization]
    if not a.enable_prefix_cache:
        common += ["--no-prefix-cache"]
    if a.tp > 1:  # every worker: prefill and decode workers that exchange KV need the same degree
        common += ["--tp", str(a.tp)]
    tls = ["--tls-cert", a.tls_cert, "--tls-key", a.tls_key] if a.tls_cert else []
    common += tls
    children: list[ClusterProcess] = []

    def child(name: str, role: str, argv: list[str], port: int) -> ClusterProcess:
        w = placement.worker(name) if role != "gateway" else None
        env: dict[str, str] = {}
        if w is not None:
            if w.gpus:
                env["CUDA_VISIBLE_DEVICES"] = physical_gpus(w.visible or w.gpus)
                if w.gpus[0] in mps:  # its GPU by UUID, and the daemon's pipe directory
                    env.update(mps[w.gpus[0]].client_env())
                argv += ["--device", "cuda", "--gpu-memory-fraction", f"{w.memory_fraction:g}"]
            if a.metrics:
                argv += ["--metrics-port", str(free_port())]
            if ready_dir is not None:
                argv += ["--ready-file", str(ready_dir / f"{name}.ready.json")]
        if role == "gateway" and a.api_key:
            env[API_KEY_ENV] = a.api_key  # the environment, not the command line `ps` shows
        return ClusterProcess(name, role, argv, port, env=env,
                              log_path=log_dir / f"{name}.log" if log_dir else None,
                              ready_file=ready_dir / f"{name}.ready.json" if ready_dir and w is not None else None,
                              auth_token=auth_token, tls_ca=a.tls_ca)

    disagg = common + (["--kv-transport", placement.kv_transport] if placement.kv_transport else [])
    sharing = ready_dir is not None and shares_weights(a, placement)
    shared = shared_weights_flags(placement, ready_dir) if sharing else {}

    def turn(name: str) -> list[str]:
        """--gpu-turn for a worker sharing its GPU with workers of the other role (worker.gpu_turn):
        one turn file per prefill worker, in the run directory; a decode worker waits on its
        prefill workers' files, at most --gpu-turn-max-wait-ms a step, holding its launches as
        --gpu-turn-hold says."""
        partners = placement.gpu_partners(name)
        if ready_dir is None or not a.gpu_turn or not partners:
            return []
        decode = placement.worker(name).role == "decode"
        files = [ready_dir / f"{p}.gpu-turn" for p in (partners if decode else [name])]
        for f in files:
            if not f.exists():
                create_turn_file(f)
        decode_flags = ["--gpu-turn-max-wait-ms", f"{a.gpu_turn_max_wait_ms:g}", "--gpu-turn-hold", a.gpu_turn_hold]
        bound = turn_max_batch(a, under_mps=bool(set(placement.worker(name).gpus) & set(mps)))
        if bound is not None:
            decode_flags += ["--gpu-turn-max-batch", str(bound)]
        wait = decode_flags if decode else []
        return ["--gpu-turn", ",".join(map(str, files)), *wait]

    def context(name: str) -> list[str]:
        """--max-model-len of worker `name`: a prefill worker's own (prefill_max_model_len) or the cluster's."""
        own = prefill_max_model_len(a, placement, name, model) if placement.worker(name).role == "prefill" else None
        value = own or a.max_model_len
        return [] if value is None else ["--max-model-len", str(value)]

    for w in placement.workers:
        port = free_port()
        share = shared.get(w.name, [])
        if w.role == "both":
            argv = ["--role", "both", "--port", str(port), "--worker-id", w.name.replace("worker-", "both-"), *common,
                    *context(w.name), *share]
            children.append(child(w.name, "worker", argv, port))
        elif w.role == "prefill":
            children.append(child(w.name, "prefill", ["--port", str(port), "--worker-id", w.name,
                                                      "--kv-push", placement.kv_push(w.name, a.kv_push),
                                                      *turn(w.name), *disagg, *context(w.name), *share], port))
        else:
            kv = ",".join(f"tcp://127.0.0.1:{free_port()}" for _ in range(a.tp))  # one receiver per rank
            children.append(child(w.name, "decode", ["--port", str(port), "--worker-id", w.name,
                                                     "--kv-address", kv, *turn(w.name), *disagg, *context(w.name),
                                                     *share], port))
    gw = ["--model", model, "--host", a.host, "--port", str(a.port), "--load-format", a.load_format]
    for c in children:
        gw += {"prefill": ["--prefill"], "decode": ["--decode"], "worker": ["--worker"]}[c.role] + [c.address]
    if a.redis_url:
        gw += ["--redis-url", a.redis_url]
    if a.metrics_port or a.metrics:
        gw += ["--metrics-port", str(a.metrics_port or free_port())]
    if a.http_port is not None:
        gw += ["--http-port", str(a.http_port)]
    if a.routing:
        gw += ["--routing", a.routing]
    if a.stream_interval is not None:
        gw += ["--stream-interval", str(a.stream_interval)]
    if a.local_prefill_tokens is not None:
        gw += ["--local-prefill-tokens", str(a.local_prefill_tokens)]
    if a.reserve_before_prefill:
        gw += ["--reserve-before-prefill"]
    if a.max_model_len is not None:
        gw += ["--max-context", str(a.max_model_len)]
    if a.block_size is not None:
        gw += ["--block-size", str(a.block_size)]
    if a.tls_cert:
        gw += [*tls, "--tls-ca", a.tls_ca]
    children.append(child("gateway", "gateway", gw, a.port))
    return children


def shared_weights_flags(placement: Placement, run_dir: Path) -> dict[str, list[str]]:
    """--share-weights: worker name -> its --shared-weights-dir flags, for every worker that
    shares its device (the same GPUs, or the CPU) with another. One rendezvous directory per
    device, in the run directory; the first decode worker there (else the first worker) is
    charged with the weights, the others' memory shares hold none."""
    groups: dict[tuple[int, ...], list[WorkerPlacement]] = {}
    for w in placement.workers:
        groups.setdefault(tuple(w.gpus), []).append(w)
    flags: dict[str, list[str]] = {}
    for gpus, workers in groups.items():
        if len(workers) < 2:
            continue
        where = run_dir / ("weights-gpu" + "-".join(map(str, gpus)) if gpus else "weights-cpu")
        charged = next((w for w in workers if w.role == "decode"), workers[0])
        for w in workers:
            flags[w.name] = ["--shared-weights-dir", str(where)] + ([] if w is charged else ["--shared-weights-uncharged"])
    return flags


def busy_port(a: argparse.Namespace) -> str | None:
    """The one-line error for a port of `a` that is already in use, or None."""
    for flag, host, port in (("--port", a.host, a.port), ("--metrics-port", a.host, a.metrics_port)):
        if port and port_in_use(host, port):
            return (f"tandem up: {flag} {port}: {host}:{port} is already in use (another cluster?); "
                    f"stop it or choose another {flag}")
    return None


def worker_rows(cluster: Cluster, placement: Placement, a: argparse.Namespace, model: str) -> list[str]:
    """The banner: one line per worker (GPU, memory share, KV blocks and tokens, max running,
    metrics port), the KV transport, and what is stored as FP8."""
    from engine.memory import default_max_running

    max_model_len = cluster_context(a, model)
    block = a.block_size or 16
    rows = []
    for p in cluster.processes:
        if p.role == "gateway":
            continue
        w = placement.worker(p.name)
        try:
            stats = p.stats()
            blocks, running = stats.total_kv_blocks, stats.max_running
        except Exception as exc:  # the banner must not fail the start
            logger.warning("%s: no Stats (%s)", p.name, exc)
            blocks = running = 0
        # The engine's own figure (a derived one may have been lowered after its graphs were timed);
        # derived here only for a worker that does not report it.
        running = running or default_max_running(a.max_running, a.num_kv_blocks, blocks, block, max_model_len,
                                                 "cuda" if w.gpus else "cpu")
        p.info.setdefault("max_running", running)
        where = f"GPU {','.join(map(str, w.gpus))} ({w.memory_fraction:.0%} of memory)" if w.gpus else "CPU"
        if "--shared-weights-dir" in p.argv:  # --share-weights: on a GPU, say whose share holds the copy
            where += ", weights shared" + ("" if not w.gpus else " (not in this share)"
                                           if "--shared-weights-uncharged" in p.argv else " (in this share)")
        metrics = f", metrics :{p.info['metrics_port']}" if p.info.get("metrics_port") else ""
        own = prefill_max_model_len(a, placement, p.name, model) if w.role == "prefill" else None
        holds = (f"max {min(own, blocks * block)} per prompt; the decode worker prefills longer ones" if own else
                 f"max {min(max_model_len, blocks * block)} per request")
        rows.append(f"  {p.name:<10} {where}: {blocks} KV blocks = {blocks * block} tokens "
                    f"({holds}), max running {running}{metrics}")
    if placement.kv_transport:
        rows.append(f"  KV transport: {placement.kv_transport}")
    checkpoint = fp8_checkpoint(model)
    fp8 = [what for what, on in (("weights" + (" (the checkpoint's)" if checkpoint else " (quantized at load)"),
                                  checkpoint or a.quantization == "fp8"),
                                 ("KV cache", a.kv_cache_dtype == "fp8")) if on]
    if fp8:
        rows.append(f"  FP8 (e4m3): {' and '.join(fp8)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    a = parse_args(argv)
    busy = busy_port(a)
    if busy:
        print(busy, file=sys.stderr, flush=True)
        return 2
    model = a.model
    if model is None:
        from engine.demo import demo_model_dir

        model = str(demo_model_dir())
        print("Serving the built-in demo model (random weights): its text is not meaningful. "
              "Use --model DIR for a real model.", flush=True)
    else:
        from tandem.hub import ModelSourceError, resolve_model

        try:
            model = resolve_model(model, a.revision)
        except ModelSourceError as exc:
            print(f"tandem up: {exc}", file=sys.stderr, flush=True)
            return 2
    try:
        fitted = fitted_max_model_len(a, model)
        if fitted is not None:
            why = ("" if a.share_weights is not False else
                   " With --no-share-weights each of the two holds the weights, which leaves the decode worker "
                   "fewer running sequences: one copy for both (the default) or --colocated (one worker) serves "
                   "more of them on this GPU")
            print(f"tandem up: --max-model-len {fitted}: a request of the model's whole context does not fit "
                  f"both the prefill and the decode worker sharing a GPU; pass --max-model-len (with "
                  f"--gpus or --gpu-memory-fraction) to choose.{why}", flush=True)
            a.max_model_len = fitted
        placement = placement_for(a, model=model)
    except PlacementError as exc:
        print(f"tandem up: {exc}", file=sys.stderr, flush=True)
        return 2
    unable = fp8_gpu_error(a, placement, model)
    if unable:
        print(f"tandem up: {unable}", file=sys.stderr, flush=True)
        return 2
    log_dir = Path(a.log_dir) if a.log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    ready_dir = Path(tempfile.mkdtemp(prefix="tandem-up-"))  # mode 0700
    try:
        mps, no_mps_rows = mps_daemons(a, placement, ready_dir, log_dir)
    except MpsError as exc:
        shutil.rmtree(ready_dir, ignore_errors=True)
        print(f"tandem up: {exc}", file=sys.stderr, flush=True)
        return 2
    token_file = write_token_file(ready_dir / "auth-token", a.auth_token)
    children = build_children(a, model, log_dir, placement, ready_dir, a.auth_token, mps)
    gateway = children.pop()
    cluster = Cluster(children)
    supervisor: SupervisorSocket | None = None
    stopping = False

    def on_signal(signum, _frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        try:
            cluster.start(HEALTH_TIMEOUT_S, should_stop=lambda: stopping)
            if stopping:
                return 0
            rows = worker_rows(cluster, placement, a, model)
            bound = turn_max_batch(a, under_mps=True) if a.gpu_turn else None
            rows += [banner_row(d, bound) for d in mps.values()] + no_mps_rows
            # The gateway keeps at most what a decode worker runs on it; the rest wait in its tiers.
            caps = [p.info["max_running"] for p in cluster.processes if p.role in ("decode", "worker")]
            gateway.argv += ["--max-inflight-per-decode", str(min(caps))]
            cluster.add(gateway, HEALTH_TIMEOUT_S)
        except ClusterError as exc:
            print(f"tandem up: {exc}", file=sys.stderr, flush=True)
            return 1
        endpoint = f"{a.host}:{a.port}"
        gw_metrics = gateway.argv[gateway.argv.index("--metrics-port") + 1] if "--metrics-port" in gateway.argv else None
        print("\n".join(rows + [f"  {'gateway':<10} {endpoint}" + (f", metrics :{gw_metrics}" if gw_metrics else "")]),
              flush=True)
        if not a.no_agent:  # the agent restarts workers through the supervisor's socket
            supervisor = SupervisorSocket(cluster, token=a.auth_token)
            agent_argv = (["--tls-ca", a.tls_ca] if a.tls_ca else []) + shlex.split(a.agent_args)
            if a.metrics and "--metrics-port" not in agent_argv:  # its tandem_agent_* series, like every child's
                agent_metrics = free_port()
                agent_argv += ["--metrics-port", str(agent_metrics)]
                print(f"  {'agent':<10} metrics :{agent_metrics}", flush=True)
            agent = agent_process(f"127.0.0.1:{a.port}", supervisor.start(), log_dir, agent_argv,
                                  ready_dir / "agent.ready.json")
            agent.auth_token = a.auth_token
            try:
                cluster.add(agent, HEALTH_TIMEOUT_S)  # "up" means every child is ready, the agent too
            except ClusterError as exc:
                print(f"tandem up: {exc}", file=sys.stderr, flush=True)
                return 1
        print(f"Cluster token (internal RPCs, Admin, KV handshake): {token_file}"
              + ("; public API key required" if a.api_key else "") + ("; TLS on" if a.tls_cert else ""), flush=True)
        print(f"Tandem is up: gRPC endpoint {endpoint} "
              f"({len(children)} workers, model {model}). Ctrl-C stops it.", flush=True)
        if a.http_port is not None:
            scheme = "https" if a.tls_cert else "http"
            print(f"OpenAI-compatible HTTP: {scheme}://{a.host}:{a.http_port}/v1", flush=True)
        if a.demo_request:
            demo_request(endpoint, a.api_key, a.tls_ca)
            if a.exit_after_demo:
                return 0
        try:
            cluster.watch(lambda: stopping, backoff=a.restart_backoff,
                          on_exit=restart_fault_sharers(cluster.processes, placement, mps) if mps else None)
        except ClusterError as exc:
            print(f"tandem up: stopping the cluster: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0
    finally:
        cluster.stop()
        stop_daemons(mps)  # after their clients, the workers, have gone
        shutil.rmtree(ready_dir, ignore_errors=True)  # ready, token and turn files, weight rendezvous, MPS pipes
        if supervisor is not None:
            supervisor.close()
        print("Tandem stopped.", flush=True)


def demo_request(endpoint: str, api_key: str | None = None, tls_ca: str | None = None) -> None:
    from tandem.client import Client

    prompt = "Once upon a time"
    with Client(endpoint, api_key=api_key, tls_ca=tls_ca) as client:
        out = client.generate(prompt, max_tokens=32, temperature=0.0)
    print(f"demo request: {prompt!r} -> {out.text!r}\n  finish={out.finish_reason} usage={out.usage}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

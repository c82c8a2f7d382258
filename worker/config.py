"""Worker settings: a frozen `WorkerConfig` composed of an `EngineConfig`, a `TransferConfig` and
an `IndexConfig`, and the command-line flags that fill it.

`tandem prefill`, `tandem decode` and `tandem worker --role both` (entrypoints.worker) share these flags.

Tensor parallelism (`--tp N`): the process started is rank 0; it starts ranks 1..N-1 itself
(`worker.tp_ranks`). On CUDA rank r runs on device cuda:r of the visible devices (choose the
GPUs with CUDA_VISIBLE_DEVICES), on CPU every rank runs on the CPU over gloo.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from engine import EngineConfig
from tandem.netaddr import is_wildcard
from tandem.types import ROLES
from worker.gpu_turn import (DEFAULT_HOLD, HOLD_MODES, MAX_WAIT_S, check_hold, check_max_batch, check_max_wait_ms,
                             turn_paths)

logger = logging.getLogger(__name__)

DEFAULT_PORTS = {"prefill": 50060, "decode": 50070, "both": 50080}
KV_PUSH_MODES = ("layer", "step")  # when a prefill worker pushes a prompt's KV (prefill.push_mode)
# Prefill graphs (engine/prefill_graphs.py) on workers that prefill: a 2,048-token prompt's
# forward is ~42 ms of GPU work on an H200 for an 8B model, about what the host needs to queue it
# eagerly; longer steps keep the GPU ahead of the host without a graph.
PREFILL_GRAPH_TOKENS = 2048


def check_kv_push(mode: str) -> None:
    """ValueError naming kv_push unless `mode` is one of KV_PUSH_MODES."""
    if mode not in KV_PUSH_MODES:
        raise ValueError(f"kv_push: must be one of {', '.join(KV_PUSH_MODES)}, got {mode!r}")


@dataclass(frozen=True)
class TransferConfig:
    """How this worker moves KV to or from its peers (prefill sends, decode receives)."""

    transport: str = "zmq"
    address: str | None = None  # decode: bind endpoint; None: tcp://{host}:* (a free port)
    timeout_s: float = 30.0  # transfer deadline / reservation lifetime when timeout_ms is 0
    sender_options: dict[str, Any] | None = None  # transport options (tests: corrupt_once)
    push: str = "layer"  # prefill: when the prompt's KV is pushed (prefill.push_mode)

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"kv_timeout_s: must be > 0, got {self.timeout_s}")
        check_kv_push(self.push)


@dataclass(frozen=True)
class IndexConfig:
    """Where this worker publishes its KV events (the global prefix index); off without redis_url."""

    redis_url: str | None = None
    namespace: str | None = None  # None: the model identity
    heartbeat_s: float = 2.0  # Redis prefix index: heartbeat period (dead after 3 missed)
    block_ttl_s: float = 3600.0  # Redis prefix index: entries not republished expire after this

    def __post_init__(self) -> None:
        for name, value in (("index_heartbeat_s", self.heartbeat_s), ("index_block_ttl_s", self.block_ttl_s)):
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")


@dataclass(frozen=True)
class WorkerConfig:
    """A worker process: its role, the engine it runs, its KV transfer and index parts, and its
    own serving settings. `engine.device` is the user's --device; `engine_config(rank)` gives
    the engine of one tensor-parallel rank."""

    role: str
    engine: EngineConfig
    transfer: TransferConfig = field(default_factory=TransferConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (logged and written to ready_file)
    advertise_host: str | None = None  # None: `host`, or this machine's primary IP when host is a wildcard
    worker_id: str | None = None  # None: "{role}-{advertised host}-{port}"
    batch_window_ms: float = 0.0  # collect arrivals this long before stepping an idle engine
    gpu_turn: str | None = None  # turn files of a GPU shared with other workers (worker.gpu_turn)
    gpu_turn_max_wait_ms: float = MAX_WAIT_S * 1000  # decode: the longest a step waits for prefill steps
    gpu_turn_hold: str = DEFAULT_HOLD  # decode: when a step's launch is held for the turn (worker.gpu_turn)
    gpu_turn_max_batch: int | None = None  # decode: take turns only while running at most this many sequences
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    drain_timeout_s: float = 30.0
    ready_file: str | None = None
    tp: int = 1  # tensor-parallel ranks (processes; GPUs on CUDA) serving one model replica
    # Security (tandem/security.py): paths, never secrets, so the config may travel to the ranks.
    auth_token_file: str | None = None  # None: $TANDEM_AUTH_TOKEN_FILE / $TANDEM_AUTH_TOKEN / no token
    tls_cert: str | None = None  # serve the gRPC port over TLS with this certificate and key
    tls_key: str | None = None
    reflection: bool = False  # gRPC server reflection (off unless asked for)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp: must be an integer >= 1, got {self.tp!r}")
        kv_address = self.transfer.address
        if kv_address and "," in kv_address:
            n = len(kv_address.split(","))
            if n != self.tp:
                raise ValueError(f"kv_address: {n} comma-separated endpoints for tp {self.tp}; give one per rank "
                                 "(or one endpoint the ranks derive theirs from)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65536), got {self.port}")
        if self.advertise_host is not None and (is_wildcard(self.advertise_host) or "/" in self.advertise_host):
            raise ValueError(f"advertise_host: must name a host others can reach (an IP or DNS name), "
                             f"got {self.advertise_host!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port: must be in [0, 65536), got {self.metrics_port}")
        if not self.drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s: must be > 0, got {self.drain_timeout_s}")
        if not 0 <= self.batch_window_ms <= 1000:
            raise ValueError(f"batch_window_ms: must be in [0, 1000], got {self.batch_window_ms}")
        turn_paths(self.role, self.gpu_turn)
        check_max_wait_ms(self.gpu_turn_max_wait_ms, "gpu_turn_max_wait_ms")
        check_hold(self.gpu_turn_hold, "gpu_turn_hold")
        check_max_batch(self.gpu_turn_max_batch, "gpu_turn_max_batch")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert: give both --tls-cert and --tls-key (or neither)")
        if self.role == "prefill" and self.engine.cuda_graphs:
            # A prefill worker never decodes: no decode graphs to capture.
            object.__setattr__(self, "engine", replace(self.engine, cuda_graphs=False))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerConfig:
        """The inverse of `dataclasses.asdict(config)` (how rank 0 hands its config to the other ranks)."""
        return cls(**{**data, "engine": EngineConfig(**data["engine"]), "transfer": TransferConfig(**data["transfer"]),
                      "index": IndexConfig(**data["index"])})

    @property
    def batch_window_s(self) -> float:
        return self.batch_window_ms / 1000.0

    def check_tp(self) -> None:
        """ValueError naming the field when the model or the machine cannot run `tp` ranks:
        tp must divide num_attention_heads and num_key_value_heads (each rank then holds
        whole KV heads, which the per-rank KV transfer relies on), and on CUDA each rank
        needs a device of its own."""
        if self.tp == 1:
            return
        from engine.config import ModelConfig
        from parallel.tensor_parallel import check_shardable

        model = self.engine.model_path
        try:
            mc = ModelConfig.from_dir(model)
        except (OSError, ValueError) as exc:
            raise ValueError(f"model: cannot read {model}/config.json: {exc}") from None
        if mc.num_heads % self.tp:
            raise ValueError(f"tp: {self.tp} does not divide num_attention_heads ({mc.num_heads})")
        if mc.num_kv_heads % self.tp:
            raise ValueError(f"tp: {self.tp} does not divide num_key_value_heads ({mc.num_kv_heads})")
        try:
            check_shardable(mc, self.tp)
        except ValueError as exc:
            raise ValueError(f"tp: {exc}") from None
        if self.tp_backend == "nccl":
            import torch

            if self.engine.device not in (None, "cuda"):
                raise ValueError(f"device: with tp {self.tp} rank r runs on cuda:r; choose the GPUs with "
                                 f"CUDA_VISIBLE_DEVICES instead of --device {self.engine.device}")
            if torch.cuda.device_count() < self.tp:
                raise ValueError(f"tp: {self.tp} ranks need {self.tp} visible CUDA devices, "
                                 f"found {torch.cuda.device_count()}")

    @property
    def tp_backend(self) -> str:
        """The process-group backend of the tensor-parallel ranks: nccl on CUDA, gloo on CPU."""
        device = self.engine.device
        if device is not None:
            return "nccl" if device.startswith("cuda") else "gloo"
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"

    def rank_device(self, rank: int) -> str | None:
        """The engine device of tensor-parallel rank `rank`."""
        if self.tp == 1:
            return self.engine.device
        return f"cuda:{rank}" if self.tp_backend == "nccl" else "cpu"

    def rank_kv_address(self, rank: int) -> str | None:
        """The KV receiver endpoint rank `rank` binds (decode). A comma-separated list gives
        one per rank; from a single endpoint, rank r > 0 derives its own: tcp://H:P -> port
        P + r, tcp://H:* stays (a free port each), ipc://PATH -> PATH.rankR."""
        if not self.transfer.address:
            return None
        parts = self.transfer.address.split(",")
        if len(parts) > 1 or rank == 0:
            return parts[rank] if len(parts) > 1 else parts[0]
        bind = parts[0]
        if bind.startswith("tcp://"):
            head, _, port = bind.rpartition(":")
            return bind if port == "*" or not port.isdigit() else f"{head}:{int(port) + rank}"
        return f"{bind}.rank{rank}"

    def engine_config(self, rank: int = 0) -> EngineConfig:
        """The engine of tensor-parallel rank `rank` (its own device; the same otherwise)."""
        device = self.rank_device(rank)
        return self.engine if device == self.engine.device else replace(self.engine, device=device)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every flag's default: appended unless the help text already says it
    (a None or False default means "off" or "derived", which the help text spells out)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def build_parser(role: str | None, prog: str | None = None) -> argparse.ArgumentParser:
    """Flags for `role` (None: a --role flag is required). Names follow vLLM / SGLang where they
    exist; their spellings there are accepted as aliases."""
    desc = {"prefill": "Tandem prefill worker", "decode": "Tandem decode worker", None: "Tandem worker"}
    p = argparse.ArgumentParser(prog=prog, description=desc.get(role, "Tandem worker"),
                                formatter_class=HelpFormatter)
    if role is None:
        p.add_argument("--role", choices=ROLES, required=True, help="prefill, decode, or both (no KV transfer)")
    p.add_argument("--model", required=True,
                   help="model directory, or a Hugging Face repo id (resolved through the local Hugging Face cache)")
    p.add_argument("--revision", default=None, help="the repo id's revision: branch, tag or commit (default: main)")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto", help="dummy: random weights from config.json")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's; float32 on CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC server binds")
    p.add_argument("--advertise-host", default=None,
                   help="the host others reach this worker at: what it registers in the prefix index and the "
                        "host of its KV endpoint (default: --host; for a wildcard --host such as 0.0.0.0, this "
                        "machine's primary IP)")
    p.add_argument("--port", type=int, default=None, help="gRPC port (0: any free port; default per role: %s)" % DEFAULT_PORTS)
    p.add_argument("--worker-id", default=None, help="the name the gateway and metrics use (default: {role}-{advertised host}-{port})")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (16, 32 or 64)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks (default: what --gpu-memory-fraction leaves after weights, activations, "
                        "CUDA graphs and the sampler)")
    p.add_argument("--max-running", "--max-num-seqs", "--max-running-requests", type=int, default=None,
                   dest="max_running",
                   help="cap on running sequences (default: KV pool tokens / min(max-model-len, 2048), at most 512)")
    p.add_argument("--max-batched-tokens", "--max-num-batched-tokens", type=int, default=4096,
                   dest="max_batched_tokens", help="per-step token budget")
    p.add_argument("--max-model-len", "--context-length", type=int, default=None, dest="max_model_len",
                   help="longest prompt + output (default: the model's max_position_embeddings)")
    p.add_argument("--enable-prefix-cache", "--enable-prefix-caching", dest="enable_prefix_cache",
                   action="store_true", default=True, help="reuse the KV of shared prompt prefixes (radix cache; default: on)")
    p.add_argument("--no-prefix-cache", "--no-enable-prefix-caching", "--disable-radix-cache",
                   dest="enable_prefix_cache", action="store_false",
                   help="disable the radix prefix cache (default: enabled)")
    p.add_argument("--seed", type=int, default=None, help="seed of the engine's sampler for unseeded requests (default: random)")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="fp8: e4m3 KV cache, twice the tokens")
    p.add_argument("--quantization", choices=("fp8",), default=None,
                   help="fp8: quantize the weights to e4m3 at load (per-channel scales; FP8 checkpoints load as FP8 anyway)")
    p.add_argument("--shared-weights-dir", default=None, metavar="DIR",
                   help="keep one copy of the weights with the other workers on this device that name DIR: the "
                        "first loads them, the others map them, and they live while any of those workers does "
                        "(default: this worker's own copy; tandem up --share-weights sets it)")
    p.add_argument("--shared-weights-uncharged", action="store_true",
                   help="with --shared-weights-dir: this worker's --gpu-memory-fraction holds no weights (another "
                        "worker's holds them; tandem up charges the decode worker)")
    p.add_argument("--gpu-memory-fraction", "--gpu-memory-utilization", "--mem-fraction-static", type=float,
                   default=0.90, dest="gpu_memory_fraction",
                   help="share of the GPU's total memory this worker may use (weights, activations, graphs, KV)")
    p.add_argument("--swap-space-gb", "--swap-space", type=float, default=1.0, dest="swap_space_gb",
                   help="GiB of host memory (per rank) for the KV of preempted requests")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every step eagerly on CUDA (default: decode steps, and prefill steps up to "
                        "--prefill-graph-tokens, replay CUDA graphs)")
    p.add_argument("--prefill-graph-tokens", type=int, default=None,
                   help="capture CUDA graphs for prefill steps of up to this many tokens (0: none; default "
                        f"{PREFILL_GRAPH_TOKENS} on prefill and colocated workers, 0 with --no-cuda-graphs); "
                        "such a step then costs its GPU time however slow the host")
    p.add_argument("--no-warm-up", action="store_true",
                   help="skip the synthetic steps that compile the GPU kernels before the worker reports ready "
                        "(faster start; the first requests then wait for the compiles; default: warm up)")
    p.add_argument("--kv-transport", default="zmq", help="KV transfer transport: zmq, nccl, or cuda_ipc (one host)")
    p.add_argument("--kv-push", choices=KV_PUSH_MODES, default="layer", dest="kv_push",
                   help="prefill: layer = push each layer's KV as soon as it is computed (overlaps the transfer "
                        "with the forward; between GPUs); step = push every layer once the forward has run (one "
                        "burst; for a GPU shared with the decode worker)")
    p.add_argument("--tp", "--tensor-parallel-size", "--tp-size", type=int, default=1, dest="tp",
                   help="tensor-parallel ranks: this process is rank 0 and starts the others (one GPU each "
                        "on CUDA: cuda:0..N-1 of CUDA_VISIBLE_DEVICES); prefill and decode workers that "
                        "exchange KV must use the same value")
    p.add_argument("--kv-address", default=None,
                   help="decode: endpoint the KV receiver binds (default tcp://HOST:* = a free port); with "
                        "--tp N, N comma-separated endpoints, or one that ranks r > 0 derive theirs from "
                        "(tcp port + r, ipc path + .rankR)")
    p.add_argument("--kv-timeout", type=float, default=30.0, dest="kv_timeout_s",
                   help="seconds a reservation waits for its KV when the request carries no timeout")
    p.add_argument("--batch-window-ms", type=float, default=0.0,
                   help="collect arrivals this long before stepping an idle engine (each one is a prompt's "
                        "TTFT at low load; a busy engine batches what queued during its step anyway)")
    p.add_argument("--gpu-turn", default=None, metavar="FILE[,FILE...]",
                   help="where prefill and decode workers share a GPU (tandem up sets it): a prefill worker marks "
                        "its steps in its FILE; a decode worker waits for the marks of every FILE given before "
                        "each step (at most --gpu-turn-max-wait-ms), so a prompt's forward runs without taking "
                        "turns with decode steps (default: none)")
    p.add_argument("--gpu-turn-max-wait-ms", type=float, default=MAX_WAIT_S * 1000,
                   help="decode: the longest a step waits for prefill steps on its GPU (the most a running "
                        "stream's token is delayed on a prefill's account)")
    p.add_argument("--gpu-turn-max-batch", type=int, default=None,
                   help="decode: wait for the prefill steps (and hold launches) only while running at most this "
                        "many sequences (default: no bound)")
    p.add_argument("--gpu-turn-hold", choices=HOLD_MODES, default=DEFAULT_HOLD,
                   help="decode: when to queue a step's forward only once the step before's forward has "
                        "finished and no prefill step holds the GPU: always (a prompt's forward then shares the "
                        "GPU with at most the rest of one decode step: lower TTFT, for the host's reaction "
                        "between steps, under the LM head and sampling of the one before), "
                        "reserving (only while a prefill for this worker is known to be near), off")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus endpoint port (0: any free port; default off)")
    p.add_argument("--redis-url", default=None, help="publish KV events to this Redis prefix index (default: none; the gateway's embedded index)")
    p.add_argument("--namespace", default=None, help="prefix-index namespace (default: the model identity)")
    p.add_argument("--index-heartbeat", type=float, default=2.0, dest="index_heartbeat_s",
                   help="seconds between heartbeats to the Redis prefix index; entries of a worker that "
                        "misses 3 are ignored and reaped")
    p.add_argument("--index-block-ttl", type=float, default=3600.0, dest="index_block_ttl_s",
                   help="seconds a Redis prefix-index entry lives unless republished or looked up")
    p.add_argument("--drain-timeout", type=float, default=30.0, dest="drain_timeout_s",
                   help="seconds to finish in-flight requests after SIGTERM")
    p.add_argument("--ready-file", default=None, help="write the bound addresses here as JSON once serving (default: none)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument("--auth-token-file", default=None,
                   help="the cluster token, required on this worker's RPCs and KV handshake (default: "
                        "$TANDEM_AUTH_TOKEN_FILE or $TANDEM_AUTH_TOKEN; none: open, for loopback only)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve gRPC over TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--reflection", action="store_true", help="serve gRPC server reflection (token required)")
    return p


def _prefill_graph_tokens(args: argparse.Namespace, role: str) -> int:
    """--prefill-graph-tokens, or its default for `role`: graphs where a worker prefills."""
    if args.prefill_graph_tokens is not None:
        return args.prefill_graph_tokens
    return PREFILL_GRAPH_TOKENS if role in ("prefill", "both") and not args.no_cuda_graphs else 0


def config_from_args(args: argparse.Namespace, role: str | None = None) -> WorkerConfig:
    role = role or args.role
    if args.shared_weights_uncharged and not args.shared_weights_dir:
        raise ValueError("--shared-weights-uncharged: only with --shared-weights-dir")
    port = args.port if args.port is not None else DEFAULT_PORTS[role]
    engine = EngineConfig(
        model_path=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len,
        load_format=args.load_format,
        device=args.device,
        enable_prefix_cache=args.enable_prefix_cache,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        shared_weights_dir=args.shared_weights_dir,
        shared_weights_charged=not args.shared_weights_uncharged,
        gpu_memory_fraction=args.gpu_memory_fraction,
        swap_space_gb=args.swap_space_gb,
        cuda_graphs=not args.no_cuda_graphs,
        prefill_graph_tokens=_prefill_graph_tokens(args, role),
        warm_up=not args.no_warm_up,
    )
    transfer = TransferConfig(transport=args.kv_transport, address=args.kv_address, timeout_s=args.kv_timeout_s,
                              push=args.kv_push)
    index = IndexConfig(redis_url=args.redis_url, namespace=args.namespace, heartbeat_s=args.index_heartbeat_s,
                        block_ttl_s=args.index_block_ttl_s)
    return WorkerConfig(
        role=role,
        engine=engine,
        transfer=transfer,
        index=index,
        host=args.host,
        port=port,
        advertise_host=args.advertise_host,
        worker_id=args.worker_id,
        batch_window_ms=args.batch_window_ms,
        gpu_turn=args.gpu_turn,
        gpu_turn_max_wait_ms=args.gpu_turn_max_wait_ms,
        gpu_turn_hold=args.gpu_turn_hold,
        gpu_turn_max_batch=args.gpu_turn_max_batch,
        metrics_port=args.metrics_port,
        drain_timeout_s=args.drain_timeout_s,
        ready_file=args.ready_file,
        tp=args.tp,
        auth_token_file=args.auth_token_file,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        reflection=args.reflection,
    )

"""Worker settings: one frozen dataclass, and the command-line flags that fill it.

`python -m prefill`, `python -m decode` and `python -m worker --role both` share these flags;
the `tandem` CLI calls the same `main(argv)` functions.

Tensor parallelism (`--tp N`): the process started is rank 0; it starts ranks 1..N-1 itself
(`worker.tp_ranks`). On CUDA rank r runs on device cuda:r of the visible devices (choose the
GPUs with CUDA_VISIBLE_DEVICES), on CPU every rank runs on the CPU over gloo.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, replace
from typing import Any

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
DEFAULT_PORTS = {"prefill": 50060, "decode": 50070, "both": 50080}


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    model: str
    load_format: str = "auto"
    dtype: str | None = None
    device: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (logged and written to ready_file)
    worker_id: str | None = None  # None: "{role}-{host}-{port}"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_running: int = 256
    max_batched_tokens: int = 4096
    max_model_len: int | None = None
    enable_prefix_cache: bool = True
    seed: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_fraction: float = 0.90
    swap_space_gb: float = 1.0  # host memory for preempted requests' KV (per rank)
    cuda_graphs: bool = True  # decode graphs on CUDA; never captured for role prefill (it never decodes)
    warm_up: bool = True  # synthetic steps at start-up on CUDA (Engine.warm_up), before reporting ready
    kv_transport: str = "zmq"
    kv_address: str | None = None  # decode: bind endpoint; None: tcp://{host}:* (a free port)
    kv_timeout_s: float = 30.0  # transfer deadline / reservation lifetime when timeout_ms is 0
    batch_window_ms: float | None = None  # None: 2 ms for prefill, 0 otherwise
    metrics_port: int | None = None  # None: no metrics endpoint; 0: any free port
    redis_url: str | None = None
    namespace: str | None = None  # None: the model identity
    index_heartbeat_s: float = 2.0  # Redis prefix index: heartbeat period (dead after 3 missed)
    index_block_ttl_s: float = 3600.0  # Redis prefix index: entries not republished expire after this
    drain_timeout_s: float = 30.0
    ready_file: str | None = None
    kv_sender_options: dict[str, Any] | None = None  # transport options (tests: corrupt_once)
    tp: int = 1  # tensor-parallel ranks (processes; GPUs on CUDA) serving one model replica

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {', '.join(ROLES)}, got {self.role!r}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp: must be an integer >= 1, got {self.tp!r}")
        if self.kv_address and "," in self.kv_address:
            n = len(self.kv_address.split(","))
            if n != self.tp:
                raise ValueError(f"kv_address: {n} comma-separated endpoints for tp {self.tp}; give one per rank "
                                 "(or one endpoint the ranks derive theirs from)")
        if not self.model:
            raise ValueError("model: a model directory is required")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: must be in [0, 65536), got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port: must be in [0, 65536), got {self.metrics_port}")
        if not self.swap_space_gb >= 0:
            raise ValueError(f"swap_space_gb: must be >= 0, got {self.swap_space_gb}")
        for name in ("kv_timeout_s", "drain_timeout_s", "index_heartbeat_s", "index_block_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.batch_window_ms is not None and not 0 <= self.batch_window_ms <= 1000:
            raise ValueError(f"batch_window_ms: must be in [0, 1000], got {self.batch_window_ms}")

    @property
    def batch_window_s(self) -> float:
        ms = self.batch_window_ms if self.batch_window_ms is not None else (2.0 if self.role == "prefill" else 0.0)
        return ms / 1000.0

    def check_tp(self) -> None:
        """ValueError naming the field when the model or the machine cannot run `tp` ranks:
        tp must divide num_attention_heads and num_key_value_heads (each rank then holds
        whole KV heads, which the per-rank KV transfer relies on), and on CUDA each rank
        needs a device of its own."""
        if self.tp == 1:
            return
        from engine.config import ModelConfig
        from parallel.tensor_parallel import check_shardable

        try:
            mc = ModelConfig.from_dir(self.model)
        except (OSError, ValueError) as exc:
            raise ValueError(f"model: cannot read {self.model}/config.json: {exc}") from None
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

            if self.device not in (None, "cuda"):
                raise ValueError(f"device: with tp {self.tp} rank r runs on cuda:r; choose the GPUs with "
                                 f"CUDA_VISIBLE_DEVICES instead of --device {self.device}")
            if torch.cuda.device_count() < self.tp:
                raise ValueError(f"tp: {self.tp} ranks need {self.tp} visible CUDA devices, "
                                 f"found {torch.cuda.device_count()}")

    @property
    def tp_backend(self) -> str:
        """The process-group backend of the tensor-parallel ranks: nccl on CUDA, gloo on CPU."""
        if self.device is not None:
            return "nccl" if self.device.startswith("cuda") else "gloo"
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"

    def rank_device(self, rank: int) -> str | None:
        """The engine device of tensor-parallel rank `rank`."""
        if self.tp == 1:
            return self.device
        return f"cuda:{rank}" if self.tp_backend == "nccl" else "cpu"

    def rank_kv_address(self, rank: int) -> str | None:
        """The KV receiver endpoint rank `rank` binds (decode). A comma-separated list gives
        one per rank; from a single endpoint, rank r > 0 derives its own: tcp://H:P -> port
        P + r, tcp://H:* stays (a free port each), ipc://PATH -> PATH.rankR."""
        if not self.kv_address:
            return None
        parts = self.kv_address.split(",")
        if len(parts) > 1 or rank == 0:
            return parts[rank] if len(parts) > 1 else parts[0]
        bind = parts[0]
        if bind.startswith("tcp://"):
            head, _, port = bind.rpartition(":")
            return bind if port == "*" or not port.isdigit() else f"{head}:{int(port) + rank}"
        return f"{bind}.rank{rank}"

    def engine_config(self, rank: int = 0) -> Any:
        from engine.engine import EngineConfig

        return EngineConfig(
            model_path=self.model,
            dtype=self.dtype,
            block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks,
            max_running=self.max_running,
            max_batched_tokens=self.max_batched_tokens,
            max_model_len=self.max_model_len,
            load_format=self.load_format,
            device=self.rank_device(rank),
            enable_prefix_cache=self.enable_prefix_cache,
            seed=self.seed,
            kv_cache_dtype=self.kv_cache_dtype,
            gpu_memory_fraction=self.gpu_memory_fraction,
            swap_space_gb=self.swap_space_gb,
            cuda_graphs=self.cuda_graphs and self.role != "prefill",
            warm_up=self.warm_up,
        )

    def with_port(self, port: int) -> WorkerConfig:
        return replace(self, port=port)


def build_parser(role: str | None, prog: str | None = None) -> argparse.ArgumentParser:
    """Flags for `role` (None: a --role flag is required)."""
    desc = {"prefill": "Tandem prefill worker", "decode": "Tandem decode worker", None: "Tandem worker"}
    p = argparse.ArgumentParser(prog=prog, description=desc.get(role, "Tandem worker"))
    if role is None:
        p.add_argument("--role", choices=ROLES, required=True, help="prefill, decode, or both (no KV transfer)")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto", help="dummy: random weights from config.json")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the checkpoint's; float32 on CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--host", default="127.0.0.1", help="address the gRPC server binds")
    p.add_argument("--port", type=int, default=None, help="gRPC port (0: any free port; default per role: %s)" % DEFAULT_PORTS)
    p.add_argument("--worker-id", default=None, help="default: {role}-{host}-{port}")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: derived from memory")
    p.add_argument("--max-running", type=int, default=256)
    p.add_argument("--max-batched-tokens", type=int, default=4096, help="per-step token budget")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    p.add_argument("--seed", type=int, default=None, help="seed of the engine's sampler for unseeded requests")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.90)
    p.add_argument("--swap-space", type=float, default=1.0, dest="swap_space_gb",
                   help="GiB of host memory (per rank) for the KV of preempted requests")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA")
    p.add_argument("--no-warm-up", action="store_true",
                   help="skip the synthetic steps that compile the GPU kernels before the worker reports ready "
                        "(faster start; the first requests then wait for the compiles)")
    p.add_argument("--kv-transport", default="zmq", help="KV transfer transport: zmq, nccl, or cuda_ipc (one host)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks: this process is rank 0 and starts the others (one GPU each "
                        "on CUDA: cuda:0..N-1 of CUDA_VISIBLE_DEVICES); prefill and decode workers that "
                        "exchange KV must use the same value")
    p.add_argument("--kv-address", default=None,
                   help="decode: endpoint the KV receiver binds (default tcp://HOST:* = a free port); with "
                        "--tp N, N comma-separated endpoints, or one that ranks r > 0 derive theirs from "
                        "(tcp port + r, ipc path + .rankR)")
    p.add_argument("--kv-timeout", type=float, default=30.0, dest="kv_timeout_s",
                   help="seconds a reservation waits for its KV when the request carries no timeout")
    p.add_argument("--batch-window-ms", type=float, default=None,
                   help="collect arrivals this long before stepping an idle engine (default 2 for prefill, 0 otherwise)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus endpoint port (0: any free port; default off)")
    p.add_argument("--redis-url", default=None, help="publish KV events to this Redis prefix index")
    p.add_argument("--namespace", default=None, help="prefix-index namespace (default: the model identity)")
    p.add_argument("--index-heartbeat", type=float, default=2.0, dest="index_heartbeat_s",
                   help="seconds between heartbeats to the Redis prefix index; entries of a worker that "
                        "misses 3 are ignored and reaped")
    p.add_argument("--index-block-ttl", type=float, default=3600.0, dest="index_block_ttl_s",
                   help="seconds a Redis prefix-index entry lives unless republished or looked up")
    p.add_argument("--drain-timeout", type=float, default=30.0, dest="drain_timeout_s",
                   help="seconds to finish in-flight requests after SIGTERM")
    p.add_argument("--ready-file", default=None, help="write the bound addresses here as JSON once serving")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace, role: str | None = None) -> WorkerConfig:
    role = role or args.role
    port = args.port if args.port is not None else DEFAULT_PORTS[role]
    return WorkerConfig(
        role=role,
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        host=args.host,
        port=port,
        worker_id=args.worker_id,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_running=args.max_running,
        max_batched_tokens=args.max_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_cache=not args.no_prefix_cache,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_fraction=args.gpu_memory_fraction,
        swap_space_gb=args.swap_space_gb,
        cuda_graphs=not args.no_cuda_graphs,
        warm_up=not args.no_warm_up,
        kv_transport=args.kv_transport,
        kv_address=args.kv_address,
        kv_timeout_s=args.kv_timeout_s,
        batch_window_ms=args.batch_window_ms,
        metrics_port=args.metrics_port,
        redis_url=args.redis_url,
        namespace=args.namespace,
        index_heartbeat_s=args.index_heartbeat_s,
        index_block_ttl_s=args.index_block_ttl_s,
        drain_timeout_s=args.drain_timeout_s,
        ready_file=args.ready_file,
        tp=args.tp,
    )

"""Pieces both ends of the NCCL transport share: control messages, the pair process group, waits.

A pair group is a two-rank torch.distributed backend (ProcessGroupNCCL on GPUs, ProcessGroupGloo
on CPUs) built straight from a store, without `init_process_group`, so it never touches the
process's default group (which tensor parallelism may own) and one process can hold many.
"""
from __future__ import annotations

import json
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvtransfer.base import KVTransferError

logger = logging.getLogger(__name__)

# Control messages over ZMQ (DEALER on the sender, ROUTER on the receiver), as [tag, body].
HELLO = b"hello"  # sender -> receiver: {"v", "channel", "backend"}
WELCOME = b"welcome"  # receiver -> sender: {"store", "prefix", "backend"}
REFUSE = b"refuse"  # receiver -> sender: {"error"}
FRAME = b"frame"  # sender -> receiver: FrameHeader bytes, one part each; layers' K and V follow through the group as one payload
BYE = b"bye"  # sender -> receiver: the channel is closed, tear its group down

CONTROL_VERSION = 2  # 2: a FRAME message may carry several layers sharing one payload
NCCL_WATCHDOG_MIN_S = 600.0
SENDER_RANK, RECEIVER_RANK = 0, 1
BACKENDS = ("nccl", "gloo")

# NVLink SHARP multicast stays off wherever NCCL is initialized: on the lent H200 hosts it is
# not available to jobs, and NCCL would otherwise probe it at communicator creation.
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}
_NCCL_ENV_DEFAULTS = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def ensure_nccl_env() -> None:
    """Set the environment every NCCL user in this process needs (before a communicator exists)."""
    for key, value in _NCCL_ENV.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    for key, value in _NCCL_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def check_backend(backend: Any, field_name: str = "backend") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{field_name}: must be one of {BACKENDS}, got {backend!r}")
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        raise ValueError(f"{field_name}: 'nccl' needs CUDA and a torch build with NCCL; use 'gloo' on CPU")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError(f"{field_name}: this torch build has no gloo backend")
    return backend


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode("utf-8")


def decode(data: bytes | memoryview) -> dict[str, Any]:
    """Parse a control body; ValueError when it is not a JSON object."""
    try:
        doc = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"control message: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError("control message: expected a JSON object")
    return doc


def split_host_port(address: str, field_name: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{field_name}: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on host:port (0 picks a free port; `.port` tells it)."""
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def connect_store(address: str, timeout_s: float) -> dist.TCPStore:
    host, port = split_host_port(address, "store")
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def pair_group(store: dist.Store, prefix: str, rank: int, backend: str, timeout_s: float) -> Any:
    """The two-rank backend of one channel; rank 0 is the sender, rank 1 the receiver.

    Gloo connects both ranks here (so this waits for the peer, up to `timeout_s`); NCCL
    creates its communicator at the first send/recv, which both ends then wait for.
    """
    scoped = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(scoped, rank, 2, timedelta(seconds=timeout_s))
    ensure_nccl_env()
    options = dist.ProcessGroupNCCL.Options()
    # The transport bounds every wait itself and aborts a stuck group (`close_group`); NCCL's
    # watchdog, which by default ends the whole process on a timeout, must never fire first.
    options._timeout = timedelta(seconds=max(NCCL_WATCHDOG_MIN_S, 10 * timeout_s))
    return dist.ProcessGroupNCCL(scoped, rank, 2, options)


MAX_PAUSE_S = 0.0005  # longest sleep between wait_work's completion checks


def wait_work(work: Any, backend: str, timeout_s: float, what: str) -> None:
    """Block until `work` finished, at most `timeout_s`; KVTransferError otherwise.

    Gloo's point-to-point work completes only inside `wait`, which takes the timeout. NCCL's
    `wait` only orders the current CUDA stream, so completion is polled on its CUDA event.
    (Sleeping on a blocking-sync event instead, with a watchdog aborting the group at the
    deadline, moved the kv bench's 2k-token transfers at 15.6 GB/s against 18.8 polled, in one
    run on two H200s, and a stuck transfer could only be ended by the abort; BENCHMARKS.md §6.)
    """
    if backend == "gloo":
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            raise KVTransferError(f"{what}: {exc}") from None
        return
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise KVTransferError(f"{what}: not completed within {timeout_s:g}s")
        # Sleep (which lets the engine and socket threads have the GIL) in short, growing
        # steps: a layer usually lands within tens of microseconds.
        time.sleep(pause)
        pause = min(MAX_PAUSE_S, pause + 0.00002)
    work.wait()  # surfaces an NCCL error and orders the current stream after the transfer


def close_group(group: Any, broken: bool) -> None:
    """Tear a pair group down: abort when an operation may still be pending, else shut down."""
    if group is None:
        return
    for name in (("abort", "shutdown") if broken else ("shutdown", "abort")):
        fn = getattr(group, name, None)
        if fn is None:
            continue
        try:
            fn()
            return
        except Exception as exc:  # best effort: the channel is gone either way
            logger.debug("pair group %s failed: %r", name, exc)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: payloads travel as raw bytes whatever the dtype."""
    return t.contiguous().view(-1).view(torch.uint8)

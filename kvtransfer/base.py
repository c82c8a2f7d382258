"""The KV-transfer contract: sender (prefill side), receiver (decode side), sink, registry.

Every transport (zmq; nccl; cuda_ipc, through memory shared on one host: CUDA IPC handles for
device caches, a shared-memory file for host caches) implements `KVSender` and `KVReceiver` and
registers itself by name, so workers pick one with `get_transport(name)`.
"""
from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)


class KVTransferError(RuntimeError):
    """A transfer could not proceed (send timed out, peer unreachable, sender closed)."""


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one incoming transfer, reported once per `KVReceiver.expect()`.

    `meta` is the sender's commit metadata (only when `ok`). `seconds` runs from `expect()` to
    the commit (or to the failure). `error` says why a failed transfer failed.
    """

    request_id: str
    ok: bool
    error: str | None = None
    meta: dict[str, Any] | None = None
    layers_received: int = 0
    bytes_received: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class SendResult:
    """Outcome of one outgoing transfer on the sender side.

    `ok` means every frame and the commit were handed to the transport; it does not mean the
    receiver accepted them (the receiver's `TransferResult` is the authority on that).
    """

    request_id: str
    ok: bool
    error: str | None = None
    bytes_sent: int = 0
    seconds: float = 0.0


@runtime_checkable
class KVSink(Protocol):
    """Where a receiver writes verified layers: the decode worker's paged KV cache.

    block_shape: (block_size, num_kv_heads, head_dim) of one block of the cache.
    dtype: the cache's element type as a torch dtype name ("float32", "bfloat16", ...).

    `write(layer, dst_block_ids, k, v)` is called from the receiver's background thread, once per
    verified layer frame, with `k` and `v` torch tensors of shape [len(dst_block_ids),
    *block_shape] and dtype `dtype` (on the CPU for host transports such as zmq; on the cache's
    device for device transports such as nccl); row i goes to block dst_block_ids[i] of that
    layer's K and V cache. The tensors are views of a transport buffer and are valid only
    during the call: copy them, don't keep them. The blocks are reserved for the transfer
    and not read until it completes, so no extra locking against the decode loop is needed;
    a GPU cache must finish the host-to-device copy before `write` returns (or copy the
    source first). An exception from `write` fails the transfer.
    """

    block_shape: tuple[int, int, int]
    dtype: str

    def write(self, layer: int, dst_block_ids: Sequence[int], k: Any, v: Any) -> None: ...


class KVSender(ABC):
    """Prefill side of a transport. One instance per worker process, shared by all requests.

    Call order per request, all from the compute thread:

        open(request_id, peer_address, num_layers)
        send_layer(request_id, layer, ...)      exactly once per layer in [0, num_layers), any order
        commit(request_id, meta)                after the last layer; returns a Future[SendResult]
      or abort(request_id) at any point after open (instead of commit).

    `send_layer` does not wait for the network: it gathers the listed source blocks into a
    staging copy (for CUDA caches, an async device-to-pinned-host copy) and queues it; a
    background thread checksums and sends. When it returns, the caller may overwrite or free
    the source blocks. It blocks only when the staged-but-unsent bytes exceed the transport's
    staging budget (backpressure), and at most for the send timeout, then raises
    `KVTransferError`. Frames are sent in the order they were queued.

    Errors: bad arguments raise ValueError naming the field; a transfer whose background send
    failed (timeout, peer gone) raises `KVTransferError` from later `send_layer` calls and its
    commit future resolves to `SendResult(ok=False)`. The sender never retries: the decode
    side reports the failure (or times out) and the gateway retries the request.
    After commit or abort the request id is forgotten and may be opened again.
    """

    @abstractmethod
    def open(self, request_id: str, peer_address: str, num_layers: int) -> None:
        """Start a transfer to the receiver at `peer_address` (its `KVReceiver.address`)."""

    @abstractmethod
    def send_layer(
        self,
        request_id: str,
        layer: int,
        src_k: Any,
        src_v: Any,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        """Queue blocks `src_block_ids` of one layer's cache for destination `dst_block_ids`.

        src_k, src_v: the whole layer cache, [num_blocks, block_size, num_kv_heads, head_dim]
        torch tensors (CPU or CUDA) or numpy arrays. Block src_block_ids[i] lands in
        dst_block_ids[i]. Every layer of a transfer carries the same destination blocks.
        """

    def send_layers(
        self,
        request_id: str,
        layers: Sequence[int],
        caches: Sequence[tuple[Any, Any]],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        """`send_layer` for each of `layers`, `caches[i]` being layer `layers[i]`'s (src_k, src_v),
        all with the same blocks: how a step's whole KV goes at once. A transport may stage them
        together; on an error the layers before the failing one may have been queued."""
        check_layers(layers, caches)
        for layer, (src_k, src_v) in zip(layers, caches):
            self.send_layer(request_id, layer, src_k, src_v, src_block_ids, dst_block_ids)

    @abstractmethod
    def commit(self, request_id: str, meta: dict[str, Any]) -> Future[SendResult]:
        """Queue the commit after all layers; `meta` is JSON-able and reaches the receiver.

        By convention the prefill worker puts {"first_token_id": int, "logprobs": dict | None,
        "num_tokens": int} there; the transport does not interpret it. The future resolves
        when the commit has been handed to the transport, or when the transfer failed.
        """

    @abstractmethod
    def abort(self, request_id: str, reason: str = "aborted by sender") -> bool:
        """Drop the transfer's unsent frames and tell the receiver; False if `request_id` is not open."""

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters (bytes_sent, frames_sent, transfers_committed, ...) for metrics."""

    @abstractmethod
    def close(self, drain_timeout_s: float = 5.0) -> None:
        """Send what is queued (up to `drain_timeout_s`), then release sockets and threads."""

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVReceiver(ABC):
    """Decode side of a transport: binds `address` and writes verified layers into a `KVSink`.

    Call order per request, from the decode worker:

        expect(request_id, dst_block_ids, num_layers, deadline_s)   before the sender is told
                                                                     the address and blocks
        ... frames arrive; each verified layer is written through the sink ...
        poll_completed() (or the on_complete callback) yields exactly one TransferResult
      or cancel(request_id) to give up (no result is reported then).

    A transfer completes when every layer and the commit arrived. It fails, with
    `TransferResult(ok=False, error=...)`, on: deadline passed, checksum mismatch, dtype or
    shape or destination blocks different from what was expected, a sequence gap, a duplicate
    layer, a commit before all layers, an abort from the sender, or a sink error.
    Frames for request ids that are not expected (never were, or already finished) are
    dropped and counted. Guarantees: a frame is verified (checksum, shape, dtype) before
    anything from it is written, so no corrupt bytes reach the cache; layers verified before
    a failure may already be written into the reserved blocks, which the caller releases.
    Once a result was reported, or `cancel()` returned, nothing is written to that request's
    blocks again, so the caller may free or reuse them at once.
    """

    @property
    @abstractmethod
    def address(self) -> str:
        """Endpoint senders connect to (e.g. tcp://127.0.0.1:5555 or ipc:///run/tandem/kv0)."""

    @abstractmethod
    def expect(
        self, request_id: str, dst_block_ids: Sequence[int], num_layers: int, deadline_s: float
    ) -> None:
        """Register an incoming transfer into `dst_block_ids` (the blocks the sender will fill).

        The transfer fails unless committed within `deadline_s` seconds from now.
        """

    @abstractmethod
    def cancel(self, request_id: str) -> bool:
        """Forget an expected transfer without a result; False if it was not pending."""

    @abstractmethod
    def poll_completed(self, timeout_s: float = 0.0) -> list[TransferResult]:
        """Results finished since the last call; waits up to `timeout_s` for at least one.

        Empty when the receiver was built with an `on_complete` callback, which then gets
        each result on the receiver thread instead.
        """

    @abstractmethod
    def stats(self) -> dict[str, float]:
        """Counters (bytes_received, transfers_ok, transfers_failed, ...) for metrics."""

    @abstractmethod
    def close(self) -> None:
        """Stop the receiver thread and unbind; pending transfers are dropped without results."""

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Transport:
    """A named pair of sender and receiver classes."""

    name: str
    sender_cls: type[KVSender]
    receiver_cls: type[KVReceiver]

    def create_sender(self, **options: Any) -> KVSender:
        return self.sender_cls(**options)

    def create_receiver(self, sink: KVSink, **options: Any) -> KVReceiver:
        return self.receiver_cls(sink, **options)


# Built-in transports are imported on first use so that importing the package stays cheap and
# a transport's heavy dependencies (torch.distributed for nccl) load only when chosen.
_BUILTIN_MODULES: dict[str, str] = {
    "zmq": "kvtransfer.zmq_transport",
    "nccl": "kvtransfer.nccl_transport",
    "cuda_ipc": "kvtransfer.ipc_transport",
}
_REGISTRY: dict[str, Transport] = {}


def register_transport(transport: Transport) -> None:
    """Make `transport` available to `get_transport(transport.name)`; re-registering replaces it."""
    if not transport.name or not isinstance(transport.name, str):
        raise ValueError(f"name: transport name must be a non-empty string, got {transport.name!r}")
    _REGISTRY[transport.name] = transport


def register_builtin(name: str, module: str) -> None:
    """Declare that importing `module` registers transport `name` (lazy registration)."""
    _BUILTIN_MODULES[name] = module


def available_transports() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def get_transport(name: str) -> Transport:
    """The transport registered as `name`; ValueError naming `transport` when unknown."""
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"transport: unknown KV transport {name!r}; available: {', '.join(available_transports())}"
        ) from None


OnComplete = Callable[[TransferResult], None]


def check_layers(layers: Sequence[int], caches: Sequence[tuple[Any, Any]]) -> None:
    """What `KVSender.send_layers` takes: one (src_k, src_v) pair per layer, no layer twice;
    ValueError naming the argument otherwise."""
    if len(layers) != len(caches):
        raise ValueError(f"caches: {len(caches)} (src_k, src_v) pairs for {len(layers)} layers")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers: {list(layers)} names a layer twice")

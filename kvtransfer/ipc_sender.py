"""Prefill side of the ipc transport: check and stage each layer into a lease of its channel's
pool (`kvtransfer.ipc_send_channel`), whose thread announces it over ZMQ.

See `kvtransfer.ipc_transport` for the protocol, `kvtransfer.ipc_wire` for the messages.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import zmq

from kvtransfer import ipc_wire as wire
from kvtransfer.base import KVSender, KVTransferError, check_layers
from kvtransfer.frames import DEFAULT_CHECKSUM, KIND_LAYER, check_checksum_algorithm
from kvtransfer.ipc_pool import CUDA, MAX_SLOTS
from kvtransfer.ipc_send_channel import CORRUPT_ENV, Channel, LayerItem
from kvtransfer.outgoing import OutgoingTransfers

logger = logging.getLogger(__name__)

__all__ = ["CORRUPT_ENV", "IpcSender"]

_SCHEMES = ("tcp://", "ipc://")


class IpcSender(OutgoingTransfers, KVSender):
    """Prefill-side ipc transport (contract: `KVSender`); thread-safe across requests.

    send_timeout_s: bound on every wait (a header send, a free run of slots).
    slots, slot_bytes: each channel's staging pool (`slots * slot_bytes` bytes of host shared
      memory, or of device memory for GPU caches). A layer takes a run of consecutive slots
      holding its K and V; the pool bounds what is staged but not yet read by the receiver.
    shm_dir: where host pools' files live (default /dev/shm).
    checksum_algorithm: for host pools, named in every header; GPU pools are not hashed.
    corrupt_once: test hook (see `kvtransfer.ipc_transport`); None reads TANDEM_KV_CORRUPT_ONCE.
    linger_s: on close, how long each channel waits for its receiver to read what was sent
      (a commit resolves once it is handed over, before the receiver maps the pool) before the
      pool is unlinked and freed.
    """

    schemes = _SCHEMES
    transport_name = "cuda_ipc"

    def __init__(
        self,
        *,
        send_timeout_s: float = 10.0,
        slots: int = 64,
        slot_bytes: int = 4 << 20,
        shm_dir: str | None = None,
        checksum_algorithm: str = DEFAULT_CHECKSUM,
        corrupt_once: bool | None = None,
        linger_s: float = 1.0,
        context: zmq.Context | None = None,
        auth_token: str | None = None,
    ) -> None:
        if not wire.is_int(slots) or not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots: must be an integer in [1, {MAX_SLOTS}], got {slots!r}")
        if not wire.is_int(slot_bytes) or slot_bytes <= 0 or slot_bytes % wire.ALIGN:
            raise ValueError(f"slot_bytes: must be a positive multiple of {wire.ALIGN}, got {slot_bytes!r}")
        if shm_dir is not None and not os.path.isdir(shm_dir):
            raise ValueError(f"shm_dir: {shm_dir!r} is not a directory")
        self.slots, self.slot_bytes, self.shm_dir = slots, slot_bytes, shm_dir
        self.checksum_algorithm = check_checksum_algorithm(checksum_algorithm)
        self._corrupt_pending = os.environ.get(CORRUPT_ENV) == "1" if corrupt_once is None else bool(corrupt_once)
        self._init_outgoing(send_timeout_s=send_timeout_s, linger_s=linger_s, context=context, auth_token=auth_token)

    def _channel_for(self, peer_address: str) -> Channel:
        return self._retiring_channel_for(peer_address, Channel)

    def send_layer(
        self, request_id: str, layer: int, src_k: Any, src_v: Any,
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        state = self._state(request_id)
        src, dst, nbytes = state.check_layer(layer, src_k, src_v, src_block_ids, dst_block_ids)
        channel: Channel = state.channel
        pool = channel.ensure_pool(src_k)
        assert state.layout is not None
        dtype, block_shape = state.layout
        payload = nbytes // 2
        lease = None
        if payload:
            need = wire.slots_needed(payload, pool.slot_bytes)
            if need > pool.slots:
                raise KVTransferError(
                    f"layer of {nbytes} bytes does not fit the staging pool ({pool.slots} slots of {pool.slot_bytes} "
                    "bytes); raise the sender's slots or slot_bytes"
                )
            lease = pool.acquire(need, self.send_timeout_s, channel.stopped)
            try:
                ids = state.src_index(src, src_k.device) if pool.kind == CUDA else src
                pool.stage(lease, src_k, src_v, ids, payload, self._pair_pool)
            except BaseException:
                pool.release(lease.lease_id)
                raise
        state.layers.add(layer)
        channel.put(LayerItem(state, KIND_LAYER, layer=layer, src=src, dst=dst, lease=lease, dtype=dtype,
                               shape=(len(src), *block_shape)))

    def send_layers(
        self, request_id: str, layers: Sequence[int], caches: Sequence[tuple[Any, Any]],
        src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
    ) -> None:
        """All of `layers` in one run of the pool (one search, at most one wait), staged and handed
        to the channel at once (one wake-up of its thread instead of one per layer); as separate
        `send_layer` calls when the run would not fit the pool, so a pool smaller than a step
        still moves it.

        Each layer is gathered by its own index op: a contiguous layer into its contiguous lease
        is the GPU's fast gather, where one op over every layer into the strided run measured
        slower than all of them (BENCHMARKS §12)."""
        check_layers(layers, caches)
        if len(layers) < 2:
            return super().send_layers(request_id, layers, caches, src_block_ids, dst_block_ids)
        state = self._state(request_id)
        checked = [state.check_layer(layer, k, v, src_block_ids, dst_block_ids)
                   for layer, (k, v) in zip(layers, caches)]
        src, dst, nbytes = checked[0]
        channel: Channel = state.channel
        pool = channel.ensure_pool(caches[0][0])
        payload = nbytes // 2
        need = wire.slots_needed(payload, pool.slot_bytes)
        if not payload or need * len(layers) > pool.slots:
            return super().send_layers(request_id, layers, caches, src_block_ids, dst_block_ids)
        for k, _ in caches[1:]:
            pool.check_source(k)
        assert state.layout is not None
        dtype, block_shape = state.layout
        leases = pool.acquire_layers(need, len(layers), self.send_timeout_s, channel.stopped)
        try:
            ids = state.src_index(src, caches[0][0].device) if pool.kind == CUDA else src
            for lease, (k, v) in zip(leases, caches):  # per layer: see the docstring
                pool.stage(lease, k, v, ids, payload, self._pair_pool)
        except BaseException:
            for lease in leases:
                pool.release(lease.lease_id)
            raise
        state.layers.update(layers)
        channel.put_all([
            LayerItem(state, KIND_LAYER, layer=layer, src=src, dst=dst, lease=lease, dtype=dtype,
                      shape=(len(src), *block_shape))
            for layer, lease in zip(layers, leases)
        ])

    def stats(self) -> dict[str, float]:
        channels = [*self._channels.values(), *self._retired]
        pools = [c.pool for c in self._channels.values() if c.pool is not None and c.broken is None]
        return {
            **self._send_stats(),
            "staged_bytes": sum(p.in_use * p.slot_bytes for p in pools),  # held in the pools' slots
            "slots_in_use": sum(p.in_use for p in pools),
            "pool_waits": sum(c.pool.waits for c in channels if c.pool is not None),
        }

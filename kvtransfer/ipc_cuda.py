"""The CUDA half of the ipc transport: export a staging pool and its events, import them, order reads.

Imported only when a cache lives on a GPU (`kvtransfer.ipc_pool` loads it on first use), so a
CPU-only host never runs any of it. The sender allocates the pool as one device buffer and
exports it once per channel with CUDA IPC (torch's `_share_cuda_`, the call
`torch.multiprocessing` makes to send a CUDA tensor), together with one interprocess event per
slot; the receiver opens both with `_new_shared_cuda` and `Event.from_ipc_handle`.

Ordering, per lease (its first slot's event):
  sender     gather the blocks into the slot on the caller's stream, record the slot's event
  receiver   its own stream waits for that event, copies the slot into the cache, records a
             `done` event that the cache device's default stream (the decode engine's) waits
             for, and releases the lease only once `done` has completed on the device
so the sender never overwrites a slot the receiver is still reading, and the engine never reads
a block before its copy. A GPU is named by its UUID, since the two processes may see different
device numbers (CUDA_VISIBLE_DEVICES).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvtransfer.ipc_wire import is_int
from kvtransfer.staging import device_index

# Handles this process exported: CUDA cannot open an IPC handle in the process that made it, so
# a receiver in the same process (tests) uses the original buffer and events instead.
_EXPORTED: dict[str, tuple[torch.Tensor, list[torch.cuda.Event]]] = {}


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_index(uuid: Any) -> int:
    """This process's index of the GPU with `uuid`; ValueError naming device_uuid if it is not visible."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise ValueError(f"device_uuid: GPU {uuid!r} is not visible to this process (check CUDA_VISIBLE_DEVICES)")


def export_pool(device: torch.device, nbytes: int, slots: int) -> tuple[torch.Tensor, list[torch.cuda.Event], dict]:
    """A pool buffer of `nbytes` on `device`, one interprocess event per slot, and their description."""
    with torch.cuda.device(device):
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        (_, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = buffer.untyped_storage()._share_cuda_()
        events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
        event_handles = [e.ipc_handle().hex() for e in events]  # creates each event on this device
    storage = {
        "handle": handle.hex(), "size": size, "offset": offset, "ref_counter_handle": ref_handle.hex(),
        "ref_counter_offset": ref_offset, "event_handle": event_handle.hex(), "event_sync_required": bool(event_sync),
    }
    _EXPORTED[_key(storage)] = (buffer, events)
    return buffer, events, {"device_uuid": device_uuid(device.index), "storage": storage, "events": event_handles}


def forget_export(description: dict) -> None:
    _EXPORTED.pop(_key(description["storage"]), None)


def _key(storage: dict) -> str:
    # One allocation can hold several pools (the caching allocator splits its segments), so
    # the handle alone does not name a pool; handle and offset do.
    return f"{storage.get('handle')}@{storage.get('offset')}"


def import_pool(doc: dict, nbytes: int, slots: int) -> tuple[torch.Tensor, list[torch.cuda.Event]]:
    """Open a pool another process exported (`export_pool`); ValueError naming the bad field."""
    index = local_index(doc.get("device_uuid"))
    storage = doc.get("storage")
    if not isinstance(storage, dict):
        raise ValueError("storage: expected the exported CUDA storage")
    fields = {}
    for name in ("handle", "ref_counter_handle", "event_handle"):
        fields[name] = _hex(storage.get(name), f"storage.{name}")
    for name in ("size", "offset", "ref_counter_offset"):
        value = storage.get(name)
        if not is_int(value) or value < 0:
            raise ValueError(f"storage.{name}: must be a non-negative integer, got {value!r}")
        fields[name] = value
    if fields["size"] != nbytes:
        raise ValueError(f"storage.size: {fields['size']} bytes, the pool description says {nbytes}")
    sync = storage.get("event_sync_required")
    if not isinstance(sync, bool):
        raise ValueError("storage.event_sync_required: must be a boolean")
    events_doc = doc.get("events")
    if not isinstance(events_doc, list) or len(events_doc) != slots:
        raise ValueError(f"events: expected {slots} event handles, one per slot")
    handles = [_hex(h, "events") for h in events_doc]
    local = _EXPORTED.get(_key(storage))
    if local is not None:
        return local
    with torch.cuda.device(index):
        shared = torch.UntypedStorage._new_shared_cuda(
            index, fields["handle"], fields["size"], fields["offset"], fields["ref_counter_handle"],
            fields["ref_counter_offset"], fields["event_handle"], sync,
        )
        device = torch.device("cuda", index)
        buffer = torch.empty(0, dtype=torch.uint8, device=device).set_(shared)
        events = [torch.cuda.Event.from_ipc_handle(device, h) for h in handles]
    if buffer.numel() != nbytes:
        raise ValueError(f"storage.size: mapped {buffer.numel()} bytes, expected {nbytes}")
    return buffer, events


def _hex(value: Any, field_name: str) -> bytes:
    try:
        return bytes.fromhex(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field_name}: expected a hex string") from None


def gather(src_k: torch.Tensor, src_v: torch.Tensor, src_block_ids: Sequence[int] | torch.Tensor,
           k_out: torch.Tensor, v_out: torch.Tensor, event: torch.cuda.Event) -> None:
    """Copy blocks `src_block_ids` (ids, or already an int64 tensor on src_k's device) of K and
    V into the slot views, then record the slot's event.

    Both run on the caller's current stream, after the compute that wrote the layer; the
    caller does not wait for them.
    """
    idx = src_block_ids if isinstance(src_block_ids, torch.Tensor) else device_index(src_block_ids, src_k.device)
    torch.index_select(src_k, 0, idx, out=k_out)
    torch.index_select(src_v, 0, idx, out=v_out)
    event.record(torch.cuda.current_stream(src_k.device))


def new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def begin_read(stream: torch.cuda.Stream, sender_event: torch.cuda.Event) -> None:
    """Order `stream` after the sender's gather into the slot."""
    stream.wait_event(sender_event)


def end_read(stream: torch.cuda.Stream, cache_device: torch.device) -> torch.cuda.Event:
    """Mark the end of a slot's reads on `stream`; the engine's stream waits for it. Returns the
    event whose completion frees the slot."""
    done = torch.cuda.Event()
    done.record(stream)
    torch.cuda.default_stream(cache_device).wait_event(done)
    return done

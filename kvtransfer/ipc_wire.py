"""Messages of the ipc transport's control link, and where a layer sits inside a staging lease.

The link is a ZMQ DEALER on the sender (identity = channel id) and a ROUTER on the receiver.
Every message is [tag, body...] with a JSON body unless noted:

    sender -> receiver
      hello    {"v", "channel"}         first message of a channel
      pool     the pool's description   before the first layer (`kvtransfer.ipc_pool`)
      frame    FrameHeader [, extent]   a layer header carries its extent as a second part;
                                        commit and abort are the header alone
      bye      {}                       the channel is closed; the receiver unmaps its pool
    receiver -> sender
      mapped   {}                       the pool is mapped (the sender may unlink its file)
      release  {"leases": [id, ...]}    these leases were read; their slots may be reused
      refuse   {"error"}                the channel cannot be used; the sender breaks it
      bye      {}                       the receiver is closing

Extent of a layer: {"lease": id, "slot": first, "slots": count}; K starts at byte
first * slot_bytes of the pool and V `v_offset(payload)` bytes after K, where `payload` is the
byte size of K (and of V) that the header's dtype and shape give. A layer without blocks
carries {"slots": 0} and no lease.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

IPC_VERSION = 1

HELLO = b"hello"
POOL = b"pool"
FRAME = b"frame"
BYE = b"bye"
MAPPED = b"mapped"
RELEASE = b"release"
REFUSE = b"refuse"

ALIGN = 512  # slot size and the start of V inside a lease are multiples of this


def encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


def decode(data: bytes | memoryview, what: str) -> dict[str, Any]:
    """Parse a JSON object body; ValueError naming `what` otherwise."""
    try:
        doc = json.loads(bytes(data))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{what}: expected a JSON object")
    return doc


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def v_offset(payload: int) -> int:
    """Where V starts inside a lease: after K, rounded up to `ALIGN`."""
    return -(-payload // ALIGN) * ALIGN


def slots_needed(payload: int, slot_bytes: int) -> int:
    """Consecutive slots a layer with `payload` bytes of K (and as many of V) occupies."""
    return -(-(v_offset(payload) + payload) // slot_bytes) if payload else 0


@dataclass(frozen=True)
class Extent:
    """Where one layer's K and V sit: the lease that holds them and its run of slots."""

    lease: int
    slot: int
    slots: int

    def encode(self) -> bytes:
        return encode({"lease": self.lease, "slot": self.slot, "slots": self.slots} if self.slots else {"slots": 0})

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Extent:
        """Parse an extent; ValueError naming the bad field (ranges are the pool's to check)."""
        doc = decode(data, "extent")
        slots = doc.get("slots")
        if not is_int(slots) or slots < 0:
            raise ValueError(f"slots: must be a non-negative integer, got {slots!r}")
        if slots == 0:
            return cls(lease=-1, slot=0, slots=0)
        lease, slot = doc.get("lease"), doc.get("slot")
        if not is_int(lease) or lease < 0:
            raise ValueError(f"lease: must be a non-negative integer, got {lease!r}")
        if not is_int(slot) or slot < 0:
            raise ValueError(f"slot: must be a non-negative integer, got {slot!r}")
        return cls(lease=lease, slot=slot, slots=slots)


def lease_of(data: bytes | memoryview) -> int | None:
    """The lease id of an extent that may be malformed otherwise, so its slots can still be released."""
    try:
        lease = decode(data, "extent").get("lease")
    except ValueError:
        return None
    return lease if is_int(lease) and lease >= 0 else None

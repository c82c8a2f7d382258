"""Sender-side pieces every KV transport shares: argument checks and one transfer's state."""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvtransfer.base import SendResult
from kvtransfer.staging import StagedLayer, check_cache_pair


def check_open_args(request_id: Any, peer_address: Any, num_layers: Any, schemes: tuple[str, ...]) -> None:
    """ValueError naming the field for a bad `KVSender.open` argument."""
    check_request_id(request_id)
    if not isinstance(peer_address, str) or not peer_address.startswith(schemes):
        raise ValueError(f"peer_address: expected an endpoint starting with one of {schemes}, got {peer_address!r}")
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"num_layers: must be a positive integer, got {num_layers!r}")


def check_request_id(request_id: Any) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")


def parse_block_ids(value: Any, field_name: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in value)
    except (TypeError, ValueError):
        raise ValueError(f"{field_name}: expected a sequence of integers") from None
    if any(i < 0 for i in ids):
        raise ValueError(f"{field_name}: block ids must be non-negative")
    return ids


@dataclass(eq=False)
class Outgoing:
    """Sender-side state of one transfer. `seq`, `bytes_sent` belong to the peer thread."""

    request_id: str
    peer: str
    num_layers: int
    started: float = field(default_factory=time.monotonic)
    layers: set[int] = field(default_factory=set)
    dst_sorted: list[int] | None = None
    layout: tuple[str, tuple[int, ...]] | None = None  # (dtype, block shape) fixed by layer one
    future: Future[SendResult] = field(default_factory=Future)
    seq: int = 0
    bytes_sent: int = 0
    error: str | None = None
    aborted: bool = False

    def check_layer(self, layer: Any, src_k: Any, src_v: Any, src_block_ids: Any,
                    dst_block_ids: Any) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """Validate one `send_layer` call against this transfer (ValueError naming the field);
        fix the layout and destination blocks on the first layer. Returns (src, dst, bytes of K+V)."""
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: must be an integer in [0, {self.num_layers}), got {layer!r}")
        if layer in self.layers:
            raise ValueError(f"layer: layer {layer} of {self.request_id!r} was already sent")
        dtype, shape = check_cache_pair(src_k, src_v)
        src = parse_block_ids(src_block_ids, "src_block_ids")
        dst = parse_block_ids(dst_block_ids, "dst_block_ids")
        if len(src) != len(dst):
            raise ValueError(f"dst_block_ids: {len(dst)} ids for {len(src)} src_block_ids")
        if len(set(dst)) != len(dst):
            raise ValueError("dst_block_ids: ids must be distinct")
        if any(i >= shape[0] for i in src):
            raise ValueError(f"src_block_ids: ids must be below num_blocks={shape[0]}")
        layout = (dtype, shape[1:])
        if self.layout is None:
            self.layout, self.dst_sorted = layout, sorted(dst)
        elif layout != self.layout:
            raise ValueError(f"src_k: dtype/block shape {layout} differs from earlier layers {self.layout}")
        elif sorted(dst) != self.dst_sorted:
            raise ValueError("dst_block_ids: every layer must carry the same destination blocks")
        block_bytes = src_k[:1].nbytes if shape[0] else 0  # bytes of one block, numpy or torch
        return src, dst, 2 * len(src) * block_bytes


@dataclass
class Item:
    state: Outgoing
    kind: str
    layer: int = -1
    staged: StagedLayer | None = None
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()
    meta: dict[str, Any] | None = None
    reason: str = ""

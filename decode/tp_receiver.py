"""KV receiving of a tensor-parallel decode worker: one receiver per rank, one result per transfer.

Rank r holds KV heads [r*H/T, (r+1)*H/T) in its own cache, so each rank binds its own receiver
over its own cache shard and the worker advertises every rank's address (worker.transfer);
prefill rank r pushes to decode rank r. Prefill workers of another degree are refused on their
side (prefill.tp_push.check_pairing): re-slicing heads between degrees is out of scope.

Rank 0 serves Reserve and Decode. `TPReceiver` is its KVReceiver: `expect` registers the
transfer with its own receiver and with every other rank (over the TP link, acknowledged
before Reserve answers, so no rank can see frames of a transfer it does not expect yet);
each rank reports its own TransferResult, and the service's `on_complete` gets one combined
result per transfer: ok when every rank's transfer completed, failed at the first rank that
failed (the other ranks' parts are cancelled then). The other ranks run `FollowerReceiver`.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvtransfer import KVReceiver, TransferResult
from kvtransfer.base import OnComplete
from worker.tp_link import CANCEL, EXPECT, RankLink
from worker.transfer import join_kv_addresses

logger = logging.getLogger(__name__)

RECEIVED = "received"
ACK_TIMEOUT_S = 5.0


def _result_body(result: TransferResult) -> dict[str, Any]:
    return {"kind": RECEIVED, "tid": result.request_id, "ok": result.ok, "error": result.error,
            "layers": result.layers_received, "bytes": result.bytes_received, "seconds": result.seconds}


def _result_from_body(body: dict[str, Any]) -> TransferResult:
    return TransferResult(body["tid"], bool(body["ok"]), body.get("error"), None, int(body.get("layers") or 0),
                          int(body.get("bytes") or 0), float(body.get("seconds") or 0.0))


class TPReceiver(KVReceiver):
    """Rank 0's view of the ranks' receivers as one. Build it, build rank 0's own receiver
    with `on_rank0_result` as its callback, then `attach` that receiver and the addresses."""

    def __init__(self, world_size: int, link: RankLink, on_complete: OnComplete) -> None:
        self.world_size = world_size
        self.link = link
        self.on_complete = on_complete
        self.local: KVReceiver | None = None
        self.addresses: list[str] = []
        self._lock = threading.Lock()
        self._pending: dict[str, dict[int, TransferResult]] = {}
        self._follower_bytes = 0

    def attach(self, local: KVReceiver, addresses: Sequence[str]) -> None:
        if len(addresses) != self.world_size:
            raise ValueError(f"addresses: {len(addresses)} receiver addresses for tp {self.world_size}")
        self.local, self.addresses = local, list(addresses)

    @property
    def address(self) -> str:
        return join_kv_addresses(self.addresses)

    def expect(self, request_id: str, dst_block_ids: Sequence[int], num_layers: int, deadline_s: float) -> None:
        with self._lock:
            self._pending[request_id] = {}
        try:
            self.local.expect(request_id, dst_block_ids, num_layers, deadline_s)
            self.link.request(EXPECT, {"tid": request_id, "dst": list(dst_block_ids), "layers": num_layers,
                                       "deadline_s": deadline_s}, min(ACK_TIMEOUT_S, deadline_s))
        except BaseException:
            self.cancel(request_id)
            raise

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            self._pending.pop(request_id, None)
        self.link.send(CANCEL, {"tid": request_id})
        return self.local.cancel(request_id)

    def on_rank0_result(self, result: TransferResult) -> None:
        """Rank 0's receiver callback (its receiver thread)."""
        self._add(0, result)

    def on_rank_result(self, rank: int, body: dict[str, Any]) -> None:
        """Another rank's result (the TP link thread)."""
        if body.get("kind") != RECEIVED:
            return
        with self._lock:
            self._follower_bytes += int(body.get("bytes") or 0)
        self._add(rank, _result_from_body(body))

    def _add(self, rank: int, result: TransferResult) -> None:
        tid = result.request_id
        with self._lock:
            parts = self._pending.get(tid)
            if parts is None:
                return  # cancelled, or an earlier rank already failed it
            parts[rank] = result
            if result.ok and len(parts) < self.world_size:
                return
            del self._pending[tid]
        if not result.ok:  # the other ranks' parts are of no use now
            self.link.send(CANCEL, {"tid": tid})
            if rank != 0:
                self.local.cancel(tid)
        self.on_complete(self._combine(tid, parts, rank if not result.ok else None))

    @staticmethod
    def _combine(tid: str, parts: dict[int, TransferResult], failed_rank: int | None) -> TransferResult:
        if failed_rank is not None:
            bad = parts[failed_rank]
            return TransferResult(tid, False, f"rank {failed_rank}: {bad.error}", None, bad.layers_received,
                                  sum(p.bytes_received for p in parts.values()), bad.seconds)
        return TransferResult(tid, True, None, parts[0].meta, min(p.layers_received for p in parts.values()),
                              sum(p.bytes_received for p in parts.values()), max(p.seconds for p in parts.values()))

    def poll_completed(self, timeout_s: float = 0.0) -> list[TransferResult]:
        return []  # results go to on_complete

    def stats(self) -> dict[str, float]:
        stats = dict(self.local.stats()) if self.local is not None else {}
        with self._lock:
            stats["bytes_received"] = stats.get("bytes_received", 0) + self._follower_bytes
        return stats

    def close(self) -> None:
        if self.local is not None:
            self.local.close()


class FollowerReceiver:
    """Rank r > 0 of a TP decode worker: runs rank 0's expect / cancel commands on this rank's
    receiver and reports each of its transfers' results through `report(body)`."""

    def __init__(self, report: Callable[[dict[str, Any]], None]) -> None:
        self.report = report
        self.receiver: KVReceiver | None = None

    def on_transfer(self, result: TransferResult) -> None:
        """The receiver's on_complete callback."""
        self.report(_result_body(result))

    def on_command(self, kind: str, body: dict[str, Any]) -> None:
        if kind == EXPECT:
            self.receiver.expect(body["tid"], body["dst"], int(body["layers"]), float(body["deadline_s"]))
        elif kind == CANCEL:
            self.receiver.cancel(body["tid"])
        else:
            raise ValueError(f"command: unknown {kind!r}")

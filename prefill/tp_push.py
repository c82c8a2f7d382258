"""KV push of a tensor-parallel prefill worker: every rank pushes its own KV heads.

Rank r of a TP prefill worker holds KV heads [r*H/T, (r+1)*H/T) of every block, and so does
rank r of a TP decode worker of the same degree T, so rank r pushes straight to decode rank r
(the r-th of the addresses the decode worker advertises) and no rank ever needs another's
heads. Pairing workers of different degrees would need the heads re-sliced on the way; that is
out of scope, and such a pairing is refused (`check_pairing`).

How the other ranks know what to push: rank 0's `KvPusher` decides which requests push in a
step (those whose last prompt chunk the step computes) and puts a `PushPlan` per request into
the step's broadcast (`parallel.runner` step extras). Each other rank runs the same step and,
through `FollowerPusher.on_step`, pushes its shard of each planned layer right after the layer
is computed, at the same layer points as rank 0, then commits. It reports its SendResult to
rank 0 over the TP link (`worker.tp_link`); `RankSends` collects those, and rank 0 answers the
Prefill call once its own commit and every other rank's were handed to the transport.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import asdict, dataclass
from typing import Any

from engine.model import LayerHook
from kvtransfer import KVSender, KVTransferError, SendResult
from prefill.push_mode import check_kv_push, layers_due, named_layers
from worker.transfer import KvPairingError

logger = logging.getLogger(__name__)

SENT = "sent"


def check_pairing(num_addresses: int, tp: int, decode_worker: str) -> None:
    """KvPairingError naming tp when a decode worker that advertises `num_addresses` KV
    receivers (one per rank) cannot take this worker's `tp` shards."""
    if num_addresses != tp:
        raise KvPairingError(
            f"tp: decode worker {decode_worker or '?'} runs tensor parallel size {num_addresses} "
            f"({num_addresses} KV receiver address{'es' if num_addresses != 1 else ''}), this prefill worker runs "
            f"tensor parallel size {tp}; prefill and decode workers that exchange KV must use the same --tp "
            f"(re-slicing KV heads between different degrees is not supported)"
        )


@dataclass(frozen=True)
class PushPlan:
    """One request's push in one step, as every rank needs it."""

    transfer_id: str
    addresses: list[str]  # decode rank r's receiver at index r
    num_layers: int
    src_block_ids: list[int]
    dst_block_ids: list[int]


def encode_plans(plans: list[PushPlan]) -> bytes:
    return json.dumps([asdict(p) for p in plans], separators=(",", ":")).encode() if plans else b""


def decode_plans(data: bytes) -> list[PushPlan]:
    return [PushPlan(**d) for d in json.loads(data)] if data else []


def sent_body(transfer_id: str, result: SendResult) -> dict[str, Any]:
    return {"kind": SENT, "tid": transfer_id, "ok": result.ok, "error": result.error,
            "bytes": result.bytes_sent}


class FollowerPusher:
    """Rank `rank` > 0 of a TP prefill worker: pushes its shard of the planned layers.

    `report(body)` sends a result to rank 0 (any thread).
    """

    def __init__(self, rank: int, kv_layers: list, sender: KVSender, report: Callable[[dict[str, Any]], None],
                 push: str = "layer") -> None:
        check_kv_push(push)
        self.rank = rank
        self.kv_layers = kv_layers
        self.sender = sender
        self.report = report
        self.push = push  # when the layers go: rank 0's rule (prefill.push_mode)

    def on_step(self, extras: bytes) -> LayerHook | None:
        plans = decode_plans(extras)
        if not plans:
            return None
        failed: set[str] = set()

        def after_layer(layer: int) -> None:
            for plan in plans:
                due = layers_due(layer, plan.num_layers, self.push)
                if due and plan.transfer_id not in failed and not self._push(plan, due):
                    failed.add(plan.transfer_id)

        return after_layer

    def _push(self, plan: PushPlan, layers: range) -> bool:
        tid = plan.transfer_id
        try:
            if layers[0] == 0:
                self.sender.open(tid, plan.addresses[self.rank], plan.num_layers)
            caches = [self.kv_layers[layer] for layer in layers]
            self.sender.send_layers(tid, layers, caches, plan.src_block_ids, plan.dst_block_ids)
            if layers[-1] == plan.num_layers - 1:
                fut = self.sender.commit(tid, {"rank": self.rank})
                fut.add_done_callback(lambda f: self.report(sent_body(tid, f.result())))
        except (KVTransferError, ValueError, IndexError) as exc:
            error = f"rank {self.rank}: kv push of {named_layers(layers)} failed: {exc}"
            logger.warning("%s: %s", tid, error)
            self.sender.abort(tid, error)
            self.report(sent_body(tid, SendResult(tid, False, error=error)))
            return False
        return True


@dataclass(eq=False)
class _Watch:
    future: Future
    deadline: float
    results: dict[int, dict[str, Any]]


class RankSends:
    """Rank 0: the other ranks' SendResults per transfer. `watch` before the step that pushes
    is broadcast (so no result can come first); `on_result` from the TP link thread; `tick`
    fails watches whose ranks did not all report in time."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.bytes_sent = 0
        self._lock = threading.Lock()
        self._watches: dict[str, _Watch] = {}

    def watch(self, transfer_id: str, timeout_s: float) -> Future:
        """Future[list[result body]] of ranks 1..world-1."""
        w = _Watch(Future(), time.monotonic() + timeout_s, {})
        with self._lock:
            self._watches[transfer_id] = w
        return w.future

    def forget(self, transfer_id: str) -> None:
        with self._lock:
            self._watches.pop(transfer_id, None)

    def on_result(self, rank: int, body: dict[str, Any]) -> None:
        if body.get("kind") != SENT:
            return
        with self._lock:
            self.bytes_sent += int(body.get("bytes") or 0)
            w = self._watches.get(body["tid"])
            if w is None:
                return
            w.results[rank] = body
            if len(w.results) < self.world_size - 1:
                return
            del self._watches[body["tid"]]
        w.future.set_result([w.results[r] for r in sorted(w.results)])

    def tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [(tid, w) for tid, w in self._watches.items() if w.deadline <= now]
            for tid, _ in late:
                del self._watches[tid]
        for tid, w in late:
            missing = sorted(set(range(1, self.world_size)) - set(w.results))
            w.future.set_result([*w.results.values(),
                                 {"kind": SENT, "tid": tid, "ok": False, "bytes": 0,
                                  "error": f"ranks {missing} did not report their kv push in time"}])


def combine_sends(own: Future, ranks: Future) -> Future:
    """Future[SendResult] that resolves once rank 0's send and the other ranks' results did:
    ok only when every rank's commit was handed to its transport."""
    out: Future = Future()

    def finish(_: Future) -> None:
        if not (own.done() and ranks.done()):
            return
        mine: SendResult = own.result()
        others: list[dict[str, Any]] = ranks.result()
        errors = [] if mine.ok else [f"rank 0: {mine.error}"]
        errors += [str(b.get("error")) for b in others if not b.get("ok")]
        result = SendResult(mine.request_id, not errors, "; ".join(errors) or None,
                            mine.bytes_sent + sum(int(b.get("bytes") or 0) for b in others), mine.seconds)
        try:
            out.set_result(result)
        except InvalidStateError:  # both callbacks ran at once; the first one answered
            pass

    own.add_done_callback(finish)
    ranks.add_done_callback(finish)
    return out

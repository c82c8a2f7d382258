"""Reservations of a decode worker: blocks held for a prompt whose KV a prefill worker pushes.

Lifecycle: Reserve creates one in state RESERVED (engine blocks held, the KV receiver
expecting the transfer, an expiry timer set). It leaves that state exactly once: to DECODING
when Decode activates it, or to RELEASED (blocks freed) on Release, Abort, a failed transfer,
or expiry. The state changes on the engine thread only; the table's lock
lets gRPC handlers look reservations up from the event loop.
"""
from __future__ import annotations

import collections
import enum
import logging
import threading
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from kvtransfer import TransferResult
from worker.engine_loop import TimerHandle
from worker.transfer import transfer_id

logger = logging.getLogger(__name__)

_MAX_TOMBSTONES = 4096


class ReservationState(enum.Enum):
    RESERVED = "reserved"
    DECODING = "decoding"
    RELEASED = "released"


@dataclass(eq=False)
class Reservation:
    request_id: str
    reservation_id: int
    num_cached_blocks: int
    dst_block_ids: list[int]
    num_output_tokens: int
    deadline: float
    result: Future = field(default_factory=Future)  # Future[TransferResult]
    state: ReservationState = ReservationState.RESERVED
    timer: TimerHandle | None = None

    @property
    def transfer_id(self) -> str:
        return transfer_id(self.request_id, self.reservation_id)

    def resolve(self, result: TransferResult) -> None:
        """Set the transfer outcome once (later calls are ignored)."""
        try:
            self.result.set_result(result)
        except InvalidStateError:
            pass


class ReservationTable:
    """Live reservations by request id and transfer id, plus why recent ones ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_request: dict[str, Reservation] = {}
        self._by_transfer: dict[str, Reservation] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._by_request)

    def add(self, res: Reservation) -> None:
        with self._lock:
            self._by_request[res.request_id] = res
            self._by_transfer[res.transfer_id] = res
            self._ended.pop(res.request_id, None)

    def get(self, request_id: str) -> Reservation | None:
        with self._lock:
            return self._by_request.get(request_id)

    def by_transfer(self, tid: str) -> Reservation | None:
        with self._lock:
            return self._by_transfer.get(tid)

    def remove(self, res: Reservation, reason: str) -> None:
        with self._lock:
            if self._by_request.get(res.request_id) is res:
                del self._by_request[res.request_id]
            self._by_transfer.pop(res.transfer_id, None)
            self._ended[res.request_id] = f"reservation {res.reservation_id} {reason}"
            while len(self._ended) > _MAX_TOMBSTONES:
                self._ended.popitem(last=False)

    def ended_reason(self, request_id: str) -> str | None:
        with self._lock:
            return self._ended.get(request_id)

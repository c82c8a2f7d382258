"""The gateway's admin service, `tandem.v1.Admin` (protos/tandem/v1/admin.proto): list the
workers the gateway routes to, and mark one drained or isolated (or clear the mark).

A mark is `WorkerHandle.mark`; a marked handle is not `routable`, so the dispatcher gives it no
new request and the placer routes no prompt to it; streams already running on it move to another
decode worker (gateway.request: as after the worker's death, each resumed exactly once), or
finish there when no other decode worker is routable.
Marks live in this gateway's memory and outlast the worker's restarts (same address).

Callers: the infra agent (`tandem agent`) and operators. Every call runs on the gateway's event
loop. Served on the gateway's port; with a cluster token (always under `tandem up`) every call
must carry it (`x-tandem-cluster-token`), else UNAUTHENTICATED (tandem/security.py).
"""
from __future__ import annotations

import logging

import grpc

from gateway.workers import WorkerHandle, WorkerRegistry
from tandem import wire
from tandem._proto.tandem.v1 import admin_pb2

logger = logging.getLogger(__name__)

DRAINED = "drained"
ISOLATED = "isolated"


def worker_to_proto(h: WorkerHandle, mark_reason: str = "") -> admin_pb2.AdminWorker:
    stats = h.stats
    return admin_pb2.AdminWorker(
        name=h.name, address=h.address, role=h.role, up=h.up, draining=bool(stats is not None and stats.draining),
        mark=h.mark, mark_reason=mark_reason if h.mark else "", metrics_port=stats.metrics_port if stats else 0,
        inflight=h.inflight, routable=h.routable, last_error=h.last_error,
    )


class AdminService(wire.AdminServicer):
    """ListWorkers / Drain / Isolate / Clear over one `WorkerRegistry`."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry
        self._reasons: dict[str, str] = {}  # address -> why it was marked

    async def ListWorkers(self, request: admin_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> admin_pb2.ListWorkersResponse:
        return admin_pb2.ListWorkersResponse(workers=[self._view(h) for h in self.registry.handles])

    async def Drain(self, request: admin_pb2.WorkerMarkRequest,
                    context: grpc.aio.ServicerContext) -> admin_pb2.WorkerMarkResponse:
        h = await self._find(request.worker, context)
        if h.mark == ISOLATED:  # an isolation is only ended by Clear, never weakened to a drain
            return admin_pb2.WorkerMarkResponse(worker=self._view(h))
        return self._mark(h, DRAINED, request.reason)

    async def Isolate(self, request: admin_pb2.WorkerMarkRequest,
                      context: grpc.aio.ServicerContext) -> admin_pb2.WorkerMarkResponse:
        return self._mark(await self._find(request.worker, context), ISOLATED, request.reason)

    async def Clear(self, request: admin_pb2.WorkerMarkRequest,
                    context: grpc.aio.ServicerContext) -> admin_pb2.WorkerMarkResponse:
        return self._mark(await self._find(request.worker, context), "", request.reason)

    async def _find(self, worker: str, context: grpc.aio.ServicerContext) -> WorkerHandle:
        if not worker:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker: give a worker name or address")
        for h in self.registry.handles:
            if worker in (h.name, h.address):
                return h
        known = ", ".join(f"{h.name} ({h.address})" for h in self.registry.handles)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"worker: no worker {worker!r}; known: {known}")
        raise AssertionError("unreachable")

    def _mark(self, h: WorkerHandle, mark: str, reason: str) -> admin_pb2.WorkerMarkResponse:
        if h.mark != mark:
            logger.warning("admin: worker %s (%s) %s%s", h.name, h.address, mark or "cleared",
                           f": {reason}" if reason else "")
        h.mark = mark
        self._reasons[h.address] = reason if mark else ""
        self.registry.on_change()  # the dispatcher re-checks capacity
        return admin_pb2.WorkerMarkResponse(worker=self._view(h))

    def _view(self, h: WorkerHandle) -> admin_pb2.AdminWorker:
        return worker_to_proto(h, self._reasons.get(h.address, ""))

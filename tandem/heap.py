"""The garbage collector and a serving process's long-lived heap.

A worker's heap after start-up holds the model's modules, torch, grpc and the protobuf
descriptors, a gateway's grpc, its routing tables and the tokenizer: objects that live as long
as the process. Python's cyclic collector scans them on each of its full collections, which the
short-lived objects of serving (a step's outputs, stream chunks, scheduler records) trigger
under load, on a worker's engine thread as on any event loop. `freeze_startup_heap` moves them
out of the collector's reach once the process serves (`gc.freeze`, what vLLM's engine core and
SGLang's scheduler do after start-up), so a collection scans only what serving allocated.
`TANDEM_GC_FREEZE=0` leaves the heap as it is. Called by the processes' entry points and by
`engine.LLM` on a GPU (an offline run's own entry, as vLLM's worker freezes after warm-up); not
by the Engine, which workers and tests build.
"""
from __future__ import annotations

import gc
import logging
import os

GC_FREEZE_ENV = "TANDEM_GC_FREEZE"

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive (none of them is scanned or collected again;
    garbage they become later is not reclaimed, which start-up objects seldom become). Returns
    how many objects the collector no longer scans: 0 with TANDEM_GC_FREEZE=0."""
    if os.environ.get(GC_FREEZE_ENV, "1").strip() == "0":
        return 0
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("froze %d objects of the start-up heap", frozen)
    return frozen

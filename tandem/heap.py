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

What serving adds to the heap for good (the prefix cache's nodes, the requests and their token
lists) still reaches the oldest generation, and CPython collects that generation fully once it
has grown by a quarter: with the start-up heap frozen, the growth since the last full pass is
soon a quarter, so full passes over a growing cache come every few seconds. The same call
therefore raises the youngest generation's threshold from CPython's 700 to
`YOUNG_THRESHOLD` (`TANDEM_GC_THRESHOLD` sets another; what libraries with a large live heap
do): a step's short-lived objects die by reference count before a collection sees them, so
fewer collections promote fewer survivors, and a full pass comes seldom. Cyclic garbage waits
for a collection as long as `YOUNG_THRESHOLD` allocations at most.
"""
from __future__ import annotations

import gc
import logging
import os

GC_FREEZE_ENV = "TANDEM_GC_FREEZE"
GC_THRESHOLD_ENV = "TANDEM_GC_THRESHOLD"
YOUNG_THRESHOLD = 50_000

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive (none of them is scanned or collected again;
    garbage they become later is not reclaimed, which start-up objects seldom become), and raise
    the youngest generation's threshold (`young_threshold`). Returns how many objects the
    collector no longer scans: 0 with TANDEM_GC_FREEZE=0, which leaves the threshold too.
    ValueError for a TANDEM_GC_THRESHOLD that is not a positive integer."""
    if os.environ.get(GC_FREEZE_ENV, "1").strip() == "0":
        return 0
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(young_threshold(), older, oldest)
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug("froze %d objects of the start-up heap", frozen)
    return frozen


def young_threshold() -> int:
    """The youngest generation's threshold for serving: TANDEM_GC_THRESHOLD or YOUNG_THRESHOLD."""
    text = os.environ.get(GC_THRESHOLD_ENV, "").strip()
    if not text:
        return YOUNG_THRESHOLD
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{GC_THRESHOLD_ENV} must be a positive integer (CPython's default is 700), got {text!r}")
    return value

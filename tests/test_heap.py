"""tandem.heap: the start-up heap leaves the cyclic collector's scans, unless turned off."""
from __future__ import annotations

import gc

import pytest

from tandem.heap import GC_FREEZE_ENV, freeze_startup_heap


@pytest.fixture(autouse=True)
def _unfreeze():
    yield
    gc.unfreeze()


def test_freeze_takes_the_live_heap_out_of_collections(monkeypatch) -> None:
    monkeypatch.delenv(GC_FREEZE_ENV, raising=False)
    gc.unfreeze()
    kept = [[i] for i in range(1000)]  # alive at start-up
    frozen = freeze_startup_heap()
    # The count it returns is the permanent generation's then; frozen objects that die since
    # leave it (another test's finished thread, say), so the count now may be a few lower.
    assert frozen >= gc.get_freeze_count() > max(len(kept), frozen - 100)
    scanned = {id(o) for o in gc.get_objects()}
    assert not any(id(x) in scanned for x in kept)  # the collector no longer sees them
    cycle: list = []
    cycle.append(cycle)  # garbage made while serving is still collected
    del cycle
    assert gc.collect() >= 1


def test_freeze_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv(GC_FREEZE_ENV, "0")
    gc.unfreeze()
    assert freeze_startup_heap() == 0 and gc.get_freeze_count() == 0

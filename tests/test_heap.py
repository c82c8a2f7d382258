"""tandem.heap: the start-up heap leaves the cyclic collector's scans and the youngest generation's
threshold is raised, unless turned off."""
from __future__ import annotations

import gc

import pytest

from tandem.heap import GC_FREEZE_ENV, GC_THRESHOLD_ENV, YOUNG_THRESHOLD, freeze_startup_heap


@pytest.fixture(autouse=True)
def _unfreeze():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


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
    gc.set_threshold(700, 10, 10)
    assert freeze_startup_heap() == 0 and gc.get_freeze_count() == 0
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("value, young", [(None, YOUNG_THRESHOLD), ("700", 700), (" 12345 ", 12345)])
def test_the_youngest_threshold_is_raised(monkeypatch, value, young) -> None:
    """The older generations' thresholds stay; TANDEM_GC_THRESHOLD names the youngest's."""
    monkeypatch.delenv(GC_FREEZE_ENV, raising=False)
    if value is None:
        monkeypatch.delenv(GC_THRESHOLD_ENV, raising=False)
    else:
        monkeypatch.setenv(GC_THRESHOLD_ENV, value)
    gc.set_threshold(700, 11, 12)
    freeze_startup_heap()
    assert gc.get_threshold() == (young, 11, 12)


@pytest.mark.parametrize("value", ["0", "-5", "many", "1.5"])
def test_a_bad_threshold_names_the_variable(monkeypatch, value) -> None:
    monkeypatch.delenv(GC_FREEZE_ENV, raising=False)
    monkeypatch.setenv(GC_THRESHOLD_ENV, value)
    gc.set_threshold(700, 10, 10)
    with pytest.raises(ValueError, match=GC_THRESHOLD_ENV):
        freeze_startup_heap()
    assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0

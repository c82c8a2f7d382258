"""The worker's GIL switch interval: 0.5 ms, or TANDEM_GIL_SWITCH_US's microseconds; a bad value
is refused naming the variable."""
from __future__ import annotations

import pytest

from entrypoints.worker import GIL_SWITCH_ENV, GIL_SWITCH_INTERVAL_S, gil_switch_interval_s


def test_the_default_and_an_override(monkeypatch) -> None:
    monkeypatch.delenv(GIL_SWITCH_ENV, raising=False)
    assert gil_switch_interval_s() == GIL_SWITCH_INTERVAL_S
    monkeypatch.setenv(GIL_SWITCH_ENV, "100")
    assert gil_switch_interval_s() == pytest.approx(1e-4)


@pytest.mark.parametrize("value", ["0", "-5", "1e9", "fast", "nan"])
def test_a_bad_value_names_the_variable(monkeypatch, value: str) -> None:
    monkeypatch.setenv(GIL_SWITCH_ENV, value)
    with pytest.raises(ValueError, match=GIL_SWITCH_ENV):
        gil_switch_interval_s()

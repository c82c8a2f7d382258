"""engine.cublas: an engine's process runs cuBLAS without a workspace unless it names one."""
from __future__ import annotations

import os

import pytest

from engine.cublas import NO_WORKSPACE, WORKSPACE_ENV, default_no_workspace


def test_unset_becomes_no_workspace(monkeypatch) -> None:
    monkeypatch.delenv(WORKSPACE_ENV, raising=False)
    assert default_no_workspace() is True
    assert os.environ[WORKSPACE_ENV] == NO_WORKSPACE == ":0:0"
    assert default_no_workspace() is False  # set now: left as it is


@pytest.mark.parametrize("value", [":4096:8", ":16:8", ":0:0"])
def test_a_value_the_process_names_wins(monkeypatch, value) -> None:
    monkeypatch.setenv(WORKSPACE_ENV, value)
    assert default_no_workspace() is False and os.environ[WORKSPACE_ENV] == value


def test_an_engine_on_the_cpu_leaves_it_unset(monkeypatch, tiny_models) -> None:
    from engine import LLM

    monkeypatch.delenv(WORKSPACE_ENV, raising=False)
    LLM(tiny_models["llama"], num_kv_blocks=16, max_running=2, device="cpu")
    assert WORKSPACE_ENV not in os.environ

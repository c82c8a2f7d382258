"""Nothing lost, nobody stuck: fault injection on real processes (a prefill worker and decode
workers on loopback, the demo llama), through the scenarios of bench/faults.py with CI-sized
counts (TANDEM_FAULT_SCALE=1 runs the full counts: 500 requests, a 3,000-call burst).

- abort / disconnect / deadline at random points of many requests, including an Abort racing
  the submit and a disconnect before the first chunk, with and without a decode worker
  SIGKILLed mid-run: every stream terminates (an aborted one within a second), the gateway
  holds nothing afterwards, every worker frees every block, and it serves normally again;
- a burst far beyond the tier queues: every call OK or RESOURCE_EXHAUSTED naming its tier
  (none CANCELLED by the RPC library), every INTERACTIVE call served, the calls held bounded;
- SIGSTOP of a decode worker with streams on it: they resume elsewhere with the fault-free
  tokens while it is still frozen; a burst of 32 splits no worse than 20/12; SIGSTOP of a
  prefill worker: its prefills migrate;
- malformed protobuf (bad UTF-8, truncated) answers INVALID_ARGUMENT;
- workers sharing one copy of the weights: SIGKILL of the decode worker that loaded them
  mid-stream leaves the others' copy, and every stream keeps the fault-free tokens;
- a decode worker's device lost mid-stream (worker/device_fault.py): the worker exits with
  DEVICE_LOST_EXIT, saying why, and its streams resume on the other with the fault-free tokens.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.faults import (FaultResult, Rig, burst, device_loss_env, frozen_worker, killed_weight_loader, lifecycle,
                          lost_device, malformed, start_rig, worker_flags)
from engine.engine import OVERLAP_ENV

SCALE = float(os.environ.get("TANDEM_FAULT_SCALE", "0"))  # 0: the CI counts below


def count(ci: int, full: int) -> int:
    return max(4, int(full * SCALE)) if SCALE > 0 else ci


@pytest.fixture(scope="module")
def rig(tiny_models: dict[str, Path], tmp_path_factory) -> Rig:
    overlap = {OVERLAP_ENV: "1"}
    specs = {"p0": ("prefill", worker_flags()), "p1": ("prefill", worker_flags()),
             "d0": ("decode", worker_flags(), overlap), "d1": ("decode", worker_flags(), overlap),
             "dv": ("decode", worker_flags(), overlap)}
    work = tmp_path_factory.mktemp("faults")
    specs["dl"] = ("decode", worker_flags(), {**overlap, **device_loss_env(work / "lose-dl")})
    r = start_rig(tiny_models["llama"], work, specs)
    yield r
    r.stop()


def clean(result: FaultResult) -> None:
    assert result.failures == 0, result.row()
    assert result.tokens_lost == 0, result.row()
    assert result.leaked_blocks == 0, result.row()
    assert not any(result.extra["gateway_in_flight"].values()), result.extra


def test_abort_disconnect_deadline_at_random_points(rig: Rig) -> None:
    result = lifecycle(rig, count(90, 500), seed=1)
    clean(result)
    # Every way of ending happened (abort chunk, client disconnect, deadline, normal end).
    assert {"abort", "DISCONNECTED", "DEADLINE_EXCEEDED", "length"} <= set(result.outcomes), result.outcomes
    assert result.extra["late_aborts"] == 0


def test_burst_is_answered_by_our_admission(rig: Rig) -> None:
    result = burst(rig, count(1500, 3000))
    clean(result)
    codes = {k.split(":")[1] for k in result.outcomes}
    assert codes <= {"OK", "RESOURCE_EXHAUSTED"} and "RESOURCE_EXHAUSTED" in codes, result.outcomes
    assert result.outcomes["INTERACTIVE:OK"] == sum(v for k, v in result.outcomes.items() if k.startswith("INTERACTIVE"))
    assert result.extra["peak_calls"] <= result.extra["bound"]


def test_frozen_decode_worker_streams_migrate_token_for_token(rig: Rig) -> None:
    result = frozen_worker(rig, 32, role="decode", stall_timeout_s=2.0)
    clean(result)
    assert result.extra["finished_frozen"]  # every stream ended while the worker was still stopped
    assert result.extra["stalls"] >= 1, result.row()
    assert max(result.extra["split"]) <= 20 and sum(result.extra["split"]) == 32, result.extra["split"]


def test_frozen_prefill_worker_prefills_migrate(rig: Rig) -> None:
    result = frozen_worker(rig, 6, role="prefill", stall_timeout_s=2.0)
    clean(result)
    assert result.extra["stalls"] >= 1, result.row()


def test_malformed_protobuf_is_invalid_argument(rig: Rig) -> None:
    result = malformed(rig, count(40, 900))
    clean(result)
    assert result.outcomes["INVALID_ARGUMENT"] >= 30 * result.requests // 40


def test_a_decode_worker_whose_device_is_lost_exits_and_its_streams_resume(rig: Rig) -> None:
    from worker.device_fault import DEVICE_LOST_EXIT

    result = lost_device(rig, rig.work / "lose-dl", count(8, 16), max_tokens=200)
    clean(result)
    assert result.extra["exit_code"] == DEVICE_LOST_EXIT, result.row()
    assert result.extra["logged_why"], result.row()


def test_decode_worker_killed_during_random_aborts(rig: Rig) -> None:
    """Last: the killed worker stays dead."""
    result = lifecycle(rig, count(48, 500), seed=2, kill="dv", decode=("d0", "dv"))
    clean(result)


def test_killing_the_worker_whose_weights_the_others_map_loses_no_token(tiny_models: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    """Its own workers (one loads, two map); the streams on the killed one resume on the other."""
    result = killed_weight_loader(tiny_models["llama"], tmp_path, count(8, 16), max_tokens=200)
    clean(result)
    assert result.outcomes["OK"] == result.requests

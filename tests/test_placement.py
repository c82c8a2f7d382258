"""`tandem up`'s GPU placement as a pure function: every GPU count × worker mix × tp, on the CPU."""
from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from entrypoints.placement import DECODE_WEIGHT, PlacementError, parse_gpus, place

GPU_COUNTS = (0, 1, 2, 4, 8)
FRACTION = 0.9


def shapes():
    """(prefill, decode, colocated) for 1-4 workers in all."""
    for total in range(1, 5):
        yield 0, total, True
        for p in range(1, total):
            yield p, total - p, False


@pytest.mark.parametrize("n_gpus", GPU_COUNTS)
@pytest.mark.parametrize("tp", (1, 2))
def test_every_shape_is_placed_or_refused_by_flag(n_gpus: int, tp: int) -> None:
    gpus = tuple(range(n_gpus))
    for prefill, decode, colocated in shapes():
        n_workers = decode if colocated else prefill + decode
        if n_gpus and tp > n_gpus:
            with pytest.raises(PlacementError, match=r"^--tp: 2 GPUs per worker, but only 1 GPU"):
                place(gpus, prefill=prefill, decode=decode, tp=tp, colocated=colocated)
            continue
        pl = place(gpus, prefill=prefill, decode=decode, tp=tp, colocated=colocated, memory_fraction=FRACTION)
        roles = [w.role for w in pl.workers]
        assert len(pl.workers) == n_workers
        assert roles == (["both"] * decode if colocated else ["prefill"] * prefill + ["decode"] * decode)
        assert len({w.name for w in pl.workers}) == n_workers
        if not n_gpus:
            assert all(w.device == "cpu" and w.gpus == () and w.memory_fraction is None for w in pl.workers)
            assert all(w.cuda_visible_devices is None for w in pl.workers)
            assert pl.kv_transport == (None if colocated else "zmq")
            continue
        per_gpu: dict[int, float] = defaultdict(float)
        hosts: dict[int, list] = defaultdict(list)
        for w in pl.workers:
            assert w.device == "cuda"
            assert len(w.gpus) == tp and len(set(w.gpus)) == tp and set(w.gpus) <= set(gpus)
            # A worker's GPUs are one group of tp consecutive ones, and its own come first in what it sees.
            assert w.gpus[0] % tp == 0 and list(w.gpus) == list(range(w.gpus[0], w.gpus[0] + tp))
            assert w.cuda_visible_devices.split(",")[:tp] == [str(g) for g in w.gpus]
            assert 0 < w.memory_fraction <= FRACTION
            for g in w.gpus:
                per_gpu[g] += w.memory_fraction
                hosts[g].append(w)
        for g, total in per_gpu.items():  # the cluster's share of each GPU is used, never exceeded
            assert total == pytest.approx(FRACTION, abs=1e-3)
        groups = n_gpus // tp
        if groups >= n_workers:
            # A group each: disjoint GPUs, prefill and decode apart, the whole share each.
            used = [g for w in pl.workers for g in w.gpus]
            assert len(used) == len(set(used)) and not pl.shared
            assert all(w.memory_fraction == FRACTION for w in pl.workers)
        else:
            assert pl.shared
            assert len(per_gpu) == groups * tp  # every group is used
            for on in hosts.values():
                dec = [w.memory_fraction for w in on if w.role in ("decode", "both")]
                pre = [w.memory_fraction for w in on if w.role == "prefill"]
                if dec and pre:
                    assert min(dec) > max(pre)  # decode workers hold the long-lived KV
            loads = [sum(DECODE_WEIGHT if w.role != "prefill" else 1.0 for w in hosts[g])
                     for g in range(0, groups * tp, tp)]
            assert max(loads) - min(loads) <= DECODE_WEIGHT
        if colocated:
            assert pl.kv_transport is None
        else:
            sides = {w.gpus for w in pl.workers}
            assert pl.kv_transport == ("cuda_ipc" if len(sides) == 1 else "nccl")


def test_one_gpu_shares_memory_two_to_one_in_favour_of_decode() -> None:
    pl = place([0], prefill=1, decode=1)
    assert pl.worker("prefill-0").memory_fraction == pytest.approx(0.3)
    assert pl.worker("decode-0").memory_fraction == pytest.approx(0.6)
    assert pl.kv_transport == "cuda_ipc"
    assert pl.describe() == ["prefill-0 (prefill): GPU 0, 30% of memory", "decode-0 (decode): GPU 0, 60% of memory"]


def test_prefill_memory_ratio_moves_a_shared_gpus_memory_between_the_roles() -> None:
    pl = place([0], prefill=1, decode=1, prefill_memory_ratio=0.25)
    assert pl.worker("prefill-0").memory_fraction == pytest.approx(0.18)
    assert pl.worker("decode-0").memory_fraction == pytest.approx(0.72)
    apart = place([0, 1], prefill=1, decode=1, prefill_memory_ratio=0.25)  # a GPU each: nothing to share
    assert apart.worker("prefill-0").memory_fraction == apart.worker("decode-0").memory_fraction == 0.9
    for bad in (0, -1, 50, True, "x"):
        with pytest.raises(PlacementError, match="^--prefill-memory-ratio"):
            place([0], prefill_memory_ratio=bad)


def test_eight_gpus_tp2_one_pair_gives_disjoint_groups_and_nccl() -> None:
    pl = place(range(8), prefill=1, decode=1, tp=2)
    assert pl.worker("decode-0").gpus == (0, 1) and pl.worker("prefill-0").gpus == (2, 3)
    assert pl.kv_transport == "nccl"


def test_explicit_cuda_ipc_across_gpus_lets_decode_see_the_prefill_gpus() -> None:
    pl = place([0, 1, 2], prefill=2, decode=1, kv_transport="cuda_ipc")
    assert pl.worker("decode-0").cuda_visible_devices == "0,1,2"
    assert pl.worker("prefill-0").cuda_visible_devices == "1"


def test_bad_input_names_the_flag() -> None:
    with pytest.raises(PlacementError, match="^--kv-transport: cuda_ipc needs GPUs"):
        place([], kv_transport="cuda_ipc")
    with pytest.raises(PlacementError, match="^--kv-transport: must be one of"):
        place([0], kv_transport="pigeon")
    with pytest.raises(PlacementError, match="^--gpu-memory-fraction"):
        place([0], memory_fraction=1.5)
    with pytest.raises(PlacementError, match="^--tp"):
        place([0, 1, 2], tp=4)
    with pytest.raises(PlacementError, match="^--decode-workers"):
        place([0], decode=0)


def test_parse_gpus() -> None:
    assert parse_gpus(None, 4) == (0, 1, 2, 3)
    assert parse_gpus("2,0", 4) == (2, 0)
    assert parse_gpus("", 4) == ()
    for bad, why in (("0,0", "twice"), ("5", "does not exist"), ("a", "comma-separated")):
        with pytest.raises(PlacementError, match=f"^--gpus: .*{why}"):
            parse_gpus(bad, 4)


def test_gpu_choice_keeps_physical_indices() -> None:
    pl = place(parse_gpus("3,5", 8), prefill=1, decode=1)
    assert {w.gpus for w in pl.workers} == {(3,), (5,)}
    assert list(itertools.chain(*(w.gpus for w in pl.workers))) == [5, 3]  # prefill listed first, decode got 3

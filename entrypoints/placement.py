"""Where `tandem up` puts each worker: its GPUs, its share of their memory, and the KV transport.

`place()` is a pure function of the visible GPUs and the cluster's shape; `tandem up` calls it
once before starting anything and hands each worker what it decided (CUDA_VISIBLE_DEVICES,
`--device`, `--gpu-memory-fraction`, `--kv-transport`). It never touches a GPU, so the CPU tests
check every case.

Rules:
- No GPUs: every worker runs on the CPU; the KV transport is ZMQ.
- Each worker needs `tp` GPUs; the GPUs are cut into groups of `tp` consecutive ones (GPUs left
  over are unused). With a group per worker, every worker gets its own (decode workers first,
  then prefill workers: prefill and decode never share a GPU), and the whole cluster share of
  memory (`memory_fraction`) of it.
- With fewer groups than workers, workers share groups: each goes to the group with the least
  weight so far (decode and role-both workers weigh DECODE_WEIGHT, prefill workers
  PREFILL_MEMORY_RATIO of that, since decode workers hold the long-lived KV;
  `--prefill-memory-ratio` sets it), and the group's share is split in proportion to the weights.
- `--kv-transport auto`: none for role-both workers (no KV moves); ZMQ on the CPU; CUDA IPC when
  every prefill and decode worker runs on the same GPUs; NCCL when they are on different GPUs.
  An explicit cuda_ipc across GPUs makes each decode worker also see its prefill workers' GPUs
  (after its own, which stay its cuda:0..tp-1) so that it can map their staging memory.
- `--kv-push auto` (`Placement.kv_push`): a prefill worker that shares a GPU with a decode
  worker pushes a prompt's KV once its forward has run (`step`): the two processes take turns
  on the GPU, and the decode worker's copy of each layer, interleaved with the forward, made the
  prefill step ~40% longer on an H200 (BENCHMARKS §11). Elsewhere each layer goes as soon as it
  is computed (`layer`), overlapping the transfer with the rest of the forward.
- Turns (`Placement.gpu_partners`, `worker.gpu_turn`): a decode worker waits for the steps of
  the prefill workers that share its GPU before its own (at most 50 ms), so a prompt's forward
  does not take turns with decode steps.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DECODE_WEIGHT = 2.0
PREFILL_MEMORY_RATIO = 0.5  # a prefill worker's weight against a decode worker's (--prefill-memory-ratio)
# A prefill worker's context where it shares a GPU with a decode worker (--prefill-max-model-len):
# its KV reserve for one longest prompt is then a few GiB, not the model's whole context (16 GiB
# for Llama-3.1-8B), and the decode worker prefills the rare longer prompt itself.
SHARED_PREFILL_MAX_MODEL_LEN = 32768
MIN_PREFILL_MEMORY_RATIO, MAX_PREFILL_MEMORY_RATIO = 0.05, 20.0
KV_TRANSPORTS = ("auto", "zmq", "nccl", "cuda_ipc")


def physical_gpus(gpus: tuple[int, ...]) -> str:
    """CUDA_VISIBLE_DEVICES for a child: `gpus` index what this process sees, which is its own
    CUDA_VISIBLE_DEVICES list when it has one."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES")
    if parent:
        names = [x.strip() for x in parent.split(",") if x.strip()]
        return ",".join(names[g] for g in gpus)
    return ",".join(map(str, gpus))


class PlacementError(ValueError):
    """The cluster cannot be placed on these GPUs; the message names the flag to change."""


@dataclass(frozen=True)
class WorkerPlacement:
    """One worker: `gpus` are physical GPU indices (empty on the CPU), `memory_fraction` the
    share of each of them this worker may use (None on the CPU), `visible` what its
    CUDA_VISIBLE_DEVICES lists (its own GPUs first)."""

    name: str
    role: str  # prefill, decode or both
    gpus: tuple[int, ...]
    memory_fraction: float | None
    visible: tuple[int, ...] = ()

    @property
    def device(self) -> str:
        return "cuda" if self.gpus else "cpu"

    @property
    def cuda_visible_devices(self) -> str | None:
        """The CUDA_VISIBLE_DEVICES to give this worker (None on the CPU)."""
        return ",".join(map(str, self.visible or self.gpus)) if self.gpus else None


@dataclass(frozen=True)
class Placement:
    workers: tuple[WorkerPlacement, ...]
    kv_transport: str | None  # None: no KV transfer (role-both workers only)
    gpus: tuple[int, ...]  # the GPUs the cluster may use

    @property
    def shared(self) -> bool:
        """Whether some GPU hosts more than one worker."""
        used = [g for w in self.workers for g in w.gpus]
        return len(used) != len(set(used))

    @property
    def prefill_decode_gpus(self) -> tuple[int, ...]:
        """The GPUs (in `gpus` order) on which a prefill and a decode worker both run."""
        return tuple(g for g in self.gpus
                     if {"prefill", "decode"} <= {w.role for w in self.workers if g in w.gpus})

    def gpu_partners(self, name: str) -> list[str]:
        """The workers of the other disaggregated role (decode for a prefill worker, prefill for
        a decode worker) that share a GPU with worker `name`, in placement order."""
        me = self.worker(name)
        other = {"prefill": "decode", "decode": "prefill"}.get(me.role)
        return [w.name for w in self.workers if w.role == other and set(me.gpus) & set(w.gpus)]

    def kv_push(self, name: str, requested: str = "auto") -> str:
        """When prefill worker `name` pushes a prompt's KV (`prefill.push_mode`): `requested`
        unless it is auto, then step where it shares a GPU with a decode worker, else layer."""
        if requested != "auto":
            return requested
        return "step" if self.gpu_partners(name) else "layer"

    def worker(self, name: str) -> WorkerPlacement:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(name)

    def describe(self) -> list[str]:
        """One line per worker: name, role, GPUs, memory share."""
        lines = []
        for w in self.workers:
            where = f"GPU {','.join(map(str, w.gpus))}" if w.gpus else "CPU"
            share = f", {w.memory_fraction:.0%} of memory" if w.memory_fraction is not None else ""
            lines.append(f"{w.name} ({w.role}): {where}{share}")
        return lines


def worker_names(prefill: int, decode: int, colocated: bool) -> list[tuple[str, str]]:
    """(name, role) of every worker `tandem up` starts, in start order."""
    if colocated:
        return [(f"worker-{i}", "both") for i in range(decode)]
    return [(f"prefill-{i}", "prefill") for i in range(prefill)] + [(f"decode-{i}", "decode") for i in range(decode)]


def parse_gpus(value: str | None, visible: int) -> tuple[int, ...]:
    """The `--gpus` list ("0,1,3"; None: all `visible` ones); PlacementError naming --gpus."""
    if value is None:
        return tuple(range(visible))
    if value.strip() == "":
        return ()
    try:
        gpus = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise PlacementError(f"--gpus: expected comma-separated GPU indices such as 0,1, got {value!r}") from None
    if len(set(gpus)) != len(gpus):
        raise PlacementError(f"--gpus: {value!r} lists a GPU twice")
    bad = [g for g in gpus if not 0 <= g < visible]
    if bad:
        raise PlacementError(f"--gpus: GPU {bad[0]} does not exist ({visible} visible)")
    return gpus


def place(gpus: Sequence[int], *, prefill: int = 1, decode: int = 1, tp: int = 1, colocated: bool = False,
          memory_fraction: float = 0.9, kv_transport: str = "auto",
          prefill_memory_ratio: float = PREFILL_MEMORY_RATIO) -> Placement:
    """Place the workers of `tandem up` on `gpus` (physical indices; empty: CPU only).

    prefill / decode: worker counts (colocated: `decode` role-both workers, no prefill ones).
    memory_fraction: the share of one GPU's memory the whole cluster may use on it.
    prefill_memory_ratio: on a shared GPU, a prefill worker's memory against a decode worker's.
    Raises PlacementError naming the flag when it cannot be done (e.g. fewer GPUs than --tp).
    """
    gpus = tuple(gpus)
    for flag, value in (("--prefill-workers", prefill), ("--decode-workers", decode), ("--tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if flag == "--prefill-workers" else 1):
            raise PlacementError(f"{flag}: must be an integer >= 1, got {value!r}")
    if not (isinstance(memory_fraction, (int, float)) and 0 < memory_fraction <= 1):
        raise PlacementError(f"--gpu-memory-fraction: must be in (0, 1], got {memory_fraction!r}")
    if isinstance(prefill_memory_ratio, bool) or not isinstance(prefill_memory_ratio, (int, float)) \
            or not MIN_PREFILL_MEMORY_RATIO <= prefill_memory_ratio <= MAX_PREFILL_MEMORY_RATIO:
        raise PlacementError(f"--prefill-memory-ratio: must be in [{MIN_PREFILL_MEMORY_RATIO:g}, "
                             f"{MAX_PREFILL_MEMORY_RATIO:g}], got {prefill_memory_ratio!r}")
    if kv_transport not in KV_TRANSPORTS:
        raise PlacementError(f"--kv-transport: must be one of {', '.join(KV_TRANSPORTS)}, got {kv_transport!r}")
    names = worker_names(prefill, decode, colocated)
    if not colocated and prefill < 1:
        raise PlacementError("--prefill-workers: must be >= 1 without --colocated")
    if not gpus:
        if kv_transport in ("nccl", "cuda_ipc") and not colocated:
            raise PlacementError(f"--kv-transport: {kv_transport} needs GPUs, and none is visible (use zmq or auto)")
        workers = tuple(WorkerPlacement(n, r, (), None) for n, r in names)
        return Placement(workers, None if colocated else "zmq", ())
    if tp > len(gpus):
        raise PlacementError(f"--tp: {tp} GPUs per worker, but only {len(gpus)} GPU(s) available "
                             f"({','.join(map(str, gpus))}); lower --tp or choose more with --gpus")
    groups = [gpus[i * tp:(i + 1) * tp] for i in range(len(gpus) // tp)]
    weight = {"prefill": DECODE_WEIGHT * prefill_memory_ratio, "decode": DECODE_WEIGHT, "both": DECODE_WEIGHT}
    # Decode (heavier) workers first, so that with a group each they take the first groups and,
    # when sharing, the heavy ones spread before the light ones fill in.
    order = sorted(range(len(names)), key=lambda i: (-weight[names[i][1]], i))
    load = [0.0] * len(groups)
    members: list[list[int]] = [[] for _ in groups]
    group_of: dict[int, int] = {}
    for i in order:
        g = min(range(len(groups)), key=lambda k: (load[k], k))
        load[g] += weight[names[i][1]]
        members[g].append(i)
        group_of[i] = g
    fractions = {i: memory_fraction * weight[names[i][1]] / load[group_of[i]] for i in range(len(names))}
    transport: str | None
    if colocated:
        transport = None
    elif kv_transport != "auto":
        transport = kv_transport
    else:
        on = {groups[group_of[i]] for i, (_, role) in enumerate(names)}
        transport = "cuda_ipc" if len(on) == 1 else "nccl"
    prefill_gpus = tuple(dict.fromkeys(g for i, (_, r) in enumerate(names) if r == "prefill"
                                       for g in groups[group_of[i]]))
    workers = []
    for i, (name, role) in enumerate(names):
        own = groups[group_of[i]]
        visible = own
        if transport == "cuda_ipc" and role == "decode":
            visible = own + tuple(g for g in prefill_gpus if g not in own)
        workers.append(WorkerPlacement(name, role, own, round(fractions[i], 4), visible))
    return Placement(tuple(workers), transport, gpus)


def visible_gpu_count() -> int:
    """GPUs this process sees (0 without torch or CUDA). Imports torch: call only from `tandem up`."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except RuntimeError:  # a broken driver: serve on the CPU
        return 0

"""CUDA MPS on the GPUs that a prefill and a decode worker share (`tandem up`'s default where it
can be had; `--mps`, `--no-mps`).

Two processes on one GPU time-slice: their kernels never run side by side, so by default the
decode worker waits out each prompt's forward (worker.gpu_turn: the prompt goes first). Under MPS
(NVIDIA's Multi-Process Service) the two processes' kernels share the GPU's SMs at once: a decode
step can run beside a prompt's forward instead of after it. MPS keeps the turns while the
decode worker runs at most `MPS_MAX_BATCH` sequences (worker.gpu_turn) and runs side by side above
that. On an H100 (1024/256, BENCHMARKS.md §45–47) that moved the FP8 rate within the SLO from 24
to 26 req/s with TPOT P50 14% lower at 22–24 req/s, and took TTFT P50 at 2 req/s from 32.1 to
30.3 ms (bf16), TPOT the same; side by side at every batch (`--no-gpu-turn`) reached the same rate
but cost 4–5 ms of TTFT P50 at 2 req/s. The 512-prompt burst moved as many tokens a second and the
bf16 rate within the SLO rose from 16 to 18 req/s (§47), so `tandem up` runs such GPUs under MPS by
default where it can (`auto_unavailable`: the tools are there, --tp 1, and no MPS daemon of the
user's is in effect), and in turns otherwise; `--mps` insists (an error where it cannot),
`--no-mps` keeps the turns.

`tandem up` starts one MPS control daemon per such GPU (`nvidia-cuda-mps-control -f`) with
its own pipe and log directories in tandem up's private run directory, so it needs no system-wide
MPS and leaves any other alone. The daemon and the workers it serves name the GPU by UUID: an MPS
server renumbers the GPUs it sees, a UUID stays what it is (NVIDIA's advice). The daemon runs
under `python -m entrypoints.mps`, which asks the kernel for SIGTERM when tandem up dies and then
becomes the daemon (exec), so it never outlives tandem up; tandem up's stop asks it to quit once
the workers have gone. A worker the supervisor restarts connects to the same daemon.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from entrypoints.cluster import ClusterProcess
from entrypoints.nvidia_smi import uuid
from entrypoints.placement import Placement, physical_gpus
from worker.device_fault import DEVICE_LOST_EXIT

logger = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
# Where a system-wide daemon listens when its pipe directory is not set: a CUDA process started
# there becomes its client without being told.
SYSTEM_PIPE_DIR = Path("/tmp/nvidia-mps")
_PARENT_ENV = "TANDEM_MPS_PARENT_PID"
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 30.0

# A CUDA client in miniature (the driver API through ctypes: no torch, ~0.3 s): it creates a
# context on its one visible GPU, which under MPS makes the daemon start its server and connects
# to it; exit status 0, or the failing call and CUDA's name for the error on stderr. A daemon
# can answer its control pipe while its server cannot start (a GPU or driver without MPS, another
# user's server on the GPU): the workers would then fail at their first CUDA call.
_PROBE_SOURCE = """
import ctypes, sys
cuda = ctypes.CDLL("libcuda.so.1")
dev, ctx, name = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_char_p()
for step, call in (("cuInit", lambda: cuda.cuInit(0)), ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0)),
                   ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))):
    rc = call()
    if rc:
        cuda.cuGetErrorName(rc, ctypes.byref(name))
        sys.exit(f"{step}: {name.value.decode() if name.value else rc}")
"""
PROBE_ARGV = (sys.executable, "-c", _PROBE_SOURCE)


class MpsError(RuntimeError):
    """MPS cannot be had as asked; the message names --mps and what to do."""


def check_placement(placement: Placement) -> tuple[int, ...]:
    """placement.prefill_decode_gpus, or MpsError where --mps has nothing to do or cannot serve a
    worker there (a worker that sees more GPUs than its own one: an MPS client reaches one server)."""
    gpus = placement.prefill_decode_gpus
    if not gpus:
        raise MpsError("--mps: no GPU here hosts both a prefill and a decode worker (MPS lets the two run "
                       "side by side on one GPU); drop --mps, or place them together (e.g. --gpus 0)")
    for w in placement.workers:
        if set(w.gpus) & set(gpus) and len(w.visible or w.gpus) != 1:
            raise MpsError(f"--mps: worker {w.name} sees GPUs {w.visible or w.gpus}; under MPS a worker runs on "
                           "one GPU (--tp 1, no --kv-transport cuda_ipc across GPUs)")
    return gpus


@dataclass
class MpsDaemon:
    """One GPU's MPS control daemon, `run_dir` holding its pipe and log directories.
    `physical_gpu`: the GPU as the machine numbers it (for messages); `uuid`: as the daemon and
    its clients name it."""

    physical_gpu: str
    uuid: str
    run_dir: Path
    control: str = CONTROL
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def pipe_dir(self) -> Path:
        return self.run_dir / "pipe"

    @property
    def log_dir(self) -> Path:
        return self.run_dir / "log"

    def client_env(self) -> dict[str, str]:
        """What a worker on this GPU needs in its environment to run under this daemon."""
        return {"CUDA_VISIBLE_DEVICES": self.uuid, PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def start(self, log_path: Path | None = None, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the daemon and wait until it answers; MpsError (with its log's tail) if it does not."""
        for d in (self.pipe_dir, self.log_dir):
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
        env = {**os.environ, **self.client_env(), _PARENT_ENV: str(os.getpid())}
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "entrypoints.mps", self.control], env=env,
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            if log_path is not None:
                out.close()
        deadline = time.monotonic() + timeout_s
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = (f"exited with code {self.proc.returncode}" if self.proc.poll() is not None
                       else f"did not answer within {timeout_s:g} s")
                self.stop()
                raise MpsError(f"--mps: the MPS control daemon for GPU {self.physical_gpu} {why}"
                               f"{self._log_tail(log_path)}; start without --mps")
            time.sleep(0.05)
        logger.info("MPS control daemon for GPU %s (%s) started: pipe %s", self.physical_gpu, self.uuid, self.pipe_dir)

    def ask(self, command: str, timeout_s: float = 5.0) -> str | None:
        """The daemon's answer to one control command (`get_server_list`, `quit`, ...); None if
        it cannot be asked."""
        try:
            done = subprocess.run([self.control], input=command + "\n", capture_output=True, text=True,
                                  env={**os.environ, **self.client_env()}, timeout=timeout_s)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    def answers(self) -> bool:
        return self.ask("get_server_list") is not None

    def client_fails(self, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
        """Why a CUDA client cannot start under this (started) daemon, or None where one can
        (PROBE_ARGV, run with the workers' environment)."""
        try:
            done = subprocess.run(PROBE_ARGV, capture_output=True, text=True, timeout=timeout_s,
                                  env={**os.environ, **self.client_env()}, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"a CUDA client did not start within {timeout_s:g} s"
        except OSError as exc:
            return f"a CUDA client could not be run ({exc})"
        if done.returncode == 0:
            return None
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return f"a CUDA client failed under it ({tail[0]})"

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the daemon to quit (it stops its server, whose clients should be gone by now);
        terminate it if it has not exited within `timeout_s`."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.ask("quit", timeout_s)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("MPS control daemon for GPU %s did not quit; terminating it", self.physical_gpu)
                self.proc.terminate()
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.proc = None

    def _log_tail(self, log_path: Path | None) -> str:
        logs = [p for p in (log_path, self.log_dir / "control.log") if p is not None and p.is_file()]
        tail = " | ".join(line for p in logs for line in p.read_text(errors="replace").strip().splitlines()[-3:])
        return f" ({tail})" if tail else ""


def auto_unavailable(placement: Placement, tp: int = 1) -> str | None:
    """Why `tandem up` given neither --mps nor --no-mps runs its GPUs without MPS, or None where
    it starts its own daemons (start_daemons). "" where no GPU hosts both a prefill and a decode
    worker (nothing to say: MPS has nothing to do there); otherwise a reason for the banner."""
    if not placement.prefill_decode_gpus:
        return ""
    if tp > 1:
        return "--tp > 1 (an MPS client runs on one GPU)"
    try:
        check_placement(placement)
    except MpsError as exc:
        return str(exc).removeprefix("--mps: ")
    if shutil.which(CONTROL) is None:
        return f"{CONTROL} is not on PATH"
    if os.environ.get(PIPE_ENV):
        return f"${PIPE_ENV} names an MPS daemon of yours"
    if (SYSTEM_PIPE_DIR / "control").exists():
        return f"a system-wide MPS daemon runs ({SYSTEM_PIPE_DIR})"
    return None


def start_daemons(placement: Placement, run_dir: Path, log_dir: Path | None = None) -> dict[int, MpsDaemon]:
    """A started daemon for each GPU of check_placement(placement), by the GPU as tandem up sees
    it, each with a CUDA client seen to start under it (MpsDaemon.client_fails); MpsError (the
    daemons started so far stopped) where one cannot be had."""
    gpus = check_placement(placement)
    control = shutil.which(CONTROL)
    if control is None:
        raise MpsError(f"--mps: {CONTROL} is not on PATH (it comes with the NVIDIA driver's utilities); "
                       "install them or start without --mps")
    daemons: dict[int, MpsDaemon] = {}
    try:
        for gpu in gpus:
            physical = physical_gpus((gpu,))
            gpu_uuid = uuid(physical)
            if gpu_uuid is None:
                raise MpsError(f"--mps: nvidia-smi cannot tell GPU {physical}'s UUID, which MPS clients name it by")
            daemon = MpsDaemon(physical, gpu_uuid, run_dir / f"mps-gpu{gpu}", control)
            daemon.start(log_dir / f"mps-gpu{gpu}.log" if log_dir else None)
            daemons[gpu] = daemon
            why = daemon.client_fails()
            if why is not None:
                raise MpsError(f"--mps: GPU {physical}'s MPS daemon started, but {why}; start without --mps")
    except BaseException:
        stop_daemons(daemons)
        raise
    return daemons


def banner_row(daemon: MpsDaemon, turn_max_batch: int | None) -> str:
    """tandem up's banner line for `daemon`'s GPU; `turn_max_batch`: the decode worker's turn bound
    (--gpu-turn-max-batch), None where it takes no turns."""
    how = ("side by side" if turn_max_batch is None else
           f"in turns while the decode worker runs at most {turn_max_batch} sequences, side by side above")
    return f"  MPS on GPU {daemon.physical_gpu} ({daemon.uuid}): its prefill and decode workers run {how}"


def turns_rows(placement: Placement, why: str) -> list[str]:
    """tandem up's banner lines for the GPUs a prefill and a decode worker share without MPS
    (`why`: auto_unavailable's reason, or why a daemon did not start)."""
    return [f"  GPU {physical_gpus((gpu,))}: its prefill and decode workers take turns (no MPS: {why})"
            for gpu in placement.prefill_decode_gpus]


def fault_sharers(placement: Placement, daemons: dict[int, MpsDaemon], name: str) -> list[str]:
    """The other workers that are clients of an MPS daemon worker `name` is a client of. A fatal
    GPU fault of one MPS client is reported to every client of its server, which takes no new
    client until they have all exited: when `name` leaves with its device lost
    (worker.device_fault), these must be restarted too."""
    gpus = set(placement.worker(name).gpus) & set(daemons)
    return [w.name for w in placement.workers if w.name != name and gpus & set(w.gpus)]


def restart_fault_sharers(processes: Iterable[ClusterProcess], placement: Placement,
                          daemons: dict[int, MpsDaemon]) -> Callable[[ClusterProcess, int | None], None]:
    """Cluster.watch's `on_exit` under --mps: a worker that left with its device lost
    (DEVICE_LOST_EXIT) takes the other clients of its MPS daemons down with it (SIGKILL, as a
    crash: the gateway resumes their streams elsewhere), so that the server recovers and the
    watch restarts them all."""
    by_name = {p.name: p for p in processes}

    def on_exit(process: ClusterProcess, code: int | None) -> None:
        if code != DEVICE_LOST_EXIT or process.name not in by_name:
            return
        for name in fault_sharers(placement, daemons, process.name):
            other = by_name.get(name)
            if other is not None and other.alive():
                logger.warning("%s lost its device under MPS, whose server reports that to every client on the "
                               "GPU: restarting %s too", process.name, name)
                other.kill()

    return on_exit


def stop_daemons(daemons: dict[int, MpsDaemon]) -> None:
    for daemon in daemons.values():
        daemon.stop()


def main(argv: list[str]) -> None:
    """`python -m entrypoints.mps CONTROL`: SIGTERM to this process when the one named in
    $TANDEM_MPS_PARENT_PID (tandem up) dies, then become `CONTROL -f` (the setting survives exec)."""
    from tandem.native import parent_death_signal

    parent = os.environ.pop(_PARENT_ENV, None)
    if parent and parent_death_signal(signal.SIGTERM) and os.getppid() != int(parent):
        sys.exit(1)  # tandem up died before the watch was set
    os.execv(argv[0], [argv[0], "-f"])


if __name__ == "__main__":
    main(sys.argv[1:])

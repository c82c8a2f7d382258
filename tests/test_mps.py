"""`tandem up --mps` (entrypoints/mps.py): one MPS control daemon per GPU that a prefill and a
decode worker share, its workers pointed at it, the daemon gone with tandem up.

On the CPU the daemon is a stand-in `nvidia-cuda-mps-control` (an external NVIDIA tool, not one
of ours) that keeps the real one's contract: `-f` runs in the foreground until a `quit` arrives
through a client invocation (`echo quit | nvidia-cuda-mps-control`), and a client invocation
fails while no daemon runs on its pipe directory. tests/test_gpu_services.py's MPS test runs the
real one on a GPU."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from entrypoints.cluster import Cluster, ClusterProcess
from entrypoints.mps import (MpsDaemon, MpsError, auto_unavailable, banner_row, check_placement, fault_sharers,
                             restart_fault_sharers, start_daemons, stop_daemons)
from entrypoints.placement import Placement, WorkerPlacement, place
from worker.gpu_turn import MPS_MAX_BATCH

REPO = Path(__file__).resolve().parents[1]
UUID = "GPU-5f0e6c1a-0000-4000-8000-00000000beef"

FAKE_CONTROL = textwrap.dedent('''\
    #!{python}
    """nvidia-cuda-mps-control's contract: -f serves until quit; a client fails without a daemon."""
    import json, os, sys, time
    pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
    state = os.path.join(pipe, "daemon.json")
    if sys.argv[1:] == ["-f"]:
        with open(state + ".tmp", "w") as f:
            json.dump({{"pid": os.getpid(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                       "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY")}}, f)
        os.replace(state + ".tmp", state)
        while not os.path.exists(os.path.join(pipe, "quit")):
            time.sleep(0.02)
        os.unlink(state)
        sys.exit(0)
    if not os.path.exists(state):
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    command = sys.stdin.read().strip()
    if command == "quit":
        open(os.path.join(pipe, "quit"), "w").close()
    elif command != "get_server_list":
        sys.exit(1)
''')


# A CUDA client's contract under MPS (entrypoints.mps.PROBE_ARGV): it starts where a daemon runs
# on its pipe directory and it sees one GPU, by UUID; FAKE_CLIENT_ERROR set: the driver refuses.
FAKE_CLIENT = textwrap.dedent('''\
    import json, os, sys
    if os.environ.get("FAKE_CLIENT_ERROR"):
        sys.exit("cuDevicePrimaryCtxRetain: " + os.environ["FAKE_CLIENT_ERROR"])
    state = os.path.join(os.environ["CUDA_MPS_PIPE_DIRECTORY"], "daemon.json")
    if not os.path.exists(state) or json.load(open(state))["visible"] != os.environ.get("CUDA_VISIBLE_DEVICES"):
        sys.exit("cuInit: CUDA_ERROR_MPS_CONNECTION_FAILED")
''')


@pytest.fixture
def nvidia_tools(tmp_path: Path, monkeypatch) -> Path:
    """A stand-in nvidia-cuda-mps-control and an nvidia-smi that answers the UUID query, on PATH,
    and a stand-in CUDA client for the check that one starts under a daemon."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(FAKE_CONTROL.format(python=sys.executable))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncase "$*" in *uuid*) echo {UUID};; *) echo 143771;; esac\n')
    for exe in (control, smi):
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr("entrypoints.mps.PROBE_ARGV", (sys.executable, "-c", FAKE_CLIENT))
    return bin_dir


def _daemon_state(daemon: MpsDaemon) -> dict:
    return json.loads((daemon.pipe_dir / "daemon.json").read_text())


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_mps_is_for_the_gpus_a_prefill_and_a_decode_worker_share() -> None:
    assert place([0]).prefill_decode_gpus == (0,)
    assert place([0, 1, 2, 3], prefill=2, decode=2).prefill_decode_gpus == ()  # each worker has its own GPU
    assert place([0, 1], prefill=2, decode=2).prefill_decode_gpus == (0, 1)
    assert place([0], prefill=2, decode=1).prefill_decode_gpus == (0,)
    assert place([0], colocated=True).prefill_decode_gpus == ()  # one role-both worker: nothing to run beside
    for placement in (place([]), place([0, 1]), place([0], colocated=True)):
        with pytest.raises(MpsError, match="--mps: no GPU here hosts both a prefill and a decode worker"):
            check_placement(placement)
    # A decode worker that also sees another GPU (to map memory there) cannot be an MPS client.
    wide = Placement((WorkerPlacement("prefill-0", "prefill", (0,), 0.3),
                      WorkerPlacement("decode-0", "decode", (0,), 0.6, visible=(0, 1))), "cuda_ipc", (0, 1))
    with pytest.raises(MpsError, match=r"worker decode-0 sees GPUs \(0, 1\); under MPS a worker runs on one GPU"):
        check_placement(wide)


def test_a_daemon_serves_its_gpu_by_uuid_and_quits_when_stopped(nvidia_tools: Path, tmp_path: Path) -> None:
    daemons = start_daemons(place([0]), tmp_path / "run", tmp_path / "logs")
    try:
        assert list(daemons) == [0]
        d = daemons[0]
        state = _daemon_state(d)
        # The daemon sees the GPU by UUID, as its workers will (an MPS server renumbers indices).
        assert state["visible"] == UUID and state["log"] == str(d.log_dir)
        assert d.client_env() == {"CUDA_VISIBLE_DEVICES": UUID, "CUDA_MPS_PIPE_DIRECTORY": str(d.pipe_dir),
                                  "CUDA_MPS_LOG_DIRECTORY": str(d.log_dir)}
        assert d.answers()
        pid, proc = state["pid"], d.proc
    finally:
        stop_daemons(daemons)
    assert proc.returncode == 0 and _gone(pid, 1.0)  # it quit when asked: not terminated
    assert not (tmp_path / "run" / "mps-gpu0" / "pipe" / "daemon.json").exists()


def test_the_daemon_does_not_outlive_tandem_up(nvidia_tools: Path, tmp_path: Path) -> None:
    """tandem up killed with SIGKILL (no finally runs): its daemon gets SIGTERM from the kernel."""
    script = textwrap.dedent(f'''\
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        import entrypoints.mps
        from entrypoints.placement import Placement, WorkerPlacement, place
        entrypoints.mps.PROBE_ARGV = (sys.executable, "-c", {FAKE_CLIENT!r})
        entrypoints.mps.start_daemons(place([0]), Path({str(tmp_path / "run")!r}))
        print("started", flush=True)
        time.sleep(60)
        ''')
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "started"
        pid = json.loads((tmp_path / "run" / "mps-gpu0" / "pipe" / "daemon.json").read_text())["pid"]
        os.kill(pid, 0)  # running
    finally:
        parent.kill()
        parent.wait()
    assert _gone(pid), "the MPS daemon outlived the process that started it"


def test_without_the_mps_tools_tandem_up_says_so(nvidia_tools: Path, tmp_path: Path, monkeypatch) -> None:
    (nvidia_tools / "nvidia-cuda-mps-control").unlink()
    monkeypatch.setenv("PATH", str(nvidia_tools))
    with pytest.raises(MpsError, match="--mps: nvidia-cuda-mps-control is not on PATH"):
        start_daemons(place([0]), tmp_path / "run")


def test_a_daemon_whose_clients_cannot_start_is_an_error_naming_mps(nvidia_tools: Path, tmp_path: Path,
                                                                     monkeypatch) -> None:
    """The daemon answers, but the driver refuses a CUDA client under it (no MPS on that GPU, or
    another user's server there): an error before any worker starts, the daemon stopped."""
    monkeypatch.setenv("FAKE_CLIENT_ERROR", "CUDA_ERROR_MPS_SERVER_NOT_READY")
    with pytest.raises(MpsError, match=r"--mps: GPU 0's MPS daemon started, but a CUDA client failed under it "
                                       r"\(cuDevicePrimaryCtxRetain: CUDA_ERROR_MPS_SERVER_NOT_READY\)"):
        start_daemons(place([0]), tmp_path / "run")
    assert not (tmp_path / "run" / "mps-gpu0" / "pipe" / "daemon.json").exists()  # it quit


def test_a_daemon_that_does_not_come_up_is_an_error_naming_mps(nvidia_tools: Path, tmp_path: Path) -> None:
    broken = nvidia_tools / "nvidia-cuda-mps-control"
    broken.write_text("#!/bin/sh\necho 'An instance of this daemon is already running' >&2\nexit 3\n")
    with pytest.raises(MpsError, match=r"--mps: the MPS control daemon for GPU 0 exited with code 3.*already running"):
        start_daemons(place([0]), tmp_path / "run", tmp_path / "logs")


def test_tandem_up_hands_the_daemon_to_the_workers_on_its_gpu(nvidia_tools: Path, tmp_path: Path) -> None:
    from entrypoints.launcher import build_children, placement_for
    from entrypoints.up_flags import parse_args

    a = parse_args(["--mps"])
    placement = placement_for(a, visible=1)
    daemons = start_daemons(placement, tmp_path / "run")
    try:
        children = {c.name: c for c in build_children(a, "/models/m", placement=placement, ready_dir=tmp_path,
                                                      mps=daemons)}
    finally:
        stop_daemons(daemons)
    for name in ("prefill-0", "decode-0"):
        assert children[name].env["CUDA_VISIBLE_DEVICES"] == UUID
        assert children[name].env["CUDA_MPS_PIPE_DIRECTORY"] == str(daemons[0].pipe_dir)
    decode = children["decode-0"].argv  # turns only at small batches, side by side above
    assert decode[decode.index("--gpu-turn-max-batch") + 1] == str(MPS_MAX_BATCH)
    assert "CUDA_MPS_PIPE_DIRECTORY" not in children["gateway"].env


@pytest.fixture
def no_mps_of_the_users(tmp_path: Path, monkeypatch) -> Path:
    """Neither $CUDA_MPS_PIPE_DIRECTORY nor a system-wide daemon (its pipe directory moved here)."""
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    system = tmp_path / "system-mps"
    monkeypatch.setattr("entrypoints.mps.SYSTEM_PIPE_DIR", system)
    return system


def test_without_a_flag_tandem_up_runs_a_shared_gpu_under_mps_where_it_can(nvidia_tools: Path, tmp_path: Path,
                                                                           no_mps_of_the_users: Path,
                                                                           monkeypatch, caplog) -> None:
    """Neither --mps nor --no-mps: tandem up's own daemon where a GPU hosts both roles, the tools
    are on PATH, --tp is 1 and no MPS of the user's is in effect; turns otherwise, the banner
    saying why. --no-mps never starts one; --mps insists."""
    from entrypoints.launcher import mps_daemons
    from entrypoints.up_flags import parse_args

    runs = iter(range(100))

    def run(*argv: str, placement: Placement | None = None) -> tuple[list[int], list[str]]:
        run_dir = tmp_path / f"run{next(runs)}"  # a fresh run directory, as each tandem up has
        daemons, rows = mps_daemons(parse_args(list(argv)), placement or place([0]), run_dir, None)
        stop_daemons(daemons)
        return list(daemons), rows

    assert auto_unavailable(place([0])) is None
    assert run() == ([0], [])
    assert run("--no-mps") == ([], [])
    for placement in (place([0, 1]), place([0], colocated=True), place([])):  # nothing shares a GPU: nothing to say
        assert auto_unavailable(placement) == ""
        assert run(placement=placement) == ([], [])
    assert auto_unavailable(place([0]), tp=2) == "--tp > 1 (an MPS client runs on one GPU)"

    # An MPS of the user's: a pipe directory in the environment, or a system-wide daemon's.
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "theirs"))
    assert run() == ([], ["  GPU 0: its prefill and decode workers take turns "
                          "(no MPS: $CUDA_MPS_PIPE_DIRECTORY names an MPS daemon of yours)"])
    assert run("--mps")[0] == [0]  # asked for: tandem up's own, as before
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY")
    no_mps_of_the_users.mkdir()
    (no_mps_of_the_users / "control").touch()
    assert "a system-wide MPS daemon runs" in run()[1][0]
    (no_mps_of_the_users / "control").unlink()

    # A daemon whose clients cannot start: turns, the warning naming CUDA's error.
    monkeypatch.setenv("FAKE_CLIENT_ERROR", "CUDA_ERROR_NOT_SUPPORTED")
    with caplog.at_level(logging.WARNING, logger="tandem.up"):
        assert run() == ([], ["  GPU 0: its prefill and decode workers take turns "
                              "(no MPS: it did not start; the warning above says why)"])
    assert "CUDA_ERROR_NOT_SUPPORTED" in caplog.text
    monkeypatch.delenv("FAKE_CLIENT_ERROR")
    caplog.clear()

    # A daemon that does not come up: turns, with a warning saying why; an error under --mps.
    control = nvidia_tools / "nvidia-cuda-mps-control"
    control.write_text("#!/bin/sh\necho 'An instance of this daemon is already running' >&2\nexit 3\n")
    with caplog.at_level(logging.WARNING, logger="tandem.up"):
        daemons, rows = run()
    assert daemons == [] and "it did not start" in rows[0]
    assert "exited with code 3" in caplog.text
    with pytest.raises(MpsError, match="exited with code 3"):
        run("--mps")

    # No tools: turns, the banner naming the tool (none with --no-gpu-turn: no turns to name).
    control.unlink()
    assert run()[1] == ["  GPU 0: its prefill and decode workers take turns "
                        "(no MPS: nvidia-cuda-mps-control is not on PATH)"]
    assert run("--no-gpu-turn") == ([], [])
    with pytest.raises(MpsError, match="nvidia-cuda-mps-control is not on PATH"):
        run("--mps")


def test_the_banner_says_how_the_workers_share_the_gpu(tmp_path: Path) -> None:
    daemon = MpsDaemon("3", UUID, tmp_path)
    assert banner_row(daemon, None) == f"  MPS on GPU 3 ({UUID}): its prefill and decode workers run side by side"
    row = banner_row(daemon, MPS_MAX_BATCH)
    assert row.startswith(f"  MPS on GPU 3 ({UUID}):") and f"at most {MPS_MAX_BATCH} sequences" in row


def test_mps_flag_errors_name_the_flag(capsys) -> None:
    from entrypoints.launcher import main
    from entrypoints.up_flags import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--mps", "--tp", "2"])
    assert "--mps" in capsys.readouterr().err
    assert main(["--mps", "--gpus", "", "--no-agent"]) == 2  # on the CPU: nothing shares a GPU
    assert "--mps: no GPU here hosts both a prefill and a decode worker" in capsys.readouterr().err


def _process(name: str, role: str, script: str) -> ClusterProcess:
    p = ClusterProcess(name, role, [])
    p.proc = subprocess.Popen([sys.executable, "-c", script])
    return p


def test_the_gpu_partners_of_a_worker_that_lost_its_device_under_mps_restart_too(tmp_path: Path) -> None:
    """An MPS server reports one client's fatal fault to every client on its GPU and takes no new
    one until they have all exited: the watch's on_exit kills the others (they are then restarted
    in turn); a worker exiting for another reason, or off the MPS GPUs, leaves them alone."""
    from worker.device_fault import DEVICE_LOST_EXIT

    placement = place([0, 1], prefill=1, decode=2)  # prefill-0 and decode-0 on GPU 0, decode-1 on GPU 1
    by_gpu = {w.name: w.gpus for w in placement.workers}
    assert by_gpu == {"prefill-0": (0,), "decode-0": (0,), "decode-1": (1,)}, by_gpu
    daemons = {0: MpsDaemon("0", UUID, tmp_path)}
    assert fault_sharers(placement, daemons, "prefill-0") == ["decode-0"]
    assert fault_sharers(placement, daemons, "decode-1") == []
    assert fault_sharers(placement, {}, "prefill-0") == []

    for code, killed in ((DEVICE_LOST_EXIT, True), (1, False)):
        sleeper = "import time; time.sleep(60)"
        procs = [_process("prefill-0", "prefill", f"raise SystemExit({code})"),
                 _process("decode-0", "decode", sleeper), _process("decode-1", "decode", sleeper)]
        procs[0].proc.wait(30)
        heard: list[tuple[str, int | None]] = []
        on_exit = restart_fault_sharers(procs, placement, daemons)

        def hear(process: ClusterProcess, exit_code: int | None) -> None:
            heard.append((process.name, exit_code))
            on_exit(process, exit_code)

        try:
            # should_stop turns true once the exit was heard: nothing is restarted here
            Cluster(procs).watch(lambda: bool(heard), interval=0.05, on_exit=hear)
            assert heard == [("prefill-0", code)]
            assert procs[1].alive() is not killed, code  # decode-0 shares GPU 0's daemon
            assert procs[2].alive(), code  # decode-1 is on another GPU
        finally:
            for p in procs:
                p.kill()

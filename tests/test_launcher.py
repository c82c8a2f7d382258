"""`tandem up`: a real local cluster of OS processes, served through the SDK, stopped without leftovers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem import Client
from entrypoints.cluster import free_port


def processes_with(marker: str) -> list[int]:
    """PIDs whose command line contains `marker` (the cluster's unique log dir)."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and int(p.name) != os.getpid():
            pids.append(int(p.name))
    return pids


def start_up(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, int, Path]:
    """`tandem up ARGS` once it says it is up: (its process, with what it printed until then as
    `printed`; its port; its log directory)."""
    port = free_port()
    log_dir = tmp_path / "logs"
    env = {**os.environ, "HOME": str(tmp_path)}  # the demo model is made under this HOME
    proc = subprocess.Popen(
        [sys.executable, "-m", "entrypoints", "up", "--port", str(port), "--log-dir", str(log_dir), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    deadline = time.time() + 240
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Tandem is up" in line:
            proc.printed = "".join(lines)
            return proc, port, log_dir
        if time.time() > deadline:
            break
    proc.kill()
    raise AssertionError("cluster did not come up:\n" + "".join(lines[-30:]))


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def test_up_serves_demo_model_and_sigterm_leaves_nothing(tmp_path):
    proc, port, log_dir = start_up(tmp_path, "--prefill-workers", "1", "--decode-workers", "1")
    try:
        # "Tandem is up" means every child is ready, the agent too: it watches already.
        assert "agent watching" in (log_dir / "agent.log").read_text()
        # Every child serves the demo model made under this test's HOME, so its path marks our processes.
        ours = [p for p in processes_with(str(tmp_path)) if p != proc.pid]
        roles = sorted(cmdline(p).split(" -m entrypoints ")[1].split()[0]
                       for p in ours if " -m entrypoints " in cmdline(p))
        assert roles == ["agent", "decode", "gateway", "prefill"]  # tandem up starts the infra agent too
        with Client(f"127.0.0.1:{port}") as client:
            a = client.generate("Once upon a time", max_tokens=12, temperature=0.0)
            b = client.generate("Once upon a time", max_tokens=12, temperature=0.0)
        assert a.finish_reason in ("length", "stop") and a.token_ids
        assert a.token_ids == b.token_ids  # greedy is deterministic across requests
        assert a.usage.prompt_tokens > 0 and a.usage.completion_tokens == len(a.token_ids)
    finally:
        code = stop(proc)
    assert code == 0
    deadline = time.time() + 10
    while time.time() < deadline and alive(ours):
        time.sleep(0.2)
    assert alive(ours) == []
    # The agent (a client of the gateway) stops before the gateway starts draining: it must not act
    # on, or warn about, the cluster going down.
    agent_stopped = logged_at(log_dir / "agent.log", "agent stopped")
    gateway_draining = logged_at(log_dir / "gateway.log", "shutting down")
    assert agent_stopped <= gateway_draining, (agent_stopped, gateway_draining)
    assert "failed" not in (log_dir / "agent.log").read_text()


def test_up_serves_fp8_weights(tmp_path):
    """`tandem up --quantization fp8`: both workers quantize the (shared) weights at load and
    serve (on a CPU, through the FP8 reference path)."""
    proc, port, log_dir = start_up(tmp_path, "--quantization", "fp8", "--no-agent")
    assert "FP8 (e4m3): weights (quantized at load)\n" in proc.printed  # the banner says so
    try:
        with Client(f"127.0.0.1:{port}") as client:
            a = client.generate("Once upon a time", max_tokens=8, temperature=0.0)
            b = client.generate("Once upon a time", max_tokens=8, temperature=0.0)
        assert a.token_ids and a.token_ids == b.token_ids
    finally:
        assert stop(proc) == 0
    for worker in ("prefill-0", "decode-0"):
        assert "FP8 weights:" in (log_dir / f"{worker}.log").read_text(), worker


def logged_at(path: Path, text: str) -> str:
    """The timestamp ("YYYY-MM-DD HH:MM:SS,mmm") of the first line of `path` holding `text`."""
    for line in path.read_text().splitlines():
        if text in line:
            return line[:23]
    raise AssertionError(f"{path.name}: no line with {text!r}")


def alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if "zombie" not in Path(f"/proc/{pid}/status").read_text().lower():
                out.append(pid)
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_up_restarts_a_crashed_worker(tmp_path):
    proc, port, log_dir = start_up(tmp_path, "--colocated", "--decode-workers", "1")
    try:
        gateway = [p for p in processes_with(f"--port {port}") if " gateway " in cmdline(p)]
        assert len(gateway) == 1
        argv = cmdline(gateway[0]).split()
        worker_port = argv[argv.index("--worker") + 1].rsplit(":", 1)[1]
        victims = [p for p in processes_with(f"--port {worker_port}") if " worker " in cmdline(p)]
        assert len(victims) == 1
        os.kill(victims[0], signal.SIGKILL)
        deadline = time.time() + 120
        result = None
        while result is None and time.time() < deadline:
            try:
                with Client(f"127.0.0.1:{port}") as client:
                    result = client.generate("hello", max_tokens=4, temperature=0.0, timeout=10)
            except Exception:
                time.sleep(1)
        assert result is not None and len(result.token_ids) == 4
        restarted = [p for p in processes_with(f"--port {worker_port}") if " worker " in cmdline(p)]
        assert restarted and victims[0] not in restarted
    finally:
        assert stop(proc) == 0
    rest = proc.stdout.read()
    assert "restarting" in rest


def test_kv_transport_reaches_both_sides_of_every_transfer() -> None:
    """`--kv-transport` goes to every prefill and decode worker (both ends must agree); auto picks
    CUDA IPC when both sides share a GPU, NCCL across GPUs and ZMQ on the CPU; colocated workers
    move no KV and get none."""
    from entrypoints.launcher import build_children, placement_for
    from entrypoints.up_flags import parse_args

    def transports(*argv: str, gpus: int = 0) -> dict[str, str | None]:
        a = parse_args(list(argv))
        children = build_children(a, "/models/m", placement=placement_for(a, visible=gpus))
        found = {}
        for c in children:
            found[c.name] = c.argv[c.argv.index("--kv-transport") + 1] if "--kv-transport" in c.argv else None
        return found

    assert transports("--prefill-workers", "2") == {"prefill-0": "zmq", "prefill-1": "zmq", "decode-0": "zmq",
                                                    "gateway": None}
    assert set(transports("--prefill-workers", "2", gpus=1).values()) == {"cuda_ipc", None}
    assert set(transports("--prefill-workers", "2", gpus=4).values()) == {"nccl", None}
    assert set(transports("--kv-transport", "nccl", gpus=1).values()) == {"nccl", None}
    assert transports("--colocated", "--kv-transport", "zmq") == {"worker-0": None, "gateway": None}
    with pytest.raises(SystemExit):
        parse_args(["--kv-transport", "carrier-pigeon"])


def test_kv_push_goes_to_the_prefill_workers() -> None:
    """`--kv-push` is the prefill workers' (auto: step where one shares a GPU with a decode worker,
    layer on GPUs of its own and on the CPU); decode workers and the gateway get none."""
    from entrypoints.launcher import build_children, placement_for
    from entrypoints.up_flags import parse_args

    def pushes(*argv: str, visible: int = 1) -> dict[str, str | None]:
        a = parse_args(list(argv))
        return {c.name: c.argv[c.argv.index("--kv-push") + 1] if "--kv-push" in c.argv else None
                for c in build_children(a, "/models/m", placement=placement_for(a, visible=visible))}

    assert pushes() == {"prefill-0": "step", "decode-0": None, "gateway": None}
    assert pushes(visible=2) == {"prefill-0": "layer", "decode-0": None, "gateway": None}
    assert pushes(visible=0) == {"prefill-0": "layer", "decode-0": None, "gateway": None}
    assert pushes("--kv-push", "layer") == {"prefill-0": "layer", "decode-0": None, "gateway": None}
    assert pushes("--kv-push", "step", "--prefill-workers", "2", visible=2) == {
        "prefill-0": "step", "prefill-1": "step", "decode-0": None, "gateway": None}
    # Two GPUs, two prefill workers: the decode worker has one, both prefill workers the other.
    assert pushes("--prefill-workers", "2", visible=2) == {
        "prefill-0": "layer", "prefill-1": "layer", "decode-0": None, "gateway": None}
    # Two GPUs, two decode workers: the prefill worker joins one of them.
    assert pushes("--decode-workers", "2", visible=2)["prefill-0"] == "step"
    with pytest.raises(SystemExit):
        parse_args(["--kv-push", "burst"])


def test_workers_sharing_a_gpu_get_turn_files(tmp_path) -> None:
    """tandem up makes one turn file per prefill worker that shares its GPU, in its run
    directory: the prefill worker marks it, the decode worker waits on it (with the bound it was
    given; under MPS only while its batch is at most MPS_MAX_BATCH, unless told otherwise); none
    with --no-gpu-turn, on separate GPUs, or on the CPU."""
    from entrypoints.launcher import build_children, placement_for
    from entrypoints.up_flags import parse_args
    from worker.gpu_turn import MAX_WAIT_S, MPS_MAX_BATCH

    def turns(*argv: str, visible: int = 1) -> dict[str, list[str]]:
        a = parse_args(list(argv))
        out = {}
        for c in build_children(a, "/models/m", placement=placement_for(a, visible=visible), ready_dir=tmp_path):
            i = c.argv.index("--gpu-turn") if "--gpu-turn" in c.argv else None
            out[c.name] = c.argv[i:i + 6 if c.role == "decode" else i + 2] if i is not None else []
        return out

    turn = str(tmp_path / "prefill-0.gpu-turn")
    assert turns() == {"prefill-0": ["--gpu-turn", turn],
                       "decode-0": ["--gpu-turn", turn, "--gpu-turn-max-wait-ms", f"{MAX_WAIT_S * 1000:g}",
                                    "--gpu-turn-hold", "always"],
                       "gateway": []}
    assert (tmp_path / "prefill-0.gpu-turn").read_bytes() == bytes(8)
    assert turns("--gpu-turn-max-wait-ms", "20")["decode-0"][3] == "20"
    assert turns("--gpu-turn-hold", "reserving")["decode-0"][-1] == "reserving"
    assert turns("--prefill-workers", "2", visible=1)["decode-0"][1] == f"{turn},{tmp_path / 'prefill-1.gpu-turn'}"
    for argv, visible in ((["--no-gpu-turn"], 1), (["--mps", "--no-gpu-turn"], 1), ([], 2), ([], 0)):
        assert all(v == [] for v in turns(*argv, visible=visible).values()), (argv, visible)

    def max_batch(*argv: str, under_mps: bool = False) -> str | None:
        from entrypoints.mps import MpsDaemon

        a = parse_args(list(argv))
        mps = {0: MpsDaemon("0", "GPU-0", tmp_path / "mps")} if under_mps else None
        decode = next(c for c in build_children(a, "/models/m", placement=placement_for(a, visible=1),
                                                ready_dir=tmp_path, mps=mps) if c.role == "decode")
        assert decode.argv[decode.argv.index("--gpu-turn") + 1] == turn
        i = decode.argv.index("--gpu-turn-max-batch") if "--gpu-turn-max-batch" in decode.argv else None
        return None if i is None else decode.argv[i + 1]

    assert max_batch() is None  # turns at every batch without MPS
    assert max_batch("--gpu-turn-max-batch", "8") == "8"
    assert max_batch(under_mps=True) == str(MPS_MAX_BATCH)  # under MPS: turns at small batches, side by side above
    assert max_batch("--gpu-turn-max-batch", "4", under_mps=True) == "4"
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit):
            parse_args(["--gpu-turn-max-batch", bad])
    for bad in ("0", "-5", "2000"):
        with pytest.raises(SystemExit):
            parse_args(["--gpu-turn-max-wait-ms", bad])
    with pytest.raises(SystemExit):
        parse_args(["--gpu-turn-hold", "1"])


def test_children_get_their_gpus_memory_share_and_flags(monkeypatch) -> None:
    """What each child is handed from the placement and the users' flags (no GPU needed)."""
    from entrypoints.launcher import build_children, placement_for
    from entrypoints.up_flags import parse_args

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the launcher's own view: indices map to these
    a = parse_args(["--max-model-len", "4096", "--kv-cache-dtype", "fp8", "--quantization", "fp8", "--no-prefix-cache",
                    "--max-num-seqs", "64", "--gpus", "1", "--swap-space", "2", "--prefill-graph-tokens", "512"])
    children = {c.name: c for c in build_children(a, "/models/m", placement=placement_for(a, visible=4))}
    pre, dec, gw = children["prefill-0"], children["decode-0"], children["gateway"]
    assert pre.env["CUDA_VISIBLE_DEVICES"] == dec.env["CUDA_VISIBLE_DEVICES"] == "5"

    def flag(c, name):
        return c.argv[c.argv.index(name) + 1]

    assert float(flag(pre, "--gpu-memory-fraction")) == pytest.approx(0.3)
    assert float(flag(dec, "--gpu-memory-fraction")) == pytest.approx(0.6)
    for c in (pre, dec):
        assert flag(c, "--device") == "cuda" and flag(c, "--max-model-len") == "4096"
        assert flag(c, "--kv-cache-dtype") == "fp8" and "--no-prefix-cache" in c.argv
        assert flag(c, "--quantization") == "fp8"  # workers sharing a device's weights must agree
        assert flag(c, "--max-running") == "64" and flag(c, "--swap-space-gb") == "2.0"
        assert flag(c, "--prefill-graph-tokens") == "512"
        assert int(flag(c, "--metrics-port")) > 0
    assert flag(gw, "--max-context") == "4096" and int(flag(gw, "--metrics-port")) > 0
    assert "CUDA_VISIBLE_DEVICES" not in gw.env and "--quantization" not in gw.argv
    cpu = build_children(parse_args(["--no-metrics"]), "/models/m", placement=placement_for(parse_args([]), 0))
    assert all("CUDA_VISIBLE_DEVICES" not in c.env and "--device" not in c.argv and "--metrics-port" not in c.argv
               and "--prefill-graph-tokens" not in c.argv for c in cpu)  # the workers' own default


@pytest.mark.parametrize("value", ["-1", "100000"])
def test_a_bad_prefill_graph_size_names_the_flag(value, capsys) -> None:
    from entrypoints.up_flags import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--prefill-graph-tokens", value])
    assert "--prefill-graph-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("argv,names", [(["--quantization", "int4"], "--quantization"),
                                        (["--quantization", "fp8", "--tp", "2"], "--tp 1")])
def test_a_quantization_the_workers_cannot_run_names_the_flag(argv, names, capsys) -> None:
    from entrypoints.up_flags import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert names in capsys.readouterr().err


@pytest.mark.parametrize("capability", ["8.0", "9.0"])
def test_fp8_on_a_gpu_that_cannot_hold_it_is_refused_before_anything_starts(tmp_path, monkeypatch,
                                                                            capability) -> None:
    """nvidia-smi (a stand-in here) tells the GPU's compute capability: FP8 asked of one older
    than 8.9 is a one-line error naming what asked for it; a newer one, or nothing FP8, passes."""
    import json

    from bench.h200_bench import LLAMA31_8B
    from entrypoints.launcher import fp8_gpu_error, placement_for
    from entrypoints.up_flags import parse_args

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        f'#!/bin/sh\ncase "$*" in *compute_cap*) echo {capability};; *) echo 81559;; esac\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    plain, fp8 = tmp_path / "plain", tmp_path / "fp8"
    for path, extra in ((plain, {}), (fp8, {"quantization_config": {"quant_method": "fp8"}})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**LLAMA31_8B, **extra}))
    placement = placement_for(parse_args([]), visible=1)
    old = capability == "8.0"
    for argv, model, named in ((["--quantization", "fp8"], plain, "--quantization fp8"),
                               (["--kv-cache-dtype", "fp8"], plain, "--kv-cache-dtype fp8"),
                               ([], fp8, "the checkpoint (config.json quantization_config)")):
        error = fp8_gpu_error(parse_args(argv), placement, str(model))
        if old:
            assert error.startswith(f"{named}: FP8 (e4m3) needs a GPU of compute capability 8.9") and "is 8.0" in error
        else:
            assert error is None
    assert fp8_gpu_error(parse_args([]), placement, str(plain)) is None  # nothing FP8 asked


def test_no_drawn_port_is_one_the_user_fixed(monkeypatch) -> None:
    """The gateway binds --port, --metrics-port and --http-port last, after every worker is up, so
    those ports are free while the launcher draws the workers' ports: drawing one of them again
    would fail the gateway (seen: its metrics server on the gateway's own gRPC port)."""
    import random

    from entrypoints.cluster import _handed_out, port_in_use
    from entrypoints.launcher import build_children, placement_for
    from entrypoints.up_flags import parse_args

    free = [p for p in range(21000, 21300) if p not in _handed_out and not port_in_use("0.0.0.0", p)]
    fixed = free[:3]
    draws = iter(fixed * 3 + free[3:])  # the user's ports drawn first, again and again
    monkeypatch.setattr(random, "randrange", lambda *_: next(draws))
    a = parse_args(["--port", str(fixed[0]), "--metrics-port", str(fixed[1]), "--http-port", str(fixed[2]),
                    "--prefill-workers", "2", "--decode-workers", "2"])
    children = build_children(a, "/models/m", placement=placement_for(a, 0))
    drawn = [int(c.argv[c.argv.index(f) + 1]) for c in children[:-1] for f in ("--port", "--metrics-port")]
    assert len(drawn) == 8 and not set(drawn) & set(fixed), drawn
    gw = children[-1]
    assert [int(gw.argv[gw.argv.index(f) + 1]) for f in ("--port", "--metrics-port", "--http-port")] == fixed


def test_a_port_is_busy_while_listened_on_not_while_its_old_connections_linger():
    """`tandem up` run again at once must find its port free: the previous run's connections
    linger in TIME_WAIT, which the servers' SO_REUSEADDR binds ignore, and so must the check."""
    import socket

    from entrypoints.cluster import port_in_use

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's, ZMQ's and http.server's
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert port_in_use("127.0.0.1", port) and port_in_use("0.0.0.0", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: its end of the connection goes to TIME_WAIT
    client.close()
    server.close()
    assert any(line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "06"  # TIME_WAIT
               for line in Path("/proc/net/tcp").read_text().splitlines()[1:])
    assert not port_in_use("127.0.0.1", port)


def test_busy_port_fails_at_once_and_a_crash_loop_stops_with_the_log_tail(tmp_path):
    """A second `tandem up` on the first one's port fails before starting anything, naming
    --port, and leaves the first serving; a worker that keeps crashing is restarted a bounded
    number of times, then `tandem up` exits non-zero with the cause and the worker's log tail."""
    model = tmp_path / "model"
    from engine.demo import make_random_model

    make_random_model(model, "llama", seed=3)
    proc, port, log_dir = start_up(tmp_path, "--colocated", "--model", str(model), "--restart-backoff", "0.05")
    try:
        t0 = time.time()
        second = subprocess.run([sys.executable, "-m", "entrypoints", "up", "--port", str(port), "--model",
                                 str(model), "--log-dir", str(tmp_path / "second")],
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 2
        assert f"--port {port}: 127.0.0.1:{port} is already in use" in second.stderr
        assert "starting" not in second.stderr + second.stdout and not (tmp_path / "second").exists()
        assert time.time() - t0 < 30
        with Client(f"127.0.0.1:{port}") as client:  # the first cluster is untouched
            assert len(client.generate("hello", max_tokens=3, temperature=0.0).token_ids) == 3

        # From now on the worker cannot start: each restart exits at once.
        (model / "config.json").rename(model / "config.json.away")
        victims = [p for p in processes_with(str(model)) if " worker " in cmdline(p)]
        assert len(victims) == 1
        os.kill(victims[0], signal.SIGKILL)
        code = proc.wait(180)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert code == 1
    assert "worker-0 exited with code" in out and "giving up" in out
    assert "no config.json" in out  # the worker's own log tail says why
    assert "Tandem stopped." in out


def test_a_cluster_process_dies_with_the_process_that_started_it(tmp_path, tiny_models) -> None:
    """Started without a preexec_fn (a fork of a process with gRPC threads can crash in gRPC's fork
    handlers), a child still gets SIGTERM when its starter dies, even by SIGKILL."""
    starter = (
        "import sys, time\n"
        "from entrypoints.cluster import ClusterProcess\n"
        "p = ClusterProcess('w', 'worker', ['--role', 'both', '--port', '0', '--model', sys.argv[1]])\n"
        "p.start(); print(p.proc.pid, flush=True); time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", starter, str(tiny_models["llama"])], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).resolve().parents[1])
    child = int(proc.stdout.readline())
    try:
        time.sleep(1.0)  # the child is past its start-up watch
        os.kill(child, 0)  # alive while its starter is
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            if _is_zombie(child):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"child {child} outlived its starter")
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False


def test_an_agent_that_cannot_start_fails_tandem_up(tmp_path):
    """`tandem up` reports up only once every child is ready, the agent too: an agent that exits at
    start (here, a --config file that does not exist) stops the cluster with its log tail."""
    port = free_port()
    env = {**os.environ, "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "entrypoints", "up", "--port", str(port), "--log-dir", str(tmp_path / "logs"),
         "--prefill-workers", "1", "--decode-workers", "1", "--agent-args", f"--config {tmp_path / 'absent.json'}"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Tandem is up" not in proc.stdout
    assert "agent exited during start-up" in proc.stderr and "absent.json" in proc.stderr
    assert "Tandem stopped." in proc.stdout
    assert processes_with(str(tmp_path)) == []  # the workers and the gateway were stopped

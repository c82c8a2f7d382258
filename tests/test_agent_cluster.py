"""The infra agent on a real `tandem up` cluster (gateway, two role-both stories260K workers,
the agent, the supervisor's socket): one latency spike only warns; a persistently slow worker is
drained after the confirmation window and its streams finish with the fault-free text; a hung
worker is restarted, a killed one comes back, and one that keeps needing restarts is isolated;
with --dry-run the same slowness is only logged. Slowness is injected with the worker's
TANDEM_FAULT_STEP_DELAY hook (worker/faults.py), one file per worker id."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from prometheus_client.parser import text_string_to_metric_families
from entrypoints.cluster import free_port
from tandem import Client, security, wire
from tandem._proto.tandem.v1 import admin_pb2
from tests.harness import wait_until

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went", "One day a bird"]
MAX_TOKENS = 40
# Short windows so each scenario fits in CI; the shapes are the production ones.
AGENT_CONFIG = {
    "poll_s": 0.25, "span_s": 1.0, "health_timeout_s": 0.5, "latency_floor_s": 0.002, "startup_grace_s": 60, "recover_s": 600,
    "escalate_s": 600, "restart_window_s": 120,
    "detectors": {
        "itl": {"warn": 2, "act": 4, "window_s": 3.0, "cooldown_s": 30},
        "unresponsive": {"warn": 1, "act": 1, "window_s": 1.5, "cooldown_s": 30},
        "restarts": {"warn": 1, "act": 2, "window_s": 0, "cooldown_s": 60},
    },
}


class UpCluster:
    def __init__(self, tmp: Path, model: Path, *agent_args: str) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.log_dir = tmp / "logs"
        cfg = tmp / "agent.json"
        cfg.write_text(json.dumps(AGENT_CONFIG))
        env = {**os.environ, "TANDEM_FAULT_STEP_DELAY": f"@{tmp}/fault-{{worker_id}}"}
        self.token = security.generate_token()  # the Admin service needs the cluster token
        token_file = security.write_token_file(tmp / "auth-token", self.token)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "entrypoints", "up", "--model", str(model), "--colocated", "--decode-workers", "2",
             "--port", str(self.port), "--log-dir", str(self.log_dir), "--max-running", "8",
             # Both workers keep getting requests: the cache-aware router would keep the four
             # prompts on whichever worker cached them, and a worker with no steps shows the
             # agent no step time (a slow worker left idle for 40 s is what failed this test).
             "--routing", "round_robin",
             "--auth-token-file", str(token_file),
             "--agent-args", " ".join(["--config", str(cfg), *agent_args])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        lines = []
        for line in self.proc.stdout:
            lines.append(line)
            if "Tandem is up" in line:
                break
        else:
            raise AssertionError("cluster did not come up:\n" + "".join(lines[-30:]))
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.target = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.admin = wire.AdminStub(self.channel)
        wait_until(lambda: len([w for w in self.workers().values() if w.routable and w.metrics_port]) == 2, 60,
                   what="both workers routable with metrics")
        agent = next((ln for ln in lines if ln.strip().startswith("agent") and "metrics :" in ln), None)
        assert agent is not None, "tandem up's banner names no agent metrics port:\n" + "".join(lines[-30:])
        self.agent_metrics = f"http://127.0.0.1:{agent.rsplit(':', 1)[1].strip()}/metrics"
        # Faults are injected only once the agent has seen both workers healthy past their start-up
        # (on a loaded host the agent's first poll can come late; a worker it never saw healthy is
        # still "starting" and is given the start-up grace).
        wait_until(lambda: self.watched() == {"both-0", "both-1"}, 60, interval=0.25,
                   what="the agent to see both workers healthy")

    def samples(self, detector: str) -> dict[str, float]:
        """Worker -> the agent's latest sample of `detector` (a worker appears once the detector has
        a value for it: for `itl`, once its baseline is filled)."""
        try:
            with urllib.request.urlopen(self.agent_metrics, timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return {}
        return {s.labels["worker"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "tandem_agent_detector_sample" and s.labels.get("detector") == detector}

    def watched(self) -> set[str]:
        """Workers whose unresponsive detector the agent has sampled healthy (past start-up)."""
        return {w for w, v in self.samples("unresponsive").items() if v == 0.0}

    def workers(self) -> dict[str, admin_pb2.AdminWorker]:
        reply = self.admin.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=5,
                                       metadata=security.token_metadata(self.token))
        return {w.name: w for w in reply.workers}

    def fault(self, worker: str, delay_s: float) -> None:
        path = self.tmp / f"fault-{worker}"
        path.with_suffix(".tmp").write_text(str(delay_s))
        path.with_suffix(".tmp").replace(path)

    def decisions(self) -> list[dict]:
        path = self.log_dir / "agent-decisions.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_decision(self, action: str, worker: str, timeout: float) -> dict:
        try:
            return wait_until(lambda: next((d for d in self.decisions() if d["decision"] == action
                                            and d["worker"] == worker), None), timeout, interval=0.2,
                              what=f"{action} of {worker}")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; decisions so far: {self.decisions()}; the agent's itl samples: "
                                 f"{self.samples('itl')}; the workers' mean steps: {self.mean_steps()}") from None

    def worker_samples(self, worker: str) -> list:
        """Every sample of the worker's own /metrics page."""
        w = self.workers()[worker]
        host = w.address.rsplit(":", 1)[0]
        with urllib.request.urlopen(f"http://{host}:{w.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return [s for fam in text_string_to_metric_families(text) for s in fam.samples]

    def mean_steps(self) -> dict[str, float]:
        """Worker -> its mean engine step (seconds) over the last second, from its own /metrics."""
        def sums() -> dict[str, tuple[float, float]]:
            out = {}
            for name in self.workers():
                vals = {s.name: s.value for s in self.worker_samples(name)}
                out[name] = (vals.get("tandem_engine_step_seconds_sum", 0.0),
                             vals.get("tandem_engine_step_seconds_count", 0.0))
            return out

        before = sums()
        time.sleep(1.0)
        after = sums()
        return {w: round((after[w][0] - before[w][0]) / max(after[w][1] - before[w][1], 1), 4) for w in after}

    def generate_calls(self, worker: str) -> float:
        """PrefillAndDecode calls the worker has served (its tandem_worker_rpcs)."""
        return sum(s.value for s in self.worker_samples(worker)
                   if s.name == "tandem_worker_rpcs_total" and s.labels.get("method") == "PrefillAndDecode")

    def settled_calls(self, worker: str, quiet_s: float = 1.0) -> tuple[float] | None:
        """(calls,) when `generate_calls` reads the same twice `quiet_s` apart, else None."""
        before = self.generate_calls(worker)
        time.sleep(quiet_s)
        after = self.generate_calls(worker)
        return (after,) if after == before else None

    def pid(self, worker: str) -> int:
        marker = f"--worker-id {worker} "
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd and str(self.log_dir.parent) not in cmd and f"--model {self.model_marker}" in cmd:
                return int(p.name)
        raise AssertionError(f"no process for {worker}")

    model_marker = ""

    def stop(self) -> None:
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Load:
    """Greedy requests over PROMPTS from `threads` threads until stopped; every result kept."""

    def __init__(self, target: str, threads: int = 4) -> None:
        self.target = target
        self.results: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        with Client(self.target) as client:
            n = i
            while not self._stop.is_set():
                prompt = PROMPTS[n % len(PROMPTS)]
                n += 1
                try:
                    out = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0, timeout=60)
                    self.results.append((prompt, out.text))
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    self.errors.append(repr(exc))

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)


def reference(target: str) -> dict[str, str]:
    with Client(target) as client:
        return {p: client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0).text for p in PROMPTS}


@pytest.fixture
def up(tmp_path, stories_dir):
    clusters = []

    def start(*agent_args: str) -> UpCluster:
        UpCluster.model_marker = str(stories_dir)
        c = UpCluster(tmp_path, stories_dir, *agent_args)
        clusters.append(c)
        return c

    yield start
    for c in clusters:
        c.stop()


def check_evidence(d: dict, detector: str) -> None:
    assert d["detector"] == detector
    ev = d["evidence"]
    th = AGENT_CONFIG["detectors"][detector]
    assert ev["thresholds"]["act"] == th["act"] and ev["thresholds"]["window_s"] == th["window_s"]
    assert ev["held_s"] >= th["window_s"]
    assert len(ev["samples"]) >= 2 and all(v >= th["act"] for _, v in ev["samples"])
    assert ev["samples"][-1][0] - ev["samples"][0][0] >= th["window_s"] - 0.01


def test_spike_warns_only_and_a_persistently_slow_worker_is_drained(up):
    c = up()
    ref = reference(c.target)
    load = Load(c.target)
    try:
        # The agent's step-time baselines fill (on a loaded host that can take longer than the
        # few seconds it takes here): a fault before then would become the baseline itself.
        wait_until(lambda: {"both-0", "both-1"} <= set(c.samples("itl")), 60, interval=0.25,
                   what="the agent's itl baselines of both workers")
        time.sleep(1)
        c.fault("both-0", 0.25)  # one spike, shorter than the window
        time.sleep(0.6)
        c.fault("both-0", 0)
        time.sleep(4)
        acted = [d for d in c.decisions() if d["decision"] != "warn"]
        assert not acted, acted
        assert all(w.mark == "" for w in c.workers().values())
        c.fault("both-0", 0.15)  # persistently slow
        t0 = time.monotonic()
        drain = c.wait_decision("drain", "both-0", 40)
        assert time.monotonic() - t0 >= AGENT_CONFIG["detectors"]["itl"]["window_s"]
        assert drain["outcome"] == "done" and drain["dry_run"] is False
        check_evidence(drain, "itl")
        assert c.workers()["both-0"].mark == "drained" and c.workers()["both-1"].routable
        wait_until(lambda: c.workers()["both-0"].inflight == 0, 60, what="both-0's streams to finish")
        # Counted as each call ends on the worker, which can be after the gateway let go of it
        # (a stream the drain moved is cancelled there): read it once it stopped moving.
        served = wait_until(lambda: c.settled_calls("both-0"), 30, what="both-0's call count to settle")[0]
        time.sleep(2)  # the load goes on, on both-1 only
    finally:
        load.stop()
    # Every stream, those that ran on the slow worker included, ends with the fault-free text.
    assert not load.errors, load.errors[:3]
    assert len(load.results) > 8
    for prompt, text in load.results:
        assert text == ref[prompt], prompt
    with Client(c.target) as client:
        for p in PROMPTS:
            assert client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0).text == ref[p]
    assert c.generate_calls("both-0") == served  # nothing new reached it
    assert all(json.dumps(d) for d in c.decisions())


def test_dry_run_only_logs(up):
    c = up("--dry-run")
    load = Load(c.target, threads=6)
    try:
        # The detector needs steps on both-0: wait until placement has given it requests.
        wait_until(lambda: c.workers()["both-0"].inflight > 0, 30, what="requests on both-0")
        wait_until(lambda: "both-0" in c.samples("itl"), 60, interval=0.25, what="the agent's itl baseline of both-0")
        time.sleep(1)
        c.fault("both-0", 0.15)
        drain = c.wait_decision("drain", "both-0", 40)
        assert drain["outcome"] == "dry-run" and drain["dry_run"] is True
        check_evidence(drain, "itl")
        assert all(w.mark == "" and w.routable for w in c.workers().values())
    finally:
        c.fault("both-0", 0)
        load.stop()
    assert not load.errors, load.errors[:3]


def test_hung_worker_restarted_killed_one_back_and_repeated_restarts_isolate(up):
    c = up()
    ref = reference(c.target)
    pid = c.pid("both-1")
    os.kill(pid, signal.SIGSTOP)  # hung: alive, answers nothing
    restart = c.wait_decision("restart", "both-1", 40)
    assert restart["outcome"] == "done"
    check_evidence(restart, "unresponsive")
    wait_until(lambda: c.workers()["both-1"].up and c.pid("both-1") != pid, 90, interval=0.5,
               what="both-1 restarted")
    assert not any(d["decision"] == "isolate" for d in c.decisions())
    pid2 = c.pid("both-1")
    os.kill(pid2, signal.SIGKILL)  # a crash: the supervisor starts it again
    isolate = c.wait_decision("isolate", "both-1", 90)
    assert isolate["detector"] == "restarts" and isolate["outcome"] == "done"
    assert isolate["evidence"]["value"] >= 2
    wait_until(lambda: c.workers()["both-1"].up, 90, interval=0.5, what="both-1 back after the kill")
    assert c.pid("both-1") not in (pid, pid2)
    w = c.workers()["both-1"]
    assert w.mark == "isolated" and not w.routable and "restarts" in w.mark_reason
    with Client(c.target) as client:  # the cluster serves on the other worker
        assert client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0).text == ref[PROMPTS[0]]
    # An operator clears it; it is routed again.
    c.admin.Clear(admin_pb2.WorkerMarkRequest(worker="both-1"), timeout=5, metadata=security.token_metadata(c.token))
    wait_until(lambda: c.workers()["both-1"].routable, 10, what="both-1 routable after Clear")
    with pytest.raises(grpc.RpcError) as err:
        c.admin.Drain(admin_pb2.WorkerMarkRequest(worker="no-such-worker"), timeout=5,
                      metadata=security.token_metadata(c.token))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no-such-worker" in err.value.details()

"""Turns on a shared GPU (`worker.gpu_turn`, `--gpu-turn`): the prefill side marks its steps in
a turn file, the decode side waits for the marks (bounded), across real processes; bad values
name the field; and a real decode worker given a turn file that is held busy spaces its tokens
by the bound, then streams the offline engine's greedy tokens as before."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from gateway.config import GatewayConfig, WorkerPoolConfig
from harness import GatewayThread, start_workers, stop_workers, wait_idle
from tandem import Client, SamplingParams
from worker.gpu_turn import (DEFAULT_HOLD, DecodeTurn, GpuTurn, PrefillTurn, create_turn_file, make_turn,
                             turn_paths)

REPO = Path(__file__).resolve().parents[1]
WAIT = 60.0
GREEDY = {"temperature": 0.0, "ignore_eos": True}
FLAGS = ["--num-kv-blocks", "64", "--max-running", "8"]


def _mark(path: Path) -> int:
    return int.from_bytes(path.read_bytes(), "little", signed=True)


def _hold(path: Path, seconds: float) -> subprocess.Popen:
    """Another process that marks `path` busy for `seconds` (as a prefill worker's step would),
    printing "held" once the mark is in."""
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from worker.gpu_turn import PrefillTurn
        t = PrefillTurn({str(path)!r})
        t.before_step()
        print("held", flush=True)
        time.sleep({seconds})
        t.close()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_the_prefill_side_marks_its_steps(tmp_path: Path) -> None:
    f = tmp_path / "p.gpu-turn"
    create_turn_file(f)
    assert _mark(f) == 0 and f.stat().st_size == 8 and f.stat().st_mode & 0o777 == 0o600
    f.write_bytes((12345).to_bytes(8, "little"))  # what a worker killed mid-step leaves
    p = PrefillTurn(str(f))
    assert _mark(f) == 0  # a (re)started prefill worker clears it
    before = time.monotonic_ns()
    assert p.before_step() == 0.0
    assert before <= _mark(f) <= time.monotonic_ns()
    p.after_step()
    assert _mark(f) == 0
    p.before_step()
    p.close()
    assert _mark(f) == 0


def test_the_decode_side_waits_for_another_process(tmp_path: Path) -> None:
    f = tmp_path / "p.gpu-turn"
    create_turn_file(f)
    d = DecodeTurn([str(f)], max_wait_s=5.0)
    assert not d.busy() and d.before_step() == 0.0 and d.waits == 0
    holder = _hold(f, 0.4)
    try:
        assert d.busy()
        waited = d.before_step()
    finally:
        holder.wait(10)
    assert 0.05 <= waited < 3.0, waited  # released when the other process cleared its mark (not the 5 s bound)
    assert d.waits == 1 and d.waited_s == pytest.approx(waited)
    assert not d.busy()


def test_the_wait_is_bounded_and_a_stale_mark_is_ignored(tmp_path: Path) -> None:
    f, g = tmp_path / "a.gpu-turn", tmp_path / "b.gpu-turn"
    for x in (f, g):
        create_turn_file(x)
    d = DecodeTurn([str(f), str(g)], max_wait_s=0.1, stale_s=1.0)
    p = PrefillTurn(str(g))  # the second of two prefill workers on the GPU, never finishing its step
    p.before_step()
    t = time.monotonic()
    waited = d.before_step()
    assert 0.1 <= waited and time.monotonic() - t < 1.0
    f.write_bytes((time.monotonic_ns() - 2_000_000_000).to_bytes(8, "little"))  # older than stale_s
    p.after_step()
    assert not d.busy() and d.before_step() == 0.0
    d.close()
    p.close()


def test_the_engine_loop_serves_commands_and_stops_while_a_step_waits_for_its_turn(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """While a decode step waits for a prefill worker's step (here held for seconds), what is
    submitted to the worker's engine thread (a Reserve, an abort) runs at once and a stop ends
    the wait; only the step waits. (The wait before a step, without the held launch, whose
    second look runs no commands: the next test.)"""
    from engine import Engine, EngineConfig, SamplingParams
    from worker.engine_loop import EngineLoop

    f = tmp_path / "p.gpu-turn"
    create_turn_file(f)
    prefill = PrefillTurn(str(f))  # stands for the prefill worker: its step runs until after_step
    turn = DecodeTurn([str(f)], max_wait_s=4.0, stale_s=60.0, hold="off")
    engine = Engine(EngineConfig(str(tiny_models["llama"]), num_kv_blocks=32, max_running=4, device="cpu"))
    loop = EngineLoop(engine, turn=turn)
    loop.start()
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    try:
        loop.submit(lambda e: e.admit([256, *range(40, 60)], params, "streaming")).result(WAIT)
        prefill.before_step()
        time.sleep(0.3)  # the loop's next step is waiting for the turn now
        t = time.monotonic()
        assert loop.submit(lambda e: e.admit([256, *range(70, 80)], params, "next")).result(WAIT) is not None
        assert loop.submit(lambda e: loop.abort_now("next")).result(WAIT) is True
        served = time.monotonic() - t
        assert served < 1.5, served  # not after the 4 s the step may wait
        assert turn.waits == 0  # and that wait is still going on
        prefill.after_step()
        wait_until = time.monotonic() + WAIT
        while turn.waits == 0:
            assert time.monotonic() < wait_until, "the step never went on after the turn was released"
            time.sleep(0.01)
        prefill.before_step()
        time.sleep(0.3)
        t = time.monotonic()
        loop.stop(timeout=WAIT)
        assert time.monotonic() - t < 2.5  # the stop ended the wait
        assert not loop.running
    finally:
        loop.stop(timeout=WAIT)
        prefill.close()
        turn.close()
        engine.close()


@pytest.mark.parametrize("overlap,near", [(False, "reservation"), (True, "reservation"), (True, "reserve"),
                                          (True, None)])
def test_a_held_launch_takes_a_second_look_right_before_the_forward(
        tiny_models: dict[str, Path], tmp_path: Path, overlap: bool, near: str | None) -> None:
    """While a decode worker holds a reservation or answers a Reserve (a prefill for it is
    near), it prepares a step while the one before runs, then looks at the turn again right
    before queuing its forward: a prefill step that began meanwhile (here, while the step was
    being prepared) goes first. Otherwise it queues at once. The outputs are the engine's
    without a turn."""
    import threading

    from engine import Engine, EngineConfig, SamplingParams
    from worker.engine_loop import EngineLoop

    f = tmp_path / "p.gpu-turn"
    create_turn_file(f)
    prefill = PrefillTurn(str(f))
    turn = DecodeTurn([str(f)], max_wait_s=5.0, stale_s=60.0, hold="reserving")
    assert turn.holds_launch
    cfg = EngineConfig(str(tiny_models["llama"]), num_kv_blocks=32, max_running=4, device="cpu",
                       overlap_schedule=overlap)
    engine = Engine(cfg)
    events: list[tuple[str, float]] = []
    engine.runner.model.register_forward_pre_hook(lambda *_: events.append(("forward", time.monotonic())))
    prepare = engine.runner.prepare
    released: list[float] = []

    def prepare_while_a_prefill_begins(*args, **kwargs):
        out = prepare(*args, **kwargs)
        if not released:  # the first step: a prefill step begins now and runs 0.3 s
            prefill.before_step()

            def end() -> None:
                released.append(time.monotonic())
                prefill.after_step()
            threading.Timer(0.3, end).start()
        events.append(("prepared", time.monotonic()))
        return out

    engine.runner.prepare = prepare_while_a_prefill_begins
    loop = EngineLoop(engine, turn=turn)
    loop.start()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [256, *range(40, 60)]
    try:
        got: list[int] = []
        done = threading.Event()

        def listener(out) -> None:
            got.extend(out.new_token_ids)
            if out.finished:
                done.set()
        if near == "reservation":
            assert loop.submit(lambda e: e.reserve("coming", [256, *range(90, 99)], params)).result(WAIT)
        elif near == "reserve":
            loop.reserves_arriving += 1  # as the decode service does while a Reserve waits for its command
        loop.submit(lambda e: (loop.listen("r", listener), e.admit(prompt, params, "r"))).result(WAIT)
        assert done.wait(WAIT)
    finally:
        loop.stop(timeout=WAIT)
        prefill.close()
        turn.close()
        engine.close()
    assert events[0][0] == "prepared" and events[1][0] == "forward"
    assert [e for e, _ in events[:2 * len(got)]] == ["prepared", "forward"] * len(got)  # one look a step
    if near:
        assert events[1][1] >= released[0]  # the first forward waited for the prefill step's end
        assert turn.waits >= 1 and turn.waited_s >= 0.25
    else:
        assert events[1][1] < released[0]  # queued at once (the next step waits for its turn before it)
    ref = Engine(EngineConfig(str(tiny_models["llama"]), num_kv_blocks=32, max_running=4, device="cpu"))
    try:
        ref.admit(prompt, params, "r")
        want: list[int] = []
        while ref.has_unfinished():
            want += [t for o in ref.step() for t in o.new_token_ids]
    finally:
        ref.close()
    assert got == want


def test_a_batch_bound_takes_turns_only_at_small_batches(tmp_path: Path) -> None:
    """--gpu-turn-max-batch N: a decode worker running more than N sequences neither waits for
    the prefill's step nor holds its launch; at N or fewer it does both, as without the bound."""
    f = tmp_path / "p.gpu-turn"
    create_turn_file(f)
    p = PrefillTurn(str(f))
    d = DecodeTurn([str(f)], max_wait_s=0.2, hold="always", max_batch=2)
    p.before_step()  # a prompt's forward is running
    t = time.monotonic()
    assert d.before_step(running=3) == 0.0 and d.waits == 0 and time.monotonic() - t < 0.1
    assert not d.holds(reserving=True, running=3)
    assert d.before_step(running=2) >= 0.2 and d.waits == 1  # bounded by max_wait_s, as before
    assert d.holds(reserving=False, running=2) and d.holds(reserving=True, running=0)
    unbounded = DecodeTurn([str(f)], max_wait_s=0.2)
    assert unbounded.max_batch is None and unbounded.before_step(running=10_000) >= 0.2
    for bad in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="gpu_turn_max_batch"):
            DecodeTurn([str(f)], max_batch=bad)
    p.close()
    d.close()
    unbounded.close()


def test_the_engine_loop_steps_through_a_prefill_past_the_batch_bound(tiny_models: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """The engine loop hands the turn its running batch: with two sequences running and a bound
    of one, the steps go on while a prefill step holds the turn (for seconds here); with one
    running they wait for it."""
    from engine import Engine, EngineConfig, SamplingParams
    from worker.engine_loop import EngineLoop

    f = tmp_path / "p.gpu-turn"
    create_turn_file(f)
    prefill = PrefillTurn(str(f))
    turn = DecodeTurn([str(f)], max_wait_s=30.0, stale_s=60.0, hold="off", max_batch=1)
    engine = Engine(EngineConfig(str(tiny_models["llama"]), num_kv_blocks=64, max_running=4, device="cpu"))
    loop = EngineLoop(engine, turn=turn)
    tokens: dict[str, int] = {"a": 0, "b": 0}

    def counter(rid: str):
        def listen(out) -> None:
            tokens[rid] += len(getattr(out, "new_token_ids", ()))  # (the loop's stop hands an exception)
        return listen

    loop.start()
    try:
        for rid, n in (("a", 4000), ("b", 60)):
            loop.listen(rid, counter(rid))
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            loop.submit(lambda e, rid=rid, params=params: e.admit([256, *range(40, 60)], params, rid)).result(WAIT)
        deadline = time.monotonic() + WAIT
        while tokens["b"] < 20:  # both running
            assert time.monotonic() < deadline
            time.sleep(0.01)
        prefill.before_step()  # a prompt's forward starts, and lasts
        deadline = time.monotonic() + WAIT
        while tokens["b"] < 60:  # two running: past the bound, no waits
            assert time.monotonic() < deadline, f"the steps waited for the turn at batch 2: {tokens}"
            time.sleep(0.01)
        assert turn.waits == 0
        time.sleep(0.5)  # "b" has finished: one running, within the bound: the next step waits
        before = tokens["a"]
        time.sleep(0.5)
        assert tokens["a"] == before, "a step of one sequence did not wait for the prefill's turn"
        prefill.after_step()
        deadline = time.monotonic() + WAIT
        while tokens["a"] == before:
            assert time.monotonic() < deadline, "the steps never went on after the turn was released"
            time.sleep(0.01)
        assert turn.waits >= 1
    finally:
        loop.stop(timeout=WAIT)
        prefill.close()
        turn.close()
        engine.close()


def test_the_hold_is_on_for_a_decode_turn_unless_turned_off(tmp_path: Path) -> None:
    f = tmp_path / "p.gpu-turn"
    create_turn_file(f)
    assert not GpuTurn().holds_launch and GpuTurn().before_forward() == 0.0
    p = PrefillTurn(str(f))
    assert not p.holds_launch
    d = DecodeTurn([str(f)], max_wait_s=5.0, hold="off")
    p.before_step()
    t = time.monotonic()
    assert not d.holds_launch and d.before_forward() == 0.0 and time.monotonic() - t < 1.0  # no look, no wait
    assert not d.holds(reserving=True)
    d = DecodeTurn([str(f)], max_wait_s=0.2, hold="reserving")
    assert d.holds_launch and d.before_forward() >= 0.2  # a look, bounded as before_step
    assert d.holds(reserving=True) and not d.holds(reserving=False)  # only while a prefill is near
    assert DEFAULT_HOLD == "always" and DecodeTurn([str(f)]).holds(reserving=False)
    assert make_turn("decode", str(f), hold="reserving").holds(reserving=False) is False
    assert not GpuTurn().holds(reserving=True)
    p.close()
    d.close()


def test_bad_values_name_the_field(tmp_path: Path) -> None:
    from worker.config import WorkerConfig, build_parser, config_from_args

    f = tmp_path / "p.gpu-turn"
    create_turn_file(f)
    assert turn_paths("decode", f"{f}, {f}") == [str(f), str(f)]
    assert turn_paths("prefill", None) == [] and type(make_turn("decode", None)) is GpuTurn
    for role, spec, match in [("prefill", f"{f},{f}", "one turn file"), ("both", str(f), "only prefill and decode"),
                              ("decode", " , ", "FILE")]:
        with pytest.raises(ValueError, match="gpu_turn") as err:
            turn_paths(role, spec)
        assert match in str(err.value)
    with pytest.raises(ValueError, match="gpu_turn: cannot open"):
        make_turn("decode", str(tmp_path / "missing"))
    (tmp_path / "big").write_bytes(bytes(16))
    with pytest.raises(ValueError, match="not a turn file"):
        make_turn("prefill", str(tmp_path / "big"))
    args = build_parser("prefill").parse_args(["--model", "m", "--gpu-turn", f"{f},{f}"])
    with pytest.raises(ValueError, match="gpu_turn"):
        config_from_args(args, "prefill")
    engine = config_from_args(build_parser("decode").parse_args(["--model", "m"]), "decode").engine
    with pytest.raises(ValueError, match="gpu_turn"):
        WorkerConfig(role="both", engine=engine, gpu_turn=str(f))
    for bad in (0, -1, 5000):
        with pytest.raises(ValueError, match="gpu_turn_max_wait_ms"):
            WorkerConfig(role="decode", engine=engine, gpu_turn=str(f), gpu_turn_max_wait_ms=bad)
    assert make_turn("decode", str(f), 0.02).max_wait_s == 0.02
    for bad in ("1", "Always", ""):
        with pytest.raises(ValueError, match="gpu_turn_hold"):
            WorkerConfig(role="decode", engine=engine, gpu_turn=str(f), gpu_turn_hold=bad)
        with pytest.raises(ValueError, match="gpu_turn_hold"):
            DecodeTurn([str(f)], hold=bad)
    assert config_from_args(build_parser("decode").parse_args(
        ["--model", "m", "--gpu-turn-hold", "reserving"]), "decode").gpu_turn_hold == "reserving"
    with pytest.raises(SystemExit):
        build_parser("decode").parse_args(["--model", "m", "--gpu-turn-hold", "sometimes"])


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


def _turn_wait_seconds(metrics_port: int) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "tandem_worker_gpu_turn_wait_seconds_total")


def test_a_decode_worker_waits_for_a_held_turn_then_streams_on(model_dir: Path, tmp_path: Path) -> None:
    """A decode worker waits on two turn files: its prefill worker's, and one the test holds for
    1 s as a second prefill worker in a long step would. While it is held, each of the decode
    worker's steps waits out the 50 ms bound (its tokens come that far apart, and it counts the
    wait); the tokens are the offline engine's; the prefill worker leaves its own file idle."""
    from engine import LLM
    from worker.gpu_turn import MAX_WAIT_S

    own, held = tmp_path / "prefill-0.gpu-turn", tmp_path / "prefill-1.gpu-turn"
    for f in (own, held):
        create_turn_file(f)
    p, d = start_workers([("prefill", [*FLAGS, "--gpu-turn", str(own)]),
                          ("decode", [*FLAGS, "--gpu-turn", f"{own},{held}", "--metrics-port", "0"])],
                         model_dir, tmp_path / "w")
    gw = GatewayThread(GatewayConfig(model_dir=str(model_dir), port=0,
                                     workers=WorkerPoolConfig(prefill=(p.address,), decode=(d.address,),
                                                              local_prefill_tokens=0)))
    prompt = [256, *range(40, 70)]
    want = LLM(str(model_dir), num_kv_blocks=64, max_running=4).generate(
        prompt, SamplingParams(max_tokens=60, **GREEDY))[0].token_ids
    try:
        assert gw.wait_ready(WAIT)
        with Client(gw.target, timeout=WAIT) as c:
            assert c.generate(prompt, max_tokens=60, **GREEDY).token_ids == want  # nothing held: no wait
            assert _turn_wait_seconds(d.info["metrics_port"]) < 0.5
            holder = _hold(held, 1.0)
            got, arrivals = [], []
            for chunk in c.stream(prompt, max_tokens=60, stream_interval=1, **GREEDY):
                got += chunk.token_ids
                arrivals.append((time.monotonic(), holder.poll() is None))
            holder.wait(10)
        assert got == want
        during = [t for t, holding in arrivals[1:] if holding]  # the decode worker's tokens (not the first)
        gaps = [b - a for a, b in zip(during, during[1:])]
        assert len(gaps) >= 5, arrivals
        # Every step waited out the bound (the median: a client thread held up on a loaded machine
        # can read two chunks back to back).
        assert sorted(gaps)[len(gaps) // 2] >= 0.8 * MAX_WAIT_S, gaps
        assert _turn_wait_seconds(d.info["metrics_port"]) >= 0.5
    finally:
        gw.stop()
    for w in (p, d):
        wait_idle(w, WAIT)
    stop_workers([p, d])
    assert _mark(own) == 0


def test_a_reserve_runs_inside_a_held_launch_and_other_commands_keep_their_order(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A held launch waits through a prefill step on the GPU. A command submitted `in_hold` (the
    decode service's Reserve: the prompt being prefilled needs its answer before its step ends)
    runs during that wait; any other command (an abort, an admit) waits for the step, and so
    does every command queued after it, in order."""
    import threading

    from engine import Engine, EngineConfig, SamplingParams
    from worker.engine_loop import EngineLoop

    f = tmp_path / "p.gpu-turn"
    create_turn_file(f)
    prefill = PrefillTurn(str(f))
    turn = DecodeTurn([str(f)], max_wait_s=5.0, stale_s=60.0, hold="always")
    engine = Engine(EngineConfig(str(tiny_models["llama"]), num_kv_blocks=64, max_running=4, device="cpu"))
    prepare = engine.runner.prepare
    marked = threading.Event()
    released: list[float] = []

    def prepare_while_a_prefill_begins(*args, **kwargs):
        out = prepare(*args, **kwargs)
        if not marked.is_set():  # this step's launch is held through a 1 s prefill step
            prefill.before_step()
            marked.set()

            def end() -> None:
                released.append(time.monotonic())
                prefill.after_step()
            threading.Timer(1.0, end).start()
        return out

    engine.runner.prepare = prepare_while_a_prefill_begins
    loop = EngineLoop(engine, turn=turn)
    loop.start()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    try:
        done = threading.Event()
        loop.submit(lambda e: (loop.listen("r", lambda out: out.finished and done.set()),
                               e.admit([256, *range(40, 60)], params, "r"))).result(WAIT)
        assert marked.wait(WAIT)
        time.sleep(0.1)  # the launch is held now
        reserved = loop.submit(lambda e: e.reserve("coming", [256, *range(90, 99)], params), in_hold=True).result(WAIT)
        reserved_at = time.monotonic()
        assert reserved is not None and not released  # answered while the prefill step still ran
        plain = loop.submit(lambda e: time.monotonic())
        after = loop.submit(lambda e: time.monotonic(), in_hold=True)
        assert plain.result(WAIT) >= released[0] > reserved_at  # waited for the held step
        assert after.result(WAIT) >= plain.result()  # queued behind it, so after it
        assert turn.waits >= 1 and turn.waited_s >= 0.8
        assert done.wait(WAIT)  # the stream went on
        assert loop.submit(lambda e: e.knows("coming")).result(WAIT)
    finally:
        loop.stop(timeout=WAIT)
        prefill.close()
        turn.close()
        engine.close()

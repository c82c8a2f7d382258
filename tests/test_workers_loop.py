"""The worker's engine thread in-process: commands, output routing, abort, timers, KV events,
stats snapshots and shutdown, over a real engine on a tiny random Llama."""
from __future__ import annotations

import queue
import time
from concurrent.futures import Future

import pytest

from engine import LLM
from engine.engine import Engine, EngineConfig, StepOutput
from engine.outputs import DuplicateRequestError, FinishReason
from tandem.hashing import block_hashes
from tandem.types import SamplingParams, Tier
from worker.engine_loop import EngineLoop, LoopStopped
from worker.events import KvEventBatch

WAIT_S = 30.0
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.demo import make_random_model

    return make_random_model(tmp_path_factory.mktemp("loop") / "m", "llama")


@pytest.fixture(scope="module")
def offline(model_dir):
    return LLM(str(model_dir), num_kv_blocks=48)


@pytest.fixture(scope="module")
def loop(model_dir):
    engine = Engine(EngineConfig(str(model_dir), num_kv_blocks=48))
    lp = EngineLoop(engine, name="test-engine")
    lp.start()
    yield lp
    lp.stop()


def collect(loop: EngineLoop, request_id: str, prompt: list[int], params: SamplingParams, **kw) -> queue.SimpleQueue:
    q: queue.SimpleQueue = queue.SimpleQueue()

    def add(engine: Engine) -> None:
        engine.admit(prompt, params, request_id, Tier.STANDARD, field="token_ids", **kw)
        loop.listen(request_id, q.put)

    loop.submit(add).result(WAIT_S)
    return q


def drain(q: queue.SimpleQueue) -> list[StepOutput]:
    outs = []
    while True:
        item = q.get(timeout=WAIT_S)
        assert not isinstance(item, BaseException), item
        outs.append(item)
        if item.finished:
            return outs


def test_outputs_are_routed_per_request_and_match_offline(loop, offline):
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40)]
    queues = [collect(loop, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    got = [[t for o in drain(q) for t in o.new_token_ids] for q in queues]
    want = [o.token_ids for o in offline.generate(prompts, GREEDY)]
    assert got == want
    assert all(len(g) == GREEDY.max_tokens for g in got)


def test_commands_run_on_the_engine_thread_and_raise_through_the_future(loop):
    assert loop.submit(lambda e: loop.in_loop()).result(WAIT_S) is True
    assert loop.in_loop() is False
    bad = loop.submit(lambda e: e.admit([], GREEDY, "x", Tier.STANDARD, field="token_ids"))
    with pytest.raises(ValueError, match="token_ids"):
        bad.result(WAIT_S)
    dup = collect(loop, "dup", [1, 2, 3], GREEDY.replace(max_tokens=200))
    with pytest.raises(DuplicateRequestError, match="request_id"):
        loop.submit(lambda e: e.admit([4, 5], GREEDY, "dup", Tier.STANDARD, field="token_ids")).result(WAIT_S)
    assert loop.abort("dup").result(WAIT_S) is True
    last = drain(dup)[-1]
    assert last.finish_reason is FinishReason.ABORT


def test_abort_frees_every_block_and_ends_the_listener(loop):
    q = collect(loop, "long", list(range(30)), GREEDY.replace(max_tokens=300))
    first = q.get(timeout=WAIT_S)
    assert first.new_token_ids and not first.finished
    assert loop.abort("long", "client went away").result(WAIT_S) is True
    outs = drain(q)
    assert outs[-1].finish_reason is FinishReason.ABORT and outs[-1].stop_reason == "client went away"
    assert loop.abort("long").result(WAIT_S) is False
    snap = loop.fresh_stats().result(WAIT_S)
    assert snap.running == 0 and snap.available_blocks == snap.total_blocks


def test_timers_fire_on_the_engine_thread_and_can_be_cancelled(loop):
    fired: Future = Future()
    cancelled: list[int] = []

    def arm(engine: Engine) -> None:
        loop.call_at(time.monotonic() + 0.05, lambda e: fired.set_result(loop.in_loop()))
        loop.call_at(time.monotonic() + 0.01, lambda e: cancelled.append(1)).cancel()

    loop.submit(arm).result(WAIT_S)
    assert fired.result(WAIT_S) is True
    loop.submit(lambda e: None).result(WAIT_S)
    assert cancelled == []


def test_kv_events_reset_lists_every_cached_block_then_deltas(loop):
    engine = loop.engine
    prompt = list(range(100, 140))  # 2 full blocks of 16, plus a partial one
    drain(collect(loop, "ev1", prompt, GREEDY.replace(max_tokens=1)))
    batches: queue.SimpleQueue[KvEventBatch] = queue.SimpleQueue()
    loop.submit(lambda e: loop.events.subscribe(batches.put)).result(WAIT_S)
    reset = batches.get(timeout=WAIT_S)
    expected = block_hashes(prompt, engine.config.block_size, engine.hash_seed)
    assert reset.reset and set(expected) <= set(reset.stored) and not reset.removed

    second = list(range(200, 236))
    drain(collect(loop, "ev2", second, GREEDY.replace(max_tokens=1)))
    delta = batches.get(timeout=WAIT_S)
    assert not delta.reset and delta.seq > reset.seq
    assert set(block_hashes(second, engine.config.block_size, engine.hash_seed)) <= set(delta.stored)

    loop.submit(lambda e: e.cache.reset()).result(WAIT_S)
    removed = batches.get(timeout=WAIT_S)
    assert set(expected) <= set(removed.removed)
    assert loop.fresh_stats().result(WAIT_S).cached_blocks == 0
    assert loop.submit(lambda e: loop.events.num_hashes).result(WAIT_S) == 0


def test_resumed_request_counts_earlier_output(loop, offline):
    """A request resumed with its first 4 outputs appended to the prompt continues exactly."""
    prompt = list(range(7, 30))
    full = offline.generate([prompt], GREEDY)[0].token_ids
    q = collect(loop, "resume", prompt + full[:4], GREEDY, num_output_tokens=4)
    rest = [t for o in drain(q) for t in o.new_token_ids]
    assert rest == full[4:]


def test_a_lost_device_goes_to_its_handler_and_a_failed_step_to_its_requests(model_dir, offline):
    """worker.device_fault: a step whose device is lost (injected: the CPU has no sticky errors)
    goes to on_device_lost, its requests untouched (a worker exits there and they resume
    elsewhere); a step that fails alone fails its requests, the handler unheard."""
    from worker.faults import InjectedDeviceLoss

    faults: list[BaseException] = []
    lost: list[str] = []

    def before_step() -> None:
        if faults:
            raise faults.pop()

    engine = Engine(EngineConfig(str(model_dir), num_kv_blocks=48))
    lp = EngineLoop(engine, name="test-lost", before_step=before_step, on_device_lost=lambda why, exc: lost.append(why))
    lp.start()
    try:
        faults.append(InjectedDeviceLoss("injected: the device is gone"))
        q = collect(lp, "lost-1", [1, 2, 3, 4], GREEDY)
        outs = drain(q)
        assert lost == ["injected: the device is gone"]
        ref = offline.generate([[1, 2, 3, 4]], GREEDY)[0]
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids  # no output lost or failed

        faults.append(RuntimeError("a step's own error"))
        q = collect(lp, "failed-1", [5, 6, 7], GREEDY)
        item = q.get(timeout=WAIT_S)
        assert isinstance(item, RuntimeError) and "own error" in str(item)
        assert lost == ["injected: the device is gone"]
    finally:
        lp.stop()


def test_stats_snapshot_and_stop(model_dir):
    engine = Engine(EngineConfig(str(model_dir), num_kv_blocks=32))
    lp = EngineLoop(engine, batch_window_s=0.002)
    lp.start()
    q = collect(lp, "s", list(range(20)), GREEDY.replace(max_tokens=500))
    q.get(timeout=WAIT_S)
    snap = lp.fresh_stats().result(WAIT_S)
    assert snap.total_blocks == 32 and snap.used_blocks >= 2 and snap.steps >= 1
    lp.stop()
    item = None
    while not isinstance(item, BaseException):
        item = q.get(timeout=WAIT_S)
    assert isinstance(item, LoopStopped)
    with pytest.raises(LoopStopped):
        lp.submit(lambda e: None)
    assert engine.num_free_blocks_after_reset() == engine.num_total_blocks


def test_index_publisher_mirrors_the_cache_into_redis(loop, redis_url):
    import uuid

    from kvindex import WorkerInfo, make_index
    from worker.index_publisher import IndexPublisher

    namespace = f"test-workers-{uuid.uuid4().hex[:8]}"
    publisher = IndexPublisher(make_index(redis_url, namespace, heartbeat_interval_s=0.5), "w-pub", loop,
                               lambda: WorkerInfo("127.0.0.1:1", "decode", 48, 0.0))
    publisher.start()
    reader = make_index(redis_url, namespace, heartbeat_interval_s=0.5)
    try:
        prompt = list(range(50, 100))  # 3 full blocks
        hashes = block_hashes(prompt, loop.engine.config.block_size, loop.engine.hash_seed)
        drain(collect(loop, "pub", prompt, GREEDY.replace(max_tokens=1)))
        deadline = time.monotonic() + WAIT_S
        while reader.match(hashes) != {"w-pub": len(hashes)}:
            assert time.monotonic() < deadline, reader.match(hashes)
            time.sleep(0.02)
        assert "w-pub" in reader.workers()
        loop.submit(lambda e: e.cache.reset()).result(WAIT_S)
        while reader.match(hashes):
            assert time.monotonic() < deadline, reader.match(hashes)
            time.sleep(0.02)
    finally:
        publisher.close()
        assert "w-pub" not in reader.workers()
        reader.close()

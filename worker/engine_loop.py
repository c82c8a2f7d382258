"""The single engine thread of a worker: it owns the `engine.Engine` and nothing else touches it.

gRPC handlers never call the engine. They `submit(fn)` a command, which the engine thread runs
as `fn(engine)` between two steps, and get a `concurrent.futures.Future` with its result. The
thread loops `engine.step()` while requests are waiting or running, and otherwise blocks on
its command queue (or until the next timer is due). After each step it hands every
`StepOutput` to the listener registered for that request, pumps the prefix cache's events into
the `KvEventHub`, and publishes a fresh `StatsSnapshot`.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.engine import Engine
from engine.outputs import FinishReason, StepOutput, StepPlan
from tandem.native import set_thread_name
from worker.device_fault import device_lost
from worker.events import KvEventHub
from worker.gpu_turn import GpuTurn
from worker.step_profiler import StepProfiler
from worker.stats import StatsSnapshot, take_snapshot

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Called on the engine thread with each StepOutput of its request, or with the exception that
# ended it (engine failure, loop stopped). It must return quickly (hand the item over).
Listener = Callable[[StepOutput | BaseException], None]
LayerHook = Callable[[int, StepPlan], None]
# Engine.step's while_running: the step's plan and a probe that says whether its samples are in.
WhileRunning = Callable[[StepPlan, Callable[[], bool]], None]


class LoopStopped(RuntimeError):
    """The engine loop stopped before it could run the command or finish the request."""


@dataclass(order=True)
class TimerHandle:
    when: float
    order: int
    fn: Callable[[Engine], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        """Engine thread only (or before the timer can fire)."""
        self.cancelled = True


@dataclass
class _Command:
    fn: Callable[[Engine], Any]
    future: Future
    in_hold: bool = False  # may also run inside a step's held launch (see EngineLoop.submit)


_STOP = object()


class EngineLoop:
    """Drives one engine from one thread.

    batch_window_s: when a command wakes an idle engine, keep collecting commands this long
      before the first step, so requests arriving together are prefilled in one batch (the
      engine's per-step token budget still caps the batch). 0 steps at once.
    on_layer, while_running: passed to `engine.step` (the prefill worker pushes KV from there).
    on_step: called on the engine thread after each step with its duration in seconds.
    turn: the worker's side of a GPU shared with other workers (`worker.gpu_turn`): called
      around each step; `on_turn_wait` gets the seconds a step waited for its turn (when > 0).
    profiler: `worker.step_profiler.StepProfiler`, called around each step (after the turn).
    before_step: called on the engine thread right before each step's forward is queued, inside
      the step's error handling (worker.device_fault's injection).
    on_device_lost: where set, a failed step whose device no longer works
      (`worker.device_fault.device_lost`) goes to it with the reason and the error instead of
      failing the step's requests (a worker exits: its requests resume elsewhere).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        name: str = "engine",
        batch_window_s: float = 0.0,
        on_layer: LayerHook | None = None,
        while_running: WhileRunning | None = None,
        on_step: Callable[[float], None] | None = None,
        turn: GpuTurn | None = None,
        on_turn_wait: Callable[[float], None] | None = None,
        profiler: StepProfiler | None = None,
        before_step: Callable[[], None] | None = None,
        on_device_lost: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        if not batch_window_s >= 0:
            raise ValueError(f"batch_window_s: must be >= 0, got {batch_window_s}")
        self.engine = engine
        self.batch_window_s = float(batch_window_s)
        self.on_layer = on_layer
        self.while_running = while_running
        self._on_step = on_step
        self.turn = turn or GpuTurn()
        self._on_turn_wait = on_turn_wait
        self.profiler = profiler
        self._before_step = before_step
        self._on_device_lost = on_device_lost
        self.events = KvEventHub()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._listeners: dict[str, Listener] = {}
        self._timers: list[TimerHandle] = []
        self._timer_order = itertools.count()
        self._steps = 0
        self._generated = 0
        self._snapshot = take_snapshot(engine, 0, 0)
        self._stopped = threading.Event()
        self._stop_taken = False  # the stop sentinel was taken by a command run inside a turn's wait
        self._deferred: list[Any] = []  # taken during a held launch, run (first, in order) after the step
        self._submit_lock = threading.Lock()
        # Reserves received and not yet answered (written by the one thread that serves the
        # worker's RPCs, read here): a prompt for this worker is coming, so the launches hold
        # (GpuTurn.holds) before the Reserve's command has even run.
        self.reserves_arriving = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ---- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the current step, fail queued commands and live requests with LoopStopped."""
        if not self._thread.is_alive():
            self._stopped.set()
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread did not stop within %.1fs", timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    def submit(self, fn: Callable[[Engine], T], in_hold: bool = False) -> Future[T]:
        """Run `fn(engine)` on the engine thread between steps; its result or exception lands in
        the returned future. Raises LoopStopped if the loop has stopped.

        in_hold: `fn` may also run while a prepared step waits for its launch (a decode worker's
        held launch waits through a prefill step on its GPU, ~25 ms): it must neither free nor
        take blocks that step writes, nor change its batch. A Reserve qualifies (it takes free
        blocks only); an abort does not. Commands keep their order: one that may not run in
        the hold also holds back every command after it."""
        future: Future[T] = Future()
        with self._submit_lock:  # so nothing is queued after the shutdown drain
            if self._stopped.is_set():
                raise LoopStopped("engine loop is stopped")
            self._commands.put(_Command(fn, future, in_hold))
        return future

    def abort(self, request_id: str, reason: str = "aborted") -> Future[bool]:
        return self.submit(lambda _e: self.abort_now(request_id, reason))

    @property
    def stats(self) -> StatsSnapshot:
        """The latest snapshot (refreshed after every step and command batch)."""
        return self._snapshot

    def fresh_stats(self) -> Future[StatsSnapshot]:
        """A snapshot taken on the engine thread after everything submitted before this call."""
        return self.submit(lambda _e: self.refresh_stats())

    # ---- engine thread only -------------------------------------------------------------------
    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def listen(self, request_id: str, listener: Listener) -> None:
        """Route `request_id`'s StepOutputs to `listener` until one is `finished`."""
        self._listeners[request_id] = listener

    def unlisten(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)

    def deliver(self, out: StepOutput) -> None:
        """Hand an output produced outside `step` (e.g. by `engine.activate`) to its listener."""
        listener = self._listeners.pop(out.request_id, None) if out.finished else self._listeners.get(out.request_id)
        if listener is not None:
            listener(out)

    def abort_now(self, request_id: str, reason: str = "aborted") -> bool:
        """Free `request_id` whatever its state and end its listener with an ABORT output.
        Returns whether the engine or a listener knew it."""
        found = self.engine.abort(request_id)
        listener = self._listeners.pop(request_id, None)
        if listener is not None:
            listener(StepOutput(request_id, [], [], True, FinishReason.ABORT, reason))
        return found or listener is not None

    def call_at(self, when: float, fn: Callable[[Engine], None]) -> TimerHandle:
        """Run `fn(engine)` on this thread once `time.monotonic() >= when` (unless cancelled)."""
        handle = TimerHandle(when, next(self._timer_order), fn)
        heapq.heappush(self._timers, handle)
        return handle

    # ---- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        set_thread_name(self._thread.name)  # `top -H` tells the engine thread from the gRPC one
        logger.info("engine loop started")
        try:
            while True:
                busy = self.engine.has_unfinished()
                if not self._run_commands(self._take(0.0 if busy else self._until_next_timer())):
                    break
                if not busy and self.batch_window_s and self.engine.has_unfinished():
                    end = time.monotonic() + self.batch_window_s
                    while (left := end - time.monotonic()) > 0:
                        if not self._run_commands(self._take(left)):
                            return
                self._run_timers()
                if self.engine.has_unfinished():
                    self._step()
                if self._stop_taken:
                    break
                self._after_iteration()
        finally:
            self._shutdown()

    def _take(self, timeout: float | None) -> list[Any]:
        """Commands queued now, after those a held launch deferred; waits up to `timeout` (None:
        forever, 0: not at all) for one."""
        items, self._deferred = self._deferred, []
        return items + self._take_new(0.0 if items else timeout)

    def _take_new(self, timeout: float | None) -> list[Any]:
        """Commands in the queue now; waits up to `timeout` (None: forever, 0: not at all) for one."""
        items = []
        try:
            items.append(self._commands.get(timeout=timeout) if timeout != 0 else self._commands.get_nowait())
        except queue.Empty:
            return items
        while True:
            try:
                items.append(self._commands.get_nowait())
            except queue.Empty:
                return items

    def _run_commands(self, items: list[Any]) -> bool:
        """Run commands in order; False once the stop sentinel is reached."""
        for i, item in enumerate(items):
            if item is _STOP:
                for rest in items[i + 1 :]:
                    if isinstance(rest, _Command):
                        rest.future.set_exception(LoopStopped("engine loop stopped"))
                return False
            if not item.future.set_running_or_notify_cancel():
                continue
            try:
                result = item.fn(self.engine)
            except BaseException as exc:  # goes back to the caller through the future
                item.future.set_exception(exc)
            else:
                item.future.set_result(result)
        return True

    def _until_next_timer(self) -> float | None:
        while self._timers and self._timers[0].cancelled:
            heapq.heappop(self._timers)
        if not self._timers:
            return None
        return max(0.0, self._timers[0].when - time.monotonic())

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self._timers and (self._timers[0].cancelled or self._timers[0].when <= now):
            handle = heapq.heappop(self._timers)
            if handle.cancelled:
                continue
            try:
                handle.fn(self.engine)
            except Exception:
                logger.exception("engine timer failed")

    def _pause(self, seconds: float) -> bool:
        """A turn's wait (`GpuTurn.before_step`): run what is submitted meanwhile, so a Reserve or
        an abort does not wait for another worker's prefill step. False once the stop came."""
        if not self._run_commands(self._take(seconds)):
            self._stop_taken = True
        return not self._stop_taken

    def _hold_pause(self, seconds: float) -> bool:
        """A held launch's wait (`GpuTurn.before_forward`): run the commands submitted
        `in_hold` meanwhile (a Reserve for the next prompt need not wait for the prefill step);
        defer the others, and everything after the first of them, to after the step. False
        (launch now) once the stop came."""
        for item in self._take_new(seconds):
            if self._deferred or item is _STOP or not item.in_hold:
                self._deferred.append(item)
            else:
                self._run_commands([item])
        return not any(item is _STOP for item in self._deferred)

    def _hold(self) -> None:
        """Engine.step's hold: the turn's second look, right before the forward is queued. Taken
        while a reservation is held, i.e. while a prefill for this worker is coming or running."""
        waited = self.turn.before_forward(self._hold_pause)
        if waited and self._on_turn_wait is not None:
            self._on_turn_wait(waited)

    def _step(self) -> None:
        waited = self.turn.before_step(self._pause, self.engine.num_running())
        if waited and self._on_turn_wait is not None:
            self._on_turn_wait(waited)
        if self._stop_taken or not self.engine.has_unfinished():  # commands ran during the wait
            self.turn.after_step()
            return
        if self.profiler is not None:
            self.profiler.before_step()
        t0 = time.perf_counter()
        try:
            reserving = self.reserves_arriving > 0 or self.engine.holds_any()
            hold = self._hold if self.turn.holds(reserving, self.engine.num_running()) else None
            if self._before_step is not None:
                self._before_step()
            outputs = self.engine.step(on_layer=self.on_layer, hold=hold, while_running=self.while_running)
        except Exception as exc:
            lost = device_lost(self.engine.device, exc) if self._on_device_lost is not None else None
            if lost is not None:  # every later step would fail too: the process gives way (worker.device_fault)
                self._on_device_lost(lost, exc)
                return
            logger.exception("engine step failed; aborting %d requests", len(self._listeners))
            self._fail_all(exc)
            return
        finally:
            self.turn.after_step()
            if self.profiler is not None:
                self.profiler.after_step()
        self._steps += 1
        if self._on_step is not None:
            self._on_step(time.perf_counter() - t0)
        for out in outputs:
            self._generated += len(out.new_token_ids)
            try:
                self.deliver(out)
            except Exception:
                logger.exception("listener of %s failed; aborting it", out.request_id)
                self.abort_now(out.request_id, "listener failed")

    def refresh_stats(self) -> StatsSnapshot:
        """Engine thread: take and publish a new snapshot."""
        self._snapshot = take_snapshot(self.engine, self._steps, self._generated)
        return self._snapshot

    def _after_iteration(self) -> None:
        self.events.pump(self.engine.cache.drain_events())
        self.refresh_stats()

    def _fail_all(self, exc: BaseException) -> None:
        listeners, self._listeners = self._listeners, {}
        for request_id, listener in listeners.items():
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("abort of %s after a failed step failed", request_id)
            try:
                listener(exc)
            except Exception:
                logger.exception("listener of %s failed", request_id)

    def _shutdown(self) -> None:
        with self._submit_lock:
            self._stopped.set()
        stopped = LoopStopped("engine loop stopped")
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            if isinstance(item, _Command):
                item.future.set_exception(stopped)
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Command):
                item.future.set_exception(stopped)
        self._fail_all(stopped)
        self._timers.clear()
        logger.info("engine loop stopped after %d steps", self._steps)

"""Pushes a prefilled prompt's KV to its decode worker, layer by layer, from the engine step.

Runs on the engine thread. `on_layer` is the engine's per-layer hook: in the step where a
prefill-only request computes its last prompt token (it samples: StepPlan.sampling), each layer's K/V
for all its prompt blocks are complete once that layer ran (blocks of earlier chunks were
finished in earlier steps), so the pusher hands blocks [num_cached_blocks, prompt_blocks) of
that layer, the last partial block included, to the sender, which stages a copy before
returning. When the step's output (the first token) reaches the request's listener, the pusher
commits the transfer with the token and frees the engine's blocks at once: the sender no
longer reads them.

A job's target may follow its prompt (`target_follows`: the gateway asks the decode worker for
blocks while this worker computes). The service sets `PrefillJob.target` from its own thread
and then runs `target_arrived` on the engine thread. A layer hook that sees no target yet skips
the push; the first one that sees it pushes every layer up to its own. If the step ends first,
the job keeps its output and its blocks (`awaiting`) and pushes every layer once the target
comes, from the engine thread after the step (the sender gathers on the current stream, so
after the forward); without a target within the timeout the job fails and frees its blocks.
Between the two, once the whole step is queued and while the device still runs it
(`while_step_runs`), the engine thread waits for the targets of the step's jobs rather than for
its samples, and pushes each as it comes: a step replayed from a prefill graph runs every hook
before its first kernel ends, so a target that comes during the forward is pushed during the
forward, not after it.

Tensor parallel (`ranks` set): this is rank 0; `step_extras` tells the other ranks which
requests push in the step about to run (`prefill.tp_push`), each rank pushes its own KV heads
to the decode rank of the same index, and the send future resolves once every rank's commit
was handed to its transport.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from functools import partial

from engine.engine import Engine
from engine.outputs import FinishReason, Request, StepOutput, StepPlan
from kvtransfer import KVSender, KVTransferError
from prefill.adapters import KvTarget, PrefillInput
from prefill.push_mode import check_kv_push, layers_due, named_layers
from prefill.tp_push import PushPlan, RankSends, combine_sends, encode_plans
from tandem.types import DEADLINE
from worker.adapters import logprob_to_meta
from worker.engine_loop import EngineLoop, TimerHandle
from worker.transfer import transfer_id

logger = logging.getLogger(__name__)

TARGET_POLL_S = 0.0005  # while a step runs: how often the engine thread looks whether it is done


class PrefillFailed(Exception):
    """A prefill did not produce a committed transfer. `kind`: "aborted", "deadline",
    "transfer" (the push failed, or its target never came) or "engine" (the engine failed or
    stopped)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class PrefillDone:
    output: StepOutput  # the first token (finished: PREFILLED, or STOP/LENGTH already)
    cached_tokens: int  # prompt tokens this worker took from its prefix cache
    send: Future  # Future[SendResult]: resolves once the commit is handed to the transport


@dataclass(eq=False)
class PrefillJob:
    """One Prefill call's work. `target` starts as the request's and, when that follows, is set
    once by the service (any thread; the engine thread reads it in its hooks)."""

    inp: PrefillInput
    num_layers: int
    deadline: float | None = None
    target: KvTarget | None = None
    request: Request | None = None
    opened: bool = False
    layers_sent: int = 0
    error: str | None = None
    timer: TimerHandle | None = None
    done: Future = field(default_factory=Future)  # Future[PrefillDone], or PrefillFailed
    rank_sends: Future | None = None  # TP: the other ranks' send results (prefill.tp_push.RankSends)
    output: StepOutput | None = None  # the first token, kept while the job awaits its target
    admitted_at: float | None = None  # time.monotonic() when the engine thread queued the prompt
    sampled_at: float | None = None  # ... when the engine thread had its first token
    committed_at: float | None = None  # ... when it had handed the commit to the transport and finished the job

    def __post_init__(self) -> None:
        if self.target is None:
            self.target = self.inp.target

    @property
    def transfer_id(self) -> str:
        assert self.target is not None, "a transfer needs the job's target"
        return transfer_id(self.inp.request_id, self.target.reservation_id)

    def finish(self, value: PrefillDone | PrefillFailed) -> None:
        try:
            if isinstance(value, PrefillFailed):
                self.done.set_exception(value)
            else:
                self.done.set_result(value)
        except InvalidStateError:
            pass


class KvPusher:
    """Prefill jobs in flight and the engine hooks that push their KV. Engine thread only.

    ranks: on rank 0 of a tensor-parallel worker, the collector of the other ranks' results
      (None without TP). rank_timeout_s bounds the wait for them after the step.
    push: when the layers go ("layer" or "step", prefill.push_mode).
    target_timeout_s: how long a computed prompt keeps its blocks waiting for a target that
      follows (the job's own deadline, when sooner, applies).
    """

    def __init__(self, loop: EngineLoop, sender: KVSender, ranks: RankSends | None = None,
                 rank_timeout_s: float = 30.0, push: str = "layer", target_timeout_s: float = 30.0) -> None:
        check_kv_push(push)
        self.loop = loop
        self.sender = sender
        self.ranks = ranks
        self.rank_timeout_s = rank_timeout_s
        self.push = push
        self.target_timeout_s = target_timeout_s
        self.jobs: dict[str, PrefillJob] = {}  # queued or computing
        self.awaiting: dict[str, PrefillJob] = {}  # computed, waiting for the target to push to
        self._target_came = threading.Event()  # set by `target_set` (any thread)

    def target_set(self) -> None:
        """Any thread, right after setting a job's `target`: wake `while_step_runs`."""
        self._target_came.set()

    def start(self, engine: Engine, job: PrefillJob) -> Request:
        """Queue the job's prompt (prefill only); ValueError for bad input."""
        inp = job.inp
        request = engine.admit(inp.token_ids, inp.params, inp.request_id, inp.tier, prefill_only=True,
                               num_output_tokens=inp.num_output_tokens, field="token_ids")
        job.request = request
        job.admitted_at = time.monotonic()
        self.jobs[inp.request_id] = job
        self.loop.listen(inp.request_id, partial(self._on_output, engine, job))
        if job.deadline is not None:
            job.timer = self.loop.call_at(job.deadline, partial(self._expire, job))
        return request

    def abort(self, engine: Engine, request_id: str, reason: str = "aborted") -> bool:
        """End `request_id`'s job wherever it is (queued, computing or awaiting its target) and
        free its blocks; its Prefill call fails. Whether anything knew the id."""
        job = self.awaiting.pop(request_id, None)
        if job is None:
            return self.loop.abort_now(request_id, reason)
        if job.timer is not None:
            job.timer.cancel()
        kind = "deadline" if reason == DEADLINE else "aborted"
        self._fail(engine, job, PrefillFailed(kind, f"request {request_id} {reason}"))
        return True

    def target_arrived(self, engine: Engine, job: PrefillJob) -> None:
        """Run on the engine thread after the service set `job.target`: push and commit now if
        the job was only waiting for it (else a layer hook or `_on_output` will see it)."""
        if self.awaiting.get(job.inp.request_id) is not job:
            return
        del self.awaiting[job.inp.request_id]
        if job.timer is not None:
            job.timer.cancel()
        assert job.output is not None
        self._push_rest_and_commit(engine, job, job.output)

    def _expire(self, job: PrefillJob, engine: Engine) -> None:
        if self.jobs.get(job.inp.request_id) is job:
            self.loop.abort_now(job.inp.request_id, DEADLINE)

    def _no_target(self, job: PrefillJob, engine: Engine) -> None:
        if self.awaiting.get(job.inp.request_id) is not job:
            return
        del self.awaiting[job.inp.request_id]
        if job.deadline is not None and time.monotonic() >= job.deadline:
            self._fail(engine, job, PrefillFailed("deadline", f"request {job.inp.request_id} {DEADLINE}"))
        else:
            self._fail(engine, job, PrefillFailed(
                "transfer", f"no KV target came for {job.inp.request_id} within {self.target_timeout_s:g}s"))

    # ---- engine hooks -------------------------------------------------------------------------
    def _pushing(self, plan: StepPlan) -> list[PrefillJob]:
        """Jobs whose last prompt chunk this step computes (they push during it)."""
        jobs = []
        for request in plan.sampling():
            job = self.jobs.get(request.request_id)
            if job is not None and job.request == request and job.error is None:
                jobs.append(job)
        return jobs

    def on_layer(self, layer: int, plan: StepPlan) -> None:
        if not self.jobs:
            return
        for job in self._pushing(plan):
            if job.target is None:  # it follows; a later layer or the step's end pushes
                continue
            due = layers_due(layer, job.num_layers, self.push)
            if due and job.layers_sent < due.stop:
                self._push(job, range(job.layers_sent, due.stop))

    def while_step_runs(self, plan: StepPlan, ready: Callable[[], bool]) -> None:
        """Engine.step's `while_running`: every hook ran and the step is queued; until `ready()`
        (its samples are in), push each of its jobs whose target comes meanwhile. The gathers
        queue after the step's work, which wrote every layer."""
        if not self.jobs:
            return
        waiting = [job for job in self._pushing(plan) if job.layers_sent < job.num_layers]
        while waiting and not ready():
            self._target_came.wait(TARGET_POLL_S)
            self._target_came.clear()  # targets set before this are seen below; later ones wake the next wait
            for job in [j for j in waiting if j.target is not None]:
                waiting.remove(job)
                if job.error is None and job.rank_sends is None:
                    self._push(job, range(job.layers_sent, job.num_layers))

    def step_extras(self, plan: StepPlan) -> bytes:
        """TP rank 0, before the step is broadcast: what the other ranks push during it."""
        if not self.jobs or self.ranks is None:
            return b""
        plans = []
        for job in self._pushing(plan):
            target = job.target
            assert target is not None, "a tensor-parallel prefill is queued only once its target is known"
            first = target.num_cached_blocks
            src = job.request.block_table[first : first + len(target.dst_block_ids)]
            plans.append(PushPlan(job.transfer_id, list(target.kv_addresses), job.num_layers, list(src),
                                  list(target.dst_block_ids)))
            job.rank_sends = self.ranks.watch(job.transfer_id, self.rank_timeout_s)
        return encode_plans(plans)

    def _push(self, job: PrefillJob, layers: range) -> None:
        target = job.target
        assert target is not None
        try:
            if not job.opened:
                self.sender.open(job.transfer_id, target.kv_addresses[0], job.num_layers)
                job.opened = True
            caches = [self.loop.engine.kv_cache.layers[layer] for layer in layers]
            first = target.num_cached_blocks
            src = job.request.block_table[first : first + len(target.dst_block_ids)]
            self.sender.send_layers(job.transfer_id, layers, caches, src, target.dst_block_ids)
            job.layers_sent += len(layers)
        except (KVTransferError, ValueError) as exc:
            job.error = f"kv push of {named_layers(layers)} failed: {exc}"
            logger.warning("%s: %s", job.inp.request_id, job.error)

    def _on_output(self, engine: Engine, job: PrefillJob, out: StepOutput | BaseException) -> None:
        rid = job.inp.request_id
        job.sampled_at = time.monotonic()
        if self.jobs.get(rid) is job:
            del self.jobs[rid]
        if job.timer is not None:
            job.timer.cancel()
        if isinstance(out, BaseException):
            self._fail(engine, job, PrefillFailed("engine", f"engine failed: {out}"))
        elif out.finish_reason is FinishReason.ABORT:
            kind = "deadline" if out.stop_reason == DEADLINE else "aborted"
            self._fail(engine, job, PrefillFailed(kind, f"request {rid} {out.stop_reason or 'aborted'}"))
        elif job.error is not None:
            self._fail(engine, job, PrefillFailed("transfer", job.error))
        elif job.target is None:  # computed before its target came: hold the KV for it
            job.output = out
            self.awaiting[rid] = job
            wait_until = time.monotonic() + self.target_timeout_s
            if job.deadline is not None:
                wait_until = min(wait_until, job.deadline)
            job.timer = self.loop.call_at(wait_until, partial(self._no_target, job))
        else:
            self._push_rest_and_commit(engine, job, out)

    def _push_rest_and_commit(self, engine: Engine, job: PrefillJob, out: StepOutput) -> None:
        """After the step: push the layers no hook pushed (the target came late), then commit."""
        if job.layers_sent < job.num_layers and job.rank_sends is None:
            self._push(job, range(job.layers_sent, job.num_layers))
        if job.error is not None or job.layers_sent != job.num_layers:
            why = job.error or f"only {job.layers_sent} of {job.num_layers} layers were pushed"
            self._fail(engine, job, PrefillFailed("transfer", why))
        else:
            self._commit(engine, job, out)

    def _commit(self, engine: Engine, job: PrefillJob, out: StepOutput) -> None:
        meta = {
            "first_token_id": out.new_token_ids[0],
            "logprobs": logprob_to_meta(out.new_logprobs[0] if out.new_logprobs else None),
            "num_tokens": len(job.inp.token_ids),
        }
        try:
            send = self.sender.commit(job.transfer_id, meta)
        except (KVTransferError, ValueError) as exc:
            self._fail(engine, job, PrefillFailed("transfer", f"kv commit failed: {exc}"))
            return
        finally:
            engine.release(job.inp.request_id)  # staged copies were taken in send_layer
        if job.rank_sends is not None:
            send = combine_sends(send, job.rank_sends)
        job.committed_at = time.monotonic()
        job.finish(PrefillDone(out, job.request.num_cached_tokens, send))

    def _fail(self, engine: Engine, job: PrefillJob, failure: PrefillFailed) -> None:
        if job.opened:
            self.sender.abort(job.transfer_id, str(failure))
        if self.ranks is not None:
            self.ranks.forget(job.transfer_id)
        engine.abort(job.inp.request_id)  # frees blocks in any state; no-op when already gone
        job.finish(failure)


def deadline_from(timeout_s: float | None) -> float | None:
    return time.monotonic() + timeout_s if timeout_s else None


__all__ = ["KvPusher", "PrefillDone", "PrefillFailed", "PrefillJob", "deadline_from"]

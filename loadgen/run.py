"""The run loop: `LoadRun` sends a dataset's conversations to one backend as a `LoadSpec` says
and measures every request (TTFT, inter-token gaps, end-to-end, usage) into `RequestResult`s.

One asyncio task per conversation (or one per concurrency slot); turns of a conversation go in
order. A request's failure is recorded in its result and never ends the run; only the
`duration_s` limit (or cancelling `run()`) cancels requests in flight.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from loadgen import datasets as ds
from loadgen.backends import BackendError, GrpcBackend, OpenAIBackend
from loadgen.report import Progress, RequestResult
from loadgen.schedule import LoadSpec, poisson_offsets, truncate
from tandem.types import MAX_SEED, Tier

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestOptions:
    """Per-request settings: max_tokens comes from each turn's output_len. A per-request
    sampling seed (derived from `seed`) is sent only when temperature > 0."""

    tier: Tier = Tier.STANDARD
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float | None = None
    seed: int = 0


@dataclass
class RunOutcome:
    """Results in completion order; `arrivals_s` are the scheduled Poisson offsets used."""

    results: list[RequestResult]
    wall_s: float
    sent: int
    cancelled: int
    skipped: int
    max_in_flight: int
    arrivals_s: list[float] = field(default_factory=list)


class LoadRun:
    """Runs `conversations` against `backend` once, as `spec` says, and returns a RunOutcome.
    `backend` is a loadgen.backends backend, or a tandem AsyncClient (driven over gRPC).

    A conversation's turns go one after another (turn k+1 is sent after turn k ended, with
    prompt = turn k's prompt + its answer + the new text); a failed turn ends its
    conversation. Every loop is bounded by the dataset and stops by itself."""

    def __init__(self, backend: GrpcBackend | OpenAIBackend | Any, conversations: Sequence[ds.Conversation], spec: LoadSpec,
                 options: RequestOptions = RequestOptions(), *, progress: Progress | None = None,
                 id_prefix: str | None = None) -> None:
        if not isinstance(backend, (GrpcBackend, OpenAIBackend)):
            backend = GrpcBackend(client=backend)
        self.backend, self.spec, self.options, self.progress = backend, spec, options, progress
        self.conversations = truncate(conversations, spec.num_requests)
        self.id_prefix = id_prefix or f"bench-{secrets.token_hex(4)}"
        self.results: list[RequestResult] = []
        self.sent = self.cancelled = self.in_flight = self.max_in_flight = self.failed = 0
        self.t0 = 0.0

    async def run(self) -> RunOutcome:
        self.t0 = time.perf_counter()
        arrivals: list[float] = []
        main = asyncio.ensure_future(self._drive(arrivals))
        try:
            done, _ = await asyncio.wait({main}, timeout=self.spec.duration_s)
            if done:
                main.result()  # re-raise a fault of the driver itself
            else:  # the --duration limit: cancel what is in flight and let it unwind
                main.cancel()
                await asyncio.wait({main})
        finally:
            if not main.done():  # run() itself was cancelled
                main.cancel()
        wall = max(time.perf_counter() - self.t0, 1e-9)
        if self.progress:
            self.progress.update(len(self.results), self.failed, final=True)
        return RunOutcome(self.results, wall, self.sent, self.cancelled, ds.num_turns(self.conversations) - self.sent,
                          self.max_in_flight, arrivals)

    async def _drive(self, arrivals: list[float]) -> None:
        async with asyncio.TaskGroup() as tg:
            if self.spec.concurrency is not None:
                it = iter(self.conversations)
                for _ in range(min(self.spec.concurrency, len(self.conversations))):
                    tg.create_task(self._worker(it))
                return
            gate = asyncio.Semaphore(self.spec.max_concurrency) if self.spec.max_concurrency else None
            arrivals.extend(poisson_offsets(self.spec.request_rate or math.inf, len(self.conversations),
                                            random.Random(self.spec.seed)))
            for conv, offset in zip(self.conversations, arrivals):
                while (delay := self.t0 + offset - time.perf_counter()) > 0:  # never early
                    await asyncio.sleep(delay)
                if self._budget_spent():
                    break
                tg.create_task(self._conversation(conv, gate))

    async def _worker(self, it: Any) -> None:
        for conv in it:  # one iterator shared by the workers: each conversation runs once
            await self._conversation(conv, None)

    def _budget_spent(self) -> bool:
        return self.spec.num_requests is not None and self.sent >= self.spec.num_requests

    async def _conversation(self, conv: ds.Conversation, gate: asyncio.Semaphore | None) -> None:
        history: str | tuple[int, ...] | None = None
        for k, turn in enumerate(conv.turns):
            async with gate if gate is not None else contextlib.nullcontext():
                if self._budget_spent():
                    return
                self.sent += 1
                prompt = turn.text if history is None else ds.concat(history, turn.text)
                result, answer = await self._request(conv, k, prompt, turn.output_len)
            self.results.append(result)
            self.failed += not result.ok
            if self.progress:
                self.progress.update(len(self.results), self.failed)
            if not result.ok:
                return
            history = ds.concat(prompt, answer)
    async def _request(self, conv: ds.Conversation, k: int, prompt: str | tuple[int, ...],
                       output_len: int) -> tuple[RequestResult, str | tuple[int, ...]]:
        opts = self.options
        seed = (opts.seed * 1_000_003 + conv.id * 1009 + k) % MAX_SEED if opts.temperature > 0 else None
        sent_at = time.perf_counter()
        res = RequestResult(conv.id, k, f"{self.id_prefix}-c{conv.id}-t{k}", sent_at - self.t0, 0.0)
        texts: list[str] = []
        ids: list[int] = []
        final = None
        last = sent_at
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            async with self.backend.stream(prompt, max_tokens=output_len, temperature=opts.temperature,
                                           ignore_eos=opts.ignore_eos, seed=seed, tier=opts.tier,
                                           request_id=res.request_id, timeout=opts.timeout_s) as stream:
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.token_ids or chunk.text:
                        if res.ttft_s is None:
                            res.ttft_s = now - sent_at
                        else:
                            res.itl_s.append(now - last)
                        last = now
                    texts.append(chunk.text)
                    ids.extend(chunk.token_ids)
                    if chunk.finish_reason is not None and final is None:
                        final = chunk
        except BackendError as exc:
            res.status, res.detail = exc.status, exc.detail
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        except Exception as exc:  # a client-side fault must not end the whole run
            logger.warning("request %s failed in the client: %r", res.request_id, exc)
            res.status, res.detail = "CLIENT_ERROR", f"{type(exc).__name__}: {exc}"
        finally:
            self.in_flight -= 1
        res.e2e_s = time.perf_counter() - sent_at
        if res.ok:
            if final is None:
                res.status, res.detail = "NO_FINAL_CHUNK", "the stream ended without finish_reason"
            elif final.finish_reason in ("error", "abort"):
                res.status, res.detail = f"FINISH_{final.finish_reason.upper()}", final.stop_reason
            usage = final.usage if final is not None else None
            res.completion_tokens = usage.completion_tokens if usage else len(ids)
            res.prompt_tokens = usage.prompt_tokens if usage else 0
            res.cached_tokens = usage.cached_tokens if usage else 0
        return res, ("".join(texts) if isinstance(prompt, str) else tuple(ids))

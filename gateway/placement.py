"""Placement: which decode worker serves a request, which worker computes its prompt (a
prefill worker, or the decode worker itself), and why, decided in one place; and the
prefill-load and recent-route bookkeeping (`CacheAwareRouter.remember` / `release`) that those
decisions imply.

Contract (one `Placer` per gateway; every call from the gateway's event loop):
1. Admission (`service`): `match_prompt(needs, prompt_ids)` fills the prompt's block hashes and
   prefix-index match into the request's `PlacementNeeds`, when the match can change a decision
   (more than one decode or prefill worker, or conditional disaggregation on).
2. Slot grant (`dispatch.Dispatcher`'s loop, among decode-capable workers with a free slot):
   `decode_worker(needs, free)`. Among role-both workers only, this routes the prompt too
   (they prefill), as the prefill routing below does.
3. Each attempt (`request.RequestRunner`): `place(needs, d, num_tokens)` says where the prompt
   is computed: on `d` (COLOCATED: a role-both worker; LOCAL: a decode worker prefills a short
   or mostly cached prompt itself, or no prefill worker is up; LONG_PROMPT: it is longer than
   every prefill worker's context, as where `tandem up` gives a prefill worker sharing a GPU a
   shorter one), or REMOTE, on a prefill worker that takes it, which
   `route_prefill(needs, placement, tokens, resumed)` picks once `d` has reserved the KV
   blocks (routing before the reservation would count a prefill that `d` may still refuse).
4. `release(needs)`: the prompt is computed, or the attempt ended in any way. The runner calls
   it as soon as the prefill is over and again in every attempt's `finally`; it is idempotent.
   `avoid(needs, worker)`: `worker` failed this request; later placements steer around it.

One id: the predicted prefill load (`LoadTracker`) is keyed by the request id, not by the
per-attempt id the workers see ("<id>#<n>"). A request has at most one attempt at a time, and
each attempt's `finally` knows the request id without carrying anything out of the attempt, so
one `release(needs)` there covers every exit path (success, retry, cancel, deadline), and a
retry routed before that release would just move the entry (`LoadTracker.on_dispatch`).

Failures: nothing here raises for a worker's state; a prefix-index lookup that fails or finds
the index degraded makes routing load-only (the index is a hint).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.metrics import GatewayMetrics
from gateway.routing import REASONS as ROUTING_REASONS
from gateway.routing import CacheAwareRouter, pick_decode
from gateway.workers import WorkerHandle, WorkerRegistry
from tandem.hashing import block_hashes
from tandem.types import Role

if TYPE_CHECKING:
    from kvindex.base import PrefixIndex

logger = logging.getLogger(__name__)

# Where a prompt is computed (`Placement.reason`) besides a routed prefill worker, whose reason
# is the router's (routing.REASONS).
COLOCATED = "colocated"  # a role-both worker prefills and decodes
LOCAL = "local"  # a decode worker prefills the prompt itself
LONG_PROMPT = "long_prompt"  # ... because no prefill worker's context takes it
REMOTE = "remote"  # a prefill worker, to be routed once the decode worker reserved the blocks
REASONS = tuple(dict.fromkeys((COLOCATED, LOCAL, LONG_PROMPT, REMOTE, *ROUTING_REASONS)))


@dataclass(eq=False)
class PlacementNeeds:
    """What placing one request takes into account; made at admission, kept across attempts."""

    request_id: str
    prompt_tokens: int
    needed_blocks: int
    hashes: tuple[int, ...] = ()  # the prompt's block hashes; empty while the index is unusable
    matches: Mapping[str, int] = field(default_factory=dict)  # prefix-index match of the prompt
    avoid: set[str] = field(default_factory=set)  # workers that failed this request


@dataclass(frozen=True)
class Placement:
    """One attempt's placement: `decode` decodes; the prompt is computed on `decode` (reason
    COLOCATED, LOCAL or LONG_PROMPT) or on `prefill` (REMOTE until routed, then the routing
    reason). `candidates`: the prefill workers up that take the prompt when a REMOTE placement
    was made."""

    decode: WorkerHandle
    reason: str
    prefill: WorkerHandle | None = None
    candidates: tuple[WorkerHandle, ...] = ()

    @property
    def local(self) -> bool:
        return self.reason in (COLOCATED, LOCAL, LONG_PROMPT)

    @property
    def computes_prompt(self) -> WorkerHandle:
        if self.local:
            return self.decode
        assert self.prefill is not None, "route_prefill() first"
        return self.prefill


class Placer:
    """Decides placements and keeps the router's bookkeeping (see the module docstring)."""

    def __init__(self, *, registry: WorkerRegistry, router: CacheAwareRouter, index: PrefixIndex | None,
                 hash_seed: int, block_size: int, local_prefill_tokens: int, sticky_bonus: float,
                 metrics: GatewayMetrics) -> None:
        self.registry = registry
        self.router = router
        self.index = index
        self.hash_seed = hash_seed
        self.block_size = block_size
        self.local_prefill_tokens = local_prefill_tokens
        self.sticky_bonus = sticky_bonus
        self.metrics = metrics

    # ---------------------------------------------------------------- admission

    async def match_prompt(self, needs: PlacementNeeds, prompt_ids: Sequence[int]) -> None:
        """Fill needs.hashes / needs.matches. The match picks among several workers, and tells
        how much of the prompt a decode worker lacks (conditional disaggregation)."""
        if (len(self.registry.decode_workers()) > 1 or len(self.registry.prefill_workers()) > 1
                or self.local_prefill_tokens > 0):
            needs.hashes, needs.matches = await self.prefix_lookup(prompt_ids)

    async def prefix_lookup(self, token_ids: Sequence[int]) -> tuple[tuple[int, ...], dict[str, int]]:
        """(block hashes, prefix-index match) of `token_ids`; ((), {}) without an index or
        while it is degraded (Redis unreachable), so routing is load-only then."""
        if self.index is None or self.router.config.policy != "cache_aware":
            return (), {}
        hashes = tuple(block_hashes(token_ids, self.block_size, self.hash_seed))
        try:
            matches = await self.index.amatch(hashes)
        except Exception as exc:  # the index is a hint; routing goes on load-only
            logger.warning("prefix index lookup failed: %r", exc)
            return (), {}
        if self.index.degraded:
            return (), {}
        return hashes, matches

    # ---------------------------------------------------------------- decode worker

    def decode_worker(self, needs: PlacementNeeds, free: Sequence[WorkerHandle]) -> WorkerHandle:
        """The decode worker among `free` (decode-capable, with a slot; not empty): with role-both
        workers only, the cache-aware router (they prefill too); otherwise the most KV headroom
        (`expected_free_blocks`: polled free blocks, less what this gateway placed since the
        poll and what its requests in flight may still need), with a bonus for the one holding
        the longest prefix (e.g. the previous turn)."""
        preferred = [h for h in free if h.name not in needs.avoid]
        cands = preferred or list(free)
        cands = [h for h in cands if h.trusted] or cands  # a suspect only when nothing else is free
        if len(cands) == 1:
            return cands[0]
        # Requests admitted together were matched before any of them was placed.
        matches = self.router.with_recent(needs.matches, needs.hashes)
        if all(h.role == Role.BOTH for h in cands):
            # Colocated workers prefill too: prefer the one holding the prompt's prefix.
            decision = self.router.route([h.name for h in cands], needs.prompt_tokens,
                                         matches if needs.hashes else None, request_id=needs.request_id)
            self.router.remember(decision.worker_id, needs.hashes)
            self.metrics.routing.labels(decision.reason).inc()
            return next(h for h in cands if h.name == decision.worker_id)
        by_name = {h.name: h for h in cands}
        sticky = max(cands, key=lambda h: matches.get(h.name, 0))
        name = pick_decode({h.name: (expected_free_blocks(h), h.inflight) for h in cands}, needs.needed_blocks,
                           sticky.name if matches.get(sticky.name) else None, sticky_bonus=self.sticky_bonus)
        if name is None:  # nobody has room by the (slightly stale) stats: least loaded, Reserve decides
            return min(cands, key=lambda h: (h.inflight, -expected_free_blocks(h), h.name))
        return by_name[name]

    # ---------------------------------------------------------------- prompt

    def place(self, needs: PlacementNeeds, d: WorkerHandle, num_tokens: int) -> Placement:
        """Where this attempt computes its `num_tokens` tokens (prompt plus output delivered)."""
        if d.role == Role.BOTH:
            return Placement(d, COLOCATED)
        up = [h for h in self.registry.prefill_workers() if h.routable]
        prefill = [h for h in up if takes_prompt(h, num_tokens)]
        prefill = [h for h in prefill if h.trusted] or prefill
        if up and not prefill:
            return self._on_decode_worker(needs, d, LONG_PROMPT)
        if not prefill or self._prefill_locally(needs, d, num_tokens):
            return self._on_decode_worker(needs, d, LOCAL)
        return Placement(d, REMOTE, candidates=tuple(prefill))

    def _on_decode_worker(self, needs: PlacementNeeds, d: WorkerHandle, reason: str) -> Placement:
        self.metrics.routing.labels(reason).inc()
        self.router.remember(d.name, needs.hashes)
        return Placement(d, reason)

    async def route_prefill(self, needs: PlacementNeeds, placement: Placement, tokens: Sequence[int],
                            resumed: bool) -> Placement:
        """Route a REMOTE placement's prompt to a prefill worker. `resumed`: output was
        delivered, so `tokens` is longer than the prompt matched at admission."""
        d = placement.decode
        cands = [h for h in placement.candidates if h.name not in needs.avoid] or list(placement.candidates)
        if resumed:
            hashes, matches = await self.prefix_lookup(tokens)
        else:
            hashes, matches = needs.hashes, needs.matches
        # Requests sharing a prefix may have been routed since the match was made.
        matches = self.router.with_recent(matches, hashes)
        decision = self.router.route([h.name for h in cands], len(tokens), matches if hashes else None,
                                     request_id=needs.request_id)
        self.router.remember(decision.worker_id, hashes)
        self.metrics.routing.labels(decision.reason).inc()
        self.router.remember(d.name, hashes)  # D keeps the prompt's blocks once it decodes
        p = next(h for h in cands if h.name == decision.worker_id)
        return Placement(d, decision.reason, prefill=p, candidates=placement.candidates)

    def _prefill_locally(self, needs: PlacementNeeds, d: WorkerHandle, num_tokens: int) -> bool:
        """Conditional disaggregation: the decode worker prefills the prompt itself when what it
        lacks of it (the prompt minus the prefix the index says it holds) is at most
        `local_prefill_tokens`, as a remote prefill plus KV transfer would cost more."""
        if self.local_prefill_tokens <= 0:
            return False
        held = needs.matches.get(d.name, 0)
        uncached = num_tokens - min(held * self.block_size, num_tokens - 1)
        return uncached <= self.local_prefill_tokens

    # ---------------------------------------------------------------- bookkeeping

    def release(self, needs: PlacementNeeds) -> None:
        """The request's prompt is computed, or its attempt ended: it no longer counts as
        prefill load. Idempotent."""
        self.router.release(needs.request_id)

    def avoid(self, needs: PlacementNeeds, worker: WorkerHandle) -> None:
        """`worker` failed this request: later decode and prefill placements avoid it (unless
        it is the only candidate)."""
        needs.avoid.add(worker.name)


def takes_prompt(h: WorkerHandle, num_tokens: int) -> bool:
    """Whether `h`'s engine takes a prompt of `num_tokens` (tandem.rules.check_prompt_ids: one
    output token must fit in its context, WorkerStats.max_model_len); True until it says."""
    context = h.stats.max_model_len if h.stats is not None else 0
    return not context or num_tokens < context


def expected_free_blocks(h: WorkerHandle) -> int:
    """The KV blocks `h` can still give a new request: its polled free blocks less the blocks of
    requests granted to it since that poll, and at most its total less every block the requests
    this gateway has on it may need (in-flight requests grow until they end). A burst placed
    between two polls thus spreads across workers instead of following one stale number."""
    if h.stats is None:
        return 0
    polled = h.stats.free_kv_blocks - h.pending_blocks
    committed = h.stats.total_kv_blocks - h.reserved_blocks
    return max(0, min(polled, committed))

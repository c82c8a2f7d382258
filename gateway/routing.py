"""Which worker gets a request: cache-aware choice of the prefill worker (SGLang's policy,
with a predicted-load term) and headroom-based choice of the decode worker. Pure logic: the
caller brings the prefix-index match and the candidates; nothing here does I/O."""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "load")
REASONS = ("cache", "load_balance", "round_robin", "load", "only_candidate", "local")


@dataclass(frozen=True)
class RoutingConfig:
    """Prefill and decode routing knobs.

    Units: cached tokens and load are both prompt tokens, load being the prefill work a
    worker still has queued (`LoadTracker`): each dispatched request adds its uncached
    tokens plus `cached_token_cost` per reused token (the cached KV is still read by
    attention and pushed to the decode worker), so a worker serving many cheap cache hits
    still looks busy. A candidate's score is
        w_cache * cached_tokens - w_load * load,
    so with w_cache = w_load = 1 it is minus the tokens the worker must compute before this
    request's prefill is done (load + prompt - cached, the prompt being the same for all):
    the predicted time to first token on equally fast workers. Raise w_cache to favour cache
    reuse over queueing delay.
    A prompt no candidate holds any of goes to the worker that has been sent the fewest
    uncached prompt tokens (then the least loaded): it holds the least cache content and has
    done the least prefill work, so prefix groups spread evenly instead of following momentary
    load (SGLang sends such requests to the "smallest tree"). Without a usable index
    (`matched_blocks` None) the choice is by load alone.
    When the busiest candidate's load exceeds the idlest's by more than
    `balance_abs_threshold` tokens AND by more than `balance_rel_threshold` times, the cache
    is ignored and the idlest worker wins (reason "load_balance").
    `ewma_alpha` in (0, 1] smooths load decreases (1 = no smoothing). `decode_sticky_bonus`
    is the fraction of extra headroom credited to the decode worker a session prefers.
    `recent_route_ttl_s`: how long the gateway counts a prompt it routed as held by the worker
    it chose, before that worker's KV events reach the prefix index (`RecentRoutes`; 0 = off).
    """

    policy: str = "cache_aware"
    w_cache: float = 1.0
    w_load: float = 1.0
    balance_abs_threshold: float = 4096.0
    balance_rel_threshold: float = 1.5
    ewma_alpha: float = 0.3
    decode_sticky_bonus: float = 0.25
    cached_token_cost: float = 0.25
    recent_route_ttl_s: float = 5.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("w_cache", "w_load", "balance_abs_threshold", "decode_sticky_bonus", "cached_token_cost",
                     "recent_route_ttl_s"):
            _check_number(name, getattr(self, name), lo=0.0)
        _check_number("balance_rel_threshold", self.balance_rel_threshold, lo=1.0)
        _check_number("ewma_alpha", self.ewma_alpha)
        if not 0.0 < self.ewma_alpha <= 1.0:
            raise ValueError(f"ewma_alpha: must be in (0, 1], got {self.ewma_alpha}")


@dataclass(frozen=True)
class RoutingDecision:
    """The chosen prefill worker, why, and how many prompt tokens it is expected to reuse."""

    worker_id: str
    reason: str
    cached_tokens: int


class LoadTracker:
    """Predicted prefill load per worker, in tokens, from what this gateway dispatched.

    `on_dispatch(worker, request_id, tokens)` adds the tokens the worker must compute;
    `on_complete(request_id)` removes them when the prefill finishes, fails or is cancelled
    (unknown ids are ignored, so calling it twice is harmless).
    `predicted(w) = max(outstanding(w), ewma(w))` where `sample()` (called once per routing
    decision) advances ewma <- alpha * outstanding + (1 - alpha) * ewma. Increases count at
    once, so back-to-back requests don't pile onto one worker before an average catches up;
    decreases fade over a few decisions, so a burst of completions doesn't pull every
    following request onto the worker that just drained. Thread-safe.
    """

    def __init__(self, alpha: float = 0.3) -> None:
        _check_number("ewma_alpha", alpha)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"ewma_alpha: must be in (0, 1], got {alpha}")
        self.alpha = float(alpha)
        self._lock = threading.Lock()
        self._outstanding: dict[str, int] = {}
        self._ewma: dict[str, float] = {}
        self._requests: dict[str, tuple[str, int]] = {}  # request id -> (worker, tokens)
        self._in_flight: dict[str, int] = {}

    def on_dispatch(self, worker_id: str, request_id: str, tokens: int) -> None:
        """Record a dispatch; a request id already in flight is moved (a retry elsewhere)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"tokens: must be an integer >= 0, got {tokens!r}")
        with self._lock:
            self._complete_locked(request_id)
            self._requests[request_id] = (worker_id, tokens)
            self._outstanding[worker_id] = self._outstanding.get(worker_id, 0) + tokens
            self._in_flight[worker_id] = self._in_flight.get(worker_id, 0) + 1

    def on_complete(self, request_id: str) -> bool:
        """Forget a request; True if it was in flight."""
        with self._lock:
            return self._complete_locked(request_id)

    def outstanding(self, worker_id: str) -> int:
        with self._lock:
            return self._outstanding.get(worker_id, 0)

    def in_flight(self, worker_id: str) -> int:
        with self._lock:
            return self._in_flight.get(worker_id, 0)

    def predicted(self, worker_id: str) -> float:
        with self._lock:
            return max(float(self._outstanding.get(worker_id, 0)), self._ewma.get(worker_id, 0.0))

    def sample(self, workers: Iterable[str]) -> dict[str, float]:
        """Advance each worker's average one step and return its predicted load."""
        a = self.alpha
        out: dict[str, float] = {}
        with self._lock:
            for w in workers:
                x = float(self._outstanding.get(w, 0))
                s = a * x + (1.0 - a) * self._ewma.get(w, 0.0)
                self._ewma[w] = s
                out[w] = max(x, s)
        return out

    def forget(self, worker_id: str) -> None:
        """Drop a worker that left, with its in-flight requests."""
        with self._lock:
            for rid in [r for r, (w, _) in self._requests.items() if w == worker_id]:
                del self._requests[rid]
            self._outstanding.pop(worker_id, None)
            self._ewma.pop(worker_id, None)
            self._in_flight.pop(worker_id, None)

    def _complete_locked(self, request_id: str) -> bool:
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return False
        worker_id, tokens = entry
        self._outstanding[worker_id] = self._outstanding.get(worker_id, 0) - tokens
        self._in_flight[worker_id] = self._in_flight.get(worker_id, 0) - 1
        return True


class RecentRoutes:
    """Prompts this gateway routed in the last `ttl_s` seconds, by block hash and worker.

    The prefix index learns of a worker's new blocks only after its prefill ran and its KV
    events arrived; requests sharing a prefix that come in meanwhile would see no holder and
    spread over every worker. Like SGLang's router, which inserts a prompt into its
    approximate tree when it routes it, the gateway `record`s where it sent each prompt and
    merges `match` into the index's answer (`merge_matches`) until the entries expire.
    At most `max_prompts` prompts are remembered (oldest forgotten first). Thread-safe.
    """

    def __init__(self, ttl_s: float = 5.0, max_prompts: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        _check_number("recent_route_ttl_s", ttl_s, lo=0.0)
        if isinstance(max_prompts, bool) or not isinstance(max_prompts, int) or max_prompts < 1:
            raise ValueError(f"max_prompts: must be an integer >= 1, got {max_prompts!r}")
        self.ttl_s = float(ttl_s)
        self.max_prompts = max_prompts
        self._clock = clock
        self._lock = threading.Lock()
        self._holders: dict[int, dict[str, float]] = {}  # hash -> {worker: expiry}
        self._order: deque[tuple[float, str, tuple[int, ...]]] = deque()

    def record(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """`worker_id` is about to compute (and cache) the blocks `block_hashes`."""
        if not block_hashes or self.ttl_s <= 0:
            return
        hashes = tuple(block_hashes)
        with self._lock:
            now = self._clock()
            self._expire_locked(now)
            expiry = now + self.ttl_s
            for h in hashes:
                self._holders.setdefault(h, {})[worker_id] = expiry
            self._order.append((expiry, worker_id, hashes))
            while len(self._order) > self.max_prompts:
                self._forget_locked(*self._order.popleft())

    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """{worker: leading blocks of `block_hashes` recorded for it and not expired}."""
        result: dict[str, int] = {}
        with self._lock:
            now = self._clock()
            active: set[str] | None = None
            for i, h in enumerate(block_hashes):
                held = {w for w, exp in self._holders.get(h, {}).items() if exp > now}
                active = held if active is None else active & held
                if not active:
                    break
                for w in active:
                    result[w] = i + 1
        return result

    def forget(self, worker_id: str) -> None:
        """Drop every entry of a worker that went down or restarted."""
        with self._lock:
            for h in [h for h, held in self._holders.items() if worker_id in held]:
                del self._holders[h][worker_id]
                if not self._holders[h]:
                    del self._holders[h]

    def __len__(self) -> int:
        """Prompts remembered and not expired."""
        with self._lock:
            self._expire_locked(self._clock())
            return len(self._order)

    def _expire_locked(self, now: float) -> None:
        while self._order and self._order[0][0] <= now:
            self._forget_locked(*self._order.popleft())

    def _forget_locked(self, expiry: float, worker_id: str, hashes: tuple[int, ...]) -> None:
        for h in hashes:
            held = self._holders.get(h)
            if held is not None and held.get(worker_id) == expiry:  # not refreshed by a later record
                del held[worker_id]
                if not held:
                    del self._holders[h]


def merge_matches(*matches: Mapping[str, int]) -> dict[str, int]:
    """Per worker, the longest leading run any of the `matches` reports."""
    out: dict[str, int] = {}
    for m in matches:
        for w, n in m.items():
            if n > out.get(w, 0):
                out[w] = n
    return out


class CacheAwareRouter:
    """Chooses the prefill worker for each request (see `RoutingConfig` for the policy).

    Per request the gateway calls `index.amatch(block_hashes)` and passes the result to
    `route(...)` with a request id, then `release(request_id)` when the prefill ends in any
    way. No match (None: no index, or it is degraded) makes the choice load-only; an empty
    one (nobody holds the prompt) sends it to the smallest cache.
    """

    def __init__(
        self, config: RoutingConfig | None = None, *, block_size: int = 16, tracker: LoadTracker | None = None
    ) -> None:
        self.config = config or RoutingConfig()
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.tracker = tracker or LoadTracker(self.config.ewma_alpha)
        self.recent = RecentRoutes(self.config.recent_route_ttl_s)
        self._lock = threading.Lock()
        self._turn = 0
        self._computed: dict[str, int] = {}  # uncached prompt tokens routed to each worker

    def with_recent(self, matches: Mapping[str, int], block_hashes: Sequence[int]) -> dict[str, int]:
        """`matches` (the prefix index's answer) merged with this gateway's recent routes of
        the same prompt (`RecentRoutes`); `matches` as it is unless the policy is cache_aware."""
        if self.config.policy != "cache_aware" or not block_hashes:
            return dict(matches)
        return merge_matches(matches, self.recent.match(block_hashes))

    def remember(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """`worker_id` was given a prompt with these block hashes to compute (cache_aware only)."""
        if self.config.policy == "cache_aware":
            self.recent.record(worker_id, block_hashes)

    def route(
        self,
        candidates: Sequence[str],
        prompt_tokens: int,
        matched_blocks: Mapping[str, int] | None = None,
        *,
        request_id: str | None = None,
    ) -> RoutingDecision:
        """Pick a prefill worker among `candidates` for a prompt of `prompt_tokens` tokens.

        `matched_blocks` is `PrefixIndex.match(...)` output (workers outside `candidates` are
        ignored); None when there is no usable index (degraded): the idlest worker wins. With
        `request_id`, the request's cost (uncached tokens + cached_token_cost
        x cached tokens) is recorded as the worker's load until `release(request_id)`.
        """
        cands = list(dict.fromkeys(candidates))
        if not cands:
            raise ValueError("candidates: at least one prefill worker is needed")
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
            raise ValueError(f"prompt_tokens: must be an integer >= 1, got {prompt_tokens!r}")
        matched = matched_blocks or {}
        # At least the last prompt token is always computed (its logits sample the first token).
        cached = {w: min(int(matched.get(w, 0)) * self.block_size, prompt_tokens - 1) for w in cands}
        with self._lock:
            turn = self._turn
            self._turn += 1
            computed = {w: self._computed.get(w, 0) for w in cands}
        n = len(cands)
        rotation = {w: (i - turn) % n for i, w in enumerate(cands)}
        cfg = self.config

        if n == 1:
            worker, reason = cands[0], "only_candidate"
        elif cfg.policy == "round_robin":
            worker, reason = cands[turn % n], "round_robin"
        else:
            loads = self.tracker.sample(cands)
            idlest = min(cands, key=lambda w: (loads[w], -cached[w], rotation[w]))
            hi, lo = max(loads.values()), loads[idlest]
            if cfg.policy == "load" or matched_blocks is None:
                worker, reason = idlest, "load"
            elif hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
                worker, reason = idlest, "load_balance"
            elif not any(cached.values()):
                # A new prefix: the smallest cache takes it (see RoutingConfig).
                worker, reason = min(cands, key=lambda w: (computed[w], loads[w], rotation[w])), "load"
            else:
                worker = max(cands, key=lambda w: (cfg.w_cache * cached[w] - cfg.w_load * loads[w], -loads[w],
                                                   -computed[w], -rotation[w]))
                reason = "cache" if cached[worker] > 0 else "load"
        with self._lock:
            self._computed[worker] = self._computed.get(worker, 0) + prompt_tokens - cached[worker]
        if request_id is not None:
            cost = prompt_tokens - cached[worker] + cfg.cached_token_cost * cached[worker]
            self.tracker.on_dispatch(worker, request_id, int(math.ceil(cost)))
        logger.debug("route %s -> %s (%s, %d cached)", request_id, worker, reason, cached[worker])
        return RoutingDecision(worker, reason, cached[worker])

    def release(self, request_id: str) -> bool:
        """The prefill of `request_id` finished, failed or was cancelled."""
        return self.tracker.on_complete(request_id)

    def pick_decode(
        self, candidates: Mapping[str, tuple[int, int]], needed_blocks: int, preferred: str | None = None
    ) -> str | None:
        return pick_decode(candidates, needed_blocks, preferred, sticky_bonus=self.config.decode_sticky_bonus)


def pick_decode(
    candidates: Mapping[str, tuple[int, int]],
    needed_blocks: int,
    preferred: str | None = None,
    *,
    sticky_bonus: float = 0.25,
) -> str | None:
    """The decode worker that can hold `needed_blocks` with the most headroom.

    `candidates` maps worker -> (free_blocks, running requests). Headroom is
    free_blocks - needed_blocks; workers without room are skipped; fewer running requests
    break ties. `preferred` (e.g. the worker holding the session's previous turn) counts its
    headroom times (1 + sticky_bonus) when it has room: a bonus, never a requirement.
    Returns None when no candidate has room.
    """
    if isinstance(needed_blocks, bool) or not isinstance(needed_blocks, int) or needed_blocks < 0:
        raise ValueError(f"needed_blocks: must be an integer >= 0, got {needed_blocks!r}")
    _check_number("sticky_bonus", sticky_bonus, lo=0.0)
    best: tuple[float, int, str] | None = None
    for worker, entry in candidates.items():
        try:
            free, running = entry
        except (TypeError, ValueError):
            raise ValueError(f"candidates: {worker!r} must map to (free_blocks, running), got {entry!r}") from None
        for name, v in (("free_blocks", free), ("running", running)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"candidates: {name} of {worker!r} must be an integer >= 0, got {v!r}")
        headroom = free - needed_blocks
        if headroom < 0:
            continue
        score = headroom * (1.0 + sticky_bonus) if worker == preferred else float(headroom)
        key = (score, -running, worker)
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else best[2]


def _check_number(name: str, value: object, lo: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name}: must be >= {lo}, got {value}")

"""Continuous-batching scheduler: who runs this step, how many tokens each, and who gets preempted.

One step is `schedule()` (pure bookkeeping, no tensors) → the model runner executes the
returned SchedulerOutput → `postprocess()` appends sampled tokens, caches full blocks and
finishes requests. Workers drive these three calls themselves; `LLM` loops over them offline.

Policy: running requests first (in (tier, arrival) order), each gets one token when decoding or
a chunk of its prompt within the step's token budget (chunked prefill); then swapped-out
requests come back; then waiting ones are admitted. When KV blocks run out, the radix cache
evicts unlocked blocks first; then the lowest-priority running request (highest tier, newest)
is preempted: swapped to host memory when the host pool has room, else dropped and recomputed.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from engine.block_allocator import BlockAllocator, OutOfBlocks
from engine.radix_cache import RadixCache
from engine.sequence import FinishReason, Sequence, SeqStatus
from tandem.rules import blocks_needed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    block_size: int = 16
    max_running: int = 256
    max_batched_tokens: int = 4096
    num_host_blocks: int = 0
    max_model_len: int = 1 << 62  # a sequence whose pending token fills this is not scheduled again

    def __post_init__(self) -> None:
        bs = self.block_size
        if not (isinstance(bs, int) and 16 <= bs <= 64 and bs & (bs - 1) == 0):
            raise ValueError(f"block_size: must be a power of two in [16, 64], got {bs!r}")
        if not (isinstance(self.max_running, int) and self.max_running >= 1):
            raise ValueError(f"max_running: must be a positive integer, got {self.max_running!r}")
        if not (isinstance(self.max_batched_tokens, int) and self.max_batched_tokens >= 1):
            raise ValueError(f"max_batched_tokens: must be a positive integer, got {self.max_batched_tokens!r}")


@dataclass(frozen=True)
class PrefillAlone:
    """When waiting prompts get a step of their own, without the running decodes: when every
    one of them fits it (`max_tokens` uncached tokens at most, `max_seqs` sequences) and no
    running sequence is still in its prompt. An engine whose pure prefill steps replay a CUDA
    graph (engine.prefill_graphs) computes a prompt faster so than in a step mixed with decodes,
    which runs eagerly and, on a slow host, takes the host's launch time (BENCHMARKS §20): the
    prompt's first token comes sooner and the decodes wait no longer than a mixed step would
    have kept them. Never two such steps running, so the decodes move at least every other
    step; a larger backlog mixes as before (the throughput path)."""

    max_tokens: int
    max_seqs: int


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (device, host) block ids
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (host, device)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.swap_out and not self.swap_in


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_swaps_out: int = 0
    num_recomputes: int = 0
    num_scheduled_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, cache: RadixCache) -> None:
        self.config = config
        self.allocator = allocator
        self.cache = cache
        self.host_allocator = BlockAllocator(config.num_host_blocks) if config.num_host_blocks else None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.stats = SchedulerStats()
        self._by_id: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}  # prefill-only requests whose KV awaits transfer
        # Finished sequences whose blocks a step still in flight writes: (seq, match, blocks)
        # until that step is done (`release_finished`), so no reservation gets them meanwhile.
        self.unreleased: list[tuple[Sequence, Any, list[int]]] = []
        self.prefill_alone: PrefillAlone | None = None  # set by an engine with prefill graphs
        self._alone_last = False  # the last step was a PrefillAlone step

    # ---- queue management -------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request_id: {seq.request_id!r} is already in the engine")
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def knows(self, request_id: str) -> bool:
        """Queued, running, swapped, reserved or prefilled-and-held."""
        return request_id in self._by_id or request_id in self.held

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted but not yet computed (waiting, swapped and mid-prefill requests)."""
        total = sum(seq.num_tokens - seq.num_computed_tokens for seq in self.waiting)
        total += sum(seq.num_tokens - seq.num_computed_tokens for seq in self.swapped)
        total += sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in self.running)
        return total

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        self.finish(seq, FinishReason.ABORT)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence: cache its computed full blocks, release its device and host blocks.
        A sequence in a step still in flight (`num_pending`; the overlapped engine schedules one
        that the step before ends) keeps its device blocks until `release_finished`: that step
        writes its last token's K/V, and a transport writing a reservation's blocks is not
        ordered after the engine's steps."""
        if seq.status is SeqStatus.FINISHED:
            return
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq.block_table:
            self._cache_computed(seq)
            if seq.num_pending:
                self.unreleased.append((seq, seq.prefix_match, seq.block_table))
            else:
                self.cache.unlock(seq.prefix_match, seq.block_table)
        if seq.host_blocks:
            self.host_allocator.decref(seq.host_blocks)
        seq.block_table, seq.host_blocks, seq.prefix_match = [], [], None
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self._by_id.pop(seq.request_id, None)

    def release_finished(self, seq: Sequence) -> None:
        """The last step in flight with finished `seq` is done: release the blocks `finish` kept."""
        for i, (held_seq, match, blocks) in enumerate(self.unreleased):
            if held_seq is seq:
                del self.unreleased[i]
                self.cache.unlock(match, blocks)
                return

    def finish_prefill(self, seq: Sequence, reason: FinishReason = FinishReason.PREFILLED) -> None:
        """A prefill-only request is done computing: stop scheduling it but keep its blocks
        (the KV transfer reads them, also when its first token ended it: `reason` STOP or
        LENGTH) until `release`."""
        self.running.remove(seq)
        self._cache_computed(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self.held[seq.request_id] = seq
        self._by_id.pop(seq.request_id, None)

    def release(self, request_id: str) -> bool:
        """Free a prefill-only request's blocks once its KV has been sent (or the send failed)."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.cache.unlock(seq.prefix_match, seq.block_table)
        seq.block_table, seq.prefix_match = [], None
        return True

    # ---- disaggregated decode: KV arrives from a prefill worker -----------------------------
    def reserve(self, seq: Sequence) -> tuple[int, list[int]] | None:
        """Hold blocks for `seq`'s prompt: reuse what the radix cache has, allocate the rest.

        Returns (number of leading prompt blocks already cached here, block ids for the rest),
        or None when the blocks cannot be had without preemption. The sequence waits in
        `reserved` (not scheduled) until `activate` or `release`.
        """
        if seq.request_id in self._by_id or seq.request_id in self.held:
            raise ValueError(f"request_id: {seq.request_id!r} is already in the engine")
        bs = self.config.block_size
        match = self.cache.match_prefix(seq.prompt_token_ids)
        need = blocks_needed(seq.num_prompt_tokens, 1, self.config.max_model_len, bs) - len(match.block_ids)
        for _ in range(4):  # an eviction may take matched blocks themselves: match again, evict more
            if self.allocator.num_free >= need or not self.cache.evict(need - self.allocator.num_free):
                break
            match = self.cache.match_prefix(seq.prompt_token_ids)
            need = blocks_needed(seq.num_prompt_tokens, 1, self.config.max_model_len, bs) - len(match.block_ids)
        if self.allocator.num_free < need:
            return None
        self.cache.lock(match)
        seq.prefix_match = match
        seq.block_table = list(match.block_ids) + self.allocator.allocate(need)
        seq.num_cached_tokens = match.num_tokens
        self.held[seq.request_id] = seq
        n_cached = len(match.block_ids)
        prompt_blocks = -(-seq.num_prompt_tokens // bs)
        return n_cached, seq.block_table[n_cached:prompt_blocks]

    def activate(self, request_id: str, first_token: int, logprob=None) -> Sequence:
        """The prompt's KV is in the reserved blocks: start decoding after `first_token`."""
        seq = self.held.pop(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.output_token_ids.append(first_token)
        seq.output_logprobs.append(logprob)
        seq.status = SeqStatus.RUNNING
        self._by_id[request_id] = seq
        self._cache_computed(seq)
        self.running.append(seq)
        return seq

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        alone = self._schedule_prefill_alone()
        self._alone_last = alone is not None
        if alone is not None:
            self.stats.num_scheduled_tokens += alone.num_tokens
            return alone
        out = SchedulerOutput()
        budget = self.config.max_batched_tokens
        self.running.sort(key=lambda s: s.priority_key)
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.surely_ends_with_pending(self.config.max_model_len):
                i += 1  # its last token is on the way; the engine finishes it when that lands
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self._ensure_blocks(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue  # seq preempted itself; the running list shrank under index i
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1

        if not preempted:
            self._swap_in(out, budget)
            budget = self.config.max_batched_tokens - out.num_tokens
            self._admit(out, budget)
        self.stats.num_scheduled_tokens += out.num_tokens
        return out

    def _schedule_prefill_alone(self) -> SchedulerOutput | None:
        """The waiting prompts alone, when `prefill_alone` says so (see PrefillAlone); else None."""
        rule = self.prefill_alone
        if rule is None or self._alone_last or not self.waiting or not self.running or self.swapped:
            return None
        if len(self.waiting) > rule.max_seqs or len(self.running) + len(self.waiting) > self.config.max_running:
            return None
        if any(s.num_tokens - s.num_computed_tokens > 1 for s in self.running):
            return None  # a prompt being computed in chunks: the usual step finishes it
        budget = min(rule.max_tokens, self.config.max_batched_tokens)
        if sum(s.num_tokens - s.num_computed_tokens for s in self.waiting) > budget:
            return None
        out = SchedulerOutput()
        self._admit(out, budget)  # a plan whatever it did (a preemption it needed is in it)
        return None if out.is_empty else out

    def _ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        need = seq.blocks_needed(num_tokens, self.config.block_size)
        if need == 0:
            return True
        if self.allocator.num_free < need:
            self.cache.evict(need - self.allocator.num_free)
        try:
            seq.block_table.extend(self.allocator.allocate(need))
        except OutOfBlocks:
            return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.stats.num_preemptions += 1
        host = self.host_allocator
        self._cache_computed(seq)
        if host is not None and host.num_free >= len(seq.block_table) and seq.num_computed_tokens > 0:
            seq.host_blocks = host.allocate(len(seq.block_table))
            out.swap_out.append((list(seq.block_table), list(seq.host_blocks)))
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
            self.stats.num_swaps_out += 1
        else:
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)
            self.stats.num_recomputes += 1
        # The device blocks go back now; a swap-out copy is issued before anything reuses them
        # because the runner performs out.swap_out before this step's forward pass.
        self.cache.unlock(seq.prefix_match, seq.block_table)
        seq.block_table, seq.prefix_match = [], None
        logger.debug("preempted %s (%s)", seq.request_id, seq.status.value)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> None:
        self.swapped.sort(key=lambda s: s.priority_key)
        while self.swapped and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.swapped[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = max(len(seq.host_blocks), -(-(seq.num_computed_tokens + n) // self.config.block_size))
            if self.allocator.num_free < need:
                self.cache.evict(need - self.allocator.num_free)
            if self.allocator.num_free < need:
                return
            seq.block_table = self.allocator.allocate(need)
            out.swap_in.append((list(seq.host_blocks), seq.block_table[: len(seq.host_blocks)]))
            self.host_allocator.decref(seq.host_blocks)
            seq.host_blocks = []
            seq.prefix_match = self.cache.match_prefix([])
            self.cache.lock(seq.prefix_match)
            self.swapped.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        self.waiting.sort(key=lambda s: s.priority_key)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running:
            seq = self.waiting[0]
            if seq.prefix_match is None:
                match = self.cache.match_prefix(seq.all_token_ids)
                self.cache.lock(match)
                seq.prefix_match = match
                seq.block_table = list(match.block_ids)
                seq.num_computed_tokens = match.num_tokens
                if not seq.output_token_ids:
                    seq.num_cached_tokens = match.num_tokens
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._ensure_blocks(seq, seq.num_computed_tokens + n):
                if not self._preempt_lower_tier(seq, out):
                    return
                continue
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

    def _preempt_lower_tier(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Make room for a waiting request by preempting a strictly lower-tier running one."""
        scheduled = {id(s.seq) for s in out.scheduled}
        for victim in sorted(self.running, key=lambda s: s.priority_key, reverse=True):
            if victim.tier > seq.tier and id(victim) not in scheduled:
                self._preempt(victim, out)
                return True
        return False

    # ---- after the forward pass -----------------------------------------------------------
    def postprocess(self, out: SchedulerOutput) -> None:
        """Advance computed counts; caller appends sampled tokens, then calls `finish` as needed."""
        caching, bs = self.cache.enabled, self.config.block_size
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # ended meanwhile (an overlapped engine resolves the previous step first)
            seq.num_computed_tokens += s.num_new_tokens
            # A sequence's newly full blocks join the prefix cache (a disabled cache takes none).
            if caching and seq.prefix_match is not None and seq.num_computed_tokens // bs > len(seq.prefix_match.block_ids):
                self._cache_computed(seq)

    def _cache_computed(self, seq: Sequence) -> None:
        """Cache the sequence's blocks filled since its last insert, below the path it holds
        locked (RadixCache.extend: per new block, not per block of the context)."""
        if not self.cache.enabled or seq.prefix_match is None or not seq.block_table:
            return
        end = min(seq.num_computed_tokens, seq.num_known_tokens)
        seq.prefix_match = self.cache.extend(seq.prefix_match, seq.token_slice(seq.prefix_match.num_tokens, end),
                                             seq.block_table)

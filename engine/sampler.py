"""Token sampler: turns one step's batch of next-token logits into token ids and logprobs.

Order of operations follows vLLM: min_tokens masking, repetition penalty, presence and
frequency penalties, then greedy argmax, or temperature, top-k, top-p, min-p and sampling.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from engine.uploads import to_device, upload
from tandem.types import SamplingParams
from tandem_kernels import ops

logger = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
# Above this k a single full sort is about as cheap as torch.topk, so the k-th logit comes from one.
_TOPK_ONLY_MAX_K = 1024
# Exponential noise of exactly 0 would turn a zero-probability token into 0/0 = NaN, which
# argmax picks; the floor keeps such tokens at probability 0.
_NOISE_FLOOR = torch.finfo(torch.float32).tiny
# top_p stored for rows that do not filter: an exclusive cumulative probability never reaches it.
_TOP_P_OFF = 2.0


@dataclass
class SamplingRow:
    """One sequence of the batch: its (validated) params and the tokens it has so far.

    `eos_token_ids` are masked while the row has fewer than `params.min_tokens` output tokens,
    together with `params.stop_token_ids`; pass an empty set to leave EOS unmasked.
    Token sequences may be lists, tuples, numpy arrays or CPU tensors of ints.
    `pending`: output tokens already sampled by a step still on the device and not yet in
    `output_token_ids` (the overlapped engine's: at most one); they count toward `min_tokens`
    and a seeded row's position, and penalties count the pending token itself, read on the
    device at `pending_row` of the tokens `Sampler.launch` is given (`pending_tokens`).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()
    pending: int = 0
    pending_row: int = 0
    _prompt: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _outputs: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _filled: int = field(default=0, init=False, repr=False, compare=False)

    def prompt_tensor(self) -> torch.Tensor:
        """The prompt's ids as an int64 CPU tensor, made once (a row's prompt never changes: the
        engine makes a new row for a new list)."""
        if self._prompt is None:
            self._prompt = _as_tokens(self.prompt_token_ids)
        return self._prompt

    def output_tensor(self) -> torch.Tensor:
        """The output ids as an int64 CPU tensor, kept from call to call and extended by the
        tokens appended since (outputs only grow while a row lives; a shorter list is read anew)."""
        out = self.output_token_ids
        n = len(out)
        if self._outputs is None or n < self._filled or not isinstance(out, list):
            self._outputs, self._filled = _as_tokens(out).clone(), n
            return self._outputs[:n]
        if n > self._outputs.numel():
            grown = torch.empty(max(16, 2 * n), dtype=torch.long)
            grown[: self._filled] = self._outputs[: self._filled]
            self._outputs = grown
        if n > self._filled:
            self._outputs[self._filled : n] = torch.as_tensor(out[self._filled : n], dtype=torch.long)
            self._filled = n
        return self._outputs[:n]

    @property
    def num_output(self) -> int:
        """Output tokens sampled before this row's sample: its position in the output."""
        return len(self.output_token_ids) + self.pending


@dataclass
class TokenLogprobs:
    """Logprob of the chosen token and the `params.logprobs` most likely tokens, highest first.

    Both come from the model's raw logits (log_softmax before penalties and temperature).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    """One entry per row, in row order; `logprobs[i]` is None when row i asked for none."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """Generator seed (63 bits) for output position `step` of a request seeded with `seed`.

    Depends on (seed, step) only, so a seeded request draws the same noise whatever else is
    in the batch and when it is recomputed after preemption.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) >> 1


class Sampler:
    """Samples one token per row from logits of shape [batch, padded_vocab].

    Only the first `vocab_size` columns are candidates (the rest is the model's padding).
    Logits come in any float dtype (the model's: CausalLM.logits); a greedy row takes their
    argmax as they are, and penalties, temperature, filters and log-probs run in float32 on the
    logits' device. Stages no row needs are skipped, and the
    results reach the host in a single device-to-host copy. Rows without a seed draw from
    a sampler-level generator seeded with `seed` (random when None).
    """

    def __init__(self, vocab_size: int, seed: int | None = None) -> None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size: must be a positive integer, got {vocab_size!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed: must be a non-negative integer or None, got {seed!r}")
        self.vocab_size = vocab_size
        self._base_seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little")
        self._generators: dict[torch.device, torch.Generator] = {}
        self._row_generators: dict[torch.device, torch.Generator] = {}
        logger.debug("sampler: vocab_size=%d seeded=%s", vocab_size, seed is not None)

    # ------------------------------------------------------------------ entry point

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Pick the next token of every row; `logits` is left unmodified."""
        return self.launch(logits, rows).result()

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow],
               pending_tokens: torch.Tensor | None = None) -> PendingSamples:
        """Queue the sampling of every row on the logits' device without waiting for it.

        The returned PendingSamples holds the token ids on the device at once (a next step may
        read its inputs from there) and gives the host-side SamplerOutput on `result()`.
        `pending_tokens`: the token ids of the step still in flight (its PendingSamples.tokens),
        where a penalised row's pending token is (SamplingRow.pending_row); needed only then."""
        self._check(logits, rows)
        batch = len(rows)
        if batch == 0:
            return PendingSamples(torch.empty(0, dtype=torch.long, device=logits.device), None, 0, [], 0, [])
        device = logits.device
        raw = logits[:, : self.vocab_size]  # [B, V], drops padding columns
        params = [row.params for row in rows]

        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        lp_index = None if len(lp_rows) in (0, batch) else _index(lp_rows, device)
        raw_logprobs = None
        if lp_rows:
            src = raw if lp_index is None else raw.index_select(0, lp_index)
            raw_logprobs = torch.log_softmax(src.float(), dim=-1)  # [L, V]

        penalised = self._apply_penalties(raw, rows, pending_tokens)
        x = raw if penalised is None else penalised  # [B, V]; never written to below
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) == batch:
            tokens = self._sample(x, rows)
        else:
            tokens = ops.argmax_rows(x)  # greedy answer for every row; sampled rows overwrite it
            if sampled:
                index = _index(sampled, device)
                tokens.index_copy_(0, index, self._sample(x.index_select(0, index), [rows[i] for i in sampled]))
        return self._start_copy(tokens, raw_logprobs, lp_rows, lp_index, params)

    # ------------------------------------------------------------------ stages

    def _apply_penalties(self, raw: torch.Tensor, rows: list[SamplingRow],
                         pending_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """min_tokens masking, repetition penalty, presence/frequency penalties (vLLM order),
        each over the row's tokens and its pending one (see `launch`).

        Returns new float32 logits, or None when no row needs any of these.
        """
        vocab = self.vocab_size
        mask_rows: list[int] = []
        mask_tokens: list[int] = []
        rep_rows: list[int] = []
        pf_rows: list[int] = []
        for i, row in enumerate(rows):
            p = row.params
            if row.num_output < p.min_tokens:
                for t in set(row.eos_token_ids).union(p.stop_token_ids):
                    if 0 <= t < vocab:
                        mask_rows.append(i)
                        mask_tokens.append(t)
            if p.repetition_penalty != 1.0:
                rep_rows.append(i)
            if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
                pf_rows.append(i)
        if not (mask_tokens or rep_rows or pf_rows):
            return None

        device = raw.device
        batch = len(rows)
        x = raw.to(torch.float32, copy=True).contiguous()  # [B, V]: flat indices below
        if mask_tokens:
            # index_fill_ takes the value as a kernel argument (an indexed assignment of a Python
            # float copies it to the device first, and that copy waits for the stream)
            flat = upload([r * vocab + t for r, t in zip(mask_rows, mask_tokens)], torch.long, device)
            x.view(-1).index_fill_(0, flat, float("-inf"))
        if rep_rows:
            # HF semantics over prompt + output: positive logits shrink, negative ones grow.
            histories = [torch.cat([rows[i].prompt_tensor(), rows[i].output_tensor()]) for i in rep_rows]
            flat = self._with_pending(self._flat_token_index(rep_rows, histories, device), rep_rows, rows,
                                      pending_tokens)
            seen = torch.zeros(batch * (vocab + 1), dtype=torch.bool, device=device)
            seen.index_fill_(0, flat, True)
            seen = seen.view(batch, vocab + 1)[:, :vocab]
            penalty = _row_values(batch, rep_rows, [rows[i].params.repetition_penalty for i in rep_rows], 1.0, device)
            x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
        if pf_rows:
            # OpenAI semantics over output tokens only.
            outputs = [rows[i].output_tensor() for i in pf_rows]
            flat = self._with_pending(self._flat_token_index(pf_rows, outputs, device), pf_rows, rows,
                                      pending_tokens)
            counts = torch.zeros(batch * (vocab + 1), dtype=torch.float32, device=device)
            counts.index_add_(0, flat, torch.ones(flat.shape[0], dtype=torch.float32, device=device))
            counts = counts.view(batch, vocab + 1)[:, :vocab]
            frequency = _row_values(batch, pf_rows, [rows[i].params.frequency_penalty for i in pf_rows], 0.0, device)
            presence = _row_values(batch, pf_rows, [rows[i].params.presence_penalty for i in pf_rows], 0.0, device)
            x = x - frequency * counts - presence * (counts > 0).float()
        return x

    def _flat_token_index(self, row_ids: list[int], seqs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Index into a flattened [B, V + 1] table for each (row, token); out-of-range tokens land in column V."""
        vocab = self.vocab_size
        lengths = torch.tensor([s.numel() for s in seqs], dtype=torch.long)
        toks = torch.cat(seqs) if seqs else torch.empty(0, dtype=torch.long)
        toks = torch.where((toks < 0) | (toks >= vocab), vocab, toks)
        row_of = torch.repeat_interleave(torch.tensor(row_ids, dtype=torch.long), lengths)
        return to_device(row_of * (vocab + 1) + toks, device)

    def _with_pending(self, flat: torch.Tensor, row_ids: list[int], rows: list[SamplingRow],
                      pending_tokens: torch.Tensor | None) -> torch.Tensor:
        """`flat` (a `_flat_token_index`) and the pending token of each row in `row_ids` that has
        one, read from `pending_tokens` on the device (sampled tokens are all in the vocabulary)."""
        late = [i for i in row_ids if rows[i].pending]
        if not late:
            return flat
        if pending_tokens is None:
            raise ValueError("pending_tokens: a penalised row has a pending token and no step's tokens were given")
        device = flat.device
        at = upload([rows[i].pending_row for i in late], torch.long, pending_tokens.device)
        tokens = pending_tokens.index_select(0, at).to(device=device, dtype=torch.long)
        return torch.cat([flat, upload(late, torch.long, device) * (self.vocab_size + 1) + tokens])

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p, then an exponential race among the tokens the
        filters allow (`ops.sample_filtered`: on the GPU a kernel that streams each row, no sort).

        x: [S, V] logits of any float dtype, not written to. Returns token ids [S].
        """
        vocab = self.vocab_size
        device = x.device
        params = [row.params for row in rows]
        table = upload(
            [
                [
                    p.temperature,
                    min(p.top_k, vocab) if p.top_k > 0 else vocab,
                    p.top_p if p.top_p < 1.0 else _TOP_P_OFF,
                    p.min_p,
                ]
                for p in params
            ],
            torch.float32,
            device,
        )
        temperature, top_k, top_p, min_p = table.unbind(1)  # each [S]
        kth = self._top_k_threshold(x, top_k, max((p.top_k for p in params if 0 < p.top_k < vocab), default=0))
        noise = self._noise(x.shape, rows, device)
        return ops.sample_filtered(x, temperature, kth, top_p, min_p, noise)

    def _top_k_threshold(self, x: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
        """[S] float32: each row's k-th largest logit (its top_k, a float column; >= vocab_size
        means none), -inf for rows without top-k. `k_max`: the largest top_k below vocab_size
        (0: no row filters). A top-k of k_max values finds it; above _TOPK_ONLY_MAX_K a sort."""
        rows = x.shape[0]
        if k_max == 0:
            return torch.full((rows,), float("-inf"), dtype=torch.float32, device=x.device)
        if k_max <= _TOPK_ONLY_MAX_K:
            best = x.topk(k_max, dim=-1).values  # [S, k_max], descending
        else:
            best = x.sort(dim=-1, descending=True).values
        at = (top_k.long() - 1).clamp_(max=best.shape[1] - 1).unsqueeze(1)
        kth = best.gather(1, at).squeeze(1).float()
        return torch.where(top_k < self.vocab_size, kth, float("-inf"))

    def _noise(self, shape: torch.Size, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """Exponential(1) noise [S, V]; seeded rows get noise derived from (seed, step) only."""
        seeded = [(j, row) for j, row in enumerate(rows) if row.params.seed is not None]
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        if len(seeded) < len(rows):
            noise.exponential_(generator=self._generator(device))
        if seeded:
            gen = self._row_generators.get(device)
            if gen is None:
                gen = self._row_generators[device] = torch.Generator(device=device)
            for j, row in seeded:
                gen.manual_seed(step_seed(row.params.seed, row.num_output))
                # A fresh full-width tensor, so the draw never depends on where the row sits.
                noise[j] = torch.empty(shape[1], dtype=torch.float32, device=device).exponential_(generator=gen)
        return noise.clamp_min_(_NOISE_FLOOR)

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(step_seed(self._base_seed, device.index if device.index is not None else -1))
            self._generators[device] = gen
        return gen

    # ------------------------------------------------------------------ output

    def _start_copy(
        self,
        tokens: torch.Tensor,
        raw_logprobs: torch.Tensor | None,
        lp_rows: list[int],
        lp_index: torch.Tensor | None,
        params: list[SamplingParams],
    ) -> PendingSamples:
        # Everything travels as one float64 vector: token ids (< 2**53) and float32 logprobs
        # are both exact in it, and one copy is one wait.
        parts = [tokens.to(torch.float64)]
        k_max = 0
        if raw_logprobs is not None:
            picked = tokens if lp_index is None else tokens.index_select(0, lp_index)
            parts.append(raw_logprobs.gather(1, picked.unsqueeze(1)).squeeze(1).to(torch.float64))
            k_max = min(max(params[i].logprobs or 0 for i in lp_rows), self.vocab_size)
            if k_max:
                top_vals, top_ids = raw_logprobs.topk(k_max, dim=-1)
                parts += [top_vals.flatten().to(torch.float64), top_ids.flatten().to(torch.float64)]
        flat = torch.cat(parts)
        done = None
        if flat.device.type == "cuda":
            flat = flat.to("cpu", non_blocking=True)  # pinned: the copy is queued, not waited on
            done = torch.cuda.Event()
            done.record()
        return PendingSamples(tokens, flat, tokens.shape[0], lp_rows, k_max, [p.logprobs for p in params], done)

    def _check(self, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError("logits: expected a floating-point tensor of shape [batch, vocab]")
        if logits.shape[0] != len(rows):
            raise ValueError(f"rows: {len(rows)} rows for {logits.shape[0]} logit rows")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits: {logits.shape[1]} columns, fewer than vocab_size {self.vocab_size}")


@dataclass
class PendingSamples:
    """One batch's samples on their way to the host (see `Sampler.launch`).

    tokens: [B] int64 on the logits' device, ready for the device's next work at once.
    `result()` waits for the copy, with the GIL released (a worker's gRPC and KV threads run
    meanwhile), and returns the host-side SamplerOutput.
    """

    tokens: torch.Tensor
    _flat: torch.Tensor | None
    _batch: int
    _lp_rows: list[int]
    _k_max: int
    _asked: list[int | None]  # each row's params.logprobs
    _done: Any = None  # torch.cuda.Event recorded after the copy, for device tensors

    def wait(self) -> None:
        """Block until the device has produced these samples (the GIL released); `result` is
        then immediate."""
        if self._done is not None:
            self._done.synchronize()

    def ready(self) -> bool:
        """Whether the device has produced these samples (never waits)."""
        return self._done is None or self._done.query()

    def result(self) -> SamplerOutput:
        if self._flat is None:
            return SamplerOutput(token_ids=[], logprobs=[])
        if self._done is not None:
            self._done.synchronize()
        flat = self._flat.tolist()
        batch, k_max = self._batch, self._k_max
        token_ids = [int(t) for t in flat[:batch]]
        logprobs: list[TokenLogprobs | None] = [None] * batch
        n_lp = len(self._lp_rows)
        chosen_lp = flat[batch : batch + n_lp]
        vals_at = batch + n_lp
        ids_at = vals_at + n_lp * k_max
        for j, i in enumerate(self._lp_rows):
            k = min(self._asked[i] or 0, k_max)
            base = j * k_max
            top = [(int(flat[ids_at + base + c]), flat[vals_at + base + c]) for c in range(k)]
            logprobs[i] = TokenLogprobs(token_id=token_ids[i], logprob=chosen_lp[j], top=top)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return upload(positions, torch.long, device)


def _as_tokens(seq: Sequence[int]) -> torch.Tensor:
    if isinstance(seq, torch.Tensor):
        return seq.detach().to("cpu", torch.long).flatten()
    return torch.as_tensor(seq, dtype=torch.long).flatten()


def _row_values(
    batch: int, row_ids: list[int], values: list[float], default: float, device: torch.device
) -> torch.Tensor:
    """A [B, 1] column holding `values` at `row_ids` and `default` elsewhere."""
    column = [default] * batch
    for i, v in zip(row_ids, values):
        column[i] = v
    return upload(column, torch.float32, device).unsqueeze(1)


__all__ = ["PendingSamples", "Sampler", "SamplingRow", "SamplerOutput", "TokenLogprobs", "step_seed"]

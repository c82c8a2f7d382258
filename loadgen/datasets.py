"""Synthetic workloads for `tandem bench`: random, shared-prefix, multi-turn and ShareGPT-like.

Every generator is deterministic for a given seed and returns `Conversation`s; a single-shot
request is a conversation of one turn, so the driver has one shape to run.
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

DATASETS = ("random", "shared-prefix", "multi-turn", "sharegpt-like")
PROMPT_FORMATS = ("text", "tokens")

# Common English words: each is about one token for BPE tokenizers, so a prompt of n words
# is roughly n tokens there. (A byte tokenizer sees ~5 tokens per word.)
_WORDS = tuple("""
the of and to in is it you that he was for on are with as his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her
long make thing see him two has look more day could go come did number sound no most people
my over know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give our
under name very through just form sentence great think say help low line differ turn cause
much mean before move right boy old too same tell does set three want air well also play small
end put home read hand port large spell add even land here must big high such follow act why
ask men change went light kind off need house picture try us again animal point mother world
near build self earth father head stand own page should country found answer school grow study
still learn plant cover food sun four between state keep eye never last let thought city tree
cross farm hard start might story saw far sea draw left late run while press close night real
life few north open seem together next white children begin got walk example ease paper group
always music those both mark often letter until mile river car feet care second book carry
took science eat room friend began idea fish mountain stop once base hear horse cut sure watch
color face wood main enough plain girl usual young ready above ever red list though feel talk
bird soon body dog family direct pose leave song measure door product black short numeral class
wind question happen complete ship area half rock order fire south problem piece told knew pass
since top whole king space heard best hour better true during hundred five remember step early
hold west ground interest reach fast verb sing listen six table travel less morning ten simple
several vowel toward war lay against pattern slow center love person money serve appear road
map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark
machine note wait plan figure star box noun field rest correct able pound done beauty drive
""".split())

@dataclass(frozen=True)
class Turn:
    """One request of a conversation. `text` is what this turn adds to the prompt (the whole
    prompt for the first turn); `output_len` becomes max_tokens. `input_len` is the planned
    length of `text` in words (text format) or tokens (tokens format)."""

    text: str | tuple[int, ...]
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Conversation:
    """Turns sent one after another; turn k's prompt is turn k-1's prompt + its answer + turn
    k's text. `group` ties together prompts that share a system prompt (shared-prefix)."""

    id: int
    turns: tuple[Turn, ...]
    group: int = -1


@dataclass(frozen=True)
class Vocab:
    """How prompt content is drawn: random words (`text`) or random token ids in
    [low, high) minus `exclude` (`tokens`)."""

    format: str = "text"
    low: int = 0
    high: int = 0
    exclude: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format: must be one of {', '.join(PROMPT_FORMATS)}, got {self.format!r}")
        if self.format == "tokens":
            _check_int("vocab_size", self.high, lo=1)
            excluded = sum(self.low <= t < self.high for t in self.exclude)
            if not 0 <= self.low < self.high or self.high - self.low <= excluded:
                raise ValueError(f"vocab_size: no usable token ids in [{self.low}, {self.high})")

    def sample(self, rng: random.Random, n: int, *, lead: str = "") -> str | tuple[int, ...]:
        """n words (joined by spaces, prefixed by `lead`) or n token ids."""
        if self.format == "text":
            return lead + " ".join(rng.choice(_WORDS) for _ in range(n))
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(self.low, self.high)
            if t not in self.exclude:
                out.append(t)
        return tuple(out)


def concat(a: str | Sequence[int], b: str | Sequence[int]) -> str | tuple[int, ...]:
    """Join two prompt pieces of the same format (str + str, or ids + ids)."""
    if isinstance(a, str) != isinstance(b, str):
        raise ValueError("prompt: cannot join text and token ids")
    return a + b if isinstance(a, str) else (*a, *b)


def random_dataset(num: int, input_len: tuple[int, int], output_len: tuple[int, int],
                   vocab: Vocab, seed: int) -> list[Conversation]:
    """`num` one-turn requests with lengths uniform in the inclusive ranges."""
    _check_int("num_requests", num, lo=1)
    _check_range("input_len", input_len)
    _check_range("output_len", output_len)
    rng = random.Random(seed)
    convs = []
    for i in range(num):
        n_in, n_out = rng.randint(*input_len), rng.randint(*output_len)
        convs.append(Conversation(i, (Turn(vocab.sample(rng, n_in), n_in, n_out),)))
    return convs


def shared_prefix_dataset(groups: int, prompts_per_group: int, system_prompt_len: int,
                          question_len: int, output_len: int, vocab: Vocab, seed: int,
                          shuffle: bool = True) -> list[Conversation]:
    """groups × prompts_per_group one-turn requests; the prompts of a group all start with
    the group's system prompt (system_prompt_len long), then a question of question_len.
    Shuffled across groups unless shuffle=False (then group-major order)."""
    _check_int("groups", groups, lo=1)
    _check_int("prompts_per_group", prompts_per_group, lo=1)
    _check_int("system_prompt_len", system_prompt_len, lo=1)
    _check_int("question_len", question_len, lo=1)
    _check_int("output_len", output_len, lo=1)
    rng = random.Random(seed)
    items = []
    for g in range(groups):
        system = vocab.sample(rng, system_prompt_len)
        for _ in range(prompts_per_group):
            question = vocab.sample(rng, question_len, lead="\n")
            items.append((g, Turn(concat(system, question), system_prompt_len + question_len, output_len)))
    if shuffle:
        rng.shuffle(items)
    return [Conversation(i, (turn,), group=g) for i, (g, turn) in enumerate(items)]


def multi_turn_dataset(conversations: int, turns: int, question_len: int, output_len: int,
                       vocab: Vocab, seed: int, system_prompt_len: int = 0) -> list[Conversation]:
    """`conversations` chats of `turns` turns; each turn asks a fresh question_len question
    (the first turn starts with a per-conversation system prompt when system_prompt_len > 0)."""
    _check_int("conversations", conversations, lo=1)
    _check_int("turns", turns, lo=1)
    _check_int("question_len", question_len, lo=1)
    _check_int("output_len", output_len, lo=1)
    _check_int("system_prompt_len", system_prompt_len, lo=0)
    rng = random.Random(seed)
    convs = []
    for c in range(conversations):
        chat = []
        for t in range(turns):
            system = vocab.sample(rng, system_prompt_len) if t == 0 and system_prompt_len else None
            text = vocab.sample(rng, question_len, lead="\n" if t or system is not None else "")
            n_in = question_len
            if system is not None:
                text, n_in = concat(system, text), n_in + system_prompt_len
            chat.append(Turn(text, n_in, output_len))
        convs.append(Conversation(c, tuple(chat)))
    return convs


def sharegpt_like_dataset(num: int, vocab: Vocab, seed: int,
                          input_clip: tuple[int, int] = (4, 2048),
                          output_clip: tuple[int, int] = (4, 1024),
                          input_median: float = 220.0, input_sigma: float = 1.1,
                          output_median: float = 180.0, output_sigma: float = 0.9) -> list[Conversation]:
    """`num` one-turn requests whose lengths follow log-normal laws clipped to the ranges,
    a synthetic stand-in for the ShareGPT mix (long-tailed prompts and answers)."""
    _check_int("num_requests", num, lo=1)
    _check_range("input_len", input_clip)
    _check_range("output_len", output_clip)
    rng = random.Random(seed)
    convs = []
    for i in range(num):
        n_in = _clip(round(rng.lognormvariate(math.log(input_median), input_sigma)), input_clip)
        n_out = _clip(round(rng.lognormvariate(math.log(output_median), output_sigma)), output_clip)
        convs.append(Conversation(i, (Turn(vocab.sample(rng, n_in), n_in, n_out),)))
    return convs


def num_turns(convs: Sequence[Conversation]) -> int:
    return sum(len(c.turns) for c in convs)


def _clip(value: int, bounds: tuple[int, int]) -> int:
    return max(bounds[0], min(bounds[1], value))


def _check_int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}: must be an integer >= {lo}, got {value!r}")


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    _check_int(name, lo, 1)
    _check_int(name, hi, 1)
    if lo > hi:
        raise ValueError(f"{name}: minimum {lo} is above maximum {hi}")


__all__ = ["DATASETS", "PROMPT_FORMATS", "Conversation", "Turn", "Vocab", "concat", "num_turns",
           "random_dataset", "shared_prefix_dataset", "multi_turn_dataset", "sharegpt_like_dataset"]

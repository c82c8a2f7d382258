"""What bench/throughput_bench.py's sections share: the `Section` a table row is measured by, the
`Context` each runs with, the results' reader `section_value`, and the log line."""
from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.throughput_clusters import Clusters

REPO = Path(__file__).resolve().parents[1]


def log(*a: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


@dataclass(frozen=True)
class Section:
    """One measured part. `where`: "child" (GPU work in a child process), "cluster" (against a
    `tandem up` this process runs) or "local" (here, no GPU). `fn(ctx)` returns a JSON-able dict."""

    name: str
    group: str  # "A", "B" or "" (only when named)
    budget_s: float
    expect_s: float  # on one H200 (BENCHMARKS §7, §8; the gpt-fast compile is a guess)
    where: str
    fn: Callable[["Context"], dict]
    what: str


@dataclass
class Context:
    args: argparse.Namespace
    model_dir: Path
    work: Path
    ceilings: dict
    deadline: float  # time.time() by which the section must end
    clusters: "Clusters | None" = None
    earlier: dict = dataclasses.field(default_factory=dict)  # the results so far (a later section may read one)

    def left(self) -> float:
        return self.deadline - time.time()

    @property
    def vocab_size(self) -> int:
        from bench.up_bench import vocab_size

        return vocab_size(self.model_dir)



def section_value(sections: dict, name: str, key: str) -> Any:
    """`sections[name][key]`, None where the section is missing, failed or lacks the key."""
    value = sections.get(name)
    return value.get(key) if isinstance(value, dict) and "error" not in value else None

"""METRICS.md's table as data, and Prometheus text parsed into sample sums: what the scrape test,
the Prometheus test and the dashboard check read, so the docs, the processes and the dashboard
cannot drift apart."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METRICS_MD = REPO / "METRICS.md"


@dataclass(frozen=True)
class Series:
    """One row of METRICS.md's table."""

    name: str  # as exposed: counters end in _total, histograms are the base name
    type: str  # counter, gauge or histogram
    labels: tuple[str, ...]
    processes: tuple[str, ...]  # gateway, worker, prefill, decode
    after_traffic: str  # grows, set, on event

    @property
    def family(self) -> str:
        """The family name in `# TYPE` lines (a counter's name without _total)."""
        return self.name[: -len("_total")] if self.type == "counter" else self.name

    @property
    def sample(self) -> str:
        """The sample whose value `grows` compares (a histogram's _count)."""
        return f"{self.name}_count" if self.type == "histogram" else self.name

    def lives_on(self, kind: str) -> bool:
        """Whether a process of `kind` (gateway, prefill, decode) exports it."""
        return kind in self.processes or (kind != "gateway" and "worker" in self.processes)


def series() -> list[Series]:
    rows = []
    for line in METRICS_MD.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0].startswith("`"):
            continue
        name, kind, labels, procs, after, _meaning = cells
        rows.append(Series(name.strip("`"), kind, tuple(x.strip() for x in labels.split(",") if x.strip()),
                           tuple(x.strip() for x in procs.split(",")), after))
    assert rows, f"no series table in {METRICS_MD}"
    return rows


def metric_names() -> set[str]:
    """Every name a PromQL query may use: each series, and a histogram's _bucket/_count/_sum."""
    names = set()
    for s in series():
        names.add(s.name)
        if s.type == "histogram":
            names |= {f"{s.name}_bucket", f"{s.name}_count", f"{s.name}_sum"}
    return names


@dataclass
class Scrape:
    """One /metrics body: the families it declares and each sample name's sum over label sets."""

    text: str
    families: set[str]
    sums: dict[str, float]
    labels: dict[str, list[dict[str, str]]]


def parse(text: str) -> Scrape:
    from prometheus_client.parser import text_string_to_metric_families

    families, sums, labels = set(), defaultdict(float), defaultdict(list)
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            families.add(line.split()[2])
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            sums[s.name] += s.value
            labels[s.name].append(dict(s.labels))
    return Scrape(text, families, dict(sums), dict(labels))

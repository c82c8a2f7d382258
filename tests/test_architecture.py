"""The import rules of ARCHITECTURE.md, checked by walking every module's imports with `ast`.

Every import counts, also one inside a function or under `if TYPE_CHECKING:`: a lazy import is
still a dependency, and hiding a cycle in a function body is how cycles come back.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The project's top-level packages, from the base up.
PACKAGES = ("tandem", "tandem_kernels", "kvtransfer", "kvindex", "loadgen", "engine", "parallel", "worker", "prefill",
            "decode", "gateway", "agent", "entrypoints", "bench")

# What each package may import (besides itself). Lower layers never import higher ones.
ALLOWED: dict[str, set[str]] = {
    "tandem": set(),
    "tandem_kernels": set(),
    "kvtransfer": {"tandem"},
    "kvindex": {"tandem"},
    "loadgen": {"tandem"},
    "engine": {"tandem", "tandem_kernels"},
    "parallel": {"tandem", "tandem_kernels", "engine", "kvtransfer"},
    "worker": {"tandem", "tandem_kernels", "engine", "parallel", "kvtransfer", "kvindex"},
    "prefill": {"tandem", "engine", "parallel", "kvtransfer", "worker"},
    "decode": {"tandem", "engine", "parallel", "kvtransfer", "worker"},
    "gateway": {"tandem", "kvindex"},
    "agent": {"tandem", "kvindex"},
    # The processes' start-up sits on top of the product; bench scripts on top of everything.
    "entrypoints": set(PACKAGES) - {"entrypoints", "bench"},
    "bench": set(PACKAGES) - {"bench"},
}

# Modules whose internals belong to their package alone.
PRIVATE = {"engine.scheduler": "engine", "engine.sequence": "engine"}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        root = REPO / pkg
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.py")):
            if "_proto" in path.parts:  # generated stubs
                continue
            out.append((pkg, path))
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, nested ones included."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _graph() -> tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]:
    edges: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], list[str]] = defaultdict(list)
    for pkg, path in _modules():
        for line, mod in _imports(path):
            top = mod.split(".")[0]
            if top in PACKAGES and top != pkg:
                edges[pkg].add(top)
                where[(pkg, top)].append(f"{path.relative_to(REPO)}:{line} imports {mod}")
    return edges, where


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in PACKAGES:
        if v not in index:
            visit(v)
    return comps


def test_no_cycles_between_packages() -> None:
    edges, where = _graph()
    cycles = _cycles(edges)
    detail = [line for comp in cycles for a in comp for b in comp if b in edges[a] for line in where[(a, b)][:3]]
    assert not cycles, f"packages that import each other: {cycles}\n" + "\n".join(detail)


def test_each_package_imports_only_the_layers_below_it() -> None:
    edges, where = _graph()
    bad = [line for pkg, deps in edges.items() for dep in sorted(deps - ALLOWED[pkg]) for line in where[(pkg, dep)]]
    assert not bad, "imports against the layering of ARCHITECTURE.md:\n" + "\n".join(bad)


def test_scheduler_and_sequence_are_the_engines_alone() -> None:
    bad = []
    for pkg, path in _modules():
        for line, mod in _imports(path):
            for private, owner in PRIVATE.items():
                if pkg != owner and (mod == private or mod.startswith(private + ".")):
                    bad.append(f"{path.relative_to(REPO)}:{line} imports {mod}")
    for path in sorted((REPO / "tests").glob("*.py")) + [p for _, p in _modules()]:
        if path.is_relative_to(REPO / "engine") or path == Path(__file__).resolve():
            continue
        for n, text in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.scheduler\.|engine_ext", text) and "import" not in text:
                bad.append(f"{path.relative_to(REPO)}:{n} reaches into the engine: {text.strip()}")
    assert not bad, "only engine/ may use Scheduler and Sequence internals:\n" + "\n".join(bad)


def _definitions(pattern: str) -> list[str]:
    rx = re.compile(pattern)
    hits = []
    for _, path in _modules():
        for n, text in enumerate(path.read_text().splitlines(), 1):
            if rx.search(text):
                hits.append(f"{path.relative_to(REPO)}:{n}")
    return hits


def test_each_rule_has_one_home() -> None:
    rules = {
        r"^\s*ROLES\s*(:[^=]*)?=": "tandem/types.py",
        r"^\s*DEADLINE\s*=": "tandem/types.py",
        r"^(class StopChecker|def blocks_needed|def check_prompt_ids)\b": "tandem/rules.py",
        r"\barmed\s*=": "tandem/rules.py",  # the stop rules wait for min_tokens: decided in one place
    }
    for pattern, home in rules.items():
        hits = _definitions(pattern)
        assert hits and all(h.startswith(home + ":") for h in hits), f"{pattern!r} defined outside {home}: {hits}"
    assert not (REPO / "worker" / "engine_ext.py").exists(), "worker/engine_ext.py is a second engine API"
    # A batch of KV events is a KvEventBatch (as the proto message) everywhere; one event a KvEvent.
    assert _definitions(r"\b(KvEventsBatch|KVEvent)\b|class KvEvents\b") == []


def test_blocks_needed_is_not_rewritten_by_hand() -> None:
    # prompt + max_tokens over the block size, rounded up: tandem.rules.blocks_needed alone.
    hits = [h for h in _definitions(r"max_tokens.*//\s*\S*block_size|//\s*\S*block_size.*max_tokens")
            if not h.startswith("tandem/rules.py:")]
    assert hits == [], f"the blocks-needed formula outside tandem.rules: {hits}"

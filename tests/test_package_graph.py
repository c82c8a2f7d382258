"""The packages import each other one way only: walk every import (function-level ones too) with
`ast` and fail on a pair of top-level packages that import each other."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "gateway", "prefill", "decode", "worker", "kvtransfer", "kvindex", "parallel", "kernels",
            "tandem", "loadgen", "bench", "entrypoints", "agent")
# Pairs still being untangled elsewhere (issue 12: the engine is handed its TP runner).
KNOWN = {("engine", "parallel")}


def imports() -> dict[str, dict[str, list[str]]]:
    """package -> imported package -> ["file:line", ...]."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in PACKAGES and top != pkg:
                        graph[pkg][top].append(f"{path.relative_to(REPO)}:{node.lineno}")
    return graph


def test_no_two_packages_import_each_other() -> None:
    graph = imports()
    cycles = [f"{a} <-> {b}: {graph[a][b][0]} / {graph[b][a][0]}"
              for a in PACKAGES for b in PACKAGES
              if a < b and (a, b) not in KNOWN and b in graph[a] and a in graph[b]]
    assert not cycles, "\n".join(cycles)


def test_layers_tandem_at_the_bottom_worker_below_the_roles_entry_points_on_top() -> None:
    graph = imports()
    assert not graph["tandem"], dict(graph["tandem"])  # `from tandem import Client` stays light
    assert not {"prefill", "decode"} & set(graph["worker"]), dict(graph["worker"])
    users = {pkg: refs for pkg, deps in graph.items() for dep, refs in deps.items()
             if dep == "entrypoints" and pkg != "bench"}
    assert not users, users

"""The `tandem bench --out` results file: one entry per run, the record around them (when, which
model and backend, Tandem's version, the command line, the flags), written as strict JSON, and
read back for `--baseline` / `--compare-only`.

The file's one home: `write_results` and `load_results` are its writer and its reader.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import logging
import math
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadgen.report import RequestResult
from loadgen.schedule import LoadSpec
from tandem.types import Tier

logger = logging.getLogger(__name__)


def run_entry(spec: LoadSpec, summary: dict[str, Any],
              results: Sequence[RequestResult] | None = None) -> dict[str, Any]:
    """One element of the file's `runs`: the load `spec` offered and the run's summary
    (loadgen.report.summarize), plus every request's timings in start order when `results` is given."""
    run: dict[str, Any] = {"label": spec.label, "concurrency": spec.concurrency, "request_rate": spec.request_rate,
                           "max_concurrency": spec.max_concurrency, "seed": spec.seed, "summary": summary}
    if results is not None:
        run["requests"] = [r.to_dict() for r in sorted(results, key=lambda r: r.start_s)]
    return run


def run_record(model: str, backend: str, argv: Sequence[str]) -> dict[str, Any]:
    """What a results file records about the run: when (UTC, ISO 8601), the model, the backend,
    Tandem's version and the command line."""
    try:
        version = importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "model": model,
            "backend": backend, "version": version, "command": shlex.join(["tandem", "bench", *argv])}


def write_results(path: str | Path, runs: Sequence[dict[str, Any]], *, model: str, backend: str,
                  argv: Sequence[str], config: Mapping[str, Any]) -> None:
    """Writes the file: `runs` (run_entry dicts), run_record's fields and `config` (the parsed
    flags; a Tier is written by its lower-case name). Raises OSError when `path` can't be written."""
    flags = {k: (v.name.lower() if isinstance(v, Tier) else v) for k, v in config.items()}
    record = {"tool": "tandem bench", **run_record(model, backend, argv), "config": flags, "runs": list(runs)}
    with open(path, "w") as f:
        json.dump(jsonable(record), f, indent=1, allow_nan=False)
        f.write("\n")


def load_results(path: str | Path) -> dict[str, Any]:
    """A `tandem bench --out` file. ValueError names the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable bench results file ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise ValueError(f"{path}: no runs (not written by tandem bench --out?)")
    return data


def jsonable(obj: Any) -> Any:
    """Strict JSON: non-finite floats (an inf request rate) become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj

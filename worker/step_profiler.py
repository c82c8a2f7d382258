"""Profile a few engine steps of a running worker with torch.profiler (off unless asked).

    TANDEM_PROFILE_DIR=/tmp/prof TANDEM_PROFILE_STEPS=3:5 tandem up ...

`TANDEM_PROFILE_STEPS=START:COUNT` profiles the worker's steps START .. START+COUNT-1 (0 is its
first step after warm-up; a plain COUNT means 0:COUNT); `TANDEM_PROFILE_WORKERS` (comma list of
worker ids, `prefill-0,decode-0` under `tandem up`; default every worker) picks the workers.
Each one writes, under `TANDEM_PROFILE_DIR`, `{worker_id}-steps{START}-{END}.json` (a Chrome /
Perfetto trace, each step a `tandem_step` range that `bench/trace_steps.py` reads) and `.txt`
(the operators' totals, device time first), then carries on: a
whole cluster is profiled by one setting in the environment `tandem up` runs in, as vLLM's
`VLLM_TORCH_PROFILER_DIR` does. The steps being profiled run slower.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENV_DIR, ENV_STEPS, ENV_WORKERS = "TANDEM_PROFILE_DIR", "TANDEM_PROFILE_STEPS", "TANDEM_PROFILE_WORKERS"
TABLE_ROWS = 40
STEP_RANGE = "tandem_step"  # the name of each profiled step's range in the trace


def parse_steps(spec: str) -> tuple[int, int]:
    """(start, count) from "START:COUNT" or "COUNT"; ValueError naming the variable."""
    try:
        start, _, count = spec.rpartition(":")
        first, n = int(start or 0), int(count)
    except ValueError:
        raise ValueError(f"{ENV_STEPS}: expected START:COUNT or COUNT (integers), got {spec!r}") from None
    if first < 0 or n < 1:
        raise ValueError(f"{ENV_STEPS}: START must be >= 0 and COUNT >= 1, got {spec!r}")
    return first, n


class StepProfiler:
    """Called around every engine step (engine thread): profiles steps [start, start + count)."""

    def __init__(self, out_dir: str | os.PathLike, worker_id: str, start: int, count: int) -> None:
        self.out_dir, self.worker_id = Path(out_dir), worker_id
        self.start, self.end = start, start + count
        self.step = 0
        self._prof: Any = None
        self._range: Any = None  # the profiled step's record_function
        self.written: list[Path] = []
        self.out_dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_env(cls, worker_id: str) -> StepProfiler | None:
        """The profiler the environment asks for this worker, or None."""
        out_dir = os.environ.get(ENV_DIR, "").strip()
        if not out_dir:
            return None
        workers = [w.strip() for w in os.environ.get(ENV_WORKERS, "").split(",") if w.strip()]
        if workers and worker_id not in workers:
            return None
        start, count = parse_steps(os.environ.get(ENV_STEPS, "0:5").strip())
        logger.warning("profiling engine steps %d..%d into %s (%s)", start, start + count - 1, out_dir, ENV_DIR)
        return cls(out_dir, worker_id, start, count)

    def before_step(self) -> None:
        if self.step == self.start and self._prof is None:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()
        if self._prof is not None:
            import torch

            self._range = torch.profiler.record_function(STEP_RANGE)
            self._range.__enter__()

    def after_step(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self.step += 1
        if self._prof is not None and self.step >= self.end:
            self._finish()

    def close(self) -> None:
        """Write what was recorded if the worker stops mid-window."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._prof is not None:
            self._finish()

    def _finish(self) -> None:
        import torch

        prof, self._prof = self._prof, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        base = self.out_dir / f"{self.worker_id}-steps{self.start}-{self.step - 1}"
        try:
            prof.export_chrome_trace(str(base.with_suffix(".json")))
            events = prof.key_averages()
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            header = f"{self.worker_id}: engine steps {self.start}..{self.step - 1} ({self.step - self.start})\n"
            base.with_suffix(".txt").write_text(header + events.table(sort_by=sort, row_limit=TABLE_ROWS) + "\n")
        except (OSError, RuntimeError) as exc:
            logger.warning("could not write the step profile %s: %s", base, exc)
            return
        self.written += [base.with_suffix(".json"), base.with_suffix(".txt")]
        logger.warning("wrote the step profile %s.{json,txt}", base)

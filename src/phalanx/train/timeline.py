"""What a failure cost, read back from a run's `metrics.jsonl` — the figures the demo prints and the recovery
benchmark reports, so both compute them the same way from the same records.

A job restarted after a failure appends to the same metrics file: the step records of the first attempt,
then a `resumed` event, then the steps of the next attempt. Given the wall-clock time of the kill:

- last step: the highest step the first attempt logged (rank 0 may finish the step in flight just after the
  kill; it still counts, its update was applied everywhere before the fault surfaced);
- resumed step: the step the next attempt restarted from (the newest checkpoint);
- steps lost: committed steps that had to be computed again (last step − resumed step);
- first step after: kill → the first step the next attempt logged;
- downtime: wall time lost vs a failure-free run: the time from the last step logged before the failure
  to the moment training got past it again, minus the one normal step that would have taken anyway. It
  includes detection, restart, reloading and the redone steps.

Reads records only: knows nothing about torch, models, the training loop or the controller.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Attempt:
    resumed_step: int | None  # None for the first attempt
    resumed_at: float | None
    steps: list[dict]


def attempts(metrics_path: Path | str) -> list[Attempt]:
    """The step records of each attempt of a run, split at `resumed` events."""
    out = [Attempt(None, None, [])]
    for line in Path(metrics_path).read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "resumed":
            out.append(Attempt(record["step"], record["time"], []))
        elif "event" not in record:
            out[-1].steps.append(record)
    return out


def normal_step_s(steps: list[dict], skip: int = 2) -> float:
    """Median wall time between consecutive step records, after the first `skip` (warm-up) steps."""
    times = [s["time"] for s in steps[skip:]]
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        raise ValueError("too few steps to tell a normal step time")
    return statistics.median(gaps)


@dataclass
class RecoveryFigures:
    last_step: int
    resumed_step: int
    steps_lost: int
    normal_step_s: float
    first_step_after_s: float  # kill → first step logged by the next attempt
    downtime_s: float

    def as_dict(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def recovery_figures(metrics_path: Path | str, killed_at: float) -> RecoveryFigures:
    """Figures for one failure: the first attempt is the one that was killed, the second the recovery."""
    runs = attempts(metrics_path)
    if len(runs) < 2:
        raise ValueError(f"{metrics_path}: no `resumed` event, the run did not recover from a failure")
    before, after = runs[0], runs[1]
    if not before.steps or not after.steps:
        raise ValueError(f"{metrics_path}: an attempt logged no steps")
    last = before.steps[-1]
    past = next((s for s in after.steps if s["step"] > last["step"]), None)
    if past is None:
        raise ValueError(f"{metrics_path}: the recovered run never got past step {last['step']}")
    step_s = normal_step_s(before.steps)
    return RecoveryFigures(
        last_step=last["step"],
        resumed_step=after.resumed_step,
        steps_lost=last["step"] - after.resumed_step,
        normal_step_s=step_s,
        first_step_after_s=after.steps[0]["time"] - killed_at,
        downtime_s=past["time"] - last["time"] - step_s,
    )

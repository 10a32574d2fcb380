"""The goodput ledger: every second of a job's wall time, from submission to its end (or now), attributed to
exactly one category, computed from the run's files alone — its events.jsonl (`run_events.py`: the
controller's, the agents' and rank 0's events) and rank 0's metrics.jsonl step records.

The ledger is a partition of [submitted, end] into segments, each labelled with one category: every rule
below proposes labelled intervals, the boundaries of all of them cut the span into elementary segments, and
each segment takes the highest-priority label that covers it (`idle` when none does). The segments tile the
span, so the categories sum to the wall time by construction (checked: `math.fsum` of exact differences).

Priority (highest first) and where each interval comes from:
  productive          a step record at time t with step_time_s d covers (t − d, t]; the last execution of each
                      step number (its result was kept)
  replayed            the same for an execution of a step number that was trained again later (after a
                      restart from a checkpoint, or a checkpointless resume at an earlier step)
  checkpoint_save     blocking time only: a synchronous `checkpoint_saved` (t − seconds, t]; an async save's
                      `checkpoint_started` (t − seconds, t] (the time it blocked); an async `checkpoint_saved`
                      only from the later of (t − seconds) and rank 0's previous activity (the commit waited for
                      at the end of training)
  checkpoint_restore  a checkpoint load: `resumed` (rank 0, t − seconds, t]; a checkpointless recovery that fell
                      back to the disk: `state_restored` with source `checkpoint` (t − seconds, t]
  failure_detection   F → K: K is the controller's first word of a fault in a generation (the job → recovering,
                      a `recovery` or `hang` event, the job → failed from running; or the next generation
                      itself when none came), F rank 0's last sign of life in the generation before K (the end
                      of its last step, or its last event); none (a command job, a generation that failed while
                      starting): the fault's moment is unknown, nothing is counted here (the time stays in
                      initialization or recovery)
  waiting_for_nodes   a controller `waiting` event of the job → its next generation (or the end)
  recovery            K → the start of the first step of the next generation (regroup, stopping and relaunching
                      processes, restore from peers, the first step's warm-up); a restore from a checkpoint
                      inside it is checkpoint_restore
  resizing            an elastic job's resize (the controller's `resize` event, not a fault: nothing to detect)
                      → the start of the first step after rank 0's next `resumed` (the survivors finish the
                      step they were in first; then the regroup at the new size, the joiners' restore from
                      peers, the first step's warm-up)
  initialization      submission → the start of the first step of the first generation (placement, process
                      start, build, the first step's warm-up); a generation started without a fault (a run
                      launched again outside a cluster) → its first step likewise
  idle                everything else: between steps (logging, callbacks), after the last step until the job
                      ended, between a run's launches outside a cluster
A step's "start" for the windows above is its normal part: the first step of a generation counts as
productive/replayed only for a normal step's time (the median step_time_s of the run); the rest of its time
is the warm-up, which the window it falls in (initialization or recovery) takes.

Times: the controller's `generation` events (source "controller") start generations; `submitted` is the
job's first `job` event (to pending), else (a run outside a cluster) the earliest record. A record that rank
0 wrote after a fault on behalf of a step completed before it (`logged_after_fault`) is placed to end at the
fault (`fault_detected.at`). Everything is clipped to [submitted, end]. When several jobs used the same run
dir (a config submitted again), only the job's own events count (by their `job`; default the newest job
submitted) and only the step records inside its span.

Must not know: the controller, the training loop, torch; standard library only (the CLI imports it).
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, bisect_right
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.observability.events import Event, EventKind as K
from phalanx.observability.run_events import events_path, read_events

PRODUCTIVE, INITIALIZATION, CHECKPOINT_SAVE, CHECKPOINT_RESTORE = (
    "productive", "initialization", "checkpoint_save", "checkpoint_restore")
FAILURE_DETECTION, WAITING, RECOVERY, RESIZING, REPLAYED, IDLE = (
    "failure_detection", "waiting_for_nodes", "recovery", "resizing", "replayed", "idle")
CATEGORIES = (PRODUCTIVE, INITIALIZATION, CHECKPOINT_SAVE, CHECKPOINT_RESTORE, FAILURE_DETECTION, WAITING,
              RECOVERY, RESIZING, REPLAYED, IDLE)
PRIORITY = (PRODUCTIVE, REPLAYED, CHECKPOINT_SAVE, CHECKPOINT_RESTORE, FAILURE_DETECTION, WAITING, RECOVERY,
            RESIZING, INITIALIZATION)  # highest first; a segment no interval covers is IDLE
FINAL_STATES = ("succeeded", "failed", "cancelled")
METRICS_FILE = "metrics.jsonl"
TOLERANCE_S = 1e-6


class RunFilesMissing(FileNotFoundError):
    """A run file the ledger needs is not there (the message names it)."""


@dataclass
class Ledger:
    submitted: float
    end: float
    seconds: dict[str, float]  # every category, in CATEGORIES order
    segments: list[tuple[float, float, str]] = field(default_factory=list)  # the partition, merged by label

    @property
    def wall(self) -> float:
        return self.end - self.submitted

    @property
    def goodput(self) -> float:
        """productive / wall (0 for an empty span)."""
        return self.seconds[PRODUCTIVE] / self.wall if self.wall > 0 else 0.0

    def share(self, category: str) -> float:
        return self.seconds[category] / self.wall if self.wall > 0 else 0.0

    def to_dict(self) -> dict:
        return {"submitted": self.submitted, "end": self.end, "wall_s": round(self.wall, 6),
                "goodput": round(self.goodput, 6), "seconds": {c: round(s, 6) for c, s in self.seconds.items()}}


@dataclass(frozen=True)
class _Step:
    step: int
    end: float
    seconds: float


def compute(events: list[Event], steps: list[dict], end: float | None = None, *, job: str | None = None,
            submitted: float | None = None) -> Ledger:
    """The ledger of a job from its run's events (any order), its step records (metrics.jsonl lines with a
    `step` and a `step_time_s`) and its end (default: the job's final `job` event, else its last record).
    `job`: whose events count when several jobs used the same run dir (default: the newest one submitted);
    steps outside the job's span are not its own."""
    events = sorted(events, key=lambda e: e.time)
    if job is None:
        job = next((e.job for e in reversed(events) if _submission(e)), None)
    if job is not None:
        events = [e for e in events if e.job == job]
    ctl = [e for e in events if e.source == "controller"]
    rank0 = [e for e in events if e.source.startswith("rank:")]
    runs = _steps(steps, rank0)
    if submitted is None:
        sub = [e.time for e in ctl if _submission(e)]
        starts = [e.time for e in events] + [s.end - s.seconds for s in runs]
        submitted = sub[0] if sub else min(starts, default=end if end is not None else time.time())
    if end is None:
        final = [e.time for e in ctl if e.kind == K.JOB and e.fields.get("to_state") in FINAL_STATES]
        records = [e.time for e in events] + [s.end for s in runs]
        end = final[-1] if final else (max(records, default=submitted) if not ctl else time.time())
    end = max(end, submitted)
    runs = [s for s in runs if s.end > submitted and s.end - s.seconds < end]  # (another job's, in the same dir)
    intervals: list[tuple[float, float, str]] = []
    add = lambda a, b, what: intervals.append((a, b, what))  # noqa: E731

    # steps: the last execution of each step number is kept; a generation's first step keeps a normal step
    normal = statistics.median([s.seconds for s in runs]) if runs else 0.0
    last = {s.step: i for i, s in enumerate(runs)}
    gens = _generation_starts(ctl, rank0)
    ends = [s.end for s in runs]
    firsts = {_first_after(ends, g) for g in gens} - {None}
    core_start = {}
    for i, s in enumerate(runs):
        d = min(s.seconds, normal) if i in firsts else s.seconds
        core_start[i] = s.end - d
        add(s.end - d, s.end, PRODUCTIVE if last[s.step] == i else REPLAYED)

    # checkpoints
    life = sorted([s.end for s in runs] + [e.time for e in rank0] + gens)  # rank 0's signs of life
    for e in rank0:
        secs = _num(e.fields.get("seconds"))
        if e.kind == K.CHECKPOINT_SAVED and secs is not None:
            start = e.time - secs
            if e.fields.get("async") and (i := bisect_left(life, e.time)) > 0:
                start = max(start, life[i - 1])
            add(start, e.time, CHECKPOINT_SAVE)
        elif e.kind == K.CHECKPOINT_STARTED and secs is not None:
            add(e.time - secs, e.time, CHECKPOINT_SAVE)
        elif e.kind == K.RESUMED and secs is not None and e.fields.get("recovery") is None:
            add(e.time - secs, e.time, CHECKPOINT_RESTORE)
        elif e.kind == K.STATE_RESTORED and secs is not None and e.fields.get("source") == "checkpoint":
            add(e.time - secs, e.time, CHECKPOINT_RESTORE)

    # faults: F (last sign of life) → K (the controller knows) → the next generation's first step
    def first_core_after(t: float) -> float:
        i = _first_after(ends, t)
        return core_start[i] if i is not None else end

    known = _faults_known(ctl, gens) if any(e.kind == K.GENERATION for e in ctl) else []  # (a cluster's run)
    resized = [(g, k) for g, k, resize in known if resize]
    known = [(g, k) for g, k, resize in known if not resize]
    resumes = sorted(e.time for e in rank0 if e.kind == K.RESUMED)
    for g, k in resized:
        # the survivors finish the step they are in after the decision: the next generation's first step is
        # the first after rank 0's `resumed` of the regroup (the old generation's late steps stay productive)
        r = next((t for t in resumes if t > k), None) or next((t for t in gens if t > k), None)
        add(k, first_core_after(r) if r is not None else end, RESIZING)
    for g, k in known:
        i = bisect_left(life, k)
        f = life[i - 1] if i > 0 and life[i - 1] > g else k  # no sign of life: the fault's moment is unknown
        add(f, k, FAILURE_DETECTION)
        nxt = next((t for t in gens if t > k), None)
        add(k, first_core_after(nxt) if nxt is not None else end, RECOVERY)
    for e in ctl:
        if e.kind == K.WAITING:
            add(e.time, next((t for t in gens if t > e.time), end), WAITING)

    # initialization: submission → the first step; a generation started without a fault likewise
    faulted = {g for g, _ in known + resized}
    add(submitted, first_core_after(gens[0] if gens else submitted), INITIALIZATION)
    for prev, g in zip(gens, gens[1:]):
        if prev not in faulted and not any(prev < k <= g for _, k in known + resized):
            add(g, first_core_after(g), INITIALIZATION)
    return _partition(submitted, end, intervals)


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


def _steps(records: list[dict], rank0: list[Event]) -> list[_Step]:
    """Step records as (step, end, seconds), in time order; a `logged_after_fault` record ends at its fault."""
    faults = [(e.time, _num(e.fields.get("at"))) for e in rank0 if e.kind == K.FAULT_DETECTED]
    out = []
    for r in records:
        t, d, n = _num(r.get("time")), _num(r.get("step_time_s")), r.get("step")
        if t is None or d is None or not isinstance(n, int) or "event" in r:
            continue
        if r.get("logged_after_fault"):
            at = next((a for when, a in faults if when >= t and a is not None), None)
            t = min(t, at) if at is not None else t
        out.append(_Step(n, t, d))
    return sorted(out, key=lambda s: s.end)


def _first_after(ends: list[float], t: float) -> int | None:
    """The index of the first step that ends after `t` (`ends` sorted), None if none does."""
    i = bisect_right(ends, t)
    return i if i < len(ends) else None


def _generation_starts(ctl: list[Event], rank0: list[Event]) -> list[float]:
    """The controller's generation starts; outside a cluster, each launch of the run (rank 0's `started`, or a
    `resumed` from a checkpoint at launch, its load time included)."""
    gens = [e.time for e in ctl if e.kind == K.GENERATION]
    if gens:
        return gens
    return [e.time - (_num(e.fields.get("seconds")) or 0.0) for e in rank0
            if e.kind == K.STARTED or (e.kind == K.RESUMED and e.fields.get("recovery") is None)]


def _faults_known(ctl: list[Event], gens: list[float]) -> list[tuple[float, float, bool]]:
    """(generation start, K, resize) for each generation that ended before its job did: K is the controller's
    first fault word in the generation, or the next generation's start when it said none; `resize`: that
    word was an elastic resize (its `resize` event comes first), not a fault."""
    out = []
    for i, g in enumerate(gens):
        nxt = gens[i + 1] if i + 1 < len(gens) else math.inf
        said = [e for e in ctl if g <= e.time < nxt and (_says_fault(e) or _resize(e))]
        if said:
            out.append((g, said[0].time, _resize(said[0])))
        elif nxt != math.inf:
            out.append((g, nxt, False))
    return out


def _resize(e: Event) -> bool:
    """The controller's word that an elastic job changes size now (not a `scale requested` note)."""
    return e.kind == K.RESIZE and (e.message or "").startswith("resize ")


def _submission(e: Event) -> bool:
    return e.source == "controller" and e.kind == K.JOB and e.fields.get("to_state") == "pending"


def _says_fault(e: Event) -> bool:
    if e.kind == K.JOB:
        to = e.fields.get("to_state")
        return to == "recovering" or (to == "failed" and e.fields.get("from_state") == "running")
    return e.kind in (K.RECOVERY, K.HANG)


def _partition(submitted: float, end: float, intervals: list[tuple[float, float, str]]) -> Ledger:
    """Cut [submitted, end] at every interval boundary; each piece takes the highest-priority label covering
    it (IDLE when none)."""
    deltas: dict[float, list[tuple[str, int]]] = defaultdict(list)
    for a, b, what in intervals:
        a, b = max(a, submitted), min(b, end)
        if b > a:
            deltas[a].append((what, 1))
            deltas[b].append((what, -1))
    points = sorted(set(deltas) | {submitted, end})
    active = dict.fromkeys(PRIORITY, 0)
    parts: dict[str, list[float]] = {c: [] for c in CATEGORIES}
    segments: list[tuple[float, float, str]] = []
    for a, b in zip(points, points[1:]):
        for what, d in deltas.get(a, ()):
            active[what] += d
        label = next((c for c in PRIORITY if active[c] > 0), IDLE)
        parts[label].append(b - a)  # exact: a and b are within a factor 2 of each other
        if segments and segments[-1][2] == label:
            segments[-1] = (segments[-1][0], b, label)
        else:
            segments.append((a, b, label))
    seconds = {c: math.fsum(parts[c]) for c in CATEGORIES}
    total = math.fsum(x for c in CATEGORIES for x in parts[c])
    assert abs(total - (end - submitted)) <= TOLERANCE_S, (total, end - submitted)
    return Ledger(submitted, end, seconds, segments)


# ---- the run's files ---------------------------------------------------------------------------------------
def read_steps(run_dir: Path | str) -> list[dict]:
    """The step records of `<run_dir>/metrics.jsonl` (RunFilesMissing naming it when absent); a torn last line or
    a broken line is skipped."""
    path = Path(run_dir) / METRICS_FILE
    try:
        text = path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        raise RunFilesMissing(f"{path}: no such file (rank 0's step records; the ledger needs them)") from None
    except IsADirectoryError:
        raise RunFilesMissing(f"{path}: a directory, not rank 0's step records") from None
    out = []
    for line in text.split("\n")[:-1]:  # the part after the last newline is empty or a torn line
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "event" not in record and "step" in record:
            out.append(record)
    return out


def read_run(checkpoint_dir: Path | str, run_dir: Path | str | None, *, end: float | None = None,
             job: str | None = None) -> Ledger:
    """The ledger of a run from `<checkpoint_dir>/events.jsonl` and `<run_dir>/metrics.jsonl` (`run_dir` None:
    a command job, no steps); `job`: which job's (default: the newest submitted). Raises RunFilesMissing naming
    the file that is not there."""
    path = events_path(checkpoint_dir)
    if not path.is_file():
        raise RunFilesMissing(f"{path}: no such file (the run's event stream; the ledger needs it)")
    steps = read_steps(run_dir) if run_dir is not None else []
    return compute(read_events(checkpoint_dir), steps, end, job=job)

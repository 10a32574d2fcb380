"""Following a running job's files: what the controller's /metrics and dashboard read about a job's training,
without re-reading the run's files at every scrape.

A `RunFollower` keeps, per job, an offset into rank 0's `metrics.jsonl` (step records) and the run's
`events.jsonl` (every source's events, `run_events.py`). `poll()` reads only the bytes appended since the
last poll (at most `max_bytes` a call: a long backlog is read over several polls), so its cost follows the
new lines, not the file's length. What it keeps is compact: the step records the goodput ledger needs (step,
time, seconds), the job's own events, running totals (tokens, steps), a step-time histogram, a checkpoint
save-time histogram (rank 0's `checkpoint_saved` seconds), and a thinned
series of (step, time, loss, tokens/s) for curves (at most `max_points`, evenly thinned as the run grows).

The derived figures (`derived()`: the goodput ledger, recovery phase durations) are recomputed from what is
kept at most once every `derive_every_s`, and never by a scrape of a finished job once computed.

Must not know: the controller, its store, HTTP; standard library only.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.observability.events import Event, EventKind as K
from phalanx.observability.goodput import FAILURE_DETECTION, FINAL_STATES, METRICS_FILE, Ledger, compute
from phalanx.observability.run_events import events_path

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PHASE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
PHASES = ("detect", "regroup", "restore", "first_step")
SAVE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class FileTail:
    """The whole lines appended to one file since the last `read()`. A file replaced or cut shorter (a run dir
    wiped and started again) is read again from its start, and `restarted` says so once."""

    def __init__(self, path: Path | str, *, max_bytes: int = 4 << 20):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.offset = 0
        self._inode: int | None = None
        self._partial = b""
        self.restarted = False

    def read(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if self._inode is not None and (st.st_ino != self._inode or st.st_size < self.offset):
                    self.offset, self._partial, self.restarted = 0, b"", True
                self._inode = st.st_ino
                f.seek(self.offset)
                data = f.read(self.max_bytes)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
            return []
        self.offset += len(data)
        *whole, self._partial = (self._partial + data).split(b"\n")  # the rest: "" or a line still being written
        return [line.decode(errors="replace") for line in whole if line.strip()]


@dataclass
class Histogram:
    """Cumulative buckets as Prometheus wants them (`le` upper bounds, +Inf last), with the sum and count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = self.counts or [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect_left(self.buckets, value)
        for j in range(i, len(self.buckets)):
            self.counts[j] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        return [(repr(float(b)), c) for b, c in zip(self.buckets, self.counts)] + [("+Inf", self.count)]

    @classmethod
    def of(cls, buckets: tuple[float, ...], values) -> "Histogram":
        h = cls(buckets)
        for v in values:
            h.observe(v)
        return h


@dataclass(frozen=True)
class Derived:
    """What is recomputed from the kept records: the ledger (None until the run has events) and one dict per
    recovery, {phase: seconds} for the phases known (`PHASES`)."""

    ledger: Ledger | None
    recoveries: list[dict]
    at: float


class RunFollower:
    def __init__(self, job: str, checkpoint_dir: Path | str, run_dir: Path | str | None, *,
                 derive_every_s: float = 5.0, max_points: int = 2000, max_bytes: int = 4 << 20):
        self.job = job
        self.events_tail = FileTail(events_path(checkpoint_dir), max_bytes=max_bytes)
        self.metrics_tail = FileTail(Path(run_dir) / METRICS_FILE, max_bytes=max_bytes) if run_dir else None
        self.derive_every_s = derive_every_s
        self.max_points = max_points
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.events: list[Event] = []  # the job's own events, every source
        self.steps: list[dict] = []  # {"step", "time", "step_time_s"[, "logged_after_fault"]}
        self.last: dict | None = None  # the newest step record, whole
        self.tokens = 0.0  # tokens processed by every step executed (replayed ones too)
        self.step_seconds = Histogram(STEP_BUCKETS)
        self.checkpoint_seconds = Histogram(SAVE_BUCKETS)  # rank 0's `checkpoint_saved`: start → committed
        self.last_checkpoint: dict | None = None  # the newest committed: {"step", "time"[, "requested", "request"]}
        self.requested_checkpoint: dict | None = None  # the newest of those asked for (`job checkpoint`)
        self.series: list[tuple[int, float, float | None, float | None]] = []  # (step, time, loss, tokens/s)
        self._stride, self._seen = 1, 0
        self._derived: Derived | None = None
        self._dirty = True

    # ---- reading -----------------------------------------------------------------------------------------
    def poll(self) -> None:
        with self._lock:
            new_events = self.events_tail.read()
            new_steps = self.metrics_tail.read() if self.metrics_tail else []
            if self.events_tail.restarted or (self.metrics_tail and self.metrics_tail.restarted):
                self.events_tail.restarted = False
                if self.metrics_tail:
                    self.metrics_tail.restarted = False
                self._reset()
            for line in new_events:
                try:
                    event = Event.from_json(line)
                except (ValueError, KeyError, TypeError):
                    continue
                if event.job == self.job:
                    self.events.append(event)
                    self._dirty = True
                    if event.kind == K.CHECKPOINT_SAVED and event.source == "rank:0":
                        self.last_checkpoint = {"step": event.fields.get("step"), "time": event.time,
                                                **({"requested": True, "request": event.fields.get("request")}
                                                   if event.fields.get("requested") else {})}
                        if event.fields.get("requested"):
                            self.requested_checkpoint = self.last_checkpoint
                        secs = _num(event.fields.get("seconds"))
                        if secs is not None:
                            self.checkpoint_seconds.observe(secs)
            for line in new_steps:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "event" not in record and isinstance(record.get("step"), int):
                    self._step(record)

    def _step(self, r: dict) -> None:
        t, d = _num(r.get("time")), _num(r.get("step_time_s"))
        if t is None or d is None:
            return
        kept = {"step": r["step"], "time": t, "step_time_s": d}
        if r.get("logged_after_fault"):
            kept["logged_after_fault"] = True
        self.steps.append(kept)
        self.last = r
        self._dirty = True
        if not r.get("logged_after_fault"):
            self.step_seconds.observe(d)
        tps = _num(r.get("tokens_per_s"))
        if tps is not None:
            self.tokens += tps * d
        self._seen += 1
        if (self._seen - 1) % self._stride == 0:
            self.series.append((r["step"], t, _num(r.get("loss")), tps))
            if len(self.series) > self.max_points:  # keep every other point, and take half as many from now on
                self.series = self.series[::2]
                self._stride *= 2

    def stragglers(self) -> list[Event]:
        """The controller's `straggler` events of the job (each names the node; fields: generation, rank,
        seconds, median_s, policy)."""
        return [e for e in self.events if e.source == "controller" and e.kind == K.STRAGGLER]

    # ---- derived figures ---------------------------------------------------------------------------------
    def ended(self) -> bool:
        return any(e.source == "controller" and e.kind == K.JOB and e.fields.get("to_state") in FINAL_STATES
                   for e in self.events[-8:])

    def derived(self, now: float | None = None) -> Derived:
        """The ledger and the recoveries, recomputed when new records came and `derive_every_s` passed (at
        once for a job that ended, and never again after)."""
        now = time.time() if now is None else now
        with self._lock:
            d = self._derived
            if d is None:
                stale = True
            elif self.ended():
                stale = self._dirty  # (its figures no longer change with the clock)
            else:
                stale = now - d.at >= self.derive_every_s
            if stale:
                ledger = compute(self.events, self.steps, job=self.job) if self.events else None
                self._derived = d = Derived(ledger, recovery_phases(self.events, self.steps, ledger), now)
                self._dirty = False
            return d


def recovery_phases(events: list[Event], steps: list[dict], ledger: Ledger | None) -> list[dict]:
    """One dict per recovery (each generation after the first), with the phases known, in seconds:
      detect      the fault → the controller knows (the ledger's failure-detection segments, in order)
      regroup     checkpointless: the fault → every rank's new process groups built (rank 0's `pg_rebuilt`);
                  restart: the controller knows → the new generation's rank 0 started (stop, relaunch, build;
                  its `started`, or for a resumed run, which writes none, the start of its checkpoint load)
      restore     the state loaded: from peers (`state_restored`) or the checkpoint (`resumed`'s seconds)
      first_step  the new generation's first step (its warm-up included)."""
    ctl_gens = [e.time for e in events if e.source == "controller" and e.kind == K.GENERATION]
    rank0 = [e for e in events if e.source.startswith("rank:")]
    detects = [b - a for a, b, label in (ledger.segments if ledger else []) if label == FAILURE_DETECTION]
    step_ends = sorted((s["time"], s["step_time_s"]) for s in steps)
    out = []
    for i, g in enumerate(ctl_gens[1:], 1):
        nxt = ctl_gens[i + 1] if i + 1 < len(ctl_gens) else math.inf
        mine = [e for e in rank0 if g <= e.time < nxt]
        phases: dict[str, float] = {}
        if i - 1 < len(detects):
            phases["detect"] = detects[i - 1]
        rebuilt = next((e for e in mine if e.kind == K.PG_REBUILT), None)
        started = next((e for e in mine if e.kind == K.STARTED), None)
        resumed = next((e for e in mine if e.kind == K.RESUMED), None)
        up = started.time if started is not None else None
        if up is None and resumed is not None:  # a resumed run writes no `started`: its load began when it was up
            up = resumed.time - (_num(resumed.fields.get("seconds")) or 0.0)
        if rebuilt is not None:
            arrived, built = _num(rebuilt.fields.get("all_arrived_after_fault_s")), _num(rebuilt.fields.get("seconds"))
            if arrived is not None and built is not None:
                phases["regroup"] = arrived + built
        elif up is not None:
            known = [e.time for e in events if e.source == "controller" and ctl_gens[i - 1] <= e.time <= g
                     and (e.kind in (K.RECOVERY, K.HANG) or e.kind == K.JOB and e.fields.get("to_state") == "recovering")]
            phases["regroup"] = max(0.0, up - (known[0] if known else g))
        restored = next((e for e in mine if e.kind == K.STATE_RESTORED), None)
        secs = _num((restored or resumed).fields.get("seconds")) if (restored or resumed) else None
        if secs is not None:
            phases["restore"] = secs
        first = next(((t, d) for t, d in step_ends if g < t < nxt), None)
        if first is not None:
            phases["first_step"] = first[1]
        out.append(phases)
    return out


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None

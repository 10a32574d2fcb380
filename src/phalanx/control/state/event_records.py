"""The controller's events: its one writer (an `EventLog` with source "controller") and the `events` table, and
the counters /metrics reads instead of scanning them; mixed into `Store` (on its connection, under its lock).

Every controller event — `Store.record_event`, a node's or a job's transition (written inside the same
transaction as the state change) — goes through `Store.log`, whose sinks are, in order:
  1. `insert_event`: one row of the `events` table (`phalanx cluster events`, `job describe`)
  2. `RunEventFiles(run_dir)`: an event of a job also to `<the job's checkpoint_dir>/events.jsonl`, the run's
     file every source appends to (phalanx.observability.run_events). A run file that cannot be written is a
     warning, once per job; the SQLite row stays, and the controller goes on.

Knows nothing about processes, HTTP or policy.
"""

from __future__ import annotations

from pathlib import Path

from phalanx.observability.events import Event, EventKind, EventLog
from phalanx.observability.run_events import RunEventFiles, job_run_dir

# cluster-wide events that change no heartbeat reply (a status among creating/in-service/degraded, a wait): no poke.
# At 4,096 nodes a poke to every agent is 4,096 full heartbeats, paced over 4 s (`server/links.py`)
QUIET = (EventKind.CLUSTER, EventKind.WAITING)


class EventRecords:
    """The events part of `Store` (uses its `_exec`, `_lock` and `clock`)."""

    def event_log(self) -> EventLog:
        """The controller's writer: the events table, then the run's events.jsonl for an event of a job."""
        return EventLog("controller", [self.insert_event, RunEventFiles(self.run_dir, what="the controller's events")],
                        clock=lambda: self.clock())  # (the store's clock as it is at each event)

    def insert_event(self, e: Event) -> None:
        """The SQLite sink: one row (a transition's from_state/to_state come from its fields)."""
        self._exec("INSERT INTO events (time, node, job, kind, from_state, to_state, reason) VALUES (?,?,?,?,?,?,?)",
                   (e.time, e.node, e.job, e.kind.value, e.fields.get("from_state"), e.fields.get("to_state"),
                    e.message or ""))

    def record_event(self, kind: EventKind | str, reason: str, *, node: str | None = None, job: str | None = None,
                     from_state: str | None = None, to_state: str | None = None, **fields) -> Event:
        """One controller event through `self.log` (under the lock: the table and the run file in one order);
        `fields`: its structured rest (the run's events.jsonl keeps them, the table its reason)."""
        states = {k: v for k, v in (("from_state", from_state), ("to_state", to_state)) if v is not None}
        with self._lock:
            event = self.log.emit(kind, reason, node=node, job=job, **states, **fields)
        if node or job or kind not in QUIET:  # (a decision was made: its agents may be concerned)
            self.changed((node,) if node and not job else None)
        return event

    def changed(self, nodes: tuple[str, ...] | None = None) -> None:
        """(`Store.changed`)"""

    def run_dir(self, job: str) -> Path | None:
        """Where a job's events.jsonl goes: its checkpoint_dir (against its cwd when relative); None: no such job."""
        rows = self._exec("SELECT cwd, checkpoint_dir FROM jobs WHERE id=?", (job,))
        return job_run_dir(rows[0]["cwd"], rows[0]["checkpoint_dir"]) if rows and rows[0]["checkpoint_dir"] else None

    def events(self, *, since_id: int = 0, node: str | None = None, job: str | None = None,
               limit: int | None = None) -> list[dict]:
        sql, args = "SELECT * FROM events WHERE id > ?", [since_id]
        if node:
            sql += " AND node = ?"
            args.append(node)
        if job:
            sql += " AND job = ?"
            args.append(job)
        sql += " ORDER BY id"
        rows = [dict(r) for r in self._exec(sql, tuple(args))]
        return rows[-limit:] if limit else rows

    # ---- counters (what /metrics reads instead of scanning the events) ----------------------------------
    def count(self, name: str, label: str, by: int = 1) -> None:
        """Add `by` to the counter `name{label}` (created at 0). Labels must come from a bounded set."""
        self._exec("INSERT INTO counters (name, label, value) VALUES (?,?,?) "
                   "ON CONFLICT(name, label) DO UPDATE SET value = value + excluded.value", (name, label, by))

    def counters(self, name: str) -> dict[str, int]:
        """{label: value} of the counter `name` (one indexed range of the counters table)."""
        return {r["label"]: r["value"] for r in self._exec("SELECT label, value FROM counters WHERE name=?", (name,))}

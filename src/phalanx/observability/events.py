"""The one event stream: the one list of event kinds (`EventKind`), the one record (`Event`) and the one
writer (`EventLog`) that the controller, the node agents and the training runtime all emit through.

An `EventLog` stamps each event with its time and its source ("controller", "agent:<node>", "rank:<r>"),
refuses a kind that is not an `EventKind`, and hands the `Event` to each of its sinks in order:
  controller   the `Store`'s events table (SQLite: `phalanx cluster events`, `job describe`), then the run's
               events.jsonl for an event of a job (`run_events.RunEventFiles`)
  agent        the run's events.jsonl (a hung worker it killed)
  rank 0       the run's metrics.jsonl `event` line (the format the soak and the tests read), then the
               run's events.jsonl
so a run's events.jsonl (`run_events.py`) holds the whole run, from every source, one `Event` per line: the
source the goodput ledger and the dashboard read (docs/observability.md).

The kind values are the words already on disk in existing clusters and runs (hence `worker-exit` beside
`fault_detected`): renaming one is a format change (bump `phalanx.protocol.PROTOCOL_VERSION`).

Must not know: the controller, the training loop, policy, models; standard library only (the agents and the
CLI import it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable


class EventKind(str, Enum):
    # the cluster and its nodes (controller)
    CLUSTER = "cluster"  # created, status changes
    CONTROLLER = "controller"  # started, restarted, stopped
    TRANSITION = "transition"  # a node's state changed
    PROMOTED = "promoted"  # a spare became a member of its group
    JOINED = "joined"  # an agent on another host joined as a waiting node (backend hosts)
    WAITING = "waiting"  # a group or job waits for capacity
    REMEDIATED = "remediated"  # a faulty node handed back to its scheduler (Slurm: drained, or reported)
    FAULT_INJECTED = "fault-injected"  # `phalanx fault inject`
    # jobs (controller)
    JOB = "job"  # a job's state changed (state/jobs.py)
    GENERATION = "generation"  # a job's generation started
    WORKER_EXIT = "worker-exit"  # a worker exited (and how)
    HANG = "hang"  # an agent killed a hung worker (the agent's own event, and the controller's record of it)
    RECOVERY = "recovery"  # what the controller does about a fault
    STRAGGLER = "straggler"  # a rank computes its steps k × slower than its peers' median, m reports in a row
    RESIZE = "resize"  # an elastic job's replica count changes (and why); its workers' side is `resized`
    CHECKPOINT_REQUESTED = "checkpoint-requested"  # a checkpoint asked for now (`job checkpoint`, a time limit)
    # a run (training runtime; checkpointless recovery also to the controller)
    STARTED = "started"  # a run (or a generation of it) started: world size, layout, where it starts from
    CHECKPOINT_STARTED = "checkpoint_started"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # a corrupt checkpoint passed over on resume
    FAULT_DETECTED = "fault_detected"
    RESIZED = "resized"  # checkpointless regroup after an elastic resize (in place of fault_detected)
    PG_REBUILT = "pg_rebuilt"
    STATE_RESTORED = "state_restored"
    RESUMED = "resumed"
    FINISHED = "finished"

    def __str__(self) -> str:
        return self.value


def event_kind(kind: "EventKind | str") -> EventKind:
    """`kind` as an `EventKind`; ValueError naming the known kinds for any other word."""
    try:
        return EventKind(kind)
    except ValueError:
        raise ValueError(f"unknown event kind {kind!r}; known: {', '.join(k.value for k in EventKind)} "
                         f"(add it to phalanx.observability.events.EventKind)") from None


@dataclass(frozen=True)
class Event:
    """One thing that happened. `message`: the human line (the controller's `reason`); `fields`: the
    structured rest (a node transition's from_state/to_state, a checkpoint's step and seconds, ...)."""

    time: float  # epoch seconds (the writer's clock)
    kind: EventKind
    source: str  # "controller", "agent:<node>", "rank:<r>"
    job: str | None = None
    node: str | None = None
    message: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "kind": self.kind.value, "source": self.source, "job": self.job,
                "node": self.node, "message": self.message, "fields": dict(self.fields)}

    def to_json(self) -> str:
        """One line (no newline): the events.jsonl format. A field JSON cannot hold is written as its str()."""
        return json.dumps(self.to_dict(), default=str, separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Event":
        return cls(time=float(d["time"]), kind=event_kind(d["kind"]), source=str(d["source"]), job=d.get("job"),
                   node=d.get("node"), message=d.get("message"), fields=dict(d.get("fields") or {}))

    @classmethod
    def from_json(cls, line: str) -> "Event":
        return cls.from_dict(json.loads(line))


Sink = Callable[[Event], None]


class EventLog:
    """The one writer: `emit()` validates the kind, stamps time and source, and hands the `Event` to each sink
    in order. A sink that raises stops the others and the error reaches the caller: a sink that must never
    break its writer (the run file, for the controller) catches its own errors (`run_events.RunEventFiles`)."""

    def __init__(self, source: str, sinks: Iterable[Sink] = (), clock: Callable[[], float] = time.time):
        self.source = source
        self.sinks: list[Sink] = list(sinks)
        self.clock = clock

    def emit(self, kind: EventKind | str, message: str | None = None, *, job: str | None = None,
             node: str | None = None, at: float | None = None, **fields) -> Event:
        return self.emit_fields(kind, fields, message=message, job=job, node=node, at=at)

    def emit_fields(self, kind: EventKind | str, fields: dict[str, Any], *, message: str | None = None,
                    job: str | None = None, node: str | None = None, at: float | None = None) -> Event:
        """`emit` with the free fields as one dict: for a writer whose field names are data (a recovery
        record may hold a `node` or a `message` of its own). `at`: when it happened, if before now (an injected
        fault: the moment before its signal, not after the fault it caused was recorded)."""
        event = Event(time=self.clock() if at is None else at, kind=event_kind(kind), source=self.source, job=job,
                      node=node, message=message, fields=dict(fields))
        for sink in self.sinks:
            sink(event)
        return event

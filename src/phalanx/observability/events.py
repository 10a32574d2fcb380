"""The one list of event kinds. The controller records events in its store (`Store.record_event`), the
training runtime in the run's metrics.jsonl (`MetricsWriter.event`); both take an `EventKind` (or its
value) and refuse any other word, so a reader — `job describe`, the chaos soak's ledger checks, the goodput
ledger — matches on names that exist.

The values are the words already on disk in existing clusters and runs (hence `worker-exit` beside
`fault_detected`): renaming one is a format change (bump `phalanx.protocol.PROTOCOL_VERSION`).
"""

from __future__ import annotations

from enum import Enum


class EventKind(str, Enum):
    # the cluster and its nodes (controller)
    CLUSTER = "cluster"  # created, status changes
    CONTROLLER = "controller"  # started, restarted, stopped
    TRANSITION = "transition"  # a node's state changed
    PROMOTED = "promoted"  # a spare became a member of its group
    WAITING = "waiting"  # a group or job waits for capacity
    FAULT_INJECTED = "fault-injected"  # `phalanx fault inject`
    # jobs (controller)
    JOB = "job"  # a job's state changed (state/jobs.py)
    GENERATION = "generation"  # a job's generation started
    WORKER_EXIT = "worker-exit"  # a worker exited (and how)
    HANG = "hang"  # an agent killed a hung worker
    RECOVERY = "recovery"  # what the controller does about a fault
    # a run (training runtime; checkpointless recovery also to the controller)
    STARTED = "started"  # a run (or a generation of it) started: world size, layout, where it starts from
    CHECKPOINT_STARTED = "checkpoint_started"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # a corrupt checkpoint passed over on resume
    FAULT_DETECTED = "fault_detected"
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

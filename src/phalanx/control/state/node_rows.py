"""A node's row as a Python value (`Node`), the node states and the moves between them (`ALLOWED`), the
cluster's status, and the bounded causes of a node fault. `store.py` reads and writes them; their users import
them from there.

Must not know: SQL statements, the store's connection, policy.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from enum import Enum
from typing import Any


class NodeState(str, Enum):
    PROVISIONING = "provisioning"
    CONFIGURING = "configuring"
    HEALTH_CHECKING = "health-checking"
    HEALTHY = "healthy"
    FAULTY = "faulty"
    REPLACING = "replacing"
    TERMINATED = "terminated"


S = NodeState
ALLOWED: dict[NodeState, set[NodeState]] = {
    S.PROVISIONING: {S.CONFIGURING, S.FAULTY, S.TERMINATED},
    S.CONFIGURING: {S.HEALTH_CHECKING, S.FAULTY, S.TERMINATED},
    S.HEALTH_CHECKING: {S.HEALTHY, S.FAULTY, S.TERMINATED},
    S.HEALTHY: {S.FAULTY, S.TERMINATED},
    S.FAULTY: {S.REPLACING, S.TERMINATED},
    S.REPLACING: {S.TERMINATED},
    S.TERMINATED: set(),
}
BRINGUP_STATES = (S.PROVISIONING, S.CONFIGURING, S.HEALTH_CHECKING)
# Why a node went faulty (`nodes.fault_cause`, set by the reconciler): the bounded label of /metrics' node
# faults and replacements.
FAULT_CAUSES = ("agent-gone", "heartbeat-timeout", "provision-timeout", "bringup-failed", "health-check",
                "deep-check", "hang", "straggler", "agent-start-failed", "scheduler")


class IllegalTransition(RuntimeError):
    pass


class ClusterStatus(str, Enum):
    CREATING = "creating"  # nodes being brought up for the first time
    IN_SERVICE = "in-service"  # every member node healthy
    DEGRADED = "degraded"  # in service, but some member is not healthy (being replaced, or recovery=none)
    FAILED = "failed"  # creation failed; nothing is running; inspect, then `cluster delete`
    DELETING = "deleting"
    DELETED = "deleted"


ENDED = (ClusterStatus.DELETING.value, ClusterStatus.FAILED.value, ClusterStatus.DELETED.value)  # agents terminate


@dataclass(frozen=True)
class Node:
    name: str
    group: str
    state: NodeState
    is_spare: bool
    reason: str | None
    health: dict | None  # the agent's latest health report
    report: dict | None  # the agent's latest bring-up report: phase, lifecycle result
    directives: list  # faults waiting to be handed to the agent on its next heartbeat
    last_heartbeat: float | None
    handle: str | None  # the backend's opaque handle for the node's agent (`Backend.launch`)
    work_dir: str
    job: str | None
    created_at: float
    state_since: float
    acked_at: float | None = None  # sent_at of the last heartbeat reply the agent acted on
    fault_cause: str | None = None  # why it went faulty (one of FAULT_CAUSES)

    @property
    def live(self) -> bool:
        """Counts towards its group (member or spare): not being retired."""
        return self.state not in (S.REPLACING, S.TERMINATED)

    def public(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["state"] = self.state.value
        return d


def with_fields(row, fields: dict):
    """`dataclasses.replace(row, **fields)` without its checks, for a frozen dataclass row with no `__post_init__`
    (a Node, a WorkerRecord): 1 µs, not 7 — a heartbeat's observations and every beat update the owner's row."""
    new = object.__new__(type(row))
    new.__dict__.update(row.__dict__, **fields)
    return new


JSON_COLUMNS = ("health", "report", "directives")


def failing(health: dict | None) -> bool:
    """A health report (a heartbeat's `health`) in which a check failed, whatever its action."""
    return bool(health) and any(c.get("status") == "fail" for c in health.get("checks", ()))


def _encoded(fields: dict) -> dict:
    """Column → value as stored (the JSON columns' `_json` text)."""
    return {(k + "_json" if k in JSON_COLUMNS else k): (json.dumps(v) if k in JSON_COLUMNS and v is not None else v)
            for k, v in fields.items()}


def _node(row: sqlite3.Row) -> Node:
    return Node(
        name=row["name"], group=row["group_name"], state=NodeState(row["state"]), is_spare=bool(row["is_spare"]),
        reason=row["reason"], health=_loads(row["health_json"]), report=_loads(row["report_json"]),
        directives=_loads(row["directives_json"]) or [], last_heartbeat=row["last_heartbeat"], handle=row["handle"],
        work_dir=row["work_dir"], job=row["job"], created_at=row["created_at"], state_since=row["state_since"],
        acked_at=row["acked_at"], fault_cause=row["fault_cause"],
    )


def _loads(text: str | None):
    return None if text is None else json.loads(text)

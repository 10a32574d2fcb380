"""The rows of the job tables as Python values: the job, generation and worker records, the job states and
their allowed moves, the kinds of fault and the outcomes a generation records, and their JSON columns' encoding.
`jobs.py` (`JobRecords`) reads and writes them; everything else imports them from there.

Must not know: SQL statements, the store's connection, policy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cached_property
from enum import Enum
from typing import Any


class FaultKind(str, Enum):
    """What ended (or will end) a generation, as recorded in `Generation.faults`."""

    NODE = "node"  # a node of the job is not healthy (gone, silent, failed health check)
    HANG = "hang"  # a worker froze (its agent killed it): a node fault too
    STALL = "stall"  # every rank alive and waiting: a job-level fault
    EXIT = "exit"  # a worker exited non-zero (killed by a signal: negative code)
    RESTART_JOB = "restart-job"  # a health check asks for a restart of the job on the same nodes (GPU XID)
    STRANDED = "stranded"  # a collective broke with every process alive (checkpointless: regroup them)
    REGROUP_FAILED = "regroup-failed"  # in-place recoveries in a row that never restored

    def __str__(self) -> str:
        return self.value


class Outcome(str, Enum):
    """How a generation ended (`Generation.outcome`)."""

    SUCCEEDED = "succeeded"
    CANCELLED = "cancelled"
    APP_ERROR = "app-error"
    NODE_FAULT = "node-fault"
    RESTART_JOB = "restart-job"
    PROCESS_FAULT = "process-fault"  # checkpointless: a worker died, its node is healthy
    STRANDED = "stranded"
    REGROUP_FAILED = "regroup-failed"
    RESIZED = "resized"  # elastic: replicas joined or left; survivors carried into the next generation

    def __str__(self) -> str:
        return self.value


class JobState(str, Enum):
    PENDING = "pending"
    RUNNING = "running"
    RECOVERING = "recovering"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


J = JobState
JOB_ALLOWED: dict[JobState, set[JobState]] = {
    J.PENDING: {J.RUNNING, J.CANCELLED, J.FAILED},
    J.RUNNING: {J.RECOVERING, J.SUCCEEDED, J.FAILED, J.CANCELLED},
    J.RECOVERING: {J.RUNNING, J.FAILED, J.CANCELLED},
    J.SUCCEEDED: set(),
    J.FAILED: set(),
    J.CANCELLED: set(),
}
FINAL = (J.SUCCEEDED, J.FAILED, J.CANCELLED)
ACTIVE = (J.RUNNING, J.RECOVERING)  # holding nodes
LIVE_WORKER = ("running", "stopping")  # a worker row whose process may still run

_JSON_FIELDS = ("nodes", "argv", "env", "config", "faults", "restored", "standbys", "straggler", "elastic")


def _enc(values: dict) -> dict:
    return {(k + "_json" if k in _JSON_FIELDS else k): (json.dumps(v) if k in _JSON_FIELDS else v)
            for k, v in values.items()}


def _dec(row) -> dict:
    out = {}
    for k in row.keys():
        if k.endswith("_json"):
            out[k[:-5]] = None if row[k] is None else json.loads(row[k])
        else:
            out[k] = row[k]
    return out


@dataclass(frozen=True)
class Job:
    id: str
    seq: int
    name: str
    state: JobState
    kind: str  # "train" | "command"
    group_name: str
    nodes_requested: int
    workers_per_node: int
    argv: list
    cwd: str
    env: dict
    config: dict | None
    job_dir: str
    checkpoint_dir: str
    nodes: list
    auto_resume: bool
    max_retries: int
    recovery: str  # restart | checkpointless
    attempts: int
    retries: int
    node_faults: int
    generation: int
    last_step: int | None
    reason: str | None
    created_at: float
    updated_at: float
    ended_at: float | None
    straggler: dict | None = None  # {"factor", "steps", "policy"}: the straggler rule's settings (None: defaults)
    # elastic jobs: protocol.elastic.ElasticSettings + {"ranks_per_replica", "nodes_per_replica", "target" (a
    # `job scale` request), "changed_at" (the last resize)}; None: a fixed-size job
    elastic: dict | None = None
    priority: int = 0  # a pending job of higher priority takes nodes from lower-priority elastic jobs

    @cached_property
    def node_index(self) -> dict[str, int]:
        """Each node of `nodes` → its position: membership and rank order without scanning the list (a heartbeat
        asks, at thousands of nodes). Kept with this record, which is read anew after any write."""
        return {name: i for i, name in enumerate(self.nodes)}

    @property
    def replicas(self) -> int | None:
        """An elastic job's replica count now (its current generation's nodes), else None."""
        if self.elastic is None:
            return None
        return len(self.nodes) // self.elastic["nodes_per_replica"]

    @property
    def world_size(self) -> int:
        return self.nodes_requested * self.workers_per_node

    def public(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["state"] = self.state.value
        d["world_size"] = self.world_size
        d["replicas"] = self.replicas
        d.pop("config")  # large; `job describe --json` shows it
        return d


@dataclass(frozen=True)
class Generation:
    job: str
    generation: int
    nodes: list
    master_addr: str
    master_port: int
    store_addr: str | None
    started_at: float
    stop_at: float | None
    ended_at: float | None
    outcome: str | None
    end_reason: str | None
    faults: list
    start_step: int | None
    last_step: int | None
    first_step_at: float | None
    restored: dict | None  # checkpointless: {"source", "step", "bytes", "seconds", ...} from its rank 0
    standbys: dict  # str(rank) → id of the warm standby worker told to become that rank

    @cached_property
    def node_index(self) -> dict[str, int]:
        """Each node of `nodes` → its position (`Job.node_index`)."""
        return {name: i for i, name in enumerate(self.nodes)}

    def public(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class WorkerRecord:
    job: str
    generation: int
    rank: int
    node: str
    local_rank: int
    pid: int | None
    state: str  # running | stopping | exited | lost
    exit_code: int | None
    detail: str | None
    hang: str | None
    frozen: bool  # hung with its liveness beat stopped too: the process itself is stuck (a node fault)
    stopped: bool  # stopped by its agent on the controller's request (not a fault)
    step: int | None
    started_at: float | None
    ended_at: float | None

    @property
    def live(self) -> bool:
        return self.state in LIVE_WORKER

    def public(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _job(row) -> Job:
    d = _dec(row)
    d["state"] = JobState(d["state"])
    d["auto_resume"] = bool(d["auto_resume"])
    return Job(**d)


def _generation(row) -> Generation:
    return Generation(**_dec(row))


def _worker(row) -> WorkerRecord:
    d = dict(row)
    d["stopped"], d["frozen"] = bool(d["stopped"]), bool(d["frozen"])
    return WorkerRecord(**d)

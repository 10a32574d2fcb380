"""Job, generation and worker records in SQLite (on the `Store`'s connection), and the job state machine.

    pending ──► running ──► succeeded
                 │   ▲
                 ▼   │
              recovering ──► failed                 pending | running | recovering ──► cancelled

    running      the current generation's workers run (or are being started by their agents)
    recovering   a fault ended the generation: its workers are being stopped, then the job waits for
                 healthy nodes (a promoted spare) and starts the next generation; or it fails
    failed       a fault it may not recover from: auto-resume off, or max_retries used up (reason says)

A *generation* is one (re)start of a job on a fixed set of nodes with fresh MASTER_ADDR/PORT; the
`generations` row carries its rendezvous, when it was told to stop (`stop_at`), when every worker was
confirmed gone (`ended_at`), its outcome and the faults seen. A `workers` row mirrors what an agent reports
about one rank of one generation (pid, state, exit code, hang, last step).

Every job transition goes through `transition()`, which refuses illegal moves and writes an event with a
reason. Knows nothing about processes, HTTP or the scheduler's policy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

from phalanx.observability.events import EventKind
from phalanx.control.state.store import IllegalTransition, Store


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
        return self.state in ("running", "stopping")

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


class JobRecords:
    """Reads and writes of the job tables. Callers serialise decisions (the scheduler holds its lock)."""

    def __init__(self, store: Store):
        self.store = store

    # ---- jobs ---------------------------------------------------------------------------------------
    def add_job(self, *, name: str | None, kind: str, group: str, nodes: int, workers_per_node: int, argv: list,
                cwd: str, env: dict, config: dict | None, jobs_root: str, checkpoint_dir: str | None,
                auto_resume: bool, max_retries: int, recovery: str = "restart", straggler: dict | None = None,
                elastic: dict | None = None, priority: int = 0) -> Job:
        now = self.store.clock()
        with self.store.transaction() as db:
            (seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()
            job_id = str(seq)
            job_dir = f"{jobs_root}/{job_id}"
            row = _enc({
                "id": job_id, "seq": seq, "name": name or job_id, "state": J.PENDING.value, "kind": kind,
                "group_name": group, "nodes_requested": nodes, "workers_per_node": workers_per_node, "argv": argv,
                "cwd": cwd, "env": env, "config": config, "job_dir": job_dir,
                "checkpoint_dir": checkpoint_dir or f"{job_dir}/checkpoints", "nodes": [],
                "auto_resume": int(auto_resume), "max_retries": max_retries, "reason": "waiting to be scheduled",
                "recovery": recovery, "straggler": straggler, "elastic": elastic, "priority": priority,
                "created_at": now, "updated_at": now,
            })
            db.execute(f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                       tuple(row.values()))
            what = f"{kind} job {name or job_id!r} submitted: {nodes} nodes × {workers_per_node} workers of group " \
                   f"{group}, auto_resume={'on' if auto_resume else 'off'}, max_retries={max_retries}, " \
                   f"recovery={recovery}"
            self.store.log.emit(EventKind.JOB, what, job=job_id, to_state=J.PENDING.value)  # (in this transaction)
        return self.job(job_id)

    def job(self, job_id: str) -> Job | None:
        rows = self.store.execute("SELECT * FROM jobs WHERE id=?", (job_id,))
        return _job(rows[0]) if rows else None

    def find(self, key: str) -> Job | None:
        """By id, else by name (the newest job of that name)."""
        job = self.job(key)
        if job is None:
            rows = self.store.execute("SELECT * FROM jobs WHERE name=? ORDER BY seq DESC LIMIT 1", (key,))
            job = _job(rows[0]) if rows else None
        return job

    def describe(self, job: Job) -> dict:
        """What `job describe` shows: the job, its generations, its workers' records and its events."""
        info = job.public()
        info["config"] = job.config
        info["generations"] = [g.public() for g in self.generations(job.id)]
        info["workers"] = [w.public() for w in self.workers(job=job.id)]
        info["log_dir"] = f"{job.job_dir}/logs"
        info["events"] = self.store.events(job=job.id)
        return info

    def jobs(self, states: tuple[JobState, ...] | None = None) -> list[Job]:
        found = [_job(r) for r in self.store.execute("SELECT * FROM jobs ORDER BY seq")]
        return found if states is None else [j for j in found if j.state in states]

    def recent_jobs(self, keep_ended: int) -> list[Job]:
        """Every job that has not ended and the newest `keep_ended` that have, in submission order (what
        /metrics labels: bounded however many jobs the cluster ran)."""
        rows = self.store.execute("SELECT * FROM jobs WHERE ended_at IS NULL UNION ALL SELECT * FROM "
                                  "(SELECT * FROM jobs WHERE ended_at IS NOT NULL ORDER BY seq DESC LIMIT ?)",
                                  (keep_ended,))
        return sorted((_job(r) for r in rows), key=lambda j: j.seq)

    def update_job(self, job_id: str, **values) -> None:
        assert "state" not in values, "use transition() to change a job's state"
        values["updated_at"] = self.store.clock()
        enc = _enc(values)
        self.store.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in enc)} WHERE id=?",
                           (*enc.values(), job_id))

    def transition(self, job_id: str, to: JobState, reason: str, **values) -> Job:
        """Move a job to `to` with an event; refuses moves the state machine forbids."""
        now = self.store.clock()
        with self.store.transaction() as db:
            row = db.execute("SELECT state FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                raise KeyError(f"no job {job_id!r}")
            frm = JobState(row["state"])
            if to not in JOB_ALLOWED[frm]:
                raise IllegalTransition(f"job {job_id}: {frm.value} → {to.value} is not a legal transition")
            values.update(state=to.value, reason=reason, updated_at=now)
            if to in FINAL:
                values["ended_at"] = now
            enc = _enc(values)
            db.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in enc)} WHERE id=?", (*enc.values(), job_id))
            self.store.log.emit(EventKind.JOB, reason, job=job_id, from_state=frm.value, to_state=to.value)
        return self.job(job_id)

    # ---- generations --------------------------------------------------------------------------------
    def add_generation(self, job_id: str, generation: int, nodes: list[str], master_addr: str, master_port: int,
                       store_addr: str | None) -> Generation:
        self.store.execute(
            "INSERT INTO generations (job, generation, nodes_json, master_addr, master_port, store_addr, started_at)"
            " VALUES (?,?,?,?,?,?,?)",
            (job_id, generation, json.dumps(nodes), master_addr, master_port, store_addr, self.store.clock()),
        )
        return self.generation(job_id, generation)

    def generation(self, job_id: str, generation: int) -> Generation | None:
        rows = self.store.execute("SELECT * FROM generations WHERE job=? AND generation=?", (job_id, generation))
        return _generation(rows[0]) if rows else None

    def generations(self, job_id: str | None = None, *, open_only: bool = False) -> list[Generation]:
        sql, args = "SELECT * FROM generations WHERE 1=1", []
        if job_id is not None:
            sql += " AND job=?"
            args.append(job_id)
        if open_only:
            sql += " AND ended_at IS NULL"
        return [_generation(r) for r in self.store.execute(sql + " ORDER BY started_at", tuple(args))]

    def update_generation(self, job_id: str, generation: int, **values) -> None:
        enc = _enc(values)
        self.store.execute(f"UPDATE generations SET {', '.join(f'{k}=?' for k in enc)} WHERE job=? AND generation=?",
                           (*enc.values(), job_id, generation))

    # ---- workers ------------------------------------------------------------------------------------
    def workers(self, *, job: str | None = None, generation: int | None = None,
                node: str | None = None) -> list[WorkerRecord]:
        sql, args = "SELECT * FROM workers WHERE 1=1", []
        for col, val in (("job", job), ("generation", generation), ("node", node)):
            if val is not None:
                sql += f" AND {col}=?"
                args.append(val)
        return [_worker(r) for r in self.store.execute(sql + " ORDER BY job, generation, rank", tuple(args))]

    def put_worker(self, rec: dict) -> None:
        """Insert or replace one rank's record (keys: the `workers` columns)."""
        self.store.execute(f"INSERT OR REPLACE INTO workers ({', '.join(rec)}) VALUES ({', '.join('?' * len(rec))})",
                           tuple(rec.values()))

    def update_worker(self, job: str, generation: int, rank: int, **values) -> None:
        self.store.execute(f"UPDATE workers SET {', '.join(f'{k}=?' for k in values)} "
                           "WHERE job=? AND generation=? AND rank=?", (*values.values(), job, generation, rank))

    def set_node_ack(self, name: str, acked_at: float | None) -> None:
        if acked_at is not None:
            self.store.update_node(name, acked_at=acked_at)

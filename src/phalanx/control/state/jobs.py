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
from contextlib import contextmanager
from dataclasses import fields

from phalanx.control.state.job_rows import (  # noqa: F401 - the records' types, imported from here by their users
    ACTIVE, FINAL, J, JOB_ALLOWED, LIVE_WORKER, FaultKind, Generation, Job, JobState, Outcome, WorkerRecord, _enc,
    _generation, _job, _worker)
from phalanx.control.state.node_rows import with_fields
from phalanx.control.state.store import IllegalTransition, Store
from phalanx.observability.events import EventKind

MAX_GENERATIONS_KEPT = 64  # generations whose rows the controller keeps in memory (`workers`): its open ones
WORKER_COLUMNS = frozenset(f.name for f in fields(WorkerRecord))
# a write of only these (the progress the controller follows) is no news to an agent: no reply depends on them
STEP_COLUMNS = frozenset({"last_step", "updated_at", "start_step", "first_step_at"})


class JobRecords:
    """Reads and writes of the job tables. Callers serialise decisions (the scheduler holds its lock).

    In the controller (the store's owner, the one writer of these tables) the reads every heartbeat makes — the
    jobs holding nodes and their current generations — are answered from memory until the next write of a job
    or generation: they were two full reads of the jobs table (every job ever submitted, each decoded from JSON)
    per heartbeat, so the controller slowed with its history (benchmarks/heartbeat_cost.py). Records read from
    memory are shared: treat their lists and dicts (nodes, faults, standbys, env, config, elastic) as read-only."""

    def __init__(self, store: Store):
        self.store = store
        # read → result until the next write; on the store, so every JobRecords over it shares it (owner only)
        self._memo: dict | None = store.job_memo

    def _remember(self, key, read):
        """`read()`, kept in the memo until the next write of a job or generation (a read that is not the owner's
        always goes to SQLite: another process may write)."""
        if self._memo is None:
            return read()
        with self.store.lock:  # the same lock the writes take: a result is never from before a write and kept after
            if key not in self._memo:
                self._memo[key] = read()
            return self._memo[key]

    @contextmanager
    def _writing(self, values: dict | None = None):
        """Around a write of a job or generation: the memo is emptied before and after it (committed or rolled
        back), under the store's lock, so no read can keep what the write changes. Then the agents are told
        (`Store.changed`), unless the write only counted steps (`values`: the columns written, when known)."""
        if self._memo is None:
            yield
        else:
            with self.store.lock:
                self._memo.clear()
                try:
                    yield
                finally:
                    self._memo.clear()
        if values is None or set(values) - STEP_COLUMNS:
            self.store.changed()

    # ---- jobs ---------------------------------------------------------------------------------------
    def add_job(self, *, name: str | None, kind: str, group: str, nodes: int, workers_per_node: int, argv: list,
                cwd: str, env: dict, config: dict | None, jobs_root: str, checkpoint_dir: str | None,
                auto_resume: bool, max_retries: int, recovery: str = "restart", straggler: dict | None = None,
                elastic: dict | None = None, priority: int = 0) -> Job:
        now = self.store.clock()
        with self._writing(), self.store.transaction() as db:
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

    def describe(self, job: Job, *, brief: bool = False) -> dict:
        """What `job describe` shows: the job, its generations, its workers' records and its events. `brief`:
        without the workers and the events, which grow with the job's size and history (what a poll for the
        job's state reads: at 4,096 ranks a full description costs the controller tens of milliseconds)."""
        info = job.public()
        info["config"] = job.config
        info["generations"] = [g.public() for g in self.generations(job.id)]
        info["log_dir"] = f"{job.job_dir}/logs"
        if not brief:
            info["workers"] = [w.public() for w in self.workers(job=job.id)]
            info["events"] = self.store.events(job=job.id)
        return info

    def jobs(self, states: tuple[JobState, ...] | None = None) -> list[Job]:
        """Every job in submission order, or those in `states`."""
        if states is None:
            return [_job(r) for r in self.store.execute("SELECT * FROM jobs ORDER BY seq")]
        values = tuple(JobState(s).value for s in states)
        return list(self._remember(("jobs", values), lambda: tuple(_job(r) for r in self.store.execute(
            f"SELECT * FROM jobs WHERE state IN ({', '.join('?' * len(values))}) ORDER BY seq", values))))

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
        with self._writing(values):
            self.store.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in enc)} WHERE id=?",
                               (*enc.values(), job_id))

    def transition(self, job_id: str, to: JobState, reason: str, **values) -> Job:
        """Move a job to `to` with an event; refuses moves the state machine forbids."""
        now = self.store.clock()
        with self._writing(), self.store.transaction() as db:
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
        with self._writing():
            self.store.execute(
                "INSERT INTO generations (job, generation, nodes_json, master_addr, master_port, store_addr, "
                "started_at) VALUES (?,?,?,?,?,?,?)",
                (job_id, generation, json.dumps(nodes), master_addr, master_port, store_addr, self.store.clock()))
        return self.generation(job_id, generation)

    def generation(self, job_id: str, generation: int) -> Generation | None:
        def read() -> Generation | None:
            rows = self.store.execute("SELECT * FROM generations WHERE job=? AND generation=?", (job_id, generation))
            return _generation(rows[0]) if rows else None
        return self._remember(("generation", job_id, generation), read)

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
        with self._writing(values):
            self.store.execute(f"UPDATE generations SET {', '.join(f'{k}=?' for k in enc)} WHERE job=? AND "
                               "generation=?", (*enc.values(), job_id, generation))

    # ---- workers ------------------------------------------------------------------------------------
    def workers(self, *, job: str | None = None, generation: int | None = None, node: str | None = None,
                ranks: list[int] | None = None) -> list[WorkerRecord]:
        if job is not None and generation is not None and node is None and ranks is None:
            kept = self._kept_rows(job, generation)
            if kept is not None:
                return [kept[rank] for rank in sorted(kept)]  # (by rank, as SQLite returns them)
        return self._select_workers(job=job, generation=generation, node=node, ranks=ranks)

    def _kept_rows(self, job: str, generation: int) -> dict[int, WorkerRecord] | None:
        """The owner: `generation`'s rows by rank, kept in memory and written through (`put_worker`,
        `update_worker`) — the scheduler reads a running generation's rows every tick, and each heartbeat its
        ranks'. Read once per generation (MAX_GENERATIONS_KEPT at most; more clears them). None: not the owner."""
        kept = self.store.generation_rows
        if kept is None:
            return None
        with self.store.lock:
            if (job, generation) not in kept:
                if len(kept) >= MAX_GENERATIONS_KEPT:
                    kept.clear()
                kept[(job, generation)] = {w.rank: w for w in self._select_workers(job=job, generation=generation)}
            return kept[(job, generation)]

    def any_reported(self, job: str, generation: int, first: int, count: int) -> bool:
        """Whether any of ranks first … first+count-1 of the generation has a row (its agent reported it); by rank,
        not by node: the owner answers from the generation's kept rows, at every heartbeat of a launch."""
        kept = self._kept_rows(job, generation)
        if kept is not None:
            return any(rank in kept for rank in range(first, first + count))
        return bool(self._select_workers(job=job, generation=generation, ranks=list(range(first, first + count))))

    def _select_workers(self, *, job: str | None = None, generation: int | None = None, node: str | None = None,
                        ranks: list[int] | None = None) -> list[WorkerRecord]:
        sql, args = "SELECT * FROM workers WHERE 1=1", []
        for col, val in (("job", job), ("generation", generation), ("node", node)):
            if val is not None:
                sql += f" AND {col}=?"
                args.append(val)
        if ranks is not None:
            sql += f" AND rank IN ({', '.join('?' * len(ranks))})"
            args.extend(ranks)
        return [_worker(r) for r in self.store.execute(sql + " ORDER BY job, generation, rank", tuple(args))]

    def reported_workers(self, node: str, keys: set[tuple[str, int, int]]) -> list[WorkerRecord]:
        """What a heartbeat from `node` is compared against: its live rows, and its rows of the (job, generation,
        rank) its agent reports, read by key (the owner: from the generations' kept rows). Never a whole job's rows
        nor every row the node ever had: at a launch or a stop every node's heartbeat brings news, and a read that
        grows with the job's size made those N heartbeats cost N² (0.7 ms each at 4,096 ranks: answers 6-9 s late)."""
        sql = f"SELECT * FROM workers WHERE node=? AND state IN ({', '.join('?' * len(LIVE_WORKER))})"
        rows = {(w.job, w.generation, w.rank): w for w in map(_worker, self.store.execute(sql, (node, *LIVE_WORKER)))}
        wanted: dict[tuple[str, int], list[int]] = {}
        for job, generation, rank in keys:
            if (job, generation, rank) not in rows:
                wanted.setdefault((job, generation), []).append(rank)
        for (job, generation), ranks in wanted.items():
            kept = self._kept_rows(job, generation)
            found = ([kept[r] for r in ranks if r in kept] if kept is not None else
                     self._select_workers(job=job, generation=generation, ranks=sorted(ranks)))
            rows.update(((w.job, w.generation, w.rank), w) for w in found if w.node == node)
        return list(rows.values())

    def unchanged_reports(self, node: str, reports: list) -> bool:
        """True when `reports` are the ones `node`'s last ingested heartbeat brought (`ingested`) and no worker row
        was written since: comparing them with the rows again would change nothing (the owner only; else False).
        A running job's agents report the same workers every heartbeat: this spares each one a read of SQLite."""
        memo = self.store.reports_memo
        with self.store.lock:
            return memo is not None and memo.get(node) == reports

    def ingested(self, node: str, reports: list) -> None:
        """`node`'s reports are now what its rows say (see `unchanged_reports`)."""
        memo = self.store.reports_memo
        if memo is not None:
            with self.store.lock:
                memo[node] = list(reports)

    def record_steps(self, job: str, generation: int, steps: dict[int, int | None]) -> None:
        """Each rank's newest step (from the rendezvous store) into its row; ranks with no row are left out. One
        transaction for every rank that moved (a tick of a 4,096-rank job may move them all)."""
        with self.store.lock:
            kept = self._kept_rows(job, generation)
            ranks = sorted(rank for rank, step in steps.items() if step is not None)
            rows = ([kept[r] for r in ranks if r in kept] if kept is not None else
                    self._select_workers(job=job, generation=generation, ranks=ranks) if ranks else [])
            moved = [w.rank for w in rows if steps[w.rank] != w.step]
            if not moved:
                return
            with self.store.transaction() as db:
                db.executemany("UPDATE workers SET step=? WHERE job=? AND generation=? AND rank=?",
                               [(steps[r], job, generation, r) for r in moved])
            if kept is not None:
                for r in moved:
                    kept[r] = with_fields(kept[r], {"step": steps[r]})

    def put_worker(self, rec: dict) -> None:
        """Insert or replace one rank's record (keys: the `workers` columns)."""
        with self.store.lock:
            self.store.execute(f"INSERT OR REPLACE INTO workers ({', '.join(rec)}) VALUES "
                               f"({', '.join('?' * len(rec))})", tuple(rec.values()))
            if self.store.reports_memo is not None:
                self.store.reports_memo.pop(rec["node"], None)
            kept = (self.store.generation_rows or {}).get((rec["job"], rec["generation"]))
            if kept is not None:
                if set(rec) == WORKER_COLUMNS:
                    kept[rec["rank"]] = _worker(rec)
                else:  # (a partial row: its defaults are SQLite's) read again when next asked
                    self.store.generation_rows.pop((rec["job"], rec["generation"]))

    def update_worker(self, job: str, generation: int, rank: int, **values) -> None:
        with self.store.lock:
            self.store.execute(f"UPDATE workers SET {', '.join(f'{k}=?' for k in values)} "
                               "WHERE job=? AND generation=? AND rank=?", (*values.values(), job, generation, rank))
            if set(values) != {"step"} and self.store.reports_memo is not None:
                self.store.reports_memo.clear()  # (a step is the scheduler's: no heartbeat's report compares it)
            kept = (self.store.generation_rows or {}).get((job, generation))
            if kept is not None and rank in kept:
                kept[rank] = with_fields(kept[rank], {k: bool(v) if k in ("frozen", "stopped") else v
                                                    for k, v in values.items()})

    def set_node_ack(self, name: str, acked_at: float | None) -> None:
        if acked_at is not None:
            self.store.observe_node(name, acked_at=acked_at)

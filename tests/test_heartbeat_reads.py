"""A heartbeat's SQL does not grow with the cluster's history: in steady state it scans no table that every job
adds rows to, reads no job row (the controller keeps the jobs holding nodes in memory) and writes nothing (its
observations are batched into the reconciler's tick). Before, each heartbeat decoded every job ever submitted and
read every worker row its node ever had (benchmarks/heartbeat_cost.py: 84 ms per heartbeat after 1,000 jobs).
Checked on the statements themselves and SQLite's query plans, not on timings.
"""

from __future__ import annotations

import sqlite3

from fakes import FakeCluster
from phalanx.control.state.jobs import JobState

GROWING = ("jobs", "generations", "workers", "events")  # tables every job adds rows to


def past_jobs(c: FakeCluster, n: int) -> None:
    records, names = c.jobs.records, sorted(c.agents)
    for _ in range(n):
        past = records.add_job(name=None, kind="command", group="workers", nodes=len(names), workers_per_node=1,
                               argv=["true"], cwd="/", env={}, config=None, jobs_root=str(c.paths.jobs_dir),
                               checkpoint_dir=None, auto_resume=False, max_retries=0)
        for rank, name in enumerate(names):
            records.put_worker({"job": past.id, "generation": 1, "rank": rank, "node": name, "local_rank": 0,
                                "pid": 1000 + rank, "state": "exited", "exit_code": 0, "detail": "exited 0"})
        records.transition(past.id, JobState.CANCELLED, "a past job")


def test_a_steady_heartbeat_scans_no_growing_table_reads_no_job_and_writes_nothing(tmp_path):
    c = FakeCluster(tmp_path, count=2, spares=1).create()
    past_jobs(c, 20)
    job = c.submit(nodes=2)
    c.run_until(lambda: all(c.agents[n].running(job.id) for n in ("workers-0", "workers-1")), "the job running")
    c.steps(3)  # steady: every worker reported, nothing changing
    statements: list[str] = []
    c.store._db.set_trace_callback(statements.append)
    for agent in list(c.agents.values()):
        c.heartbeat(agent)
    c.store._db.set_trace_callback(None)

    assert statements, "the heartbeats read nothing at all?"
    assert not [s for s in statements if " jobs" in s.lower()], statements  # the jobs holding nodes: in memory
    writes = [s for s in statements if s.split()[0].upper() in ("UPDATE", "INSERT", "DELETE", "BEGIN")]
    assert not writes, writes  # observations batched (Store.observe_node), nothing else changed
    plans = sqlite3.connect(c.paths.db)
    scans = {s: plan for s in statements
             if (plan := [row[3] for row in plans.execute("EXPLAIN QUERY PLAN " + s)])
             and any(step.startswith(f"SCAN {t}") for step in plan for t in GROWING)}
    plans.close()
    assert not scans, scans
    c.close()


def test_the_worker_rows_a_heartbeat_compares_are_the_live_and_reported_ones(tmp_path):
    """`ingest` reads the node's live rows and its rows of the jobs its agent reports, not its whole history —
    and still notices a live worker its agent stopped reporting."""
    c = FakeCluster(tmp_path, count=2, spares=0).create()
    past_jobs(c, 5)
    job = c.submit(nodes=2)
    c.run_until(lambda: all(c.agents[n].running(job.id) for n in ("workers-0", "workers-1")), "the job running")
    c.step()  # (the agents report the workers they started)
    read = c.jobs.records.reported_workers("workers-0", {job.id})
    assert {(w.job, w.state) for w in read} == {(job.id, "running")}  # none of the 5 past jobs' rows
    assert c.jobs.records.reported_workers("workers-0", set()) == read  # live rows come without being reported
    c.agents["workers-0"].workers.clear()  # its agent forgets the worker (as after a restart that lost it)
    c.step()
    rows = c.jobs.records.workers(job=job.id, node="workers-0")
    assert rows and rows[0].state == "lost", rows
    c.close()


def test_every_reader_of_the_controllers_store_sees_a_job_write_at_once(tmp_path):
    """The jobs kept in memory are the store's, not one reader's: a write through one `JobRecords` is seen by
    another over the same store (the /metrics collector's, say) at its next read."""
    from phalanx.control.state.jobs import ACTIVE, JobRecords

    c = FakeCluster(tmp_path, count=2, spares=0).create()
    other = JobRecords(c.store)
    assert other.jobs(ACTIVE) == []
    job = c.submit(nodes=2)
    c.run_until(lambda: c.jobs.records.job(job.id).state == JobState.RUNNING, "the job running")
    assert [j.id for j in other.jobs(ACTIVE)] == [job.id]
    assert other.generation(job.id, 1) == c.jobs.records.generation(job.id, 1) is not None
    c.jobs.records.update_generation(job.id, 1, last_step=7)
    assert other.generation(job.id, 1).last_step == 7
    c.close()

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


def running_job_with_store_reads(tmp_path):
    """A fake cluster of 2 nodes running a job of one rank each, and the list every store check it makes appends
    its keys to."""
    c = FakeCluster(tmp_path, count=2, spares=0).create()
    job = c.submit(nodes=2)
    c.run_until(lambda: all(c.agents[n].running(job.id) for n in ("workers-0", "workers-1")), "the job running")
    c.steps(2)
    reads: list[list[str]] = []
    check = c.rendezvous.check
    c.rendezvous.check = lambda keys: reads.append(list(keys)) or check(keys)
    return c, job, reads


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
    c.store.execute("SELECT 1")  # the trace works (the steady heartbeats themselves may read nothing at all)
    c.store._db.set_trace_callback(None)

    assert statements.pop() == "SELECT 1", statements
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
    read = c.jobs.records.reported_workers("workers-0", {(job.id, 1, 0)})
    assert {(w.job, w.state) for w in read} == {(job.id, "running")}  # none of the 5 past jobs' rows
    assert c.jobs.records.reported_workers("workers-0", set()) == read  # live rows come without being reported
    past = sorted(j.id for j in c.jobs.records.jobs() if j.id != job.id)[0]
    reported = c.jobs.records.reported_workers("workers-0", {(past, 1, 0)})  # a row no longer live, by its key
    assert sorted((w.job, w.state) for w in reported) == sorted([(past, "exited"), (job.id, "running")])
    assert c.jobs.records.reported_workers("workers-0", {(past, 1, 1)}) == read  # workers-1's row: not this node's
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


def test_a_running_jobs_heartbeat_reads_no_worker_row_while_its_workers_and_steps_go_on(tmp_path):
    """The controller keeps what a heartbeat compares in memory: the worker reports its node sent last (unchanged:
    nothing to compare) and the running generation's rows (its ranks' steps, read by the ticks, written through).
    Before, every heartbeat of a running job read its node's rows twice (benchmarks/heartbeat_cost.py at 1,024
    nodes)."""
    c = FakeCluster(tmp_path, count=2, spares=0).create()
    job = c.submit(nodes=2)
    c.run_until(lambda: all(c.agents[n].running(job.id) for n in ("workers-0", "workers-1")), "the job running")
    c.steps(3)
    for step in (4, 5):
        for rank in (0, 1):
            c.report_step(job.id, 1, rank, step)
        statements: list[str] = []
        c.store._db.set_trace_callback(statements.append)
        for agent in list(c.agents.values()):
            c.heartbeat(agent)
        c.store._db.set_trace_callback(None)
        assert not [s for s in statements if "from workers" in s.lower()], statements
        c.reconciler.tick()  # (the steps are the tick's to read: `_read_steps`)
        assert [w.step for w in c.jobs.records._select_workers(job=job.id, generation=1)] == [step, step]
    c.close()


def test_the_generation_rows_the_controller_keeps_are_sqlites_after_every_write(tmp_path):
    """Written through, never stale: through a launch, steps, a killed worker (restart mode: stopped, relaunched)
    and a killed node of a checkpointless job (its worker lost, the survivor carried), the rows kept for each
    generation equal SQLite's after every tick."""
    from phalanx import protocol

    c = FakeCluster(tmp_path, count=4, spares=1).create()
    records = c.jobs.records

    def same() -> bool:
        for job_id, gen in list(c.store.generation_rows):
            assert records.workers(job=job_id, generation=gen) == records._select_workers(job=job_id, generation=gen)
        return True

    def run_until(predicate, what):
        c.run_until(lambda: same() and predicate(), what)

    job = c.submit(nodes=2, max_retries=1)  # (a killed worker on a healthy node is the application's failure)
    run_until(lambda: len(records.workers(job=job.id, generation=1)) == 2, "generation 1's workers reported")
    for rank in (0, 1):
        c.report_step(job.id, 1, rank, 3)
    run_until(lambda: {w.step for w in records.workers(job=job.id, generation=1)} == {3}, "the steps written")
    c.inject_fault("workers-1", "kill-worker")
    run_until(lambda: len(records.workers(job=job.id, generation=2)) == 2, "generation 2 running")
    assert {w.state for w in records.workers(job=job.id, generation=1)} == {"exited"}
    assert c.store.generation_rows, "no generation's rows were kept: nothing was checked"

    second = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    run_until(lambda: len(records.workers(job=second.id, generation=1)) == 2, "the checkpointless job running")
    victim = records.generation(second.id, 1).nodes[1]
    c.inject_fault(victim, "kill-node")
    run_until(lambda: len(records.workers(job=second.id, generation=2)) == 2, "its generation 2 running")
    assert {w.state for w in records.workers(job=second.id, generation=1)} == {"carried", "lost"}
    c.close()


def test_a_running_jobs_heartbeat_reads_nothing_from_the_store_and_a_tick_reads_every_ranks_step_at_once(tmp_path):
    """Protocol 6: a reply carries no progress (each agent's hang rule reads its workers' on its node), so a
    heartbeat reads nothing from the rendezvous store, however its job runs. The job's step comes from the tick,
    which reads every rank's step of a running generation in one check and one multi_get, and their step times
    in one more; nothing while a rank has not published its step (a job still starting)."""
    from phalanx import protocol

    c, job, reads = running_job_with_store_reads(tmp_path)
    c.report_step(job.id, 1, 0, 3)  # rank 0 only: the tick's check of both ranks' steps fails, nothing more
    c.reconciler.tick()
    assert reads == [[protocol.progress_key(job.id, 1, 0), protocol.progress_key(job.id, 1, 1)]], reads
    for name in ("workers-0", "workers-1"):
        (a,) = [a for a in c.heartbeat(c.agents[name])["workers"] if a["job"] == job.id]
        assert "progress" not in a and "hang_detection" not in a, a
    assert len(reads) == 1, f"a heartbeat read the store: {reads[1:]}"
    reads.clear()
    for rank in (0, 1):
        c.report_step(job.id, 1, rank, 4)
        c.rendezvous.set(protocol.step_time_key(job.id, 1, rank), "4 0.5")
    c.reconciler.tick()
    assert [len(keys) for keys in reads] == [2, 2], reads  # every rank's step in one check, their times in one
    assert c.job(job.id).last_step == 4
    reads.clear()
    for name in ("workers-0", "workers-1"):
        c.heartbeat(c.agents[name])
    assert reads == [], "a heartbeat read the store"
    c.close()


def test_a_heartbeat_with_news_reads_its_own_rows_not_the_whole_jobs(tmp_path):
    """At a launch or a stop every node's heartbeat brings news (its workers started, or exited), and each is
    compared with its node's rows. Read by the job, that scanned every rank's row per heartbeat — N² for the N
    heartbeats of a launch (benchmarks/control_scale.py at 4,096 nodes: answers 6 s late as a job started). The
    SQLite work of one such heartbeat (its virtual machine's instructions, counted by a progress handler) does not
    grow with the job's size."""
    work = {}
    for nodes in (2, 48):
        c = FakeCluster(tmp_path / str(nodes), count=nodes, spares=0).create()
        job = c.submit(nodes=nodes)
        c.run_until(lambda: all(a.running(job.id) for a in c.agents.values()), "the job running")
        c.step()
        agent = c.agents["workers-0"]
        for w in agent.workers.values():
            w.detail = "news"  # (what a real agent's report changes between heartbeats: its workers' state)
        steps = [0]
        c.store._db.set_progress_handler(lambda: steps.__setitem__(0, steps[0] + 1), 10)
        c.heartbeat(agent)
        c.store._db.set_progress_handler(None, 10)
        assert c.jobs.records.workers(job=job.id, node="workers-0")[0].detail == "news"  # the news was taken
        work[nodes] = steps[0]
        c.close()
    assert work[48] <= work[2] * 1.2, work

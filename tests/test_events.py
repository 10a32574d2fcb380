"""The one event stream: the `Event` record and its JSON line, the one writer (`EventLog`), the run's
events.jsonl appended to by several processes, the controller's events in SQLite and in the run file (and a
run file it cannot write), rank 0's events in metrics.jsonl (the old line) and events.jsonl, an agent's hang."""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import subprocess
import time

import pytest

from phalanx.control.state.jobs import JobRecords, JobState
from phalanx.control.state.store import SCHEMA, Store
from phalanx.observability.events import Event, EventKind, EventLog
from phalanx.observability.run_events import EVENTS_FILE, JsonlSink, RunEventFiles, read_events
from phalanx.protocol.messages import Assignment
from phalanx.train.metrics import MetricsWriter, read_metrics


# ---- the record and the writer -------------------------------------------------------------------------------
def test_an_event_round_trips_through_its_json_line():
    e = Event(time=12.5, kind=EventKind.HANG, source="agent:workers-1", job="3", node="workers-1",
              message="frozen: no progress", fields={"rank": 1, "frozen": True, "nested": {"a": [1, 2]}})
    line = e.to_json()
    assert "\n" not in line and json.loads(line)["kind"] == "hang"
    assert Event.from_json(line) == e
    bare = Event(time=1.0, kind=EventKind.FINISHED, source="rank:0")
    assert Event.from_json(bare.to_json()) == bare


def test_the_writer_stamps_time_and_source_and_refuses_an_unknown_kind():
    seen: list[Event] = []
    log = EventLog("rank:0", [seen.append, seen.append], clock=lambda: 42.0)
    e = log.emit("checkpoint_saved", job="7", step=3, seconds=0.5)
    assert e == Event(42.0, EventKind.CHECKPOINT_SAVED, "rank:0", job="7", fields={"step": 3, "seconds": 0.5})
    assert seen == [e, e]  # every sink, in order
    # field names that are data (a recovery record's `node`) stay fields with emit_fields
    e = log.emit_fields(EventKind.FAULT_DETECTED, {"node": "workers-2", "message": "m"})
    assert e.node is None and e.message is None and e.fields == {"node": "workers-2", "message": "m"}
    with pytest.raises(ValueError, match="unknown event kind 'checkpoint-saved'.*checkpoint_saved"):
        log.emit("checkpoint-saved", step=1)
    assert len(seen) == 4, "a refused event reaches no sink"


# ---- the run's events.jsonl -----------------------------------------------------------------------------------
def _append_many(path: str, writer: int, count: int, start) -> None:
    log = EventLog(f"rank:{writer}", [JsonlSink(path)])
    start.wait(30)  # all at once
    for i in range(count):  # lines of 1 to 13 kB: longer than a pipe's atomic write or an 8 kB buffer
        log.emit(EventKind.STARTED, "x" * (1000 + 60 * i), writer=writer, i=i)


def test_several_processes_append_whole_lines_to_one_file(tmp_path):
    path = tmp_path / "run" / "deep" / EVENTS_FILE  # the sink creates the directories
    ctx = multiprocessing.get_context("fork")
    start = ctx.Barrier(3)
    procs = [ctx.Process(target=_append_many, args=(str(path), w, 200, start)) for w in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = path.read_text().split("\n")
    assert lines[-1] == "" and len(lines) == 601
    seen = [(e.fields["writer"], e.fields["i"]) for e in map(Event.from_json, lines[:-1])]  # each line whole
    assert sorted(seen) == [(w, i) for w in range(3) for i in range(200)]
    for w in range(3):  # each writer's own lines in its order
        assert [i for writer, i in seen if writer == w] == list(range(200))
    assert len(read_events(path.parent)) == 600


def test_read_events_sorts_by_time_and_ignores_a_torn_last_line(tmp_path):
    assert read_events(tmp_path) == []
    sink = JsonlSink(tmp_path / EVENTS_FILE)
    for t, kind in ((3.0, EventKind.FINISHED), (1.0, EventKind.STARTED), (2.0, EventKind.RESUMED)):
        sink(Event(t, kind, "rank:0"))
    with open(tmp_path / EVENTS_FILE, "a") as f:
        f.write('{"time": 4.0, "kind": "ha')  # a writer that died mid-line
    assert [e.kind for e in read_events(tmp_path)] == [EventKind.STARTED, EventKind.RESUMED, EventKind.FINISHED]


# ---- the controller ------------------------------------------------------------------------------------------
def _store(tmp_path, checkpoint_dir) -> tuple[Store, JobRecords, str]:
    store = Store(tmp_path / "state.db")
    store._db.executescript(SCHEMA)  # (no cluster row: the job tables are enough)
    records = JobRecords(store)
    job = records.add_job(name="j", kind="train", group="workers", nodes=1, workers_per_node=1, argv=[],
                          cwd=str(tmp_path), env={}, config=None, jobs_root=str(tmp_path / "jobs"),
                          checkpoint_dir=str(checkpoint_dir), auto_resume=True, max_retries=0)
    return store, records, job.id


def test_a_controller_event_of_a_job_lands_in_sqlite_and_in_the_runs_file(tmp_path):
    run = tmp_path / "run" / "checkpoints"
    store, records, job = _store(tmp_path, run)
    store.record_event(EventKind.RECOVERY, "restarting from the newest checkpoint", job=job, node="workers-0")
    records.transition(job, JobState.RUNNING, "generation 1 started")
    store.record_event(EventKind.WAITING, "group workers waits for a node")  # not a job's: SQLite only

    rows = [(e["kind"], e["job"], e["from_state"], e["to_state"], e["reason"]) for e in store.events()]
    assert rows[1] == ("recovery", job, None, None, "restarting from the newest checkpoint")
    assert rows[2][:4] == ("job", job, "pending", "running") and rows[3][:2] == ("waiting", None)
    events = read_events(run)
    assert [(e.source, e.kind, e.job) for e in events] == [("controller", EventKind.JOB, job),
                                                            ("controller", EventKind.RECOVERY, job),
                                                            ("controller", EventKind.JOB, job)]
    assert events[0].message.startswith("train job 'j' submitted") and events[0].fields == {"to_state": "pending"}
    assert events[1].node == "workers-0" and events[1].message == "restarting from the newest checkpoint"
    assert events[2].fields == {"from_state": "pending", "to_state": "running"}
    assert [e.time for e in events] == [r["time"] for r in store.events() if r["job"]]
    store.close()


def test_a_run_file_the_controller_cannot_write_never_breaks_it(tmp_path, caplog):
    (tmp_path / "taken").write_text("a file where the run dir should be")
    with caplog.at_level(logging.WARNING, logger="phalanx.events"):
        store, records, job = _store(tmp_path, tmp_path / "taken" / "checkpoints")
        for i in range(3):
            assert store.record_event(EventKind.RECOVERY, f"try {i}", job=job).kind == EventKind.RECOVERY
    assert [e["reason"] for e in store.events(job=job)][1:] == ["try 0", "try 1", "try 2"]  # SQLite has them all
    warned = [r for r in caplog.records if "events.jsonl" in r.getMessage()]
    assert len(warned) == 1 and f"job {job}" in warned[0].getMessage(), "one warning per job"
    # the run dir removed under a running job: made again
    (tmp_path / "other").mkdir()
    store2, _, job2 = _store(tmp_path / "other", tmp_path / "gone")
    (tmp_path / "gone" / EVENTS_FILE).unlink()
    (tmp_path / "gone").rmdir()
    store2.record_event(EventKind.RECOVERY, "again", job=job2)
    assert [e.message for e in read_events(tmp_path / "gone")] == ["again"]
    store.close()
    store2.close()


def test_run_event_files_skip_events_without_a_job_or_a_run_dir(tmp_path):
    sink = RunEventFiles({"1": tmp_path / "one"}.get)
    sink(Event(1.0, EventKind.CLUSTER, "controller"))
    sink(Event(1.0, EventKind.JOB, "controller", job="2"))
    sink(Event(1.0, EventKind.JOB, "controller", job="1"))
    assert [p.name for p in tmp_path.iterdir()] == ["one"] and len(read_events(tmp_path / "one")) == 1


# ---- rank 0 ----------------------------------------------------------------------------------------------------
def test_metrics_writer_events_land_in_metrics_jsonl_as_before_and_in_events_jsonl(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_JOB_ID", "5")
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    writer = MetricsWriter(run, enabled=True, max_steps=10, events_dir=ckpt)
    writer.event("checkpoint_saved", step=5, seconds=0.25, dir=str(ckpt))
    writer.event(EventKind.FAULT_DETECTED, node="workers-1", at=3.5)  # names that are data stay fields
    writer.close()
    _, metric_events = read_metrics(run)
    assert [list(e) for e in metric_events] == [["time", "event", "step", "seconds", "dir"],
                                                ["time", "event", "node", "at"]]  # the line it always was
    assert metric_events[0]["event"] == "checkpoint_saved" and metric_events[1]["node"] == "workers-1"
    events = read_events(ckpt)
    assert [(e.source, e.kind, e.job, e.node) for e in events] == [("rank:0", EventKind.CHECKPOINT_SAVED, "5", None),
                                                                   ("rank:0", EventKind.FAULT_DETECTED, "5", None)]
    assert events[0].fields == {"step": 5, "seconds": 0.25, "dir": str(ckpt)}
    assert [e.time for e in events] == [m["time"] for m in metric_events]

    quiet = MetricsWriter(tmp_path / "rank1", enabled=False, max_steps=10, events_dir=tmp_path / "rank1")
    with pytest.raises(ValueError, match="unknown event kind 'saved'"):  # every rank checks the kind
        quiet.event("saved", step=1)
    quiet.event("finished", step=1)
    assert not (tmp_path / "rank1").exists(), "only rank 0 writes"


# ---- an agent --------------------------------------------------------------------------------------------------
def test_an_agent_that_kills_a_hung_worker_writes_a_hang_event_to_the_run(tmp_path):
    from phalanx.control.agent.supervisor import Worker, WorkerSupervisor

    sup = WorkerSupervisor("workers-1", "t", hang_timeout_s=2.0, wake=lambda: None)
    sup.apply([Assignment(job="4", generation=2, cwd=str(tmp_path), checkpoint_dir="run/ckpt")])  # (a relative
    #                                                                   checkpoint_dir is the job's cwd's)
    now = time.monotonic()
    proc = subprocess.Popen(["sleep", "30"], process_group=0)
    w = Worker("4", 2, 1, 0, pid=proc.pid, started_at=time.time(), proc=proc, last_step=5, last_beat=9,
               last_change=now - 3.0, last_beat_change=now - 3.0)
    sup._judge_hang(w, now)
    assert proc.wait(5) == -signal.SIGKILL
    (e,) = read_events(tmp_path / "run" / "ckpt")
    assert (e.source, e.kind, e.job, e.node) == ("agent:workers-1", EventKind.HANG, "4", "workers-1")
    assert e.message == w.hang and e.fields == {"generation": 2, "rank": 1, "pid": proc.pid, "frozen": True}

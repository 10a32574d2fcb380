"""Following a run's files as the controller does (`observability.follow`): only appended bytes are read,
torn lines wait for their end, a run dir started again is read again from its start, the figures equal the
goodput ledger read from the whole files, and the series stays bounded. Pure and fast."""

from __future__ import annotations

import json

from phalanx.observability.follow import FileTail, Histogram, RunFollower, recovery_phases
from phalanx.observability.goodput import read_run
from phalanx.observability.run_events import JsonlSink
from tests.test_goodput import T0, ctl, ended, generation, r0, step, submitted


def write(path, *records, newline=True):
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + ("\n" if newline else ""))


def test_a_tail_reads_only_new_whole_lines_and_starts_over_on_a_new_file(tmp_path):
    path = tmp_path / "f.jsonl"
    tail = FileTail(path, max_bytes=16)
    assert tail.read() == []  # not there yet
    path.write_text('{"a": 1}\n{"b": ')
    assert tail.read() == ['{"a": 1}']
    assert tail.read() == []  # the torn line waits
    with open(path, "a") as f:
        f.write('2}\n{"c": 3}\n')
    got = tail.read() + tail.read() + tail.read()  # at most 16 bytes a read: a backlog takes several
    assert got == ['{"b": 2}', '{"c": 3}']
    path.unlink()
    path.write_text('{"d": 4}\n')  # the run started again in the same dir
    assert tail.read() == ['{"d": 4}'] and tail.restarted


def test_histogram_is_cumulative():
    h = Histogram.of((1.0, 2.0), [0.5, 1.5, 1.5, 3.0])
    assert h.cumulative() == [("1.0", 1), ("2.0", 3), ("+Inf", 4)] and h.total == 6.5 and h.count == 4


def run_files(tmp_path):
    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    run.mkdir()
    sink = JsonlSink(ckpt / "events.jsonl")
    return ckpt, run, sink


def test_the_follower_matches_the_ledger_of_the_whole_files_and_times_each_recovery(tmp_path):
    ckpt, run, sink = run_files(tmp_path)
    f = RunFollower("1", ckpt, run, derive_every_s=0.0)
    for e in [submitted(), *generation(1, 1), r0(5, "started", world_size=2)]:
        sink(e)
    write(run / "metrics.jsonl", *[step(n, 5 + n, tokens_per_s=100.0) for n in (1, 2, 3, 4)])
    f.poll()
    assert f.last["step"] == 4 and f.tokens == 400.0 and f.step_seconds.count == 4
    # a node fault at 9.5, known at 12; restart from the checkpoint at step 2: steps 3, 4 redone
    for e in [ctl(12, "job", "node fault", from_state="running", to_state="recovering"), *generation(14, 2),
              r0(18, "started", world_size=2), r0(20, "resumed", step=2, seconds=1.5)]:
        sink(e)
    write(run / "metrics.jsonl", *[step(n, 19 + n, d=1.0 if n > 3 else 2.0, tokens_per_s=100.0) for n in (3, 4, 5)])
    sink(ended(30))
    f.poll()
    d = f.derived()
    whole = read_run(ckpt, run, job="1")
    assert d.ledger.seconds == whole.seconds and d.ledger.wall == whole.wall == 30.0
    assert d.recoveries == [{"detect": 3.0, "regroup": 6.0, "restore": 1.5, "first_step": 2.0}]
    assert f.derived() is d  # an ended job's figures are not recomputed


def test_checkpointless_phases_come_from_rank_0s_recovery_events():
    events = [ctl(0, "generation"), ctl(10, "generation"),
              r0(12, "pg_rebuilt", seconds=0.25, all_arrived_after_fault_s=1.0),
              r0(12.5, "state_restored", source="peer-memory", seconds=0.5)]
    steps = [{"step": 7, "time": T0 + 13.0, "step_time_s": 0.75}]
    assert recovery_phases(events, steps, None) == [{"regroup": 1.25, "restore": 0.5, "first_step": 0.75}]


def test_a_resumed_restart_without_started_event_regroups_until_its_checkpoint_load_began():
    """A restarted generation that resumes writes `resumed` (with the load's seconds) and no `started`."""
    events = [ctl(0, "generation"), ctl(10, "job", "node fault", from_state="running", to_state="recovering"),
              ctl(11, "generation"), r0(16, "resumed", step=4, seconds=1.0)]
    steps = [{"step": 5, "time": T0 + 17.0, "step_time_s": 0.5}]
    assert recovery_phases(events, steps, None) == [{"regroup": 5.0, "restore": 1.0, "first_step": 0.5}]


def test_the_series_is_thinned_evenly_and_other_jobs_events_are_not_kept(tmp_path):
    ckpt, run, sink = run_files(tmp_path)
    f = RunFollower("2", ckpt, run, max_points=10)
    sink(submitted())  # job "1"'s (an earlier submission into the same dir)
    write(run / "metrics.jsonl", *[step(n, n) for n in range(1, 101)], {"time": T0, "event": "started"})
    f.poll()
    assert f.events == [] and len(f.steps) == 100
    assert 5 <= len(f.series) <= 10 and [p[0] for p in f.series] == sorted(p[0] for p in f.series)
    assert f.series[0][0] == 1

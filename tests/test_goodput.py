"""The goodput ledger on synthetic event streams (pure, fast): a fault-free run, a restart from a checkpoint
with steps redone, a checkpointless recovery with nothing redone, a job waiting for nodes, async checkpoint
saves, a run outside a cluster, torn and missing files. Every case checks that the categories sum to the wall
time. (Real runs: the assertions added to tests/test_train.py and tests/test_jobs.py.)"""

from __future__ import annotations

import json

import pytest

from phalanx.observability.events import Event, EventKind
from phalanx.observability.goodput import CATEGORIES, RunFilesMissing, compute, read_run
from phalanx.observability.run_events import JsonlSink

T0 = 1_795_500_000.0  # a realistic epoch: the sums must stay exact at this magnitude


def ctl(t: float, kind: str, message: str = "", **fields) -> Event:
    return Event(T0 + t, EventKind(kind), "controller", job="1", message=message, fields=fields)


def r0(t: float, kind: str, **fields) -> Event:
    return Event(T0 + t, EventKind(kind), "rank:0", job="1", fields=fields)


def step(n: int, end: float, d: float = 1.0, **extra) -> dict:
    return {"time": T0 + end, "step": n, "loss": 5.0, "step_time_s": d, "samples_consumed": 8 * n, **extra}


def submitted(t: float = 0.0) -> Event:
    return ctl(t, "job", "train job 'x' submitted", to_state="pending")


def generation(t: float, g: int) -> list[Event]:
    frm = "pending" if g == 1 else "recovering"
    return [ctl(t, "job", f"generation {g}", from_state=frm, to_state="running"), ctl(t, "generation", f"generation {g}")]


def ended(t: float, state: str = "succeeded") -> Event:
    return ctl(t, "job", "done", from_state="running", to_state=state)


def seconds(ledger) -> dict[str, float]:
    """The categories (rounded), after checking that they partition the wall time."""
    assert list(ledger.seconds) == list(CATEGORIES)
    assert abs(sum(ledger.seconds.values()) - ledger.wall) <= 1e-6
    assert all(s >= 0 for s in ledger.seconds.values())
    tiles = [b - a for a, b, _ in ledger.segments]
    assert ledger.segments[0][0] == ledger.submitted and ledger.segments[-1][1] == ledger.end
    assert all(a[1] == b[0] for a, b in zip(ledger.segments, ledger.segments[1:])) and min(tiles) >= 0
    return {c: round(s, 6) for c, s in ledger.seconds.items()}


def expect(**nonzero) -> dict[str, float]:
    return {c: float(nonzero.get(c, 0.0)) for c in CATEGORIES}


def test_a_fault_free_run():
    events = [submitted(), *generation(1, 1), r0(5, "started", world_size=2),
              r0(17.4, "checkpoint_saved", step=10, seconds=0.4), r0(17.5, "finished", step=10), ended(18)]
    steps = [step(1, 7, 2.0)] + [step(n, 7 + (n - 1) * 1.1) for n in range(2, 11)]
    ledger = compute(events, steps)
    # submit → the first step's normal part: initialization (its extra second of warm-up included)
    assert seconds(ledger) == expect(productive=10, initialization=6, checkpoint_save=0.4, idle=1.6)
    assert ledger.wall == 18 and ledger.goodput == pytest.approx(10 / 18)


def test_a_restart_from_a_checkpoint_makes_the_redone_steps_first_execution_replayed():
    events = [submitted(), *generation(1, 1), r0(2, "started"), r0(7.5, "checkpoint_saved", step=4, seconds=0.5),
              ctl(12.5, "job", "generation 1 stopping: node workers-1 faulty", from_state="running",
                  to_state="recovering"),
              ctl(12.7, "worker-exit", "rank 0 exited with code 1"), ctl(13, "recovery", "next: restart"),
              *generation(13.5, 2), r0(17, "resumed", step=4, samples_consumed=32, seconds=1.0),
              r0(24.5, "checkpoint_saved", step=10, seconds=0.5), r0(24.5, "finished", step=10), ended(25)]
    first = [step(1, 4, 2.0), step(2, 5), step(3, 6), step(4, 7)] + [step(n, 8.5 + n - 5) for n in range(5, 9)]
    second = [step(5, 19, 1.5)] + [step(n, 20 + n - 6) for n in range(6, 11)]
    ledger = compute(events, first + second)
    redone = sum(s["step_time_s"] for s in first if s["step"] > 4)  # steps 5-8 ran twice: the first time is replayed
    assert seconds(ledger) == expect(productive=10, replayed=redone, initialization=3, checkpoint_save=1.0,
                                     failure_detection=1.0,  # the last step (11.5) → the controller knew (12.5)
                                     recovery=4.5,  # 12.5 → the first step of generation 2, less the load
                                     checkpoint_restore=1.0, idle=0.5)
    assert redone == 4


def test_a_checkpointless_recovery_with_nothing_redone():
    # rank 0 writes its recovery events once the state is restored (t=14); the controller repeats them after
    fault = dict(at=T0 + 9.8, generation=1, step=6, what="peer gone", detected_by=3, failed_generations=1)
    told = [r0(14, "fault_detected", **fault), r0(14, "generation", generation=2, world_size=4),
            r0(14, "pg_rebuilt", generation=2, seconds=0.3), r0(14, "state_restored", source="peer-memory", step=6,
                                                                 bytes=1000, seconds=1.5),
            r0(14, "resumed", step=6, world_size=4, recovery="checkpointless", steps_lost=0)]
    echo = [ctl(14.2, k, "as rank 0 told") for k in ("fault_detected", "pg_rebuilt", "state_restored", "resumed")]
    events = [submitted(), *generation(1, 1), r0(2, "started"),
              ctl(10, "job", "generation 1: rank 1 lost", from_state="running", to_state="recovering"),
              ctl(10, "recovery", "survivors keep running"), *generation(11, 2), *told, *echo, ended(19)]
    # step 6 was completed by the survivors but logged by the new rank 0 after the fault: it ends at the fault
    steps = ([step(1, 4, 2.0)] + [step(n, 4 + n - 1) for n in range(2, 6)]
             + [step(6, 13.9, logged_after_fault=True), step(7, 15.5, 1.5)] + [step(n, 15.5 + n - 7) for n in (8, 9, 10)])
    ledger = compute(events, steps)
    assert seconds(ledger) == expect(productive=10, initialization=3,
                                     failure_detection=0.2,  # step 6 ended at the fault (9.8) → controller (10)
                                     recovery=4.5,  # 10 → step 7's normal part (14.5): regroup, peers' restore
                                     idle=1.3)  # 8 → 8.8 (before step 6), 18.5 → 19
    assert ledger.seconds["replayed"] == 0


def test_a_checkpointless_fallback_to_the_checkpoint_counts_the_load_as_checkpoint_restore():
    events = [submitted(), *generation(1, 1), ctl(6, "job", "lost", from_state="running", to_state="recovering"),
              *generation(7, 2), r0(9, "fault_detected", at=T0 + 5.5, step=4),
              r0(9, "state_restored", source="checkpoint", step=2, seconds=1.0, reason="both replicas lost"),
              r0(9, "resumed", step=2, recovery="checkpoint", steps_lost=2, seconds=0.9), ended(13)]
    steps = [step(n, 1 + n) for n in range(1, 5)] + [step(n, 7 + n) for n in range(3, 6)]
    s = seconds(compute(events, steps))
    assert s == expect(productive=5, replayed=2, initialization=1, failure_detection=1, recovery=2,
                       checkpoint_restore=1, idle=1)


def test_waiting_for_nodes_before_the_first_generation_and_after_a_fault():
    events = [submitted(), ctl(0.5, "waiting", "waiting for 2 free healthy nodes"), *generation(2, 1),
              r0(3, "started"), r0(7.5, "checkpoint_saved", step=3, seconds=0.5),
              ctl(8, "job", "generation 1 stopping", from_state="running", to_state="recovering"),
              ctl(8.5, "recovery", "next: restart"), ctl(8.6, "waiting", "waiting for 1 healthy node"),
              *generation(20, 2), r0(23, "resumed", step=3, seconds=1.0), ended(26.5)]
    steps = [step(1, 5, 2.0), step(2, 6), step(3, 7), step(4, 25, 2.0), step(5, 26)]
    assert seconds(compute(events, steps)) == expect(
        productive=5, initialization=2.5, waiting_for_nodes=12.9, checkpoint_save=0.5,
        failure_detection=0.5,  # the checkpoint saved at 7.5 was rank 0's last word before the controller's (8)
        recovery=3.6, checkpoint_restore=1.0, idle=0.5)


def test_a_generation_that_fails_while_starting_counts_no_failure_detection():
    # generation 2 dies before rank 0 says anything: when it failed is unknown; its time stays in recovery
    events = [submitted(), *generation(1, 1), r0(2, "started"),
              ctl(6, "job", "stopping", from_state="running", to_state="recovering"), *generation(7, 2),
              ctl(9, "job", "stopping again", from_state="running", to_state="recovering"), *generation(10, 3),
              r0(12, "resumed", step=2, seconds=1.0), ended(16.5)]
    steps = [step(1, 4, 2.0), step(2, 5), step(3, 14, 2.0), step(4, 15), step(5, 16)]
    assert seconds(compute(events, steps)) == expect(productive=5, initialization=3, failure_detection=1,
                                                     recovery=6, checkpoint_restore=1, idle=0.5)


def test_async_saves_count_only_the_time_they_blocked():
    events = [submitted(), *generation(1, 1), r0(2, "started"),
              r0(5.2, "checkpoint_started", step=2, seconds=0.2),
              r0(7.25, "checkpoint_saved", step=2, seconds=2.25, **{"async": True}),  # committed at the next save
              r0(7.4, "checkpoint_started", step=4, seconds=0.2),
              r0(9.0, "checkpoint_saved", step=4, seconds=1.8, **{"async": True}),  # waited for at the end
              r0(9.0, "finished", step=5), ended(9.5)]
    steps = [step(1, 4, 2.0), step(2, 5), step(3, 6.2), step(4, 7.2), step(5, 8.4)]
    assert seconds(compute(events, steps)) == expect(productive=5, initialization=3, checkpoint_save=1.0, idle=0.5)


def test_a_run_outside_a_cluster_spans_its_records_and_a_second_launch_initializes_again():
    events = [r0(2, "started"), r0(8, "finished", step=4), r0(20, "resumed", step=4, seconds=1.0),
              r0(26, "finished", step=6)]
    steps = [step(1, 4, 2.0), step(2, 5), step(3, 6), step(4, 7), step(5, 23, 2.0), step(6, 24)]
    ledger = compute(events, steps)
    assert ledger.submitted == T0 + 2 and ledger.end == T0 + 26
    assert seconds(ledger) == expect(productive=6, initialization=1 + 2, checkpoint_restore=1, idle=1 + 11 + 2)


def test_a_job_still_running_is_counted_up_to_the_end_given_and_nothing_after_it():
    events = [submitted(), *generation(1, 1), r0(2, "started")]
    steps = [step(1, 4, 2.0), step(2, 5), step(3, 6)]
    ledger = compute(events, steps, T0 + 5.5)
    assert seconds(ledger) == expect(productive=2.5, initialization=3)  # step 3 half inside
    assert seconds(compute([submitted()], [], T0 + 4)) == expect(initialization=4)


def test_a_run_dir_used_by_two_jobs_counts_only_the_jobs_own_events_and_steps():
    from dataclasses import replace

    first = [submitted(), *generation(1, 1), r0(2, "started"), ended(8)]
    second = [replace(e, job="2", time=e.time + 20) for e in first]
    steps = [step(1, 4, 2.0), step(2, 5), step(3, 6), step(1, 24, 2.0), step(2, 25), step(3, 26)]
    newest = compute(first + second, steps)  # the newest job by default: steps 1-3 again are not replays
    assert newest.submitted == T0 + 20 and seconds(newest) == expect(productive=3, initialization=3, idle=2)
    older = compute(first + second, steps, job="1")
    assert older.end == T0 + 8 and seconds(older) == expect(productive=3, initialization=3, idle=2)


def test_read_run_skips_torn_and_broken_lines_and_names_a_missing_file(tmp_path):
    ckpt, run = tmp_path / "checkpoints", tmp_path / "run"
    with pytest.raises(RunFilesMissing, match=str(ckpt / "events.jsonl")):
        read_run(ckpt, run)
    sink = JsonlSink(ckpt / "events.jsonl")
    for e in [submitted(), *generation(1, 1), r0(2, "started"), ended(8)]:
        sink(e)
    with pytest.raises(RunFilesMissing, match=str(run / "metrics.jsonl")):
        read_run(ckpt, run)
    with open(ckpt / "events.jsonl", "a") as f:
        f.write('{"time": 1795500003, "kind": "job", "sou')  # torn: a crash mid-write
    run.mkdir()
    lines = [json.dumps(step(1, 4, 2.0)), "{not json", json.dumps({"time": T0 + 2, "event": "started"}),
             json.dumps(step(2, 5)), json.dumps(step(3, 6)), json.dumps(step(4, 7))[:30]]  # broken inside, torn last
    (run / "metrics.jsonl").write_text("\n".join(lines))
    ledger = read_run(ckpt, run)
    assert seconds(ledger) == expect(productive=3, initialization=3, idle=2)
    assert seconds(read_run(ckpt, None)) == expect(initialization=8)  # a command job: no steps


# ---- the CLI, on a job described from synthetic run files (no cluster) ---------------------------------------
def test_job_goodput_and_describe_print_the_ledger_and_name_a_missing_file(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from phalanx.cli import app
    from phalanx.control.client import jobs as jobs_module

    ckpt, run = tmp_path / "ckpt", tmp_path / "run"
    for e in [submitted(), *generation(1, 1), r0(5, "started"), r0(17.4, "checkpoint_saved", step=10, seconds=0.4),
              ended(18)]:
        JsonlSink(ckpt / "events.jsonl")(e)
    run.mkdir()
    steps = [step(1, 7, 2.0)] + [step(n, 7 + (n - 1) * 1.1) for n in range(2, 11)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    info = {"id": "1", "name": "tiny", "kind": "train", "state": "succeeded", "reason": "done", "cwd": str(tmp_path),
            "checkpoint_dir": "ckpt", "config": {"run_dir": str(run)}, "ended_at": T0 + 18, "last_step": 10,
            "nodes_requested": 2, "workers_per_node": 1, "group_name": "workers", "auto_resume": False,
            "attempts": 1, "retries": 0, "max_retries": 0, "node_faults": 0, "created_at": T0, "argv": [],
            "log_dir": str(tmp_path / "logs"), "generations": [], "workers": [], "events": []}

    class FakeJobs(jobs_module.JobClient):
        def __init__(self, cluster=None):
            self.cluster = SimpleNamespace(name="c1", offline_since=None)

        def describe(self, job):
            if job not in ("1", "tiny"):
                raise jobs_module.JobError(f"no job {job!r} in cluster c1")
            return dict(info)

    monkeypatch.setattr(jobs_module, "JobClient", FakeJobs)
    runner = CliRunner()
    result = runner.invoke(app, ["job", "goodput", "tiny"])
    text = " ".join(result.output.split())
    assert result.exit_code == 0, result.output
    for category in CATEGORIES:
        assert category in text
    assert "│ productive │ 10.00 │ 55.6% │" in text and "goodput 55.6% (productive / wall); wall 18.00 s" in text, text
    result = runner.invoke(app, ["job", "goodput", "tiny", "--json"])
    figures = json.loads(result.output)
    assert figures["seconds"]["initialization"] == 6 and figures["wall_s"] == 18
    result = runner.invoke(app, ["job", "describe", "1", "--json"])
    assert json.loads(result.output)["goodput"]["goodput"] == pytest.approx(10 / 18, abs=1e-6)
    result = runner.invoke(app, ["job", "describe", "1"])
    assert "goodput: 55.6% (productive 10.0 s of 18.0 s wall; initialization 6.0 s" in " ".join(result.output.split())

    result = runner.invoke(app, ["job", "goodput", "7"])
    assert result.exit_code == 2 and "no job '7' in cluster c1" in result.output
    (run / "metrics.jsonl").unlink()
    result = runner.invoke(app, ["job", "goodput", "1"])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and str(run / "metrics.jsonl") in " ".join(result.output.split()), result.output
    assert len(lines) <= 2, result.output  # one line (rich may wrap a long path)
    result = runner.invoke(app, ["job", "describe", "1", "--json"])
    assert "metrics.jsonl: no such file" in json.loads(result.output)["goodput"]["error"]


def test_a_resize_is_its_own_category_and_the_step_in_flight_stays_productive():
    """An elastic resize at t=10.05 while step 11 is in flight: the survivors finish it (logged at 10.1), then
    regroup; rank 0's `resumed` at 10.6, the first step at the new size ends at 10.8 (normal step 0.1 s)."""
    from phalanx.observability.events import Event

    def ctl(t, kind, message, **fields):
        return Event(time=t, kind=kind, source="controller", job="1", message=message, fields=fields)

    def rank0(t, kind, **fields):
        return Event(time=t, kind=kind, source="rank:0", job="1", fields=fields)

    events = [ctl(0.0, "job", "submitted", to_state="pending"), ctl(0.0, "generation", "generation 1"),
              ctl(10.05, "resize", "resize 4 → 2 replicas (job scale request (2 replicas))"),
              ctl(10.05, "job", "resize 4 → 2 replicas", to_state="recovering"),
              ctl(10.06, "generation", "generation 2"),
              rank0(10.6, "resized", step=11), rank0(10.6, "resumed", step=11, recovery="checkpointless"),
              ctl(20.0, "job", "done", to_state="succeeded")]
    steps = [{"step": n, "time": n * 0.1 + 9.0, "step_time_s": 0.1} for n in range(1, 12)]
    steps += [{"step": 12 + i, "time": 10.8 + i * 0.1, "step_time_s": 0.1} for i in range(10)]
    ledger = compute(events, steps, job="1")
    assert ledger.seconds["resizing"] == pytest.approx(10.7 - 10.1)
    assert ledger.seconds["failure_detection"] == ledger.seconds["recovery"] == 0
    assert ledger.seconds["productive"] == pytest.approx(21 * 0.1)

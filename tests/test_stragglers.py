"""Stragglers: the pure rule (`control/policy/stragglers.py`) on made-up numbers; the scheduler's side of it
(`straggler_policy.py`) on a fake cluster and a fake clock (tests/fakes.py: the step times a worker publishes
are set in the fake rendezvous store); the worker's half of the seam (`ProgressReporter` writes the step's
compute seconds beside its step); and a real local cluster training a small job with one rank made slow by the
`straggle` drill (`PHALANX_DRILL`): `report` flags it and the job goes on, `replace-node` replaces its node
from the spare pool and the job recovers from its checkpoint.
"""

from __future__ import annotations

import json
import time

import pytest

from clusters import home, wait_for  # noqa: F401  (home is a fixture)
from conftest import tiny_config
from fakes import FakeCluster, FakeStore
from phalanx import protocol
from phalanx.control.client.cluster import ClusterClient, create_cluster
from phalanx.control.client.jobs import JobClient
from phalanx.control.policy.admission import JobRequestError
from phalanx.control.policy.stragglers import MIN_EXCESS_S, StragglerSettings, StragglerWatch, is_slow
from phalanx.observability.run_events import read_events
from phalanx.resilience.drill import ENV_VAR, DrillSpec

K2M3 = StragglerSettings(factor=2.0, steps=3)


# ---- the rule, pure -------------------------------------------------------------------------------------------
def feed(watch: StragglerWatch, step: int, times: list[float]) -> None:
    for rank, seconds in enumerate(times):
        watch.record(rank, step, seconds)


def test_a_rank_slower_than_k_times_the_median_for_m_reports_is_flagged_once():
    watch = StragglerWatch(4, K2M3)
    feed(watch, 1, [0.10, 0.11, 0.09, 0.35])
    feed(watch, 2, [0.10, 0.11, 0.09, 0.35])
    assert watch.take_new() == [] and watch.streak[3] == 2, "2 slow reports of 3"
    feed(watch, 3, [0.10, 0.11, 0.09, 0.36])
    (s,) = watch.take_new()
    assert (s.rank, s.step, s.seconds, s.median_s, s.reports) == (3, 3, 0.36, 0.10, 3)
    assert round(s.ratio, 1) == 3.6
    for step in range(4, 10):  # once per generation, however long it stays slow
        feed(watch, step, [0.10, 0.11, 0.09, 0.36])
    assert watch.take_new() == [] and set(watch.flagged) == {3}


def test_a_fast_report_restarts_the_count_and_a_reread_step_is_not_a_new_report():
    watch = StragglerWatch(3, K2M3)
    for step, slow in enumerate([0.5, 0.5, 0.1, 0.5, 0.5], start=1):
        feed(watch, step, [0.1, 0.1, slow])
    assert watch.take_new() == [] and watch.streak[2] == 2
    watch.record(2, 5, 0.5)  # the same step read at the next heartbeat
    assert watch.streak[2] == 2 and watch.take_new() == []
    watch.record(2, 6, 0.5)
    assert [s.rank for s in watch.take_new()] == [2]


def test_nothing_is_judged_before_every_rank_reported_and_tiny_steps_are_noise():
    watch = StragglerWatch(3, StragglerSettings(factor=2.0, steps=1))
    watch.record(0, 1, 0.001)
    watch.record(1, 1, 0.5)  # rank 2 has not reported: no baseline yet
    assert watch.take_new() == [] and not watch.streak
    assert is_slow(0.003, [0.001, 0.001], 2.0) == (False, 0.001), f"under MIN_EXCESS_S={MIN_EXCESS_S}"
    assert is_slow(0.03, [0.01, 0.011], 2.0)[0]


def test_with_two_ranks_the_slower_is_compared_with_the_other():
    """The median of both would be their mean, which neither can exceed twice over; the other rank is the
    baseline, so only the slower one of two can be flagged."""
    watch = StragglerWatch(2, StragglerSettings(factor=2.0, steps=2))
    feed(watch, 1, [0.1, 0.25])
    feed(watch, 2, [0.1, 0.25])
    assert [(s.rank, s.median_s) for s in watch.take_new()] == [(1, 0.1)]
    assert watch.streak[0] == 0


@pytest.mark.parametrize("kw, field", [({"factor": 1.0}, "straggler_factor"), ({"steps": 0}, "straggler_steps"),
                                       ({"policy": "restart"}, "straggler_policy")])
def test_settings_are_refused_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        StragglerSettings(**kw)
    assert StragglerSettings.of(None) == StragglerSettings(2.0, 5, "report")  # a job from before the settings


# ---- the worker's half of the seam ------------------------------------------------------------------------------
def test_step_times_are_a_sibling_key_that_readers_of_the_step_do_not_see():
    store = FakeStore()
    store.set(protocol.progress_key("7", 2, 1), "40")
    store.set(protocol.step_time_key("7", 2, 1), "40 0.250000")
    assert protocol.read_progress(store, "7", 2, [0, 1])[1] == {"step": 40, "beat": None}
    assert protocol.read_step_times(store, "7", 2, [0, 1]) == {1: (40, 0.25)}


def test_the_reporter_publishes_each_steps_seconds_beside_the_step_and_moves_them_with_switch():
    import torch.distributed as dist

    from phalanx.control.backends.local import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    reporter = protocol.ProgressReporter(f"127.0.0.1:{port}", "j", 1, 0, beat_s=0.1)
    try:
        reporter.report(4)  # the step a run starts from: no time
        assert reporter.flush(10) and protocol.read_step_times(server, "j", 1, [0]) == {}
        reporter.report(5, 0.125)
        assert reporter.flush(10) and protocol.read_step_times(server, "j", 1, [0]) == {0: (5, 0.125)}
        assert reporter.switch(2, 3, wait_s=10)  # a checkpointless survivor regrouped as rank 3
        reporter.report(6, 0.25)
        assert reporter.flush(10) and protocol.read_step_times(server, "j", 2, [3]) == {3: (6, 0.25)}
    finally:
        reporter.close()


# ---- the scheduler's side, on a fake cluster ---------------------------------------------------------------------
@pytest.fixture
def fake(tmp_path):
    made = []

    def make(**kw) -> FakeCluster:
        made.append(FakeCluster(tmp_path / f"cluster{len(made)}", **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def running(c: FakeCluster, job: str, ranks: int) -> dict[int, str]:
    """Wait until generation 1's ranks run and their agents reported them: rank → node."""
    def ready():
        rows = [w for w in c.jobs.records.workers(job=job, generation=1) if w.state == "running"]
        return {w.rank: w.node for w in rows} if len(rows) == ranks else None
    return c.run_until(ready, f"generation 1 of job {job} running")


def publish(c: FakeCluster, job: str, generation: int, step: int, times: list[float]) -> None:
    for rank, seconds in enumerate(times):
        c.report_step(job, generation, rank, step)
        c.rendezvous.set(protocol.step_time_key(job, generation, rank), f"{step} {seconds}")


def run_steps(c: FakeCluster, job: str, generation: int, times: list[float], steps: range) -> None:
    for step in steps:
        publish(c, job, generation, step, times)
        c.step()  # every agent heartbeats (the controller reads the times), the reconciler ticks


def test_report_policy_records_one_event_naming_the_rank_and_node_and_the_job_goes_on(fake):
    c = fake(count=3, spares=1).create()
    job = c.submit(nodes=3, straggler_factor=2.0, straggler_steps=3)
    node = running(c, job.id, 3)[1]
    run_steps(c, job.id, 1, [0.1, 0.4, 0.1], range(1, 9))
    (event,) = [e for e in c.events(job=job.id) if e["kind"] == "straggler"]
    assert event["node"] == node and f"rank 1 on {node} is a straggler in generation 1" in event["reason"]
    assert "0.400 s of compute per step vs its peers' median 0.100 s (4.0×" in event["reason"]
    assert "straggler_policy=report: reported only" in event["reason"]
    (flagged,) = c.jobs.stragglers(job.id)
    assert (flagged["rank"], flagged["node"], flagged["generation"], flagged["policy"]) == (1, node, 1, "report")
    assert c.job(job.id).state == "running" and len(c.generations(job.id)) == 1
    assert not [e for e in c.events() if e["to_state"] == "faulty"]


def test_replace_node_policy_treats_the_stragglers_node_as_faulty_and_the_job_recovers_on_the_spare(fake):
    c = fake(count=2, spares=1).create()
    job = c.submit(nodes=2, auto_resume=True, straggler_steps=2, straggler_policy="replace-node")
    nodes = running(c, job.id, 2)
    slow, fast = nodes[1], nodes[0]
    run_steps(c, job.id, 1, [0.1, 0.3], range(1, 4))
    c.run_until(lambda: len(c.generations(job.id)) == 2, "generation 2")
    g1, g2 = c.generations(job.id)
    assert g1.outcome == "node-fault" and "straggler: rank 1 of job" in g1.end_reason, g1.end_reason
    (faulty,) = [e for e in c.events(node=slow) if e["to_state"] == "faulty"]
    assert "(straggler_policy=replace-node)" in faulty["reason"]
    assert g2.nodes == [fast, "workers-2"], "the spare took the straggler's place"
    assert [s["rank"] for s in c.jobs.stragglers(job.id)] == [1]


def test_a_job_request_with_bad_straggler_settings_is_refused(fake):
    c = fake(count=2, spares=0).create()
    with pytest.raises(JobRequestError, match="straggler_policy='drain'"):
        c.submit(nodes=2, straggler_policy="drain")
    assert c.jobs.records.jobs() == []


# ---- a real cluster: one rank made slow by the straggle drill -------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("policy", ["report", "replace-node"])
def test_a_slow_rank_in_a_real_job_is_flagged_and_the_policy_applies(tmp_path, home, demo_data, policy):
    spec = tmp_path / "c1.json"
    spec.write_text(json.dumps({"name": "c1", "backend": "local", "instance_groups": [
        {"name": "workers", "instance_type": "local.cpu-1", "count": 2, "spares": 1, "warm_standby": False}],
        "health": {"heartbeat_timeout_s": 5.0, "hang_timeout_s": 60.0}}))
    create_cluster(spec, timeout_s=60)
    jobs, client = JobClient("c1"), ClusterClient("c1")
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, demo_data, training={"max_steps": 24, "log_interval": 8},
                         checkpoint={"interval": 5, "keep": 20}, pg_timeout_s=60)
    drill = DrillSpec(rank=1, step=2, at="forward", action="straggle", seconds=0.25)
    job = jobs.submit(config, nodes=2, auto_resume=True, env={ENV_VAR: drill.to_env()}, straggler_factor=2.0,
                      straggler_steps=3, straggler_policy=policy)
    started = time.monotonic()
    info = jobs.wait(job["id"], timeout_s=150)
    assert info["state"] == "succeeded" and info["last_step"] == 24, info["reason"]
    first = info["generations"][0]
    slow_node = next(w["node"] for w in info["workers"] if w["generation"] == 1 and w["rank"] == 1)
    (event,) = [e for e in info["events"] if e["kind"] == "straggler"]
    assert event["node"] == slow_node and f"rank 1 on {slow_node} is a straggler in generation 1" in event["reason"]
    assert f"straggler_policy={policy}" in event["reason"]
    # the run's events.jsonl has it with its numbers: the slow rank's compute against its peer's
    (streamed,) = [e for e in read_events(run_dir / "checkpoints") if e.kind.value == "straggler"]
    assert streamed.fields["rank"] == 1 and streamed.fields["seconds"] > 2 * streamed.fields["median_s"]
    # /metrics counts it, the dashboard's timeline marks it in generation 1
    import urllib.request
    request = urllib.request.Request(client.url() + "/metrics", headers={"Authorization": f"Bearer {client.token}"})
    scraped = urllib.request.urlopen(request, timeout=10).read().decode()
    assert f'phalanx_job_stragglers_total{{job="{job["id"]}"}} 1.0' in scraped
    marks = client.call("GET", f"/v1/jobs/{job['id']}/dashboard")["timeline"]["marks"]
    assert [(m["kind"], m["generation"]) for m in marks] == [("straggler", 1)]
    if policy == "report":
        assert info["attempts"] == 1 and not [e for e in client.events() if e["to_state"] == "faulty"]
    else:
        assert info["attempts"] == 2 and first["outcome"] == "node-fault", first
        assert "straggler" in first["end_reason"]
        assert info["generations"][1]["nodes"] == [first["nodes"][0], "workers-2"]
        assert not [e for e in info["events"] if e["kind"] == "straggler" and "generation 2" in e["reason"]]
    print(f"\nstraggler ({policy}): {streamed.fields['seconds']:.3f} s vs {streamed.fields['median_s']:.3f} s; "
          f"job done in {time.monotonic() - started:.1f} s")


def test_a_state_db_from_before_straggler_settings_gives_its_jobs_the_defaults(tmp_path):
    """A jobs table without `straggler_json` (an older Phalanx): opening the store adds it, NULL → defaults."""
    import sqlite3

    from phalanx.control.state.jobs import JobRecords
    from phalanx.control.state.schema import SCHEMA
    from phalanx.control.state.store import Store

    db = tmp_path / "state.db"
    old = SCHEMA.replace("    straggler_json TEXT,                      -- {\"factor\", \"steps\", \"policy\"} (NULL: the "
                         "defaults)\n", "")
    assert old != SCHEMA
    with sqlite3.connect(db) as conn:
        conn.executescript(old)
        conn.execute("INSERT INTO jobs (id, seq, name, state, kind, group_name, nodes_requested, workers_per_node, "
                     "argv_json, cwd, env_json, job_dir, checkpoint_dir, auto_resume, max_retries, created_at, "
                     "updated_at) VALUES ('1', 1, 'old', 'running', 'command', 'workers', 2, 1, '[]', '/', '{}', "
                     "'/j', '/j/c', 0, 0, 0, 0)")
    store = Store(db)
    try:
        job = JobRecords(store).job("1")
        assert job.straggler is None and StragglerSettings.of(job.straggler) == StragglerSettings()
    finally:
        store.close()


def test_a_ranks_peers_median_comes_from_the_sorted_times_as_statistics_median_gives_it():
    """`median_without` (each rank judged in O(log world) against its peers) is `statistics.median` of the others,
    bit for bit: odd and even peer counts, ties, the value at either end."""
    import random
    import statistics

    from phalanx.control.policy.stragglers import median_without

    rng = random.Random(7)
    for _ in range(2000):
        values = [rng.choice([0.1, 0.25, 0.5, 1.0, rng.random()]) for _ in range(rng.randint(2, 12))]
        for i, value in enumerate(values):
            assert median_without(sorted(values), value) == statistics.median(values[:i] + values[i + 1:])

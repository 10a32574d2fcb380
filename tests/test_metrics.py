"""The controller's /metrics collector (`control/server/metrics.py`) on a real state.db and real run files,
without processes: the names and values Prometheus sees, and that a scrape never reads the events table
(its cost must not grow with the cluster's history). Fast."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from phalanx.control.server.job_runs import JobRuns
from phalanx.control.server.metrics import ClusterCollector
from phalanx.control.spec import ClusterSpec
from phalanx.control.state.jobs import JobRecords, JobState, Outcome
from phalanx.control.state.store import NodeState, Store
from phalanx.observability.events import Event, EventKind as K

S = NodeState


def make_store(tmp_path) -> Store:
    spec = ClusterSpec.model_validate({"name": "c1", "instance_groups": [
        {"name": "workers", "instance_type": "local.cpu-1", "count": 2, "spares": 1}]})
    store = Store(tmp_path / "state.db")
    store.initialize(spec)
    return store


def add_train_job(store: Store, tmp_path, steps: int = 20) -> str:
    """A training job that ran `steps` steps (one checkpoint) in its first generation, and was restarted
    after a node fault into a second that is running."""
    records = JobRecords(store)
    run = tmp_path / "run"
    run.mkdir()
    job = records.add_job(name="tiny", kind="train", group="workers", nodes=2, workers_per_node=1, argv=[],
                          cwd=str(tmp_path), env={}, config={"run_dir": str(run)}, jobs_root=str(tmp_path / "jobs"),
                          checkpoint_dir=str(run / "checkpoints"), auto_resume=True, max_retries=0)
    records.transition(job.id, JobState.RUNNING, "generation 1 started")
    t0 = store.clock()
    with open(run / "metrics.jsonl", "w") as f:
        for i in range(1, steps + 1):
            f.write(json.dumps({"step": i, "time": t0 + i * 0.1, "loss": 5.0 - i * 0.1, "grad_norm": 1.5,
                                "lr": 1e-3, "tokens_per_s": 1000.0, "step_time_s": 0.1, "mfu": 0.25}) + "\n")
    (run / "checkpoints").mkdir(exist_ok=True)  # (the controller's job events are already there)
    with open(run / "checkpoints" / "events.jsonl", "a") as f:
        f.write(Event(t0 + 1.0, K.CHECKPOINT_SAVED, "rank:0", job=job.id, fields={"step": 10, "seconds": 0.3})
                .to_json() + "\n")
    for g in (1, 2):
        records.add_generation(job.id, g, ["workers-0", "workers-1"], "127.0.0.1", 29500 + g, None)
    records.update_generation(job.id, 1, outcome=Outcome.NODE_FAULT.value, ended_at=t0 + 3)
    records.update_job(job.id, generation=2)
    return job.id


def scrape(collector) -> dict[str, list]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return {f.name: f.samples for f in families}


def value(samples, metric: str, /, **labels) -> float:
    found = [s.value for s in samples if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (metric, labels, samples)
    return found[0]


def test_the_controllers_own_rendering_of_the_per_node_family_is_the_librarys_text(tmp_path):
    """The controller's /metrics renders `phalanx_node_heartbeat_age_seconds` itself (`heartbeat_ages`: one sample
    per node, prometheus_client's exposition was most of a 4,096-node scrape): the same text, with label values
    escaped as the text format wants."""
    from phalanx.control.server.metrics import AGE, _escape

    store = make_store(tmp_path)
    for spare in (False, False, True, False):
        store.add_node("workers", is_spare=spare, work_root=tmp_path, reason="test")
    for i, ago in enumerate((2.0, 0.1, 7.25)):
        store.update_node(f"workers-{i}", last_heartbeat=1000.0 - ago)  # workers-3 never heard: not shown
    store.transition("workers-1", S.FAULTY, "test")
    clock = lambda: 1000.0  # noqa: E731
    library = generate_latest(registry_of(ClusterCollector(store, JobRuns(), clock=clock))).decode()
    ours = ClusterCollector(store, JobRuns(), render_ages=True, clock=clock)
    library_block = library[library.index(f"# HELP {AGE} "):]
    library_block = library_block[:library_block.index("# HELP", 1)]
    assert ours.heartbeat_ages().decode() == library_block, (ours.heartbeat_ages(), library_block)
    assert AGE not in generate_latest(registry_of(ours)).decode(), "left to heartbeat_ages(): not twice"
    assert len(library_block.splitlines()) == 2 + 3
    tricky = 'a"b\\c\nd'
    (family,) = text_string_to_metric_families(f'{AGE}{{node="{_escape(tricky)}"}} 1.0\n')
    assert family.samples[0].labels["node"] == tricky


def registry_of(collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def test_metrics_follow_prometheus_naming_and_count_what_happened(tmp_path):
    store = make_store(tmp_path)
    for name, spare in (("workers", False), ("workers", False), ("workers", True)):
        store.add_node(name, is_spare=spare, work_root=tmp_path, reason="test")
    store.update_node("workers-0", last_heartbeat=store.clock() - 2.0)
    store.update_node("workers-1", last_heartbeat=store.clock())
    store.transition("workers-1", S.FAULTY, "health check failed", fault_cause="health-check")
    store.count("health_check_failures", "gpu.xid")
    store.count("node_faults", "health-check")
    store.count("node_replacements", "health-check")
    job = add_train_job(store, tmp_path)

    m = scrape(ClusterCollector(store, JobRuns(derive_every_s=0.0)))
    assert value(m["phalanx_nodes"], "phalanx_nodes", group="workers", state="provisioning", role="member") == 1
    assert value(m["phalanx_nodes"], "phalanx_nodes", state="faulty", role="member") == 1
    assert value(m["phalanx_nodes"], "phalanx_nodes", state="provisioning", role="spare") == 1
    age = value(m["phalanx_node_heartbeat_age_seconds"], "phalanx_node_heartbeat_age_seconds", node="workers-0")
    assert 1.5 < age < 60
    assert value(m["phalanx_health_check_failures"], "phalanx_health_check_failures_total", check="gpu.xid") == 1
    assert value(m["phalanx_node_faults"], "phalanx_node_faults_total", cause="health-check") == 1
    assert value(m["phalanx_node_replacements"], "phalanx_node_replacements_total", reason="health-check") == 1
    assert value(m["phalanx_jobs"], "phalanx_jobs", state="running") == 1
    assert value(m["phalanx_jobs"], "phalanx_jobs", state="failed") == 0

    assert value(m["phalanx_job_step"], "phalanx_job_step", job=job) == 20
    assert value(m["phalanx_job_loss"], "phalanx_job_loss", job=job) == pytest.approx(3.0)
    assert value(m["phalanx_job_grad_norm"], "phalanx_job_grad_norm", job=job) == 1.5
    assert value(m["phalanx_job_tokens_per_second"], "phalanx_job_tokens_per_second", job=job) == 1000
    assert value(m["phalanx_job_mfu_ratio"], "phalanx_job_mfu_ratio", job=job) == 0.25
    assert value(m["phalanx_job_tokens"], "phalanx_job_tokens_total", job=job) == pytest.approx(20 * 100)
    assert value(m["phalanx_job_last_step_timestamp_seconds"], "phalanx_job_last_step_timestamp_seconds",
                 job=job) > 1e9
    steps = m["phalanx_job_step_duration_seconds"]
    assert value(steps, "phalanx_job_step_duration_seconds_count", job=job) == 20
    assert value(steps, "phalanx_job_step_duration_seconds_bucket", job=job, le="+Inf") == 20
    saves = m["phalanx_job_checkpoint_save_seconds"]
    assert value(saves, "phalanx_job_checkpoint_save_seconds_sum", job=job) == pytest.approx(0.3)
    assert value(m["phalanx_job_restarts"], "phalanx_job_restarts_total", job=job, cause="node-fault") == 1
    assert value(m["phalanx_job_restarts"], "phalanx_job_restarts_total", job=job, cause="app-error") == 0
    phases = {s.labels["phase"] for s in m["phalanx_job_recovery_phase_seconds"]}
    assert phases == {"detect", "regroup", "restore", "first_step"}
    goodput = {s.labels["category"]: s.value for s in m["phalanx_job_goodput_seconds"]}
    assert goodput["productive"] > 0 and "idle" in goodput
    assert 0 < value(m["phalanx_job_goodput_ratio"], "phalanx_job_goodput_ratio", job=job) <= 1
    assert value(m["phalanx_job_info"], "phalanx_job_info", job=job, name="tiny", kind="train") == 1


def test_a_scrape_never_reads_the_events_table(tmp_path):
    """However long the cluster's history, a scrape reads only aggregates, counters and the jobs shown."""
    store = make_store(tmp_path)
    store.add_node("workers", is_spare=False, work_root=tmp_path, reason="test")
    add_train_job(store, tmp_path)
    with store.transaction():
        for i in range(2000):
            store.insert_event(Event(float(i), K.TRANSITION, "controller", node="workers-0", message="x",
                                     fields={"from_state": "healthy", "to_state": "faulty"}))
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    calls = []
    store.events = lambda *a, **kw: calls.append(a) or []  # noqa: E731 (a scrape must not call it)
    collector = ClusterCollector(store, JobRuns())
    scrape(collector)
    store._db.set_trace_callback(None)
    assert statements and not calls
    assert not [s for s in statements if "events" in s.lower()], statements


def test_a_state_db_from_before_the_metrics_gets_its_counters_table_and_fault_cause(tmp_path):
    import re
    import sqlite3

    from phalanx.control.state.schema import SCHEMA

    old = re.sub(r"\n\s*fault_cause TEXT[^\n]*", "", SCHEMA.replace("acked_at REAL,", "acked_at REAL"))
    old = old[:old.index("CREATE TABLE IF NOT EXISTS counters")] + old[old.index("CREATE INDEX IF NOT EXISTS events_node"):]
    assert "fault_cause" not in old and "counters" not in old
    with sqlite3.connect(tmp_path / "state.db") as conn:
        conn.executescript(old)
        conn.execute("INSERT INTO groups (name, instance_type, count, spares) VALUES ('workers', 'local.cpu-1', 1, 0)")
        conn.execute("INSERT INTO nodes (name, group_name, state, is_spare, work_dir, created_at, state_since) "
                     "VALUES ('workers-0', 'workers', 'healthy', 0, '/w', 0, 0)")
    store = Store(tmp_path / "state.db")
    try:
        assert store.node("workers-0").fault_cause is None and store.counters("node_faults") == {}
        store.transition("workers-0", S.FAULTY, "no heartbeat", fault_cause="heartbeat-timeout")
        store.count("node_faults", "heartbeat-timeout")
        assert store.node("workers-0").fault_cause == "heartbeat-timeout"
        assert store.counters("node_faults") == {"heartbeat-timeout": 1}
    finally:
        store.close()

"""`phalanx demo` end to end (a real local cluster, a real node kill) and the failure-cost arithmetic it prints."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from clusters import home  # noqa: F401  (fixture: private PHALANX_HOME, fails on leftover processes)
from phalanx.control.state.paths import list_clusters
from phalanx.train.timeline import attempts, recovery_figures


def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_recovery_figures_from_a_restarted_run(tmp_path):
    # steps 1-7 one second apart, killed at t=7.4, resumed from the checkpoint at step 4; the new attempt logs
    # step 5 at t=12 and gets past the old last step (7) at t=15
    records = [{"time": float(t), "step": t, "loss": 1.0} for t in range(1, 8)]
    records += [{"time": 2.0, "event": "checkpoint_saved", "step": 2}, {"time": 4.0, "event": "checkpoint_saved", "step": 4}]
    records += [{"time": 11.0, "event": "resumed", "step": 4}]
    records += [{"time": 12.0 + i, "step": 5 + i, "loss": 1.0} for i in range(6)]
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, records)

    runs = attempts(path)
    assert [r.resumed_step for r in runs] == [None, 4] and [len(r.steps) for r in runs] == [7, 6]
    f = recovery_figures(path, killed_at=7.4)
    assert (f.last_step, f.resumed_step, f.steps_lost) == (7, 4, 3)
    assert f.normal_step_s == 1.0
    assert f.first_step_after_s == pytest.approx(12.0 - 7.4)
    assert f.downtime_s == pytest.approx(15.0 - 7.0 - 1.0)  # step 8 done at t=15 instead of t=8


def test_recovery_figures_refuse_a_run_that_did_not_recover(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, [{"time": float(t), "step": t} for t in range(1, 6)])
    with pytest.raises(ValueError, match="no `resumed` event"):
        recovery_figures(path, killed_at=3.0)
    write_metrics(path, [{"time": float(t), "step": t} for t in range(1, 6)] + [{"time": 9.0, "event": "resumed", "step": 4},
                                                                             {"time": 10.0, "step": 5}])
    with pytest.raises(ValueError, match="never got past step 5"):
        recovery_figures(path, killed_at=5.5)


@pytest.mark.slow
def test_demo_kills_a_node_halfway_and_the_job_recovers_on_the_spare(tmp_path, home, demo_data):  # noqa: F811
    from phalanx.demo import run_demo

    console = Console(record=True, width=120)
    overrides = [f"data.path={demo_data}", "model.overrides.vocab_size=512", "model.overrides.n_layers=2",
                 "training.global_batch_size=8", "training.micro_batch_size=2", "training.max_steps=40",
                 "training.log_interval=10", "checkpoint.interval=5", "lr_schedule.warmup_steps=2"]
    # run_dir/home is the `home` fixture's PHALANX_HOME, so its teardown checks nothing was left running
    summary = run_demo("recipes/tiny-llama.yaml", tmp_path, nodes=2, overrides=overrides, console=console)

    assert summary["state"] == "succeeded" and summary["steps"] == 40 and summary["generations"] == 2
    assert summary["failed_node"] == "workers-1" and summary["nodes_replaced"] == ["workers-1 → workers-2"]
    assert summary["spare_pool"] == ["workers-3"], "the spare pool was refilled"
    # checkpointless by default: no checkpoint involved, the state came from the buddy's snapshot (FSDP recipe)
    assert summary["last_step"] >= 20 and summary["restored_from"] == "buddy-snapshot", summary
    assert summary["steps_lost"] == summary["last_step"] - summary["resumed_step"] and 0 <= summary["steps_lost"] <= 2
    assert 0 <= summary["fault_detected_s"] <= summary["restarted_s"] <= summary["first_step_after_s"]
    assert summary["survivor_stall_s"] == pytest.approx(summary["first_step_after_s"] - summary["normal_step_s"],
                                                        abs=1e-3)
    assert summary["rejoin_s"] > 0 and summary["restored_bytes"] > 0
    out = console.export_text()
    assert "what the failure cost" in out and "workers-1 → workers-2" in out and "deleting the cluster" in out
    assert "survivor stall" in out and "replacement rejoin" in out and "steps lost" in out
    assert list_clusters() == [], "the demo deletes its cluster"


@pytest.mark.slow
def test_elastic_demo_grows_shrinks_on_a_fault_and_for_priority_and_grows_back(tmp_path, home, demo_data):  # noqa: F811
    from phalanx.demo_elastic import run_elastic_demo

    console = Console(record=True, width=160)
    overrides = [f"data.path={demo_data}", "model.overrides.vocab_size=512", "model.overrides.n_layers=2",
                 "training.global_batch_size=8", "training.micro_batch_size=2", "training.log_interval=10",
                 "lr_schedule.warmup_steps=2"]
    rows = run_elastic_demo("recipes/tiny-llama.yaml", tmp_path, nodes=4, overrides=overrides, console=console)

    changes = [(r["from"], r["to"], r["cause"]) for r in rows]
    assert changes == [(3, 4, "resized"), (4, 3, "node-fault"), (3, 4, "resized"), (4, 2, "resized"),
                       (2, 4, "resized")], changes
    assert all(r["steps_lost"] == 0 and r["state_from"] == "peer-memory" for r in rows), rows
    assert "preempted by job 2" in rows[3]["why"] and "idle healthy node" in rows[0]["why"]
    out = console.export_text()
    assert "every change in place" in out and "cluster scale workers --count 4" in out
    assert list_clusters() == [], "the demo deletes its cluster"

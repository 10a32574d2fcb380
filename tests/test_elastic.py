"""Elastic training on a local cluster, with real processes: a job resized in place by `job scale` (4 → 2 → 3 →
4 replicas, 3 splitting the global batch unevenly) keeps its global batch and its data order and matches the
fixed-size run's loss at every step and its final parameters within 1e-5 (CPU, fp32); a node failure with no
spare shrinks the job in place and it grows back onto the replacement; a higher-priority job takes nodes from
it and gives them back when it ends. No checkpoint is read on any of these changes.

The fixed-size reference is the same config trained by `phalanx train --nproc 4` (4 replicas).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from clusters import home, story, wait_for  # noqa: F401  (home is a fixture)
from conftest import run_training, tiny_config
from phalanx.control.client.cluster import create_cluster
from phalanx.control.client.jobs import JobClient
from test_jobs import cli, flat, sleeper, step_at_least, write_config, write_spec

pytestmark = pytest.mark.slow

STEPS = 40
GLOBAL_BATCH = 12  # over 4 replicas 3 each, over 3: 4 each, over 2: 6 each — micro-batches of at most 2


def elastic_config(run_dir: Path, data: Path, max_steps: int = STEPS, dp_shard: int = 1, **elastic):
    return tiny_config(run_dir, data, parallel={"dp_shard": dp_shard},
                       elastic={"min_replicas": 1, "max_replicas": 4, "stable_period_s": 0, "scale_up_delay_s": 0,
                                **elastic},
                       resilience={"recovery": "checkpointless", "regroup_timeout_s": 60.0,
                                   "recovery_timeout_s": 120.0},
                       training={"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2, "max_steps": max_steps,
                                 "log_interval": 8},
                       lr_schedule={"warmup_steps": 3, "total_steps": STEPS},
                       checkpoint={"interval": 20, "keep": 5})


def records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "event" not in r], [r for r in lines if "event" in r]


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model tensors of the run's last checkpoint, read back into one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    last = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    out = run_dir / "final.pt"
    dcp_to_torch_save(last, out)
    state = torch.load(out, weights_only=False)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", state["model_optim"])  # the parameters and AdamW's moments (not the RNG states, which are per rank)
    return flat


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_data) -> tuple[dict[int, float], Path]:
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    steps = run_training(elastic_config(run_dir, demo_data, max_replicas=4, min_replicas=4), 4)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    return {s["step"]: s["loss"] for s in steps}, run_dir


def test_job_scale_resizes_in_place_keeping_batch_order_and_loss(tmp_path, home, demo_data, reference):
    ref_loss, ref_dir = reference
    create_cluster(write_spec(tmp_path, count=4, spares=0), timeout_s=90)
    jobs = JobClient("c1")
    run_dir = tmp_path / "run"
    job = jobs.submit(write_config(tmp_path / "el.yaml", elastic_config(run_dir, demo_data)), name="el")
    assert job["recovery"] == "checkpointless" and job["elastic"]["valid"] == [1, 2, 3, 4]
    info = step_at_least(jobs, "el", 6)
    assert info["replicas"] == 4, "an elastic job starts with every free node up to max_replicas"
    for replicas, at in ((2, 14), (3, 24), (4, 32)):
        jobs.scale("el", replicas)
        wait_for(lambda: (i := jobs.describe("el"))["replicas"] == replicas and i["state"] == "running", 60,
                 f"the job to run {replicas} replicas")
        step_at_least(jobs, "el", at, timeout=120)
    info = jobs.wait("el", timeout_s=180)
    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    code, out = cli("job", "describe", "el")  # the history of sizes
    assert code == 0 and "elastic: 1-4 replicas (valid [1, 2, 3, 4])" in flat(out), out
    assert all(f"{r} replicas" in out for r in (2, 3, 4)) and "resized" in out
    code, out = cli("job", "scale", "el", "--replicas", 2)  # a finished job is not resized
    assert code == 2 and "already succeeded" in flat(out), out

    gens = info["generations"]
    assert [len(g["nodes"]) for g in gens] == [4, 2, 3, 4], story(info)
    assert [g["outcome"] for g in gens] == ["resized", "resized", "resized", "succeeded"], story(info)
    # survivors kept their processes: the first two ranks run in one process each from start to end
    pids = {(w["generation"], w["rank"]): w["pid"] for w in info["workers"]}
    assert all(pids[(g, r)] == pids[(1, r)] for g in (2, 3, 4) for r in (0, 1))
    kinds = [e["kind"] for e in info["events"]]
    assert kinds.count("resize") >= 6, kinds  # 3 requests + 3 changes, each with its reason

    steps, events = records(run_dir)
    # every step once, in order: no step redone, none skipped; the position is one integer
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert [s["samples_consumed"] for s in steps] == [GLOBAL_BATCH * s for s in range(1, STEPS + 1)]
    worst = max(abs(s["loss"] - ref_loss[s["step"]]) for s in steps)
    assert worst <= 1e-5, f"loss differs from the fixed-size run by up to {worst}"
    resized = [e for e in events if e["event"] == "resized"]
    assert [(e["from_world_size"], e["world_size"]) for e in resized] == [(4, 2), (2, 3), (3, 4)]
    assert not [e for e in events if e["event"] == "fault_detected"], "a resize is not a fault"
    restored = [e for e in events if e["event"] == "state_restored"]
    assert len(restored) == 3 and all(e["source"] == "peer-memory" for e in restored), restored
    assert all(e["steps_lost"] == 0 for e in events if e["event"] == "resumed")
    assert not [e for e in events if e["event"] == "resumed" and e.get("recovery") == "checkpoint"]

    ledger = jobs.goodput("el")  # the resizes' stalls are their own category, not a fault's detection or recovery
    assert ledger.seconds["resizing"] > 0 and ledger.seconds["failure_detection"] == ledger.seconds["recovery"] == 0

    mine, theirs = final_params(run_dir), final_params(ref_dir)
    assert mine.keys() == theirs.keys() and mine
    worst = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    assert worst <= 1e-5, f"final parameters differ from the fixed-size run's by up to {worst}"


def test_fault_without_spare_shrinks_then_grows_and_priority_takes_nodes(tmp_path, home, demo_data):
    create_cluster(write_spec(tmp_path, count=4, spares=0), timeout_s=90)
    jobs = JobClient("c1")
    from phalanx.control.client.cluster import ClusterClient

    client = ClusterClient("c1")
    code, out = cli("job", "submit", write_config(tmp_path / "bad.yaml", elastic_config(tmp_path, demo_data)),
                    "--nodes", 2)
    assert code == 2 and "--nodes with an elastic config" in flat(out), out
    code, out = cli("job", "submit", write_config(tmp_path / "bad.yaml", elastic_config(tmp_path, demo_data)),
                    "--max-replicas", 20, "training.global_batch_size=6")
    assert code == 2 and "cannot hold training.global_batch_size=6" in flat(out), out
    assert "sizes that can: [1, 2, 3, 4, 5, 6]" in flat(out), out
    run_dir = tmp_path / "run"
    job = jobs.submit(write_config(tmp_path / "el.yaml", elastic_config(run_dir, demo_data, max_steps=400,
                                                                        max_replicas=5)), name="el")
    assert any("max_replicas=5 needs 5 nodes; group workers has 4" in w for w in job["warnings"]), job["warnings"]
    step_at_least(jobs, "el", 4)
    victim = jobs.describe("el")["nodes"][3]
    client.inject_fault(victim, "kill-node")
    # no spare: the job goes on with 3 replicas at once, then grows back onto the freshly provisioned node (a forked
    # agent can be up in a few tenths of a second: the 3-replica generation is read from the history, not polled)
    grown = wait_for(lambda: (i := jobs.describe("el"))["replicas"] == 4 and i["state"] == "running"
                     and victim not in i["nodes"] and i, 90, "the job to shrink, then grow back to 4 replicas")
    gens = grown["generations"]
    sizes = [len(g["nodes"]) for g in gens]
    assert sizes[:2] == [4, 3] and sizes[-1] == 4, story(grown)
    assert victim in gens[0]["nodes"] and not [g for g in gens[1:] if victim in g["nodes"]], story(grown)
    # a higher-priority job takes two nodes; the elastic job gives them and takes them back when it ends
    step = jobs.describe("el")["last_step"]
    jobs.submit(command=sleeper(6), nodes=2, name="urgent", priority=10)
    wait_for(lambda: jobs.describe("urgent")["state"] == "running", 60, "the urgent job to start")
    assert jobs.describe("el")["replicas"] == 2
    assert jobs.wait("urgent", timeout_s=60)["state"] == "succeeded"
    wait_for(lambda: jobs.describe("el")["replicas"] == 4, 60, "the elastic job to grow back")
    step_at_least(jobs, "el", step + 4)
    jobs.cancel("el")
    info = jobs.wait("el", timeout_s=60)
    outcomes = [g["outcome"] for g in info["generations"]]
    assert outcomes[:1] == ["node-fault"] and outcomes.count("resized") >= 3, story(info)
    steps, events = records(run_dir)
    assert not [e for e in events if e["event"] == "resumed" and e.get("recovery") == "checkpoint"]
    assert all(e["steps_lost"] == 0 for e in events if e["event"] == "resumed")


def test_sharded_replicas_of_two_nodes_resize_in_place(tmp_path, home, demo_data):
    """A replica sharded over 2 nodes (dp_shard 2, FSDP inside, HSDP across replicas): 2 → 1 → 2 replicas; the
    joining replica's two ranks each take their own shard from the survivor with the same coordinates."""
    ref = run_training(elastic_config(tmp_path / "ref", demo_data, max_steps=24, dp_shard=2, min_replicas=2,
                                      max_replicas=2), 4)
    ref_loss = {s["step"]: s["loss"] for s in ref}
    create_cluster(write_spec(tmp_path, count=4, spares=0), timeout_s=90)
    jobs = JobClient("c1")
    run_dir = tmp_path / "run"
    config = elastic_config(run_dir, demo_data, max_steps=24, dp_shard=2, max_replicas=2)
    job = jobs.submit(write_config(tmp_path / "el.yaml", config), name="el")
    assert job["elastic"]["nodes_per_replica"] == 2 and job["elastic"]["ranks_per_replica"] == 2
    step_at_least(jobs, "el", 6)
    for replicas, at in ((1, 12), (2, 18)):
        jobs.scale("el", replicas)
        wait_for(lambda: (i := jobs.describe("el"))["replicas"] == replicas and i["state"] == "running", 60,
                 f"the job to run {replicas} replica(s)")
        step_at_least(jobs, "el", at, timeout=120)
    info = jobs.wait("el", timeout_s=180)
    assert info["state"] == "succeeded" and [len(g["nodes"]) for g in info["generations"]] == [4, 2, 4], story(info)
    steps, events = records(run_dir)
    assert [s["step"] for s in steps] == list(range(1, 25))
    worst = max(abs(s["loss"] - ref_loss[s["step"]]) for s in steps)
    assert worst <= 1e-5, f"loss differs from the fixed-size run by up to {worst}"
    restored = [e for e in events if e["event"] == "state_restored"]
    assert [e["source"] for e in restored] == ["peer-memory"] * 2 and restored[1]["transfers"] == 2, restored


def test_scale_batch_resize_follows_the_replica_count_with_the_learning_rate(tmp_path, home, demo_data):
    """elastic.scale_batch: 4 → 2 replicas halves the global batch (12 → 6 samples a step, still the next samples
    in order) and, with lr_scaling linear, the peak learning rate; the schedule goes on from the same step."""
    from phalanx.train.optim import lr_factor

    create_cluster(write_spec(tmp_path, count=4, spares=0), timeout_s=90)
    jobs = JobClient("c1")
    run_dir = tmp_path / "run"
    config = elastic_config(run_dir, demo_data, max_steps=24, scale_batch=True, lr_scaling="linear")
    jobs.submit(write_config(tmp_path / "el.yaml", config), name="el")
    step_at_least(jobs, "el", 8)
    jobs.scale("el", 2)
    info = jobs.wait("el", timeout_s=180)
    assert info["state"] == "succeeded" and [len(g["nodes"]) for g in info["generations"]] == [4, 2], story(info)
    steps, events = records(run_dir)
    (resized,) = [e for e in events if e["event"] == "resized"]
    assert resized["global_batch_size"] == 6 and resized["peak_lr"] == pytest.approx(config.optimizer.lr / 2)
    switch = resized["step"]  # the last step at 4 replicas
    assert [s["step"] for s in steps] == list(range(1, 25))
    consumed = [0] + [s["samples_consumed"] for s in steps]
    assert [b - a for a, b in zip(consumed, consumed[1:])] == [12] * switch + [6] * (24 - switch)
    schedule = config.lr_schedule
    for s in steps:
        planned = config.optimizer.lr * lr_factor(s["step"] - 1, warmup_steps=schedule.warmup_steps,
                                                  decay_steps=config.decay_steps, min_lr_ratio=schedule.min_lr_ratio)
        assert s["lr"] == pytest.approx(planned * (1.0 if s["step"] <= switch else 0.5), rel=1e-9), s
    assert "global batch 12 → 6 (scale_batch)" in " ".join(e["reason"] for e in info["events"])

"""Checkpointless recovery on a local cluster, with real processes: survivors keep their processes and their
state, the replacement restores from a peer's memory (the other HSDP replica, or a buddy snapshot without
replicas), and training continues with the same loss at every step as a run without failures (CPU, fp32:
bit-exact). Faults land at different moments — a killed node, and a worker killing itself inside forward,
inside backward, after its optimizer update, as a checkpoint starts, and during the regroup after a first
fault; a collective broken by the network (nobody dies) regroups every process — and when both replicas of a
shard are lost the job falls back to the disk checkpoint and says so.

The failure-free reference is the same config trained by `phalanx train --nproc 4` (same ranks, same gloo).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from clusters import generations, home, wait_for  # noqa: F401  (home is a fixture)
from conftest import run_training, tiny_config
from phalanx import protocol
from phalanx.control.client.cluster import ClusterClient, create_cluster
from phalanx.control.client.jobs import JobClient
from phalanx.demo import spare_standby_warm
from test_jobs import step_at_least, write_config, write_spec
from test_tensorboard import scalars

pytestmark = pytest.mark.slow

STEPS = 48
HSDP = {"dp_replicate": 2, "dp_shard": 2}
FSDP = {"dp_replicate": 1, "dp_shard": 4}


def config_for(run_dir: Path, data: Path, parallel: dict, drill: dict | None = None, max_steps: int = STEPS,
               **top):
    """The reference's config; `max_steps` past STEPS trains on (the schedule still ends at STEPS), so a fault
    that takes longer to detect still lands mid-run while the first STEPS steps stay comparable."""
    resilience = {"recovery": "checkpointless", "regroup_timeout_s": 60.0, "recovery_timeout_s": 120.0}
    if drill is not None:
        resilience["drill"] = drill
    return tiny_config(run_dir, data, parallel=parallel, resilience=resilience, **top,
                       training={"max_steps": max_steps, "log_interval": 8},
                       lr_schedule={"warmup_steps": 3, "total_steps": STEPS},
                       checkpoint={"interval": 10, "keep": 10})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_data) -> dict[str, dict[int, float]]:
    """Loss per step of the failure-free runs (HSDP 2×2 and FSDP 4), trained by `phalanx train --nproc 4`."""
    out = {}
    for name, parallel in (("hsdp", HSDP), ("fsdp", FSDP)):
        steps = run_training(config_for(tmp_path_factory.mktemp(f"ref-{name}"), demo_data, parallel), 4)
        out[name] = {s["step"]: s["loss"] for s in steps}
        assert sorted(out[name]) == list(range(1, STEPS + 1))
    return out


def records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """Every step record (a step redone after a rollback appears again) and every event of metrics.jsonl."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "event" not in r], [r for r in lines if "event" in r]


def assert_same_losses(run_dir: Path, reference: dict[int, float], where: str = "") -> list[dict]:
    steps, events = records(run_dir)
    missing = set(reference) - {s["step"] for s in steps}
    assert not missing, f"{where}: steps never logged: {sorted(missing)}"
    diverged = [(s["step"], s["loss"], reference[s["step"]]) for s in steps
                if s["step"] in reference and s["loss"] != reference[s["step"]]]
    assert not diverged, f"{where}: loss differs from the failure-free run at (step, loss, reference): {diverged[:5]}"
    return events


def submit(jobs: JobClient, tmp_path: Path, config, name: str, nodes: int = 4) -> dict:
    job = jobs.submit(write_config(tmp_path / f"{name}.yaml", config), nodes=nodes, auto_resume=True, name=name)
    assert job["recovery"] == "checkpointless"
    return job


def pids_by_rank(info: dict, generation: int) -> dict[int, int]:
    return {w["rank"]: w["pid"] for w in info["workers"] if w["generation"] == generation}


# ---- a killed node: survivors keep their processes, the spare's warm standby takes the rank -------------------
@pytest.mark.parametrize("layout", ["hsdp", "fsdp"])
def test_killed_node_recovers_from_peers_memory_with_the_same_loss_at_every_step(tmp_path, home, demo_data,
                                                                                reference, layout):
    create_cluster(write_spec(tmp_path, count=4, spares=1, warm_standby=True), timeout_s=90)
    jobs, client = JobClient("c1"), ClusterClient("c1")
    # The precondition of "the standby is adopted", as `make demo` waits for it: the spare's template imports torch
    # under SCHED_IDLE, so on a 2-core host with 4 ranks training it may not be warm by step 14 (CI's one failure
    # at cb343b6); a spare not warm yet gets a fresh process, which is right, but not what this test is about.
    wait_for(lambda: spare_standby_warm(client), 120, "the spare's warm standby")
    run_dir = tmp_path / "run"
    submit(jobs, tmp_path, config_for(run_dir, demo_data, HSDP if layout == "hsdp" else FSDP), "cl")
    step_at_least(jobs, "cl", 14)
    victim = jobs.describe("cl")["generations"][0]["nodes"][1]
    client.inject_fault(victim, "kill-node")
    info = jobs.wait("cl", timeout_s=180)

    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    first, second = generations(info, 2)
    assert first["outcome"] == "node-fault" and second["outcome"] == "succeeded"
    assert second["nodes"] == [n if n != victim else "workers-4" for n in first["nodes"]]
    # the survivors are the same processes; rank 1 is the spare's warm standby, adopted
    before, after = pids_by_rank(info, 1), pids_by_rank(info, 2)
    assert {r: after[r] for r in (0, 2, 3)} == {r: before[r] for r in (0, 2, 3)} and after[1] != before[1]
    assert second["standbys"].get("1"), "the replacement rank was a warm standby"

    events = assert_same_losses(run_dir, reference[layout])
    kinds = [e["event"] for e in events]
    for kind in ("fault_detected", "generation", "pg_rebuilt", "state_restored", "resumed"):
        assert kind in kinds, f"no {kind} event in metrics.jsonl: {kinds}"
    restored = next(e for e in events if e["event"] == "state_restored")
    resumed = next(e for e in events if e["event"] == "resumed")
    fault = next(e for e in events if e["event"] == "fault_detected")
    assert restored["bytes"] > 0 and restored["seconds"] > 0
    if layout == "hsdp":  # the other replica holds every committed step: nothing is lost
        assert restored["source"] == "peer-memory" and resumed["steps_lost"] == 0
    else:  # no replica: everyone rolls back to the newest buddy snapshot every shard has (taken every step)
        assert restored["source"] == "buddy-snapshot" and 0 <= resumed["steps_lost"] <= 2
    assert resumed["step"] == fault["step"] - resumed["steps_lost"] and resumed["recovery"] == "checkpointless"
    assert second["restored"]["source"] == restored["source"], "the controller recorded the restore"
    assert any(e["kind"] == "state_restored" and restored["source"] in e["reason"] for e in info["events"]), \
        [(e["kind"], e["reason"]) for e in info["events"]]
    controller = {e["kind"]: e["reason"] for e in info["events"]}  # the recovery in the controller's events too
    assert {"fault_detected", "generation", "pg_rebuilt", "state_restored", "resumed"} <= set(controller), controller
    assert f"training resumed at step {resumed['step']}" in controller["resumed"], controller["resumed"]
    # the goodput ledger from the run's files: the fault → the controller is failure detection, the regroup and
    # the restore from peers' memory recovery; with a replica nothing is redone, so nothing is replayed
    ledger = jobs.goodput("cl")
    assert abs(sum(ledger.seconds.values()) - ledger.wall) <= 1e-6, ledger.seconds
    g = ledger.seconds
    assert g["productive"] > 0 and g["failure_detection"] > 0 and g["recovery"] > 0 and g["checkpoint_restore"] == 0
    assert (g["replayed"] == 0) if resumed["steps_lost"] == 0 else (g["replayed"] > 0), (g, resumed)


# ---- a node that stays alive: a failed health check, a frozen agent ----------------------------------------------
@pytest.mark.parametrize("kind", ["fail-health", "freeze-node"])
def test_a_node_judged_faulty_while_its_worker_lives_is_replaced_without_waiting_out_a_timeout(
        tmp_path, home, demo_data, reference, kind):
    """The faulty node's worker is still in the job's collectives: the survivors learn of the fault from the
    generation the controller publishes (or from the collective that breaks when a peer leaves), not from the
    process-group timeout, which is set far longer than the whole recovery may take here. A frozen agent is
    judged only after the heartbeat timeout (5 s), so that run trains on past the reference's steps."""
    create_cluster(write_spec(tmp_path, count=4, spares=1, warm_standby=True), timeout_s=90)
    jobs, client = JobClient("c1"), ClusterClient("c1")
    run_dir = tmp_path / "run"
    steps = STEPS if kind == "fail-health" else 3 * STEPS
    submit(jobs, tmp_path, config_for(run_dir, demo_data, HSDP, max_steps=steps, pg_timeout_s=300.0), "alive")
    step_at_least(jobs, "alive", 14)
    victim = jobs.describe("alive")["generations"][0]["nodes"][1]
    client.inject_fault(victim, kind)
    injected = next(e["time"] for e in reversed(client.events(node=victim)) if e["kind"] == "fault-injected")
    info = jobs.wait("alive", timeout_s=180)

    assert info["state"] == "succeeded" and info["last_step"] == steps, info["reason"]
    first, second = generations(info, 2)
    assert first["outcome"] == "node-fault" and victim not in second["nodes"], (first, second)
    before, after = pids_by_rank(info, 1), pids_by_rank(info, 2)
    assert {r: after[r] for r in (0, 2, 3)} == {r: before[r] for r in (0, 2, 3)}, "the survivors kept their pids"
    events = assert_same_losses(run_dir, reference["hsdp"], kind)
    restored = next(e for e in events if e["event"] == "state_restored")
    resumed = next(e for e in events if e["event"] == "resumed")
    assert restored["source"] == "peer-memory" and resumed["steps_lost"] == 0, (restored, resumed)
    assert resumed["time"] - injected < 30, f"recovered {resumed['time'] - injected:.1f} s after the fault"


def test_a_node_frozen_as_training_ends_does_not_keep_the_finished_job_running(tmp_path, home, demo_data):
    """Rank 1's agent freezes a moment before the last step: its worker finishes with the others, but the exit
    is never reported (the agent is frozen, then terminated as its node is replaced). Training finished
    everywhere, so the job succeeds instead of waiting forever for that report."""
    create_cluster(write_spec(tmp_path, count=2, spares=1), timeout_s=90)
    jobs, client = JobClient("c1"), ClusterClient("c1")
    submit(jobs, tmp_path, config_for(tmp_path / "run", demo_data, {"dp_shard": 2}), "end", nodes=2)
    step_at_least(jobs, "end", STEPS - 8)
    client.inject_fault(jobs.describe("end")["generations"][0]["nodes"][1], "freeze-node")
    info = jobs.wait("end", timeout_s=60)

    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    assert len(info["generations"]) == 1 and "rank 1 not seen exiting: its node workers-1 is" in info["reason"], \
        info["reason"]


# ---- faults at chosen moments, then a second fault during the regroup -------------------------------------------
MOMENTS = [  # (layout, drill): rank 1 or 2 dies there; each must continue exactly or fall back cleanly
    ("hsdp", {"rank": 1, "step": 17, "at": "forward"}),
    ("fsdp", {"rank": 2, "step": 17, "at": "backward"}),
    ("hsdp", {"rank": 2, "step": 17, "at": "optimizer"}),
    ("hsdp", {"rank": 0, "step": 17, "at": "optimizer"}),  # the metrics writer dies before logging step 17
    ("fsdp", {"rank": 1, "step": 20, "at": "checkpoint"}),
]


def test_a_worker_dying_at_any_moment_of_a_step_continues_exactly(tmp_path, home, demo_data, reference):
    create_cluster(write_spec(tmp_path, count=4, spares=1, warm_standby=True), timeout_s=90)
    jobs = JobClient("c1")
    for i, (layout, drill) in enumerate(MOMENTS):
        run_dir = tmp_path / f"run-{i}-{drill['at']}"
        name = f"drill-{i}-{drill['at']}"
        submit(jobs, tmp_path, config_for(run_dir, demo_data, HSDP if layout == "hsdp" else FSDP, drill), name)
        info = jobs.wait(name, timeout_s=180)
        where = f"{layout}, rank {drill['rank']} killed during {drill['at']} of step {drill['step']}"
        assert info["state"] == "succeeded" and info["last_step"] == STEPS, (where, info["reason"])
        assert len(info["generations"]) == 2, (where, [(g["outcome"], g["end_reason"]) for g in info["generations"]])
        first, second = generations(info, 2)
        assert first["outcome"] == "process-fault", (where, first)
        assert second["nodes"] == first["nodes"], "a process fault keeps the node: the rank restarts there"
        events = assert_same_losses(run_dir, reference[layout], where)
        restored = next(e for e in events if e["event"] == "state_restored")
        expected = "peer-memory" if layout == "hsdp" else "buddy-snapshot"
        assert restored["source"] == expected, (where, restored)
        log = jobs.logs(name, rank=drill["rank"])
        assert f"SIGKILL during {drill['at']}" in log, (where, log[-2000:])


def test_a_second_fault_while_regrouping_ends_in_a_correct_continuation(tmp_path, home, demo_data, reference):
    create_cluster(write_spec(tmp_path, count=4, spares=1, warm_standby=True), timeout_s=90)
    jobs, client = JobClient("c1"), ClusterClient("c1")
    run_dir = tmp_path / "run"
    submit(jobs, tmp_path, config_for(run_dir, demo_data, FSDP, {"rank": 2, "at": "regroup"}), "twice")
    step_at_least(jobs, "twice", 14)
    client.inject_fault(jobs.describe("twice")["generations"][0]["nodes"][1], "kill-node")
    info = jobs.wait("twice", timeout_s=240)

    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    outcomes = [g["outcome"] for g in info["generations"]]
    assert outcomes[0] == "node-fault" and outcomes[-1] == "succeeded" and len(outcomes) >= 3, outcomes
    assert "SIGKILL while regrouping" in jobs.logs("twice", rank=2)
    events = assert_same_losses(run_dir, reference["fsdp"])
    sources = [e["source"] for e in events if e["event"] == "state_restored"]
    assert sources and set(sources) <= {"buddy-snapshot", "checkpoint"}, sources


def assert_recovery_ledger(events: list[dict], where: str) -> None:
    """Every recovery in metrics.jsonl reads in order — fault_detected, generation, pg_rebuilt,
    state_restored, resumed — with no negative step, and resumes no later than the step its fault held."""
    kinds = [e["event"] for e in events if e["event"] in ("fault_detected", "generation", "pg_rebuilt",
                                                          "state_restored", "resumed")]
    order = ["fault_detected", "generation", "pg_rebuilt", "state_restored", "resumed"]
    recoveries = [kinds[i:i + 5] for i in range(0, len(kinds), 5)]
    assert recoveries and all(r == order for r in recoveries), (where, kinds)
    for fault, resumed in zip([e for e in events if e["event"] == "fault_detected"],
                              [e for e in events if e["event"] == "resumed"]):
        if fault["step"] is None:  # no rank of the recovery held training state: only a restart from the checkpoint
            assert resumed["recovery"] == "checkpoint" and resumed["steps_lost"] is None, (where, fault, resumed)
            continue
        assert fault["step"] >= resumed["step"] >= 0, (where, fault, resumed)
        assert resumed["steps_lost"] == fault["step"] - resumed["step"] >= 0, (where, fault, resumed)


@pytest.mark.parametrize("second", ["0.3 s later", "as the replacement joins"])
def test_a_second_node_lost_during_recovery_ends_in_a_recovered_job(tmp_path, home, demo_data, reference, second):
    """The reliability issue's hang: kill a node, then another during the recovery (0.3 s later, or the moment
    the controller publishes the generation the first spare's standby joins). Rank 1 and rank 2 hold
    different shards, so the other replica still has every committed step: the job ends bit-exact with nothing
    redone — never a survivor stuck in the old generation's group creation, never two processes as one rank.
    (One exception, seen in the full suite: a survivor caught in gloo's connect to the node killed while the
    groups formed exits stuck; when it held the last copy of its shard (or both survivors do), no copy of a
    shard is left in memory and the job restarts from the checkpoint — still bit-exact, the steps since the
    checkpoint redone.)"""
    create_cluster(write_spec(tmp_path, count=4, spares=2, warm_standby=True), timeout_s=120)
    jobs, client = JobClient("c1"), ClusterClient("c1")
    run_dir = tmp_path / "run"
    submit(jobs, tmp_path, config_for(run_dir, demo_data, HSDP, max_steps=2 * STEPS), "two")
    step_at_least(jobs, "two", 14)
    nodes = jobs.describe("two")["generations"][0]["nodes"]
    client.inject_fault(nodes[1], "kill-node")
    if second == "0.3 s later":
        time.sleep(0.3)
    else:
        wait_for(lambda: len(jobs.describe("two")["generations"]) >= 2, 60, "generation 2")
    client.inject_fault(nodes[2], "kill-node")
    info = jobs.wait("two", timeout_s=300)

    assert info["state"] == "succeeded" and info["last_step"] == 2 * STEPS, info["reason"]
    gens = info["generations"]
    ends = [(g["outcome"], g["end_reason"]) for g in gens]
    assert gens[-1]["outcome"] == "succeeded", ends
    # A survivor caught in gloo's connect to the node killed mid-forming gives up after `stuck_grace_s` and exits
    # with EXIT_STUCK once the next generation is out (it was carried into it): a process fault whose fresh
    # process takes the rank. Any other process fault is a bug.
    stuck = f"exited with code {protocol.EXIT_STUCK}"
    # When both survivors exit stuck, one after the other, the in-place recoveries fail MAX_FAILED_REGROUPS times
    # in a row before any restores state, and the controller restarts the job from its checkpoint with fresh
    # processes (outcome regroup-failed; seen once in the full suite, 2026-11-27: generations 3 and 4 ended by
    # rank 3's then rank 0's stuck exit). No other generation may end that way.
    escalated = [g for g in gens[:-1] if g["outcome"] == "regroup-failed"]
    assert all(g["outcome"] == "node-fault" or (g["outcome"] == "process-fault" and stuck in g["end_reason"])
               for g in gens[:-1] if g not in escalated), ends
    events = assert_same_losses(run_dir, reference["hsdp"], second)
    if escalated:  # nothing was left in memory: the restart from the checkpoint redid steps, bit-exact (above)
        assert len(escalated) == 1 and "in-place recoveries in a row failed" in escalated[0]["end_reason"], ends
        assert any(g["outcome"] == "process-fault" for g in gens), ends
        return
    assert_recovery_ledger(events, second)
    from_disk = [e for e in events if e["event"] == "state_restored" and e["source"] == "checkpoint"]
    if from_disk:
        # A process still holding state (rank 0 or 3, or both) was caught connecting to the node killed
        # mid-forming and exited stuck: the one other copy of its shard had died with the first node, so no copy
        # of that shard was left in memory and the job restarted from the checkpoint, bit-exact (checked above)
        # with the steps since it redone. Only that path may redo steps.
        assert any(g["outcome"] == "process-fault" for g in info["generations"]), info["generations"]
        assert all("no rank holds training state" in e["reason"] or "its holders are gone" in e["reason"]
                   for e in from_disk), from_disk
        return
    assert all(e["steps_lost"] == 0 for e in events if e["event"] == "resumed"), events
    redone = [int(m.group(1)) for e in info["events"] if (m := re.search(r"(-?\d+) committed step", e["reason"]))]
    assert redone and all(n == 0 for n in redone), redone  # the controller's `resumed` lines


# ---- no process dies: a collective broken by the network -------------------------------------------------------
def test_a_collective_broken_by_the_network_regroups_every_process_in_place(tmp_path, home, demo_data, reference):
    """Rank 1's collective fails inside step 17 as a dropped connection would make it, and every process lives
    on: no agent reports a fault, so the ranks that left the generation tell the controller (`protocol.left_key`),
    which regroups them all in place once no real fault has shown up within a heartbeat timeout. Meanwhile their
    agents must not judge them stalled (no step for 2 × hang_timeout_s = 5 s, less than the 6 s grace): they left
    their generation, so they tell their agents no step (`ProgressReporter.leave`)."""
    create_cluster(write_spec(tmp_path, count=4, spares=1, warm_standby=True, hang_timeout_s=2.5), timeout_s=90)
    jobs = JobClient("c1")
    run_dir = tmp_path / "run"
    submit(jobs, tmp_path, config_for(run_dir, demo_data, HSDP, {"rank": 1, "step": 17, "at": "network"}), "net")
    info = jobs.wait("net", timeout_s=180)

    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    first, second = generations(info, 2)
    assert first["outcome"] == "stranded" and "left generation 1" in first["end_reason"], first
    assert second["nodes"] == first["nodes"] and pids_by_rank(info, 2) == pids_by_rank(info, 1), \
        "every process carried on into generation 2"
    events = assert_same_losses(run_dir, reference["hsdp"])
    restored = next(e for e in events if e["event"] == "state_restored")
    resumed = next(e for e in events if e["event"] == "resumed")
    assert restored["source"] != "checkpoint" and restored["bytes"] == 0, "every rank held its own state"
    assert resumed["step"] == 16 and resumed["steps_lost"] == 0, resumed
    assert "network failure in the forward of step 17" in jobs.logs("net", rank=1)


# ---- both replicas of a shard lost: the disk checkpoint, said so -----------------------------------------------
def test_losing_both_replicas_of_a_shard_falls_back_to_the_checkpoint(tmp_path, home, demo_data, reference):
    create_cluster(write_spec(tmp_path, count=4, spares=2, warm_standby=True), timeout_s=90)
    jobs, client = JobClient("c1"), ClusterClient("c1")
    run_dir = tmp_path / "run"
    submit(jobs, tmp_path, config_for(run_dir, demo_data, HSDP), "both")
    step_at_least(jobs, "both", 14)
    nodes = jobs.describe("both")["generations"][0]["nodes"]
    for victim in (nodes[1], nodes[3]):  # ranks 1 and 3: shard 1 of replica 0 and of replica 1
        client.inject_fault(victim, "kill-node")
    info = jobs.wait("both", timeout_s=240)

    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    events = assert_same_losses(run_dir, reference["hsdp"])
    restored = [e for e in events if e["event"] == "state_restored"]
    assert restored and restored[-1]["source"] == "checkpoint", restored
    assert "no step is held for every shard" in restored[-1]["reason"], restored
    resumed = [e for e in events if e["event"] == "resumed"][-1]
    saved = [e["step"] for e in events if e["event"] == "checkpoint_saved" and e["time"] < restored[-1]["time"]]
    assert resumed["step"] == max(saved), (resumed, saved)
    # rank 0 survived in its process and rolled back with it: TensorBoard shows each step once, the newest value
    steps, _ = records(run_dir)
    newest = {s["step"]: s["loss"] for s in steps}
    shown = scalars(run_dir / "tensorboard")["loss"]
    assert [step for step, _ in shown] == list(range(1, STEPS + 1)), shown
    assert all(value == pytest.approx(newest[step], rel=1e-6) for step, value in shown)

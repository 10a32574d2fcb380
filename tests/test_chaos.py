"""`phalanx chaos`: the seeded plan, every invariant checker fed a story it must reject (so each checker is
known to fail when the thing it guards breaks), the drill's slow action, the process census, and — marked
slow, run in CI — a short soak on a real local cluster that lands every fault kind once, across both recovery
modes and every phase of a step, and fails if any trial breaks an invariant.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

import pytest

from clusters import home  # noqa: F401  (home is a fixture)
from phalanx.chaos import KINDS, MODES, PHASES, JobShape, Trial, ci_plan, make_plan
from phalanx.chaos import invariants as inv
from phalanx.chaos.census import Census, NodeCensus, listening_ports, take_census
from phalanx.chaos.plan import shard_lost, steps_allowed
from phalanx.resilience.drill import ENV_VAR, Drill, DrillSpec, spec_from_env

SHAPE = JobShape(steps=30, interval=10, world=4)  # the CI soak: shorter jobs than the default 40 steps


# ---- the plan ------------------------------------------------------------------------------------------------
def test_a_seed_gives_the_same_plan_and_another_seed_another():
    assert make_plan(7, 60) == make_plan(7, 60)
    assert make_plan(7, 60) != make_plan(8, 60)
    assert [t.index for t in make_plan(3, 25)] == list(range(1, 26))


def test_a_plan_as_long_as_the_matrix_covers_every_cell_with_valid_trials():
    cells = len(KINDS) * len(PHASES) * len(MODES)
    plan = make_plan(11, cells, shape=SHAPE)
    assert {(t.kind, t.phase, t.mode) for t in plan} == {(k, p, m) for k in KINDS for p in PHASES for m in MODES}
    for t in plan:
        assert 1 <= t.step <= SHAPE.steps // 2 and 0 <= t.rank < SHAPE.world, t
        if t.phase == "checkpoint":
            assert t.step % SHAPE.interval == 0, t
        assert (t.first is not None) == (t.phase == "regroup"), t
        assert (t.other is not None) == (t.kind in ("two-nodes", "second-fault")), t
    assert sum(t.faults for t in plan) > len(plan)  # two-node, second-fault and regroup trials inject more
    only = make_plan(2, 40, modes=("restart",), kinds=("kill-node",))
    assert {t.mode for t in only} == {"restart"} and {t.kind for t in only} == {"kill-node"}


def test_the_ci_list_covers_every_kind_both_modes_and_every_phase():
    plan = ci_plan(SHAPE)
    assert sorted(t.kind for t in plan) == sorted(KINDS)
    assert {t.mode for t in plan} == set(MODES) and {t.phase for t in plan} == set(PHASES)
    assert any(t.rank == 0 for t in plan), "rank 0 (it writes the metrics) is a target somewhere"


def test_a_trial_refuses_ranks_that_collide_or_fields_of_another_kind():
    with pytest.raises(ValueError):
        Trial(1, "two-nodes", "forward", "restart", rank=1, step=5, other=1)
    with pytest.raises(ValueError):
        Trial(1, "kill-node", "forward", "restart", rank=1, step=5, other=2)
    with pytest.raises(ValueError):
        Trial(1, "kill-node", "regroup", "restart", rank=1, step=5)
    with pytest.raises(ValueError):
        Trial(1, "meteor", "forward", "restart", rank=1, step=5)
    with pytest.raises(ValueError):
        JobShape(world=3)  # HSDP needs 2 replicas of at least 2 shards


def test_the_steps_a_recovery_may_redo_follow_from_the_ranks_lost():
    hsdp = dict(kind="two-nodes", phase="forward", mode="checkpointless", step=5, layout="hsdp")
    assert shard_lost(Trial(1, rank=1, other=3, **hsdp), SHAPE)  # both replicas of shard 1
    assert steps_allowed(Trial(1, rank=1, other=3, **hsdp), SHAPE) == SHAPE.interval
    assert not shard_lost(Trial(1, rank=1, other=2, **hsdp), SHAPE)
    assert steps_allowed(Trial(1, rank=1, other=2, **hsdp), SHAPE) == 0
    fsdp = {**hsdp, "layout": "fsdp"}
    assert steps_allowed(Trial(1, rank=1, other=2, **fsdp), SHAPE) == SHAPE.interval  # a rank and its buddy
    assert steps_allowed(Trial(1, rank=1, other=3, **fsdp), SHAPE) == 2
    assert steps_allowed(Trial(1, "kill-node", "forward", "restart", rank=1, step=5), SHAPE) == SHAPE.interval
    slow = Trial(1, "slow-rank", "forward", "checkpointless", rank=1, step=5)
    assert slow.lost_ranks == set() and slow.expected_generations() == (1, 1)
    assert Trial(1, "kill-worker", "regroup", "restart", rank=1, step=5, first=2).expected_generations() == (3, None)
    # a controller restarted mid-regroup: a stranded generation, and a rank stuck in its group creation may follow
    assert Trial(7, "controller-restart", "regroup", "checkpointless", rank=1, step=8,
                 first=3).expected_generations() == (2, 4)


# ---- the invariants, each fed a story it must reject ----------------------------------------------------------
def steps(*pairs, t0: float = 100.0) -> list[dict]:
    return [{"step": s, "loss": loss, "time": t0 + s} for s, loss in pairs]


REFERENCE = {1: 5.0, 2: 4.5, 3: 4.0, 4: 3.5}


def checkpointless_story() -> list[dict]:
    """Rank 0's records of a good checkpointless recovery after step 2."""
    return [{"event": "started"}, *steps((1, 5.0), (2, 4.5)),
            {"event": "fault_detected", "generation": 1, "step": 2},
            {"event": "generation", "generation": 2}, {"event": "pg_rebuilt", "generation": 2},
            {"event": "state_restored", "source": "peer-memory", "step": 2, "bytes": 10},
            {"event": "resumed", "step": 2, "steps_lost": 0},
            *steps((3, 4.0), (4, 3.5)), {"event": "finished", "step": 4}]


def test_a_good_story_passes_every_metrics_check():
    records = checkpointless_story()
    assert inv.check_metrics_events(records) == []
    assert inv.check_losses(records, REFERENCE) == []
    assert inv.check_steps_lost(records, 0) == []
    restart = [*steps((1, 5.0), (2, 4.5), (3, 4.0)), {"event": "resumed", "step": 2},
               *steps((3, 4.0), (4, 3.5)), {"event": "finished", "step": 4}]
    assert inv.check_metrics_events(restart) == [] and inv.check_losses(restart, REFERENCE) == []
    assert [r["lost"] for r in inv.recoveries(restart)] == [1] and inv.check_steps_lost(restart, 1) == []
    from_scratch = [{"event": "started"}, *steps((1, 5.0), (2, 4.5)), {"event": "started"}, *steps((1, 5.0))]
    assert [r["lost"] for r in inv.recoveries(from_scratch)] == [2], "a restart before the first checkpoint"


def test_negative_step_counts_are_caught():
    records = checkpointless_story()
    records[7]["steps_lost"] = -1  # `resumed`
    assert any("steps_lost=-1" in m for m in inv.check_metrics_events(records))
    records = checkpointless_story() + [{"step": -3, "loss": 1.0, "time": 0}]
    assert any("step -3" in m for m in inv.check_metrics_events(records))


def test_resumed_written_before_its_fault_detected_is_caught():
    records = checkpointless_story()
    resumed = records.pop(7)
    records.insert(3, resumed)  # right after step 2, before fault_detected
    found = inv.check_metrics_events(records)
    assert any("`resumed` (step 2) written before the `fault_detected` and `state_restored`" in m for m in found), found


def test_two_recoveries_in_a_row_are_two_stories_not_one_out_of_order():
    """A second fault during the first's recovery: rank 0 writes two complete recoveries with no step between."""
    story = checkpointless_story()
    second = [{"event": "fault_detected", "generation": 2, "step": 2}, {"event": "generation", "generation": 3},
              {"event": "state_restored", "source": "peer-memory", "step": 2, "bytes": 10},
              {"event": "resumed", "step": 2, "steps_lost": 0}]
    assert inv.check_metrics_events(story[:8] + second + story[8:]) == []


def test_generations_that_do_not_increase_and_a_fault_never_resolved_are_caught():
    records = checkpointless_story() + [{"event": "fault_detected", "generation": 2, "step": 4},
                                        {"event": "generation", "generation": 2}]
    found = inv.check_metrics_events(records)
    assert any("do not increase" in m for m in found), found
    assert any("never followed by `resumed`" in m for m in found), found
    assert any("fault_detected in generation 2 followed by generation 2" in m for m in found), found


def test_a_different_or_missing_loss_and_too_many_steps_redone_are_caught():
    records = checkpointless_story()
    records[2]["loss"] = 4.500001
    assert any("differ from the failure-free run" in m for m in inv.check_losses(records, REFERENCE))
    assert any("never logged: [4]" in m for m in inv.check_losses(checkpointless_story()[:-2], REFERENCE))
    rolled_back = [*steps((1, 5.0), (2, 4.5), (3, 4.0)), {"event": "resumed", "step": 1}, *steps((2, 4.5))]
    assert inv.check_steps_lost(rolled_back, 1) and not inv.check_steps_lost(rolled_back, 2)


def controller_story() -> dict:
    gens = [{"generation": 1, "started_at": 1.0, "outcome": "node-fault", "start_step": 0, "last_step": 2,
             "restored": None, "master_port": 1234, "nodes": ["w0"], "end_reason": "node w0 faulty"},
            {"generation": 2, "started_at": 2.0, "outcome": "succeeded", "start_step": 2, "last_step": 4,
             "restored": {"source": "peer-memory", "step": 2, "bytes": 10}, "master_port": 1235, "nodes": ["w1"],
             "end_reason": None}]
    events = [{"id": 1, "time": 1.0, "kind": "generation", "reason": "generation 1 started"},
              {"id": 2, "time": 2.0, "kind": "generation", "reason": "generation 2 started"},
              {"id": 3, "time": 2.5, "kind": "fault_detected", "reason": "generation 1: 3 rank(s) saw the fault at "
                                                                       "step 2"},
              {"id": 4, "time": 2.6, "kind": "state_restored", "reason": "generation 2 restored from peer-memory at "
                                                                       "step 2: 10 bytes moved"},
              {"id": 5, "time": 2.6, "kind": "resumed", "reason": "generation 2: training resumed at step 2 on 4 "
                                                                "ranks, 0 committed step(s) redone"}]
    return {"id": "1", "state": "succeeded", "last_step": 4, "reason": "done", "generations": gens,
            "workers": [{"generation": 1, "pid": 10}, {"generation": 2, "pid": 11}], "events": events}


def test_the_controllers_story_is_checked():
    assert inv.check_controller_events(controller_story(), "checkpointless") == []
    bad = controller_story()
    bad["events"][4]["reason"] = "generation 2: training resumed at step 2 on 4 ranks, -1 committed step(s) redone"
    assert any("negative step count" in m for m in inv.check_controller_events(bad, "checkpointless"))
    bad = controller_story()
    bad["events"][4]["time"], bad["events"][4]["id"] = 2.4, 0  # resumed before state_restored
    assert any("before its state_restored" in m for m in inv.check_controller_events(bad, "checkpointless"))
    bad = controller_story()
    bad["generations"][1]["generation"] = 3
    assert any("not numbered 1..n" in m for m in inv.check_controller_events(bad, "restart"))
    bad = controller_story()
    bad["generations"][1]["restored"]["step"] = -2
    assert any("restore summary has step=-2" in m for m in inv.check_controller_events(bad, "checkpointless"))
    assert any("controller recorded step 2" in m for m in inv.check_controller_events(
        {**controller_story(), "last_step": 2}, "restart", max_steps=4)), "a stale last step"
    bad = controller_story()
    bad["events"].pop(3)  # no state_restored after fault_detected
    assert any("never followed by state_restored" in m for m in inv.check_controller_events(bad, "checkpointless"))


def test_finished_and_generations_checks_reject_what_they_guard():
    info = controller_story()
    assert inv.check_finished(info, [{"event": "finished", "step": 4}], 4) == []
    assert inv.check_finished({**info, "state": "failed"}, [{"event": "finished", "step": 4}], 4)
    assert inv.check_finished(info, [], 4)
    assert inv.check_generations(info, 2, None) == []
    assert inv.check_generations(info, 1, 1), "a slow rank must not end a generation"
    assert inv.check_generations({**info, "generations": info["generations"][:1]}, 2, None), "no effect"


def census(extra_member: int | None = None, retired: dict | None = None, controller_ports=(7000,)) -> Census:
    nodes = {f"w{i}": NodeCensus(agent=100 + i, members=[100 + i, 200 + i], standbys=1) for i in range(3)}
    if extra_member is not None:
        nodes["w1"].members.append(extra_member)
    listening = {p: 1 for p in controller_ports}
    return Census(controller=1, nodes=nodes, retired=retired or {}, listening=listening)


def test_the_census_finds_each_nodes_session_from_its_handle():
    """A local node's handle is its agent's pid (as text): the census reads each node's session from it, so the
    leak checks look at real processes (a census that finds no node would make them vacuous)."""
    agent = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        nodes = [{"name": "w0", "state": "healthy", "handle": str(agent.pid), "report": {"standbys": {"0": "s"}}},
                 {"name": "w1", "state": "provisioning", "handle": None}]
        found = take_census(nodes, controller=None)
        assert list(found.nodes) == ["w0"] and found.nodes["w0"].agent == agent.pid
        assert found.nodes["w0"].members == [agent.pid] and found.nodes["w0"].standbys == 1
    finally:
        agent.kill()
        agent.wait()


def test_leaked_processes_and_ports_are_caught():
    before = census()
    assert inv.check_leaks(before, census(), {}, [1234]) == []
    with_template = census(300)
    with_template.nodes["w1"].template = 300  # the node's worker template is not a leak
    assert inv.check_leaks(with_template, with_template, {}, []) == []
    assert any("besides its agent" in m for m in inv.check_leaks(with_template, census(300), {}, []))
    assert any("besides its agent" in m and "999" in m for m in inv.check_leaks(before, census(999), {}, []))
    assert any("still running after it ended" in m for m in inv.check_leaks(before, census(), {999: "python -m x"}, []))
    assert any("retired node w9" in m for m in inv.check_leaks(before, census(retired={"w9": [555]}), {}, []))
    assert any("more ports" in m for m in inv.check_leaks(before, census(controller_ports=(7000, 7001)), {}, []))
    held = census()
    held.listening[1234] = 200
    assert any("ports still listened on" in m for m in inv.check_leaks(before, held, {}, [1234]))


def test_the_census_sees_a_listening_port_of_a_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listening_ports({os.getpid()}).get(port) == os.getpid()
    assert port not in listening_ports({os.getpid()})


# ---- the drill's slow action ---------------------------------------------------------------------------------
def test_a_slow_drill_is_armed_from_the_env_and_sleeps_without_dying(capsys):
    spec = DrillSpec(rank=2, step=5, at="regroup", action="slow", seconds=0.2)
    env = {ENV_VAR: spec.to_env()}
    assert spec_from_env(env) == spec and spec_from_env({}) is None
    assert not Drill(None, rank=1, generation=1, env=env).armed
    assert not Drill(None, rank=2, generation=2, env=env).armed, "only a first-generation process"
    drill = Drill(None, rank=2, generation=1, env=env)
    assert drill.armed and drill.action == "slow"
    start = time.monotonic()
    drill.at_regroup()  # a kill drill would SIGKILL this test process here
    assert time.monotonic() - start >= 0.2 and not drill.armed
    assert "=== phalanx drill: slow rank: sleeping 0.2 s while regrouping ===" in capsys.readouterr().err
    with pytest.raises(ValueError):
        spec_from_env({ENV_VAR: json.dumps({"rank": 1, "at": "lunch"})})


# ---- the CI soak: a real cluster, every fault kind once --------------------------------------------------------
@pytest.mark.slow
def test_a_short_seeded_soak_survives_every_fault_kind_in_both_modes(tmp_path, home):  # noqa: F811
    from phalanx.chaos import Settings, run_soak
    from phalanx.chaos.report import summary_line

    plan = ci_plan(SHAPE)
    report = run_soak(plan, tmp_path / "chaos", Settings(shape=SHAPE), say=print)
    print(summary_line(report))
    failed = [(r["label"], r["failures"], r.get("evidence")) for r in report["trials"] if r["outcome"] != "survived"]
    assert report["error"] is None, report["error"]
    assert not failed, "\n".join(f"{label}: {json.dumps(f)} (evidence: {ev})" for label, f, ev in failed)
    assert len(report["trials"]) == len(plan) and report["left_running"] == []
    s = report["summary"]
    assert s["faults_survived"] == s["faults_injected"] == sum(t.faults for t in plan)
    assert set(s["per_kind"]) == set(KINDS) and set(s["per_mode"]) == set(MODES)
    assert all(r["hit"] in ("drill", "timed") for r in report["trials"]), [r["hit"] for r in report["trials"]]

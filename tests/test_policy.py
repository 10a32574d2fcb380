"""The controller's policy — node bring-up, faults, replacement from the spare pool, refill, and the job fault
policy (restart, resume or fail; in place for checkpointless jobs) — decided over a real SQLite store with a
fake backend, fake agents and a fake clock (tests/fakes.py): no processes, no sockets, no sleeps; each test
takes milliseconds. The real-process tests stay: they prove that the agents, the workers and the API deliver
what these fakes stand for.

Every fault kind the real-process tests inject, what the policy decides here, and the real test (file::test)
that covers it with processes:

  cluster creation: every node provisioning → configuring → health-checking → healthy; cluster in service
      test_control::test_create_lists_healthy_nodes_and_refuses_unauthenticated_requests
  lifecycle script fails during creation → creation fails, the controller asked to stop everything
      test_control::test_failed_lifecycle_script_is_reported_with_its_output_and_nothing_runs
  agent never registers (provision_timeout_s), during creation and on a refill → faulty, replaced
      (no real-process test)
  lifecycle script fails / the agent cannot be launched, on a refill → faulty, replaced; 3 in a row → stop
      (no real-process test)
  kill-node (backend: agent gone) → faulty, replaced by the spare, pool refilled
      test_control::test_faulty_node_is_replaced_by_the_spare_and_the_pool_refilled[kill-node]
  freeze-node (heartbeat lost past heartbeat_timeout_s) → the same
      test_control::test_faulty_node_is_replaced_by_the_spare_and_the_pool_refilled[freeze-node]
  an agent's link closed (its process ended; the backend cannot tell) → faulty after link_grace_s
      test_hosts::test_a_checkpointless_job_survives_a_killed_host
  fail-health (health check failed) → the same
      test_control::test_faulty_node_is_replaced_by_the_spare_and_the_pool_refilled[fail-health]
  gpu-xid 79 (a replace-node health failure) → the same
      test_control::test_faulty_node_is_replaced_by_the_spare_and_the_pool_refilled[gpu-xid]
  a faulty spare → retired, the pool refilled
      test_control (the refilled pool after each replacement)
  an agent that ignores SIGTERM → SIGKILL after TERMINATE_GRACE_S
      (no real-process test)
  controller restart: heartbeat silence counted from the new controller's start
      test_control::test_controller_sigkill_and_restart_leave_agents_untouched
  node_recovery=none → left faulty; a group without spares → a freshly provisioned node
      test_control::test_recovery_none_leaves_the_faulty_node_and_no_spares_means_a_fresh_node
  deep health check: one round at creation, a refill paired with a healthy peer, a slow link fails
      test_control::test_deep_health_check_pairs_new_nodes_with_a_healthy_peer_and_fails_slow_links
  refused submits; a job whose ranks all exit 0 succeeds
      test_jobs::test_refused_submits_start_nothing_and_a_torch_distributed_command_runs
  app error (exit N on healthy nodes) → retried on the same nodes up to max_retries, then failed
      test_jobs::test_app_errors_retry_on_the_same_nodes_then_fail_and_node_faults_need_auto_resume
  kill-worker on a restart job → an app error, retried on the same nodes; cancel
      test_jobs::test_app_errors_retry_... (its kill-worker and cancel parts)
  gpu-xid 13 (restart-job) → restarted on the same nodes, no retry used; without auto-resume, failed
      test_jobs::test_app_errors_retry_... (its gpu-xid part)
  node fault (each kind above) + auto-resume → stopped, then the survivor + the promoted spare
      test_jobs::test_killed_node_is_replaced_by_the_spare_and_training_resumes_from_the_checkpoint
  node fault without auto-resume → the job fails, the node is still replaced
      test_jobs::test_app_errors_retry_... (its last part)
  node fault, no free spare → the job waits for a freshly provisioned node
      test_jobs::test_without_a_free_spare_the_job_waits_for_a_fresh_node
  hang-worker, frozen (no progress, no beat) → a node fault: only the frozen rank's node is replaced
      test_jobs::test_hung_worker_is_detected_killed_and_the_job_recovers
  stalled hang (beat alive, no progress) → an app error
      test_jobs::test_hang_rule_kills_a_frozen_worker_first_and_a_stalled_one_only_later (the agent's verdict)
  controller restart under a running job → left running, progress tracked again
      test_jobs::test_controller_sigkill_and_restart_leave_the_job_running
  checkpointless node fault → in place: survivors held and carried, a warm standby takes the rank
      test_checkpointless::test_killed_node_recovers_from_peers_memory_with_the_same_loss_at_every_step,
      test_checkpointless::test_a_node_judged_faulty_while_its_worker_lives_is_replaced_without_waiting_out_...
  checkpointless worker killed → a process fault, in place on the same nodes
      test_checkpointless::test_a_worker_dying_at_any_moment_of_a_step_continues_exactly
  checkpointless second node lost while regrouping → in place again
      test_checkpointless::test_a_second_fault_while_regrouping_ends_in_a_correct_continuation,
      test_checkpointless::test_a_second_node_lost_during_recovery_ends_in_a_recovered_job
  checkpointless collective broken, nobody dead → stranded after the grace: every process regroups
      test_checkpointless::test_a_collective_broken_by_the_network_regroups_every_process_in_place
  checkpointless node frozen as training ends → the finished job succeeds
      test_checkpointless::test_a_node_frozen_as_training_ends_does_not_keep_the_finished_job_running
  checkpointless app error (exit N) → not in place: stopped, then retried or failed
      (no real-process test)
  in-place recoveries that never restore → a restart with fresh processes (regroup-failed)
      test_regroup::test_repeated_failed_regroups_end_in_a_restart_not_a_loop (the rule alone)
"""

from __future__ import annotations

import json
import signal

import pytest

from fakes import FakeBackend, FakeCluster
from phalanx import protocol
from phalanx.control.backends.base import Backend
from phalanx.control.policy.admission import JobRequestError
from phalanx.control.policy.inplace import MAX_FAILED_REGROUPS
from phalanx.control.policy.reconciler import MASS_SILENCE_MIN, MAX_PROVISION_FAILURES, TERMINATE_GRACE_S
from phalanx.control.server.links import AgentLinks
from phalanx.control.state.jobs import JobState
from phalanx.control.state.store import NodeState, Store

J = JobState


@pytest.fixture
def make(tmp_path):
    made = []

    def make(**kw) -> FakeCluster:
        c = FakeCluster(tmp_path / f"cluster{len(made)}", **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def faulty_reason(c: FakeCluster, name: str) -> str:
    (event,) = [e for e in c.events(node=name) if e["to_state"] == "faulty"]
    return event["reason"]


def state(c: FakeCluster, name: str) -> str | None:
    node = c.node(name)
    return node.state.value if node else None


def recovery(c: FakeCluster, job: str) -> str:
    """What the controller said it does about the job's newest fault."""
    return [e for e in c.events(job=job) if e["kind"] == "recovery"][-1]["reason"]


def job_states(c: FakeCluster, job: str) -> list[str]:
    return [e["to_state"] for e in c.events(job=job) if e["kind"] == "job"]


def running(c: FakeCluster, job: str, generation: int, ranks: int = 2):
    """Wait until the generation's ranks run and their agents reported them."""
    def ready():
        ws = c.workers(job, generation)
        rows = [w for w in c.jobs.records.workers(job=job, generation=generation) if w.state == "running"]
        return ws if len(ws) == ranks and len(rows) == ranks else None
    return c.run_until(ready, f"generation {generation} of job {job} running")


NODE_FAULTS = [  # (inject, what the node's faulty reason says)
    (("kill-node", {}), "killed by SIGKILL"),
    (("freeze-node", {}), "no heartbeat for"),
    (("fail-health", {}), "health check failed: injected"),
    (("gpu-xid", {"xid": 79}), "gpu.xid: XID [79] (injected): hardware fault"),
]
NODE_FAULT_IDS = ["kill-node", "freeze-node", "fail-health", "gpu-xid-79"]


# ---- the fakes themselves ----------------------------------------------------------------------------------------
def test_the_fake_backend_implements_every_method_of_backend(tmp_path):
    methods = [name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")]
    assert len(methods) >= 13 and isinstance(FakeBackend(tmp_path), Backend)
    assert [m for m in methods if not callable(getattr(FakeBackend, m, None))] == []


def test_the_controllers_store_reads_nodes_from_memory_and_writes_every_change_to_sqlite(make):
    c = make(count=2, spares=0)
    c.create()
    reader = Store(c.store.path)  # a CLI's view: straight from SQLite
    try:
        c.store.update_node("workers-0", last_heartbeat=123.0, health={"ok": False, "checks": []}, is_spare=0)
        c.store.transition("workers-1", NodeState.FAULTY, "test", fault_cause="health-check")
        for name in ("workers-0", "workers-1"):
            assert c.store.node(name) == reader.node(name), name
        assert c.store.nodes() == reader.nodes() and c.store.node("workers-0").is_spare is False
        assert [n.name for n in c.store.nodes(include_terminated=False)] == ["workers-0", "workers-1"]
        reader.execute("UPDATE nodes SET reason='written elsewhere' WHERE name='workers-0'")
        assert c.store.node("workers-0").reason != "written elsewhere", "the owner must be the only writer: it does not re-read rows"
    finally:
        reader.close()


# ---- cluster creation ---------------------------------------------------------------------------------------------
def test_creation_brings_count_plus_spares_nodes_to_healthy_and_the_cluster_in_service(make):
    c = make(count=2, spares=1)
    c.step()
    assert c.backend.launched() == ["workers-0", "workers-1", "workers-2"]
    assert c.status() == "creating"
    c.create()
    assert c.states() == {"workers-0": "healthy", "workers-1": "healthy", "workers-2": "healthy"}
    assert [n.is_spare for n in c.store.nodes()] == [False, False, True]
    for name in c.states():
        assert c.transitions(name) == ["provisioning", "configuring", "health-checking", "healthy"], name
    assert "initial spare 1/1" in c.events(node="workers-2")[0]["reason"]
    checking = next(e for e in c.events(node="workers-0") if e["to_state"] == "health-checking")
    assert "lifecycle script on_create.sh succeeded" in checking["reason"]
    c.steps(5)
    assert c.backend.launched() == ["workers-0", "workers-1", "workers-2"], "nothing more to provision"
    status = [e for e in c.events() if e["kind"] == "cluster" and e["to_state"] == "in-service"]
    assert len(status) == 1 and "all 3 nodes healthy" in status[0]["reason"]


def test_an_agent_that_joins_while_its_row_is_provisioned_keeps_the_node(make):
    """Backends whose agents join (hosts, Slurm) launch nothing: `launch` returns no handle. An agent started with
    the cluster may claim the row between its insert and the end of `provision`; provisioning used to write the
    None handle over the claim, and a second agent then claimed the same node (seen at 1,024 simulated agents:
    16 nodes never got an agent of their own)."""
    c = make(count=2, spares=0)
    launch = c.backend.launch

    def joined_meanwhile(node):
        launch(node)  # (the fake agent runs as if it had joined)
        assert c.store.claim_node("workers", f"host{node.name[-1]}:4242", "/work").name == node.name
        return None

    c.backend.launch = joined_meanwhile
    c.step()
    assert {n.name: n.handle for n in c.store.nodes()} == {"workers-0": "host0:4242", "workers-1": "host1:4242"}
    assert c.store.claim_node("workers", "late:1", "/work") is None, "no row waits for another agent"


def test_a_lifecycle_script_failing_during_creation_fails_the_cluster_and_asks_to_stop_everything(make):
    c = make(count=2, spares=0)
    c.plan("workers-1", lifecycle_code=3, lifecycle_tail="mounting /fsx\nfatal: /fsx unreachable")
    c.run_until(lambda: c.status() == "failed", "creation to fail")
    reason = faulty_reason(c, "workers-1")
    assert "exited with code 3" in reason and "fatal: /fsx unreachable" in reason, reason
    (why,) = c.exit_requests
    assert why.startswith("node workers-1 failed during creation") and "exited with code 3" in why, why
    c.steps(3)
    assert c.backend.launched() == ["workers-0", "workers-1"], "creation replaces nothing"
    assert c.states()["workers-1"] == "faulty" and c.status() == "failed" and len(c.exit_requests) == 1


def test_a_member_that_never_registers_fails_creation_after_provision_timeout_s(make):
    c = make(count=2, spares=0, health={"provision_timeout_s": 10})
    c.plan("workers-1", register=False)
    c.run_until(lambda: state(c, "workers-0") == "healthy", "workers-0 healthy")
    since = c.node("workers-1").state_since
    while c.clock() - since <= 10:
        assert c.node("workers-1").state.value == "provisioning" and c.status() == "creating"
        c.step()
    c.reconciler.tick()
    assert c.status() == "failed"
    assert "did not register within provision_timeout_s=10" in faulty_reason(c, "workers-1")
    assert len(c.exit_requests) == 1


# ---- node faults in service ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("polls", [True, False], ids=["polled", "not-polled"])
def test_an_agent_whose_link_closes_is_faulty_after_the_grace_not_the_heartbeat_timeout(make, polls):
    # backends whose agents are not the controller's children (hosts, Slurm) cannot say an agent ended: its link can
    c = make(count=2, spares=1).create()
    c.backend.polls = polls  # not polled: the close itself brings the node back to the reconciler's eyes
    links = c.reconciler.links = AgentLinks()
    handle = c.node("workers-0").handle
    links.opened("workers-0", handle)
    links.closed("workers-0", handle, c.clock())  # a reset on the way: the living agent heartbeats at once
    c.steps(4)
    assert state(c, "workers-0") == "healthy"
    links.opened("workers-0", handle)
    links.closed("workers-0", handle, c.clock())
    links.opened("workers-0", handle)  # or opens another link before it heartbeats
    c.backend.frozen.add("workers-0")  # from here on silent, and its backend cannot tell why
    c.steps(2)
    assert state(c, "workers-0") == "healthy"
    links.closed("workers-0", handle, closed_at := c.clock())  # the agent process ended: the link with it
    grace = c.spec.health.link_grace_s
    while c.clock() - closed_at < grace:
        c.step(0.1)
        assert state(c, "workers-0") == "healthy", "judged before the grace"
    c.step(0.1)
    assert "its agent's link to the controller closed" in faulty_reason(c, "workers-0")
    assert c.node("workers-0").fault_cause == "agent-gone"
    faulty = next(e for e in c.events(node="workers-0") if e["to_state"] == "faulty")
    assert faulty["time"] - closed_at <= grace + 0.1 < c.spec.health.heartbeat_timeout_s
    c.run_until(lambda: c.transitions("workers-0")[-1] == "terminated", "workers-0 replaced")


@pytest.mark.parametrize("before_s", [0.05, 0.3, 0.45])
def test_a_link_closed_just_before_its_nodes_silence_check_is_still_judged_after_the_grace(make, before_s):
    """A backend not polled looks at a healthy node when its silence comes due, and again `link_grace_s` after its
    link closed. When the close came that little before the silence check, the check found it within the grace
    and the close was forgotten: the killed agent was found only at the heartbeat timeout (control_scale at 4,096
    nodes, one run in about 20: a killed agent faulty after 11.9 s, the timeout, not ~0.6 s)."""
    c = make(count=2, spares=1).create()
    c.backend.polls = False
    links = c.reconciler.links = AgentLinks()
    handle = c.node("workers-0").handle
    links.opened("workers-0", handle)
    c.backend.frozen.add("workers-0")  # the agent process is killed (it sends nothing more)...
    due = c.reconciler.watch._next["workers-0"]  # (when the reconciler next looks at it unprompted: its silence)
    while c.clock() + 0.1 < due - before_s:
        c.step(0.1)
    c.clock.advance(due - before_s - c.clock())
    links.closed("workers-0", handle, closed_at := c.clock())  # ...and its link closes
    grace = c.spec.health.link_grace_s
    assert before_s < grace
    timeout = c.spec.health.heartbeat_timeout_s
    while "faulty" not in c.transitions("workers-0") and c.clock() - closed_at < 2 * timeout:
        c.step(0.1)  # (ticks 0.1 s apart: the silence check comes within the grace)
    assert "its agent's link to the controller closed" in faulty_reason(c, "workers-0")
    faulty = next(e for e in c.events(node="workers-0") if e["to_state"] == "faulty")
    assert faulty["time"] - closed_at <= grace + 0.15  # the first tick past the grace (not the next silence check)


@pytest.mark.parametrize("polls", [True, False], ids=["polled", "not-polled"])
@pytest.mark.parametrize("fault, reason", NODE_FAULTS, ids=NODE_FAULT_IDS)
def test_a_faulty_member_is_replaced_by_the_spare_and_the_pool_refilled(make, fault, reason, polls):
    c = make(count=2, spares=1).create()
    c.backend.polls = polls  # not polled (hosts, Slurm between views): a killed agent is heard only as silence here
    kind, kw = fault
    silent = kind == "freeze-node" or (kind == "kill-node" and not polls)  # (these fakes have no link to close)
    reason = "no heartbeat for" if silent else reason
    injected_at = c.clock()
    last_heartbeat = c.node("workers-0").last_heartbeat
    c.inject_fault("workers-0", kind, **kw)
    c.run_until(lambda: "faulty" in c.transitions("workers-0"), "workers-0 faulty")
    faulty = next(e for e in c.events(node="workers-0") if e["to_state"] == "faulty")
    assert reason in faulty["reason"], faulty["reason"]
    h = c.spec.health
    if silent:  # judged at the first tick past the heartbeat timeout, never before
        assert h.heartbeat_timeout_s < faulty["time"] - last_heartbeat <= h.heartbeat_timeout_s + c.interval
    else:  # the next tick (kill-node), or the heartbeat after the agent's check ran (health faults)
        assert faulty["time"] - injected_at <= 2 * c.interval

    assert c.transitions("workers-0")[-3:] == ["faulty", "replacing", "terminated"]
    replacing = next(e for e in c.events(node="workers-0") if e["to_state"] == "replacing")
    assert "replaced by spare workers-2" in replacing["reason"]
    assert ("terminate", "workers-0") in c.backend.calls
    (promoted,) = [e for e in c.events(node="workers-2") if e["kind"] == "promoted"]
    assert "replacing workers-0" in promoted["reason"]
    c.run_until(lambda: state(c, "workers-3") == "healthy", "the pool refilled")
    live = c.live()
    assert {n for n, node in live.items() if not node.is_spare} == {"workers-1", "workers-2"}
    assert [n for n, node in live.items() if node.is_spare] == ["workers-3"]
    assert "refilling spare pool" in c.events(node="workers-3")[0]["reason"]
    assert c.backend.launched() == ["workers-0", "workers-1", "workers-2", "workers-3"]
    assert c.status() == "in-service"


def test_a_healthy_node_of_a_backend_not_polled_is_observed_when_its_row_changes_or_its_silence_is_due(make):
    """Hosts, Slurm between its views: a healthy node whose agent only beats on its link (nothing new) is not
    looked at every tick (4,096 of them were a quarter of a core), yet is judged as before: news at the next
    tick, silence at the first tick past the timeout."""
    c = make(count=4, spares=0).create()
    c.backend.polls = False
    observed: list[str] = []
    observe = c.reconciler.observe
    c.reconciler.observe = lambda node, now: (observed.append(node.name), observe(node, now))[1]
    timeout = c.spec.health.heartbeat_timeout_s
    for name in c.states():  # a full heartbeat from each: observed at the next tick
        c.store.observe_node(name, last_heartbeat=c.clock())
    c.reconciler.tick()
    assert sorted(observed) == sorted(c.states())

    def beats(names, seconds):  # the agents of `names` beat on their links (no full heartbeat), ticks between
        for _ in range(round(seconds / c.interval)):
            c.clock.advance(c.interval)
            c.store.observe_beats({name: c.clock() for name in names})
            c.reconciler.tick()

    observed.clear()
    beats(c.states(), 10 * timeout)  # 60 ticks: each node observed when its silence came due (about every timeout)
    assert all(9 <= observed.count(name) <= 11 for name in c.states()), observed  # (observing all: 60 each)
    assert set(c.states().values()) == {"healthy"}
    observed.clear()
    c.store.observe_node("workers-1", health={"ok": False, "checks": [
        {"name": "disk", "status": "fail", "action": "replace-node", "detail": "disk full"}]})
    c.reconciler.tick()
    assert observed == ["workers-1"] and "faulty" in c.transitions("workers-1")
    quiet_since = c.clock()
    beats(["workers-0", "workers-3"], 2 * timeout)  # workers-2 goes silent
    faulty = next(e for e in c.events(node="workers-2") if e["to_state"] == "faulty")
    assert "no heartbeat for" in faulty["reason"]
    assert timeout < faulty["time"] - quiet_since <= timeout + c.interval
    assert state(c, "workers-0") == state(c, "workers-3") == "healthy"


@pytest.mark.parametrize("polls", [True, False], ids=["polled", "not-polled"])
def test_an_idle_tick_scans_no_node_for_recovery_status_or_refill_until_a_row_is_written(make, polls):
    """Recovery, status, retirement and refill read every node; with nothing written since a tick that left them
    nothing to do they would find the same, and at 4,096 idle nodes those scans were most of the reconciler's time.
    A write (here: `cluster scale`) is acted on at the next tick."""
    c = make(count=4, spares=1).create()
    c.backend.polls = polls
    c.steps(2)
    names, scans, nodes = list(c.states()), [], c.store.nodes
    c.store.nodes = lambda **kw: (scans.append(kw), nodes(**kw))[1]
    for _ in range(20):  # the agents beat on their links (nothing new)
        c.clock.advance(c.interval)
        c.store.observe_beats({name: c.clock() for name in names})
        c.reconciler.tick()
    assert len(scans) == (20 if polls else 0), "polled: the backend's checks, one read a tick"
    c.store.update_group("workers", count=5)
    scans.clear()
    c.reconciler.tick()
    assert scans and [n for n in nodes() if n.name not in names][0].state == NodeState.PROVISIONING
    c.store.nodes = nodes
    c.run_until(lambda: c.status() == "in-service" and len(c.states()) == 6, "the fifth member up")


def test_a_node_its_scheduler_takes_is_replaced_and_every_fault_is_handed_back_to_the_backend(make):
    c = make(count=2, spares=1).create()
    c.backend.taken_by["workers-0"] = "Slurm node n1 is drained (reason: bad DIMM): Slurm or an operator took it"
    c.run_until(lambda: "faulty" in c.transitions("workers-0"), "workers-0 faulty")
    assert c.node("workers-0").fault_cause == "scheduler"
    assert "bad DIMM" in next(e for e in c.events(node="workers-0") if e["to_state"] == "faulty")["reason"]
    c.run_until(lambda: state(c, "workers-3") == "healthy", "the pool refilled")
    assert c.live()["workers-2"].is_spare is False  # the spare took its place
    c.inject_fault("workers-1", "kill-node")
    c.run_until(lambda: "faulty" in c.transitions("workers-1"), "workers-1 faulty")
    # every fault goes to the backend, which hands the node back to its scheduler (Slurm: drain) as it sees fit
    assert c.backend.remediated == [("workers-0", "scheduler"), ("workers-1", "agent-gone")]


def test_a_faulty_spare_is_retired_and_a_refill_that_never_registers_times_out_and_is_replaced(make):
    c = make(count=1, spares=1, health={"provision_timeout_s": 10}).create()
    c.plan("workers-2", register=False)
    c.inject_fault("workers-1", "kill-node")
    c.step()
    assert c.transitions("workers-1")[-3:] == ["faulty", "replacing", "terminated"]
    retired = next(e for e in c.events(node="workers-1") if e["to_state"] == "replacing")
    assert "faulty spare retired" in retired["reason"]
    assert c.node("workers-2").is_spare and c.node("workers-2").state.value == "provisioning"
    since = c.node("workers-2").state_since
    while c.clock() - since <= 10:
        assert c.node("workers-2").state.value == "provisioning"
        c.step()
    c.step()
    assert "did not register within provision_timeout_s=10" in faulty_reason(c, "workers-2")
    c.run_until(lambda: state(c, "workers-3") == "healthy", "a fresh spare")
    assert c.node("workers-3").is_spare and c.states()["workers-2"] == "terminated"
    assert c.node("workers-0").state.value == "healthy" and c.status() == "in-service"


@pytest.mark.parametrize("how", ["lifecycle script fails", "launch fails"])
def test_refills_that_fail_to_come_up_are_replaced_until_three_in_a_row_then_provisioning_stops(make, how):
    c = make(count=1, spares=1).create()
    refills = [f"workers-{i}" for i in range(2, 2 + MAX_PROVISION_FAILURES)]
    if how == "launch fails":
        c.backend.launch_error = "fork: resource temporarily unavailable"
    else:
        for name in refills:
            c.plan(name, lifecycle_code=3, lifecycle_tail="fatal: /fsx unreachable")
    c.inject_fault("workers-1", "kill-node")
    c.steps(30)
    assert c.backend.launched() == ["workers-0", "workers-1", *refills], "no fourth try"
    for name in refills:
        assert c.transitions(name)[-3:] == ["faulty", "replacing", "terminated"], name
        expected = "could not start the agent: fork" if how == "launch fails" else "exited with code 3"
        assert expected in faulty_reason(c, name)
    assert c.store.groups()[0]["provision_failures"] == MAX_PROVISION_FAILURES
    stuck = [e for e in c.events() if e["kind"] == "waiting" and "3 nodes in a row failed to come up" in e["reason"]]
    assert len(stuck) == 1, "said once"
    assert c.node("workers-0").state.value == "healthy" and c.status() == "in-service"


def test_an_agent_that_ignores_sigterm_is_killed_after_the_grace_period(make):
    c = make(count=1, spares=1).create()
    c.backend.stubborn.add("workers-0")  # wedged: frozen, and SIGTERM + SIGCONT do not end it
    c.inject_fault("workers-0", "freeze-node")
    c.run_until(lambda: state(c, "workers-0") == "replacing", "workers-0 being replaced")
    since = c.node("workers-0").state_since
    assert ("terminate", "workers-0") in c.backend.calls
    while c.clock() - since <= TERMINATE_GRACE_S:
        assert ("kill", "workers-0") not in c.backend.calls and state(c, "workers-0") == "replacing"
        c.step()
    c.step()  # the first tick past the grace period
    assert ("kill", "workers-0") in c.backend.calls and state(c, "workers-0") == "replacing"
    c.step()
    assert state(c, "workers-0") == "terminated"
    assert "killed by SIGKILL" in c.node("workers-0").reason


@pytest.mark.parametrize("polls", [True, False], ids=["polled", "not-polled"])
def test_many_nodes_silent_at_once_are_not_judged_until_the_others_are_heard_again(make, polls):
    """More than health.mass_silence_fraction of the nodes (and at least MASS_SILENCE_MIN) silent past the timeout
    at once reads as the controller's own load or network: none is faulty, and a running job goes on. The ones still
    silent once the rest are heard again are judged then; below the minimum each node is judged alone."""
    c = make(count=10, spares=0)
    c.backend.polls = polls
    c.create()
    job = c.submit(nodes=10)
    running(c, job.id, 1, ranks=10)
    frozen = [f"workers-{i}" for i in range(MASS_SILENCE_MIN)]  # 8 of 10
    for name in frozen:
        c.inject_fault(name, "freeze-node")
    c.steps(int(3 * c.spec.health.heartbeat_timeout_s / c.interval))
    assert set(c.states().values()) == {"healthy"} and c.job(job.id).state == J.RUNNING
    (said,) = [e["reason"] for e in c.events() if "at once" in (e["reason"] or "")]
    assert said.startswith("8 of 10 nodes silent past heartbeat_timeout_s=3 at once") and "none is judged" in said
    for name in frozen[1:]:  # heard again, but workers-0
        c.backend.frozen.discard(name)
    c.run_until(lambda: state(c, "workers-0") != "healthy", "workers-0 judged once the others are heard")
    assert "no heartbeat for" in faulty_reason(c, "workers-0")
    assert all(state(c, n) == "healthy" for n in frozen[1:])
    gen1 = c.run_until(lambda: (g := c.generations(job.id)[0]).outcome and g, "generation 1 ended")
    assert gen1.outcome == "node-fault" and "node workers-0 faulty" in gen1.end_reason, "on workers-0 alone"


def test_the_nodes_left_silent_after_a_mass_silence_wait_while_the_others_keep_coming_back(make):
    """A controller catching up after a mass silence hears its nodes a few at a time (4,096 agents started together:
    the 188 still silent the tick the rest were past the fraction were judged, and failed the cluster's creation).
    The nodes still silent are judged once none came back for heartbeat_timeout_s, not as soon as too few are."""
    c = make(count=10, spares=0).create()
    timeout = c.spec.health.heartbeat_timeout_s
    frozen = [f"workers-{i}" for i in range(9)]
    for name in frozen:
        c.inject_fault(name, "freeze-node")
    c.steps(int(1.5 * timeout / c.interval))
    assert set(c.states().values()) == {"healthy"}, "a mass silence: none judged"
    for name in reversed(frozen[1:]):  # heard again one at a time, each half a timeout after the one before
        c.backend.frozen.discard(name)
        c.steps(int(0.5 * timeout / c.interval))
        assert set(c.states().values()) == {"healthy"}, f"{name} came back; the rest still wait"
    last_back = c.clock()
    c.run_until(lambda: state(c, "workers-0") != "healthy", "workers-0 judged once none came back for a timeout")
    assert timeout - 0.5 * timeout <= c.clock() - last_back <= timeout + 2 * c.interval
    assert "no heartbeat for" in faulty_reason(c, "workers-0")
    assert all(state(c, n) == "healthy" for n in frozen[1:])
    c.inject_fault("workers-9", "freeze-node")  # a node alone, after: judged at its timeout, nothing held
    silent_from = c.clock()
    c.run_until(lambda: state(c, "workers-9") != "healthy", "workers-9 judged alone")
    assert c.clock() - silent_from <= timeout + 2 * c.interval


def test_a_heartbeat_answered_late_never_dates_its_node_back(make):
    """A heartbeat queued for seconds (4,096 agents started together: 14 s), whose agent's retry was answered first
    and whose beats came since, is answered with its arrival time: the node's last sign of life stays the newest, or
    the node reads as silent (one failed a cluster's creation that way)."""
    from phalanx.control.server.heartbeat import answer_heartbeat
    from phalanx.protocol.messages import Heartbeat

    c = make(count=2, spares=0).create()
    agent = c.agents["workers-0"]
    arrived = c.clock()  # the original heartbeat arrives, and waits in the queue
    body = Heartbeat.model_validate(agent.body())
    c.steps(int(0.8 * c.spec.health.heartbeat_timeout_s / c.interval))  # its retry and heartbeats since: answered
    newest = c.node("workers-0").last_heartbeat
    assert newest > arrived
    answer_heartbeat(c.store, c.jobs, c.deep, c.started_at, c.node("workers-0"), body, arrived)  # answered at last
    assert c.node("workers-0").last_heartbeat == newest
    c.backend.frozen.add("workers-0")  # silent from here: judged at the timeout from the newest, not from `arrived`
    c.steps(int(0.5 * c.spec.health.heartbeat_timeout_s / c.interval))
    assert state(c, "workers-0") == "healthy"


def test_mass_silence_holds_many_at_once_then_the_tail_while_it_falls():
    from phalanx.control.policy.watch import MASS_SILENCE_HOLD, MassSilence

    m, heard = MassSilence(), lambda: 100
    hold = dict(timeout=3.0, fraction=0.5)
    assert m.holds([4.0] * 7, heard, now=0.0, **hold) is None, "fewer than MASS_SILENCE_MIN: judged"
    assert m.holds([4.0] * 50, heard, now=0.0, **hold) is None, "not more than half"
    assert m.holds([4.0] * 60, heard, now=1.0, **hold) == "mass" and m.heard == 100
    assert m.holds([5.0] * 20, heard, now=2.0, **hold) == "tail", "fewer: catching up"
    assert m.holds([6.0] * 20, heard, now=4.9, **hold) == "tail", "none back for less than a timeout"
    assert m.holds([7.0] * 20, heard, now=5.0, **hold) is None, "none back for a timeout: judged"
    assert m.holds([4.0], heard, now=6.0, **hold) is None, "the tail ended with its judgment"
    assert m.holds([4.0] * 60, heard, now=7.0, **hold) == "mass"
    assert m.holds([3.0 * MASS_SILENCE_HOLD] * 60, heard, now=8.0, **hold) is None, "past the hold: judged"
    assert m.holds([4.0] * 60, heard, now=9.0, timeout=3.0, fraction=None) is None, "the rule off"


def test_a_mass_silence_longer_than_its_hold_is_judged(make):
    """Hosts can die together (a rack's power): held past MASS_SILENCE_HOLD timeouts, the silent nodes are faulty."""
    from phalanx.control.policy.reconciler import MASS_SILENCE_HOLD

    c = make(count=10, spares=0).create()
    frozen = [f"workers-{i}" for i in range(9)]
    for name in frozen:
        c.inject_fault(name, "freeze-node")
    hold = MASS_SILENCE_HOLD * c.spec.health.heartbeat_timeout_s
    c.steps(int((hold - 1.0) / c.interval))
    assert set(c.states().values()) == {"healthy"}, "held"
    c.run_until(lambda: all(state(c, n) != "healthy" for n in frozen), "judged past the hold", max_steps=6)
    assert all("no heartbeat for" in faulty_reason(c, n) for n in frozen) and state(c, "workers-9") == "healthy"


@pytest.mark.parametrize("health,frozen,judged", [
    ({}, MASS_SILENCE_MIN - 1, "fewer than MASS_SILENCE_MIN: each alone"),
    ({}, 5, "half of 10 is not more than half"),
    ({"mass_silence_fraction": None}, 9, "null: each alone"),
])
def test_silence_below_the_mass_rule_is_judged_node_by_node(make, health, frozen, judged):
    c = make(count=10, spares=0, health=health).create()
    names = [f"workers-{i}" for i in range(frozen)]
    for name in names:
        c.inject_fault(name, "freeze-node")
    c.run_until(lambda: all(state(c, n) != "healthy" for n in names), f"every frozen node judged ({judged})")
    assert all("no heartbeat for" in faulty_reason(c, n) for n in names)
    assert not [e for e in c.events() if "at once" in (e["reason"] or "")]


def test_a_cluster_status_change_or_a_wait_pokes_no_agent_and_a_delete_pokes_every_one(make):
    """A poke asks agents for a full heartbeat now (`server/links.py`); at 4,096 nodes a poke to every agent is 4,096
    of them, paced over 4 s. The cluster's status changes no reply until it ends (the agents then terminate), nor
    does a wait: neither pokes. (The in-service transition poked every agent, into the benchmark's idle window.)"""
    from phalanx.control.state.store import ClusterStatus
    from phalanx.observability.events import EventKind

    c = make(count=2, spares=1).create()
    told = []
    c.store.on_change = told.append
    c.store.set_status(ClusterStatus.DEGRADED, "members not healthy: workers-1 faulty")
    c.store.set_status(ClusterStatus.IN_SERVICE, "every member node healthy")
    c.store.record_event(EventKind.WAITING, "group workers waits for capacity")
    assert told == []
    c.store.record_event(EventKind.PROMOTED, "spare promoted", node="workers-2")
    assert told == [("workers-2",)]
    c.store.set_status(ClusterStatus.DELETING, "cluster delete requested")
    assert told[1:] == [None], "every agent"
    c.step()
    assert all(a.replies[-1]["action"] == "terminate" for a in c.agents.values())


def test_a_restarted_controller_counts_heartbeat_silence_from_its_own_start(make):
    c = make(count=2, spares=1).create()
    c.clock.advance(10)  # the controller was down: no heartbeat for 10 s, far past heartbeat_timeout_s
    c.start_controller()
    c.reconciler.tick()  # before any agent got through to it
    c.steps(4)
    assert set(c.states().values()) == {"healthy"}
    assert not [e for e in c.events() if e["to_state"] == "faulty"]
    c.inject_fault("workers-1", "freeze-node")  # silence after the restart still counts
    c.run_until(lambda: "faulty" in c.transitions("workers-1"), "workers-1 faulty")
    assert "no heartbeat for 3.5 s" in faulty_reason(c, "workers-1")


def test_node_recovery_none_leaves_the_faulty_node_and_without_spares_a_fresh_node_replaces_it(make):
    keep = make(count=1, spares=0, node_recovery="none").create()
    heal = make(count=1, spares=0).create()
    for c in (keep, heal):
        c.inject_fault("workers-0", "kill-node")
        c.steps(6)
    assert keep.states() == {"workers-0": "faulty"} and keep.status() == "degraded"
    assert keep.backend.launched() == ["workers-0"]
    assert len([e for e in keep.events() if "node_recovery=none" in e["reason"]]) == 1
    assert heal.states() == {"workers-0": "terminated", "workers-1": "healthy"}
    assert not heal.node("workers-1").is_spare and heal.status() == "in-service"
    replacing = [e for e in heal.events(node="workers-0") if e["to_state"] == "replacing"][0]
    assert "freshly provisioned node (group has no spares)" in replacing["reason"]


def test_the_deep_check_runs_one_round_at_creation_then_pairs_a_refill_with_a_healthy_peer(make):
    c = make(count=2, spares=1, health={"deep_health_check": True}).create()
    for name in ("workers-0", "workers-1", "workers-2"):
        reason = [e for e in c.events(node=name) if e["to_state"] == "healthy"][0]["reason"]
        assert "deep health check: bus bandwidth 1.000 GB/s" in reason, reason
        assert "across workers-0, workers-1, workers-2, 3 processes" in reason, reason
    c.plan("workers-3", busbw=0.01)  # a slow link: below deep_check_min_busbw_gbps (0.05)
    c.inject_fault("workers-0", "kill-node")
    c.run_until(lambda: "faulty" in c.transitions("workers-3"), "the slow refill judged")
    reason = faulty_reason(c, "workers-3")
    assert "bus bandwidth 0.010 GB/s" in reason and "across workers-1, workers-3" in reason, reason
    assert "below deep_check_min_busbw_gbps=0.05" in reason
    c.run_until(lambda: state(c, "workers-4") == "healthy", "the next refill")
    reason = [e for e in c.events(node="workers-4") if e["to_state"] == "healthy"][0]["reason"]
    assert "across workers-1, workers-4" in reason, reason


def test_a_deep_check_below_the_threshold_fails_creation_with_the_figure(make):
    c = make(count=2, spares=0, health={"deep_health_check": True, "deep_check_min_busbw_gbps": 1e6})
    c.run_until(lambda: c.status() == "failed", "creation to fail")
    (why,) = c.exit_requests
    assert "deep health check: bus bandwidth 1.000 GB/s" in why and "below deep_check_min_busbw_gbps=1e+06" in why


# ---- jobs ------------------------------------------------------------------------------------------------------------
def test_refused_submits_start_nothing(make):
    c = make(count=2, spares=1)
    with pytest.raises(JobRequestError) as err:
        c.submit(nodes=1)
    assert err.value.status == 409 and "is creating" in str(err.value)
    c.create()
    with pytest.raises(JobRequestError) as err:
        c.submit(nodes=3)
    assert err.value.status == 422 and "more than group workers has: 2 worker nodes" in str(err.value)
    with pytest.raises(JobRequestError) as err:
        c.jobs.submit(kind="command", nodes=1, argv=["x"], cwd="/", recovery=protocol.CHECKPOINTLESS)
    assert err.value.status == 422 and "--recovery checkpointless needs a training config" in str(err.value)
    with pytest.raises(JobRequestError) as err:
        c.jobs.submit(kind="train", nodes=1, cwd="/")
    assert err.value.status == 422
    c.steps(2)
    assert c.jobs.records.jobs() == [] and c.jobs.records.generations() == []


def test_a_job_runs_one_generation_on_healthy_members_and_succeeds_when_every_rank_exits_0(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2)
    assert job.state == J.PENDING
    ws = running(c, job.id, 1)
    j = c.job(job.id)
    assert j.state == J.RUNNING and j.generation == 1 and j.nodes == ["workers-0", "workers-1"]
    (gen,) = c.generations(job.id)
    assert (gen.master_addr, ws[0][0].name, ws[1][0].name) == ("workers-0.fake", "workers-0", "workers-1")
    assigned = ws[1][0].assigned[(job.id, 1)]
    assert assigned["master_port"] == gen.master_port and assigned["world_size"] == 2
    assert not c.agents["workers-2"].workers, "a spare runs no job"
    assert c.node("workers-0").job == job.id
    for agent, w in ws.values():
        agent.exit_worker(w, 0)
    c.run_until(lambda: c.job(job.id).state == J.SUCCEEDED, "the job to succeed")
    (gen,) = c.generations(job.id)
    assert gen.outcome == "succeeded" and gen.end_reason == "all 2 ranks exited 0"
    assert job_states(c, job.id) == ["pending", "running", "succeeded"]
    c.step()
    assert c.node("workers-0").job is None


def test_a_job_whose_last_step_reached_the_store_just_before_its_workers_exited_records_that_step(make,
                                                                                                    monkeypatch):
    """Workers flush their last step to the store before exiting, yet the reconciler may tick between the
    heartbeat that reports the exits and the progress read that follows it: the success must still carry the
    last step, not the one before."""
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2)
    ws = running(c, job.id, 1)
    for rank in (0, 1):
        c.report_step(job.id, 1, rank, 39)
    c.step()
    assert c.job(job.id).last_step == 39
    for rank in (0, 1):
        c.report_step(job.id, 1, rank, 40)  # flushed at exit
    for agent, w in ws.values():
        agent.exit_worker(w, 0)
    with monkeypatch.context() as m:  # the tick wins the race: no heartbeat reads progress after the exits
        m.setattr(c.jobs, "assignments", lambda node: (c.clock(), [], 0))
        for agent, _w in ws.values():
            c.heartbeat(agent)
    c.reconciler.tick()
    assert c.job(job.id).state == J.SUCCEEDED and c.job(job.id).last_step == 40


def test_a_job_waits_for_free_healthy_nodes(make):
    c = make(count=2, spares=1).create()
    first = c.submit(nodes=2)
    running(c, first.id, 1)
    second = c.submit(nodes=1)
    c.steps(3)
    assert c.job(second.id).state == J.PENDING
    assert "waiting for 1 free healthy nodes of group workers (0 free now)" in c.job(second.id).reason
    c.jobs.cancel(first.id)
    running(c, second.id, 1, ranks=1)
    assert c.job(second.id).nodes == ["workers-0"], "never on the spare"


@pytest.mark.parametrize("fault, reason", NODE_FAULTS, ids=NODE_FAULT_IDS)
def test_a_node_fault_stops_the_generation_and_auto_resume_restarts_on_the_survivor_and_the_promoted_spare(
        make, fault, reason):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, auto_resume=True)
    gen1 = running(c, job.id, 1)
    survivor = gen1[0][1]
    kind, kw = fault
    c.inject_fault("workers-1", kind, **kw)
    c.run_until(lambda: c.generations(job.id)[0].stop_at is not None, "generation 1 told to stop")
    assert c.job(job.id).state == J.RECOVERING
    (g1,) = c.generations(job.id)
    assert g1.ended_at is None and survivor.state == "running", "ends only once its workers are confirmed gone"
    c.run_until(lambda: len(c.generations(job.id)) == 2, "generation 2")
    g1, g2 = c.generations(job.id)
    assert g1.outcome == "node-fault" and "node workers-1 faulty" in g1.end_reason and reason in g1.end_reason
    assert survivor.stopped and survivor.ended_at <= g2.started_at, "the survivor's worker stopped first"
    assert g2.nodes == ["workers-0", "workers-2"] and g2.master_port != g1.master_port
    j = c.job(job.id)
    assert (j.state, j.attempts, j.node_faults, j.retries) == (J.RUNNING, 2, 1, 0)
    assert "next: restart on healthy nodes (replacing workers-1) (the command is run again)" in recovery(c, job.id)
    assert job_states(c, job.id) == ["pending", "running", "recovering", "running"]
    gen2 = running(c, job.id, 2)
    assert {r: a.name for r, (a, _) in gen2.items()} == {0: "workers-0", 1: "workers-2"}
    assert gen2[0][1].pid != survivor.pid, "a restart starts fresh processes"
    c.run_until(lambda: state(c, "workers-3") == "healthy", "the pool refilled")
    assert c.node("workers-3").is_spare


def test_agents_of_a_job_changing_generation_are_asked_to_heartbeat_sooner_until_it_runs_again(make):
    from phalanx.control.policy.assignments import FAST_POLL_S

    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, auto_resume=True)
    running(c, job.id, 1)
    survivor = c.agents["workers-0"]
    assert "next_heartbeat_s" not in survivor.replies[-1], "a running generation: the normal interval"
    c.inject_fault("workers-1", "kill-node")
    c.run_until(lambda: c.generations(job.id)[0].stop_at is not None, "generation 1 told to stop")
    seen = len(survivor.replies)
    c.run_until(lambda: len(c.generations(job.id)) == 2, "generation 2")
    stopping = survivor.replies[seen:]
    assert stopping and all(r.get("next_heartbeat_s") == FAST_POLL_S for r in stopping)
    running(c, job.id, 2)
    c.run_until(lambda: "next_heartbeat_s" not in survivor.replies[-1], "the interval again once its workers run")
    assert "next_heartbeat_s" not in c.agents["workers-2"].replies[-1]


def test_a_hurry_stretched_to_the_interval_or_past_it_is_not_asked(make, monkeypatch):
    """The hurried poll is stretched with the generation's size (at most FAST_POLL_PER_S heartbeats a second); past
    the interval it would slow the agents down instead: 4,096 nodes at 1,000 a second is 4.1 s, beyond the default
    heartbeat_timeout_s of 3 s, and every agent obeying it was judged silent at its job's launch."""
    from phalanx.control.policy import assignments

    c = make(count=2, spares=1).create()
    monkeypatch.setattr(assignments, "FAST_POLL_PER_S", 2 / (1.5 * c.interval))  # 2 nodes: 1.5 intervals
    job = c.submit(nodes=2, auto_resume=True)
    running(c, job.id, 1)
    survivor = c.agents["workers-0"]
    seen = len(survivor.replies)
    c.inject_fault("workers-1", "kill-node")
    c.run_until(lambda: len(c.generations(job.id)) == 2, "generation 2")
    running(c, job.id, 2)
    assert len(survivor.replies) > seen and all("next_heartbeat_s" not in r for r in survivor.replies[seen:])
    monkeypatch.setattr(assignments, "FAST_POLL_PER_S", 2 / (0.5 * c.interval))  # half an interval: asked
    c.inject_fault("workers-2", "kill-node")
    c.run_until(lambda: len(c.generations(job.id)) == 3, "generation 3")
    assert 0.5 * c.interval in [r.get("next_heartbeat_s") for r in survivor.replies[seen:]]


def test_a_node_fault_without_auto_resume_fails_the_job_and_the_node_is_still_replaced(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2)
    gen1 = running(c, job.id, 1)
    c.inject_fault("workers-1", "kill-node")
    c.run_until(lambda: c.job(job.id).state == J.FAILED, "the job to fail")
    j = c.job(job.id)
    assert j.attempts == 1 and "node workers-1 faulty" in j.reason and "auto-resume is off" in j.reason, j.reason
    assert gen1[0][1].stopped, "the survivor's worker is stopped"
    assert len(c.generations(job.id)) == 1 and c.generations(job.id)[0].outcome == "node-fault"
    c.steps(2)
    assert c.states()["workers-1"] == "terminated" and not c.node("workers-2").is_spare


def test_without_a_free_spare_the_job_waits_for_a_fresh_node(make):
    c = make(count=2, spares=0).create()
    job = c.submit(nodes=2, auto_resume=True)
    running(c, job.id, 1)
    c.inject_fault("workers-0", "kill-node")
    c.run_until(lambda: c.job(job.id).reason and "waiting for 1 healthy node(s) to replace workers-0"
                in c.job(job.id).reason, "the job to wait")
    assert "spare pool: 0 healthy spares, 0 being provisioned" in c.job(job.id).reason
    assert len(c.generations(job.id)) == 1
    c.run_until(lambda: len(c.generations(job.id)) == 2, "generation 2")
    g2 = c.generations(job.id)[1]
    assert g2.nodes == ["workers-2", "workers-1"], "the fresh node takes rank 0's place"
    healthy_at = next(e["time"] for e in c.events(node="workers-2") if e["to_state"] == "healthy")
    assert g2.started_at >= healthy_at


def test_app_errors_retry_on_the_same_nodes_up_to_max_retries_then_fail(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, max_retries=2, auto_resume=True)
    for g in (1, 2, 3):
        agent, w = running(c, job.id, g)[1]
        agent.exit_worker(w, 3)
        c.run_until(lambda: c.jobs.records.generation(job.id, g).ended_at is not None, f"generation {g} to end")
        if g < 3:
            assert c.job(job.id).retries == g and f"retry {g}/2 on the same nodes" in recovery(c, job.id)
    c.step()
    j = c.job(job.id)
    assert (j.state, j.attempts, j.retries) == (J.FAILED, 3, 2)
    assert "rank 1 on workers-1 exited with code 3" in j.reason and "max_retries=2" in j.reason, j.reason
    gens = c.generations(job.id)
    assert [g.outcome for g in gens] == ["app-error"] * 3
    assert all(g.nodes == ["workers-0", "workers-1"] for g in gens)
    assert len({g.master_port for g in gens}) == 3, "a fresh rendezvous port per generation"
    assert not [e for e in c.events() if e["to_state"] == "faulty"], "an app error replaces nothing"


def test_a_killed_worker_of_a_restart_job_is_an_app_error_retried_on_the_same_nodes(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, max_retries=1)
    first = running(c, job.id, 1)
    c.inject_fault("workers-1", "kill-worker")
    assert c.backend.signals == [("workers-1", first[1][1].pid, signal.SIGKILL)]
    second = running(c, job.id, 2)
    g1, g2 = c.generations(job.id)
    assert g1.outcome == "app-error" and "rank 1 on workers-1 killed by SIGKILL" in g1.end_reason
    assert g2.nodes == g1.nodes and c.job(job.id).retries == 1 and first[0][1].stopped
    assert {a.name for a, _ in second.values()} == {"workers-0", "workers-1"}
    assert not [e for e in c.events() if e["to_state"] == "faulty"]


def test_a_frozen_hang_is_a_node_fault_and_only_the_frozen_ranks_node_is_replaced(make):
    c = make(count=2, spares=1, health={"hang_timeout_s": 4.0}).create()
    job = c.submit(nodes=2, auto_resume=True)
    running(c, job.id, 1)
    injected_at = c.clock()
    c.inject_fault("workers-1", "hang-worker")
    c.run_until(lambda: len(c.generations(job.id)) == 2, "generation 2")
    g1, g2 = c.generations(job.id)
    assert g1.outcome == "node-fault" and "rank 1 on workers-1 hung (frozen" in g1.end_reason, g1.end_reason
    assert 4.0 <= g1.stop_at - injected_at <= 4.0 + 2 * c.interval, "hang_timeout_s, then the next heartbeat"
    assert "a hang is a node fault" in faulty_reason(c, "workers-1")
    assert not [e for e in c.events(node="workers-0") if e["to_state"] == "faulty"], "the waiting rank's node stays"
    assert g2.nodes == ["workers-0", "workers-2"]
    assert [e for e in c.events(job=job.id) if e["kind"] == "hang"]
    hung = [w for w in c.jobs.records.workers(job=job.id, generation=1) if w.hang]
    assert [(w.rank, w.frozen, w.detail) for w in hung] == [(1, True, "killed by SIGKILL")]


def test_a_stalled_hang_is_an_app_error_on_the_same_nodes(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, auto_resume=True, max_retries=1)
    for agent, w in running(c, job.id, 1).values():  # every rank alive, nobody progressing: a deadlock
        agent.hang(w, frozen=False)
    running(c, job.id, 2)
    g1, g2 = c.generations(job.id)
    assert g1.outcome == "app-error" and "hung (stalled" in g1.end_reason, g1.end_reason
    assert g2.nodes == g1.nodes and c.job(job.id).retries == 1
    assert not [e for e in c.events() if e["to_state"] == "faulty"], "a stall replaces nothing"


def test_a_restart_job_xid_restarts_on_the_same_nodes_without_using_a_retry_and_fails_without_auto_resume(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, auto_resume=True, max_retries=0)
    first = running(c, job.id, 1)
    c.inject_fault("workers-0", "gpu-xid", xid=13)
    running(c, job.id, 2)
    g1, g2 = c.generations(job.id)
    assert g1.outcome == "restart-job" and "XID [13] (injected): application-level fault" in g1.end_reason
    assert g2.nodes == g1.nodes and c.job(job.id).retries == 0 and first[0][1].stopped
    c.steps(4)  # the node's latest health still names the XID, but it predates generation 2
    assert len(c.generations(job.id)) == 2 and c.job(job.id).state == J.RUNNING
    assert c.node("workers-0").state.value == "healthy"
    c.jobs.cancel(job.id)

    plain = c.submit(nodes=2)
    running(c, plain.id, 1)
    c.inject_fault("workers-1", "gpu-xid", xid=31)
    c.run_until(lambda: c.job(plain.id).state == J.FAILED, "the job to fail")
    assert "XID [31]" in c.job(plain.id).reason and "auto-resume is off" in c.job(plain.id).reason
    assert not [e for e in c.events() if e["to_state"] == "faulty"], "a job-level XID replaces nothing"


def test_a_running_jobs_nodes_are_scanned_for_faults_again_only_after_a_write(make, monkeypatch):
    """`JobScheduler._node_faults`: a tick scans the generation's nodes again only after a write since a scan that
    found none (`Store.version`, which a health report with a failed check moves too); at 4,096 nodes that scan was
    25-110 ms of every tick under the lock heartbeats wait on. A restart-job health failure is still found."""
    from phalanx.control.policy import scheduler

    scans, real = [], scheduler.restart_job_failures
    monkeypatch.setattr(scheduler, "restart_job_failures", lambda health, since: scans.append(1) or real(health, since))
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, auto_resume=True)
    running(c, job.id, 1)
    c.steps(3)
    scans.clear()
    c.steps(10)
    assert scans == [], "nothing written since the last scan: the nodes are not scanned again"
    c.inject_fault("workers-0", "gpu-xid", xid=13)
    running(c, job.id, 2)
    assert scans and c.generations(job.id)[0].outcome == "restart-job"


def test_cancel_stops_the_generation_and_frees_its_nodes(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2)
    ws = running(c, job.id, 1)
    assert c.jobs.cancel(job.id).state == J.CANCELLED
    with pytest.raises(JobRequestError) as err:
        c.jobs.cancel(job.id)
    assert err.value.status == 409
    c.run_until(lambda: c.generations(job.id)[0].ended_at is not None, "the cancelled generation to end")
    assert c.generations(job.id)[0].outcome == "cancelled"
    assert all(w.stopped for _, w in ws.values())
    nxt = c.submit(nodes=2)
    running(c, nxt.id, 1)
    assert c.job(nxt.id).nodes == ["workers-0", "workers-1"]


def test_slurms_time_limit_warning_relayed_by_the_agents_asks_the_training_job_for_one_checkpoint(make):
    """Every node of an allocation gets Slurm's USR2 before its time limit, and each agent relays it in every
    heartbeat: the training job on those nodes is asked for a checkpoint once (its generation's request key),
    a spare's warning asks nothing, and a warning a minute later (another allocation's) asks again."""
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)  # (a train job)
    running(c, job.id, 1)
    key = protocol.checkpoint_request_key(job.id, 1)
    asked = lambda: [e for e in c.events(job=job.id) if e["kind"] == "checkpoint-requested"]  # noqa: E731
    c.agents["workers-2"].time_limit_warned_at = c.clock()  # the spare: no job runs there
    c.steps(2)
    assert key not in c.rendezvous.data and not asked()
    for name in ("workers-0", "workers-1"):
        c.agents[name].time_limit_warned_at = c.clock()
    c.steps(3)
    (event,) = asked()
    assert "Slurm's warning before the time limit of node workers-0's allocation" in event["reason"], event
    first = int(c.rendezvous.data[key])
    c.clock.advance(61)
    c.agents["workers-1"].time_limit_warned_at = c.clock()
    c.steps(2)
    assert len(asked()) == 2 and int(c.rendezvous.data[key]) >= first
    cmd = c.submit(nodes=1)  # a command job is not asked (Phalanx does not know how it saves)
    with pytest.raises(JobRequestError, match="runs a command: Phalanx checkpoints training jobs only"):
        c.jobs.request_checkpoint(cmd.id)


def test_a_controller_restart_leaves_the_running_job_and_its_progress_alone(make):
    c = make(count=2, spares=0).create()
    job = c.submit(nodes=2, auto_resume=True)
    before = {r: w.pid for r, (_, w) in running(c, job.id, 1).items()}
    for rank in (0, 1):
        c.report_step(job.id, 1, rank, 7)
    c.run_until(lambda: c.job(job.id).last_step == 7, "progress recorded")
    c.clock.advance(10)  # the controller was down past the heartbeat timeout; the workers kept training
    c.start_controller()
    c.rendezvous.data.clear()  # the restarted controller's store comes back empty
    for rank in (0, 1):
        c.report_step(job.id, 1, rank, 9)  # workers re-publish at their next step
    c.run_until(lambda: c.job(job.id).last_step == 9, "progress after the restart")
    c.steps(4)
    assert {r: w.pid for r, (_, w) in c.workers(job.id).items()} == before
    j = c.job(job.id)
    assert (j.state, j.generation, j.attempts) == (J.RUNNING, 1, 1) and len(c.generations(job.id)) == 1
    assert not [e for e in c.events() if e["to_state"] == "faulty"]


# ---- checkpointless jobs: in place ------------------------------------------------------------------------------
def test_a_checkpointless_node_fault_recovers_in_place_with_survivors_carried_and_a_standby_taking_the_rank(make):
    c = make(count=2, spares=1, warm_standby=True).create()
    c.steps(2)  # idle nodes keep warm standbys
    spare_standby = c.agents["workers-2"].standbys[0]
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    gen1 = running(c, job.id, 1)
    survivor = gen1[0][1]
    assert c.rendezvous.get(protocol.generation_key(job.id)) == b"1"
    c.inject_fault("workers-1", "kill-node")
    c.step()  # one tick: faulty, generation 1 ended in place, spare promoted, generation 2 started
    g1, g2 = c.generations(job.id)
    assert g1.outcome == "node-fault" and g1.ended_at == g1.stop_at, "nobody is waited for"
    assert g2.nodes == ["workers-0", "workers-2"] and g2.standbys == {"1": spare_standby}
    assert "survivors keep running and wait for generation 2 with workers-1 replaced" in recovery(c, job.id)
    layout = json.loads(c.rendezvous.get(protocol.layout_key(job.id, 2)))
    assert layout["nodes"] == ["workers-0", "workers-2"] and c.rendezvous.get(protocol.generation_key(job.id)) == b"2"
    assert c.rendezvous.check([protocol.standby_key(spare_standby)]), "the standby's rank env was published"
    assert not survivor.stopped
    gen2 = running(c, job.id, 2)
    assert gen2[0][1] is survivor and survivor.pid == gen1[0][1].pid and survivor.carried_from == [1, 0]
    assert gen2[1][1].pid == c.standby_pids[spare_standby], "the warm standby was adopted"
    rows = {(w.generation, w.rank): w.state for w in c.jobs.records.workers(job=job.id)}
    assert rows[(1, 0)] == "carried" and rows[(2, 0)] == rows[(2, 1)] == "running"
    assert c.job(job.id).node_faults == 1 and c.job(job.id).state == J.RUNNING

    summary = {"source": "peer-memory", "step": 16, "bytes": 4096, "seconds": 0.25,
               "events": [{"event": "resumed", "step": 16, "world_size": 2, "steps_lost": 0}]}
    c.rendezvous.set(protocol.recovered_key(job.id, 2), json.dumps(summary))
    c.step()
    assert c.generations(job.id)[1].restored["source"] == "peer-memory"
    kinds = {e["kind"]: e["reason"] for e in c.events(job=job.id)}
    assert "restored from peer-memory at step 16" in kinds["state_restored"]
    assert "training resumed at step 16 on 2 ranks, 0 committed step(s) redone" in kinds["resumed"]


def test_the_spare_refill_waits_for_the_relaunched_generations_first_step_at_most_refill_hold_s(make):
    from phalanx.control.policy.reconciler import REFILL_HOLD_S

    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    running(c, job.id, 1)
    c.inject_fault("workers-1", "kill-node")
    c.step()  # the spare promoted and generation 2 started in this tick: the refill waits
    assert c.job(job.id).generation == 2 and "workers-3" not in c.backend.launched()
    running(c, job.id, 2)
    c.steps(2)
    assert "workers-3" not in c.backend.launched(), "no first step yet: still held"
    for rank in (0, 1):
        c.report_step(job.id, 2, rank, 5)  # where the generation starts
    c.step()
    for rank in (0, 1):
        c.report_step(job.id, 2, rank, 6)  # its first step
    c.run_until(lambda: "workers-3" in c.backend.launched(), "the refill once the first step is in")
    assert c.generations(job.id)[1].first_step_at is not None
    (refill,) = [e for e in c.events(node="workers-3")]
    assert "refilling spare pool" in refill["reason"]

    # a relaunch whose first step never comes holds the refill REFILL_HOLD_S at most
    c.run_until(lambda: state(c, "workers-3") == "healthy", "the new spare healthy")
    c.inject_fault("workers-0", "kill-node")
    c.step()
    started = c.generations(job.id)[2].started_at
    c.run_until(lambda: "workers-4" in c.backend.launched(), "the refill after the hold", max_steps=60)
    (refill,) = [e for e in c.events(node="workers-4")]
    assert REFILL_HOLD_S <= refill["time"] - started <= REFILL_HOLD_S + 2 * c.interval


def test_a_checkpointless_node_fault_marks_the_dead_nodes_worker_lost_not_running(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    running(c, job.id, 1)
    c.inject_fault("workers-1", "kill-node")
    running(c, job.id, 2)
    c.steps(3)
    old = {w.rank: w for w in c.jobs.records.workers(job=job.id, generation=1)}
    assert old[0].state == "carried"
    assert old[1].state == "lost" and "its node workers-1 failed" in old[1].detail, (old[1].state, old[1].detail)


def test_a_checkpointless_worker_killed_is_a_process_fault_recovered_in_place_on_the_same_nodes(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    gen1 = running(c, job.id, 1)
    c.inject_fault("workers-1", "kill-worker")
    gen2 = running(c, job.id, 2)
    g1, g2 = c.generations(job.id)
    assert g1.outcome == "process-fault" and g2.nodes == g1.nodes
    assert "a new process in the failed one's place" in recovery(c, job.id)
    assert gen2[0][1] is gen1[0][1] and gen2[0][1].carried_from == [1, 0], "the survivor carried"
    assert gen2[1][1].pid != gen1[1][1].pid and gen2[1][1].carried_from is None, "the killed rank starts fresh"
    assert c.job(job.id).retries == 0 and not [e for e in c.events() if e["to_state"] == "faulty"]


def test_a_checkpointless_worker_that_gave_up_a_generation_it_was_stuck_in_is_replaced_in_place(make):
    """EXIT_STUCK: the worker's main thread stayed blocked in the old generation's group creation after a newer
    one appeared, so it exited; a fresh process takes its rank, the survivors keep theirs, no retry is used."""
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    ws = running(c, job.id, 1)
    ws[1][0].exit_worker(ws[1][1], protocol.EXIT_STUCK)
    gen2 = running(c, job.id, 2)
    g1, _g2 = c.generations(job.id)
    assert g1.outcome == "process-fault" and "stuck in a generation's process-group creation" in g1.end_reason
    assert gen2[0][1] is ws[0][1] and gen2[1][1].pid != ws[1][1].pid and gen2[1][1].carried_from is None
    assert c.job(job.id).retries == 0


def test_a_checkpointless_second_node_lost_while_regrouping_recovers_in_place_again(make):
    c = make(count=2, spares=2).create()
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    survivor = running(c, job.id, 1)[0][1]
    c.inject_fault("workers-1", "kill-node")
    c.step()
    assert c.generations(job.id)[1].nodes == ["workers-0", "workers-2"]
    c.inject_fault("workers-2", "kill-node")  # the replacement dies before generation 2 ever ran
    gen3 = running(c, job.id, 3)
    outcomes = [g.outcome for g in c.generations(job.id)]
    assert outcomes == ["node-fault", "node-fault", None]
    assert c.generations(job.id)[2].nodes == ["workers-0", "workers-3"]
    assert gen3[0][1] is survivor and survivor.stopped is False, "the survivor carried through both"
    assert c.job(job.id).node_faults == 2


def test_a_checkpointless_collective_broken_with_nobody_dead_regroups_every_process_after_the_grace(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    gen1 = running(c, job.id, 1)
    c.rendezvous.add(protocol.left_key(job.id, 1), 1)  # rank 1 left generation 1 after a failed collective
    c.step()
    seen = c.clock() - c.interval
    h = c.spec.health
    grace = h.heartbeat_timeout_s + 2 * h.heartbeat_interval_s
    while c.clock() - seen < grace:
        assert len(c.generations(job.id)) == 1, "a real fault may still show up"
        c.step()
    gen2 = running(c, job.id, 2)
    g1, g2 = c.generations(job.id)
    assert g1.outcome == "stranded" and "left generation 1" in g1.end_reason and g2.nodes == g1.nodes
    assert {r: w.pid for r, (_, w) in gen2.items()} == {r: w.pid for r, (_, w) in gen1.items()}
    assert all(w.carried_from == [1, r] for r, (_, w) in gen2.items()), "every process carried"
    assert "every process regroups in generation 2 on the same nodes" in recovery(c, job.id)


def test_a_checkpointless_job_whose_node_froze_as_training_ended_succeeds(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    ws = running(c, job.id, 1)
    c.inject_fault("workers-1", "freeze-node")
    c.rendezvous.set(protocol.finished_key(job.id), json.dumps({"step": 48}))
    ws[0][0].exit_worker(ws[0][1], 0)  # rank 0 exits; rank 1's exit is never reported (its agent is frozen)
    c.steps(2)
    assert c.job(job.id).state == J.RUNNING, "waits while rank 1's node may still report"
    c.run_until(lambda: c.job(job.id).state == J.SUCCEEDED, "the job to succeed")
    j = c.job(job.id)
    assert j.last_step == 48 and len(c.generations(job.id)) == 1
    assert "rank 1 not seen exiting: its node workers-1 is faulty" in j.reason, j.reason


def test_a_checkpointless_app_error_is_not_recovered_in_place(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    ws = running(c, job.id, 1)
    ws[1][0].exit_worker(ws[1][1], 1)  # a bug, a bad batch: the peers' state is not to be trusted
    c.run_until(lambda: c.job(job.id).state == J.FAILED, "the job to fail")
    (g1,) = c.generations(job.id)
    assert g1.outcome == "app-error" and ws[0][1].stopped, "the survivor was stopped, not carried"
    assert "max_retries=0" in c.job(job.id).reason


def test_in_place_recoveries_that_never_restore_end_in_a_restart_with_fresh_processes(make):
    c = make(count=2, spares=1).create()
    job = c.submit(nodes=2, recovery=protocol.CHECKPOINTLESS)
    survivor = running(c, job.id, 1)[0][1]
    for g in range(1, MAX_FAILED_REGROUPS + 2):
        running(c, job.id, g)
        c.inject_fault("workers-1", "kill-worker")  # rank 1 dies again before any state was restored
        c.run_until(lambda: len(c.generations(job.id)) == g + 1, f"generation {g + 1}")
    outcomes = [g.outcome for g in c.generations(job.id)]
    assert outcomes == ["process-fault"] * MAX_FAILED_REGROUPS + ["regroup-failed", None], outcomes
    last = c.generations(job.id)[-1]
    assert f"{MAX_FAILED_REGROUPS} in-place recoveries in a row failed" in c.generations(job.id)[-2].end_reason
    fresh = running(c, job.id, last.generation)
    assert survivor.stopped, "the survivor was stopped this time"
    assert all(w.carried_from is None and w.pid != survivor.pid for _, w in fresh.values())
    assert last.nodes == ["workers-0", "workers-1"]

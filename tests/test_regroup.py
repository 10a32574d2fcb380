"""The regroup after a fault, piece by piece (the end-to-end drills are in test_checkpointless.py):

- a process-group rendezvous whose peer never comes is abandoned as soon as a newer generation is published
  (and bounded otherwise), instead of blocking for the process-group timeout;
- a rank blocked where no store wait can notice (gloo connecting to a peer that died while the groups formed)
  gives up its generation soon after a newer one appears, and the controller hands its rank to a fresh process;
- exactly one process holds a rank in a generation;
- a generation that failed half-way through building its groups leaves no stale group counter behind;
- a fault during the recovery from another keeps the step of the state the rank holds (no negative steps);
- the agent adopts a standby that a failed generation activated as that slot's survivor, instead of starting
  a second process for the same rank, and keeps standbys while its job is between generations;
- the controller stops recovering in place after repeated regroups that never restored, and restarts.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from phalanx import protocol
from phalanx.protocol.messages import Assignment

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the rendezvous store ------------------------------------------------------------------------------------
RANK_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from phalanx.resilience.membership import RegroupStore, Superseded
    from phalanx.process import exit_without_teardown

    port, rank, world = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    tcp = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
    newer = lambda: int(tcp.get("newest")) if tcp.check(["newest"]) else 0
    store = RegroupStore(dist.PrefixStore("gen1", tcp), newer=newer, superseded=lambda g: Superseded(1, g),
                         timeout_s=float(sys.argv[4]))
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
        out = {"result": "formed"}
    except Superseded as err:
        out = {"result": "superseded", "newer": err.newer}
    except TimeoutError as err:
        out = {"result": "timeout", "error": str(err)}
    print(json.dumps(out), flush=True)
    exit_without_teardown(0)
""")


def _ranks(port: int, world: int, present: list[int], timeout_s: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(port), str(r), str(world), str(timeout_s)],
                             stdout=subprocess.PIPE, text=True, env={"GLOO_SOCKET_IFNAME": "lo", "PATH": "/usr/bin",
                                                                     "OMP_NUM_THREADS": "1",
                                                                     "PYTHONPATH": str(ROOT / "src")})
            for r in present]


def test_a_rendezvous_missing_a_peer_is_abandoned_when_a_newer_generation_appears():
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs = _ranks(port, 3, [0, 1], timeout_s=300)  # rank 2 "died after it arrived": never comes
    time.sleep(3)  # both wait inside init_process_group (gloo's rendezvous) for rank 2
    assert all(p.poll() is None for p in procs), "the group cannot form without rank 2"
    server.set("newest", "2")
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert outs == [{"result": "superseded", "newer": 2}] * 2, outs


def test_a_rendezvous_missing_a_peer_is_bounded_by_the_regroup_timeout():
    port = _free_port()
    _server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    (proc,) = _ranks(port, 2, [0], timeout_s=2)  # the process-group timeout is 600 s
    out = json.loads(proc.communicate(timeout=60)[0])
    assert out["result"] == "timeout" and "within 2 s" in out["error"], out


MEMBER_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import torch, torch.distributed as dist
    from phalanx.resilience.membership import Membership
    from phalanx.process import exit_without_teardown

    def join(port, node):  # the store is built in here: nothing in this frame outlives the call
        m = Membership(f"127.0.0.1:{port}", "7", node, 0, token="tok")
        p = m.placement(1)
        m.arrive(p, 60)
        m.init_process_group(p, "gloo", 600, 60)
        return m

    membership = join(int(sys.argv[1]), sys.argv[2])
    gc.collect()
    group = dist.new_group([0, 1])  # the device mesh's groups rendezvous on the same store, later
    x = torch.ones(2)
    dist.all_reduce(x, group=group)
    print(json.dumps({"sum": x.tolist()}), flush=True)
    dist.destroy_process_group()
    exit_without_teardown(0)
""")


def test_a_generation_forms_its_groups_through_membership_when_everyone_comes():
    port = _free_port()
    server = protocol.namespaced(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), "tok")
    protocol.publish_generation(server, "7", 1, ["n0", "n1"], 1)
    env = {"GLOO_SOCKET_IFNAME": "lo", "PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", MEMBER_SCRIPT, str(port), node], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for node in ("n0", "n1")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [json.loads(o or "{}") for o, _ in outs] == [{"sum": [2.0, 2.0]}] * 2, [e[-2000:] for _, e in outs]


# ---- a rank stuck where it cannot notice ------------------------------------------------------------------------
STUCK_SCRIPT = textwrap.dedent("""
    import sys, time
    from phalanx.resilience.membership import Membership

    port, formed = int(sys.argv[1]), sys.argv[2] == "formed"
    m = Membership(f"127.0.0.1:{port}", "7", "n1", 0, token="tok", stuck_grace_s=1.0)
    m.forming(1)
    if formed:
        m.watch(1)  # generation 1 formed and trains: a newer generation is news for the loop, not a reason to exit
    print("waiting", flush=True)
    time.sleep(8)  # stands for a C++ wait that releases the GIL and never returns in time (gloo's connect)
    print("superseded" if m.superseded.is_set() else "not superseded", flush=True)
    from phalanx.process import exit_without_teardown
    exit_without_teardown(0)  # as a worker ends (phalanx/process.py): the watch thread may be inside a store call
""")


@pytest.mark.parametrize("formed", [False, True], ids=["forming", "formed"])
def test_a_rank_stuck_forming_a_generation_exits_once_a_newer_one_appears(formed):
    port = _free_port()
    server = protocol.namespaced(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), "tok")
    protocol.publish_generation(server, "7", 1, ["n0", "n1"], 1)
    proc = subprocess.Popen([sys.executable, "-c", STUCK_SCRIPT, str(port), "formed" if formed else "forming"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")})
    assert proc.stdout.readline() == "waiting\n"
    protocol.publish_generation(server, "7", 2, ["n0", "n1"], 1)
    out, err = proc.communicate(timeout=60)
    if formed:
        assert proc.returncode == 0 and out == "superseded\n", err[-2000:]
    else:
        assert proc.returncode == protocol.EXIT_STUCK and out == "", (proc.returncode, out, err[-2000:])
        assert "still forming generation 1" in err and "line 11, in <module>" in err, err[-2000:]  # the sleep


STEPPING_SCRIPT = textwrap.dedent("""
    import sys, time
    from phalanx.resilience.membership import Membership

    m = Membership(f"127.0.0.1:{sys.argv[1]}", "7", "n1", 0, token="tok", stuck_grace_s=1.0)
    m.forming(1)
    m.watch(1)
    m.on_step_start(None, 0)  # the trainer's callbacks and the run loop: one step done, the next one in flight
    m.on_step_end(None, {})
    m.at_boundary()
    m.on_step_start(None, 1)
    if sys.argv[2] == "save":  # the step ended; its checkpoint save is in flight
        m.on_step_end(None, {})
    print("waiting", flush=True)
    time.sleep(8)  # stands for a collective whose peer stopped without dying (a frozen host)
    print("superseded" if m.superseded.is_set() else "not superseded", flush=True)
    from phalanx.process import exit_without_teardown
    exit_without_teardown(0)  # as a worker ends (phalanx/process.py): the watch thread may be inside a store call
""")


@pytest.mark.parametrize("where", ["step", "save"])
def test_a_rank_blocked_inside_a_step_or_its_save_exits_once_a_newer_generation_appears(where):
    """A frozen host keeps its sockets open: its peers' collective would wait out the group's timeout. Inside a
    step or the checkpoint save after it, a rank superseded for max(stuck_grace_s, 3 × its longest step) exits so
    a fresh process takes its rank."""
    port = _free_port()
    server = protocol.namespaced(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), "tok")
    protocol.publish_generation(server, "7", 1, ["n0", "n1"], 1)
    proc = subprocess.Popen([sys.executable, "-c", STEPPING_SCRIPT, str(port), where],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")})
    assert proc.stdout.readline() == "waiting\n"
    protocol.publish_generation(server, "7", 2, ["n0", "n1"], 1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == protocol.EXIT_STUCK and out == "", (proc.returncode, out, err[-2000:])
    assert "still training generation 1" in err and "in a collective" in err, err[-2000:]


CUT_PEER_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist

    rank, store_port, pg_port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    pg_store = dist.TCPStore("127.0.0.1", pg_port, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=pg_store, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    dist.all_reduce(torch.ones(4))
    if rank == 0:  # the peer on node n0: its host is about to die without a word (the test stops it)
        print("ready", flush=True)
        time.sleep(600)
    from phalanx.resilience.membership import Membership

    m = Membership(f"127.0.0.1:{store_port}", "7", "n1", 0, token="tok", stuck_grace_s=60.0)
    m.forming(1)
    m.watch(1)
    m.on_step_start(None, 1)
    print("waiting", flush=True)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))  # blocks: the peer is gone
        print("returned", flush=True)
    except RuntimeError as err:
        print(f"raised after {time.monotonic() - start:.1f} s: {err}".splitlines()[0], flush=True)
    print(f"the store still answers: generation {m.latest()}", flush=True)
    os._exit(0)
""")


def test_a_rank_inside_a_step_cuts_its_peers_connections_when_a_fault_took_a_node_of_its_generation():
    """A host that dies whole (power, link) closes no connection: a survivor's collective with it would wait out
    the group's timeout, and the survivor would exit (EXIT_STUCK) and lose its state. When the controller
    publishes the next generation without that node, the watch thread cuts this process's connections to the
    generation's peers: the collective fails at once as a peer fault, the process lives on with its state, and
    its connection to the controller's store is kept."""
    port, pg_port = _free_port(), _free_port()
    server = protocol.namespaced(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), "tok")
    pg_server = dist.TCPStore("127.0.0.1", pg_port, is_master=True, wait_for_workers=False)  # noqa: F841
    protocol.publish_generation(server, "7", 1, ["n0", "n1"], 1)
    env = {"PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), "GLOO_SOCKET_IFNAME": "lo"}
    peer, subject = (subprocess.Popen([sys.executable, "-c", CUT_PEER_SCRIPT, str(r), str(port), str(pg_port)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                     for r in (0, 1))
    try:
        assert peer.stdout.readline() == "ready\n"
        assert subject.stdout.readline() == "waiting\n"
        peer.send_signal(signal.SIGSTOP)  # its sockets stay open and silent
        protocol.publish_generation(server, "7", 2, ["n2", "n1"], 1)  # n0 replaced after a fault
        out, err = subject.communicate(timeout=60)
    finally:
        peer.kill()
        peer.wait()
    assert subject.returncode == 0, (subject.returncode, out, err[-2000:])
    raised, store = out.splitlines()
    assert raised.startswith("raised after ") and float(raised.split()[2]) < 10, (out, err[-2000:])
    assert store == "the store still answers: generation 2", out
    assert "generation 1 lost n0 to a fault mid-step: cut" in err, err[-2000:]


def test_the_stuck_grace_is_the_jobs_setting(tmp_path, demo_data):
    """`resilience.stuck_grace_s` reaches the worker's watch (a big model's build + checkpoint load may need more
    than the default 10 s), and a bad value is refused with the field named."""
    import torch
    from conftest import tiny_config
    from phalanx.resilience.run import CheckpointlessRun
    from phalanx.train.config import ConfigError

    port = _free_port()
    _server = protocol.namespaced(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), "tok")
    config = tiny_config(tmp_path, demo_data, resilience={"recovery": "checkpointless", "stuck_grace_s": 42.0})
    env = {protocol.STORE_ADDR: f"127.0.0.1:{port}", protocol.JOB_ID: "7", protocol.NODE: "n0",
           protocol.LOCAL_RANK: "0", protocol.RANK: "0", protocol.GENERATION: "1", protocol.CLUSTER_TOKEN: "tok",
           protocol.PROTOCOL_ENV: str(protocol.PROTOCOL_VERSION)}
    run = CheckpointlessRun(config, torch.device("cpu"), "gloo", env=env)
    run.reporter.close()
    assert run.membership.stuck_grace_s == 42.0
    with pytest.raises(ConfigError, match="stuck_grace_s"):
        tiny_config(tmp_path, demo_data, resilience={"stuck_grace_s": 0})


DYING_PEER_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    import torch.distributed as dist
    from phalanx.resilience import membership as M
    from phalanx.process import exit_without_teardown

    port, node, dies = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "dies"
    armed = []

    class DiesAfterItsAddress(M.RegroupStore):  # dies after writing its address for the next group
        def set(self, key, value):
            super().set(key, value)
            if armed:
                os.kill(os.getpid(), signal.SIGKILL)

    if dies:
        M.RegroupStore = DiesAfterItsAddress
    m = M.Membership(f"127.0.0.1:{port}", "7", node, 0, token="tok", stuck_grace_s=2.0)
    m.forming(1)
    p = m.placement(1)
    m.arrive(p, 60)
    m.init_process_group(p, "gloo", 600, 60)
    armed.append(True)
    try:
        dist.new_group([0, 1, 2])  # a device mesh's group, formed after the default one
        dist.barrier()
        print(json.dumps({"result": "formed"}), flush=True)
    except Exception as err:  # the peer's death broke the group: a rank that notices leaves the generation
        print(json.dumps({"result": "left", "error": str(err)[:200]}), flush=True)
    exit_without_teardown(0)
""")


def test_a_peer_dying_while_the_groups_form_leaves_nobody_blocked():
    """Rank 1 dies between writing its address and connecting to its peers: a peer waiting for that connection
    blocks in gloo's C++ connect (the group's timeout: 30 minutes), past any store wait. Once the controller
    publishes the next generation, every rank has either left (an error it could see) or exited EXIT_STUCK."""
    port = _free_port()
    server = protocol.namespaced(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), "tok")
    protocol.publish_generation(server, "7", 1, ["n0", "n1", "n2"], 1)
    env = {"GLOO_SOCKET_IFNAME": "lo", "PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", DYING_PEER_SCRIPT, str(port), node, "dies" if node == "n1" else ""],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for node in ("n0", "n1", "n2")]
    try:
        assert procs[1].wait(timeout=60) == -9
        protocol.publish_generation(server, "7", 2, ["n0", "n3", "n2"], 1)  # the controller saw rank 1's node die
        ends = [(p.wait(timeout=40), p.stdout.read(), p.stderr.read()) for p in (procs[0], procs[2])]
    finally:
        for p in procs:  # a rank still blocked (the failure this test is about) must not outlive it
            p.kill()
    for code, out, err in ends:
        assert (code == 0 and json.loads(out)["result"] == "left") or code == protocol.EXIT_STUCK, \
            (code, out, err[-1500:])


# ---- one process per rank ---------------------------------------------------------------------------------------
def test_exactly_one_process_holds_a_rank_in_a_generation():
    from phalanx.resilience.membership import Membership, RankTaken

    port = _free_port()
    server = protocol.namespaced(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), "tok")
    protocol.publish_generation(server, "7", 3, ["n0", "n1"], 1)
    first = Membership(f"127.0.0.1:{port}", "7", "n1", 0, token="tok")
    second = Membership(f"127.0.0.1:{port}", "7", "n1", 0, token="tok")  # a stale standby on the same slot
    other = Membership(f"127.0.0.1:{port}", "7", "n0", 0, token="tok")
    assert first.identity != second.identity
    placement = first.placement(3)
    with pytest.raises(TimeoutError):  # claimed and counted; rank 0 has not come yet
        first.arrive(placement, timeout_s=0.2)
    with pytest.raises(RankTaken, match="rank 1 of generation 3 is already held"):
        second.arrive(second.placement(3), timeout_s=5)
    other.arrive(other.placement(3), timeout_s=5)  # both ranks counted: the duplicate was not
    assert server.add(protocol.joined_key("7", 3), 0) == 2
    first.arrive(placement, timeout_s=0.1)  # a rank arriving again after a timeout keeps its claim


def test_a_failed_group_creation_leaves_no_group_counter_behind():
    from phalanx.resilience.run import release_process_groups

    dist.distributed_c10d._world.group_count = 3  # as a generation that failed inside build_mesh leaves it
    release_process_groups()
    assert not dist.is_initialized() and dist.distributed_c10d._world.group_count == 0


# ---- the step a fault is counted from ------------------------------------------------------------------------------
def _run_at(generation: int, trainer=None, carried=None):
    from phalanx.resilience.run import CheckpointlessRun

    run = CheckpointlessRun.__new__(CheckpointlessRun)
    left = []
    run.generation, run.fault, run.trainer, run.carried, run.snapshots = generation, None, trainer, carried, None
    run.last_record, run.world_size = None, 4
    run.membership = SimpleNamespace(unwatch=lambda: None, report_left=left.append)
    run.shelf = SimpleNamespace(freeze=lambda: None)
    told = []  # what its agent's hang rule is told: no step from each leave on (regrouping, not stalled)
    run.reporter = SimpleNamespace(told=told, leave=lambda: told.append("no step"))
    return run, left


def test_a_fault_during_recovery_keeps_the_step_of_the_first(monkeypatch):
    import phalanx.resilience.run as run_mod

    monkeypatch.setattr(run_mod, "release_process_groups", lambda marks=None: None)
    captured = SimpleNamespace(step=20)
    monkeypatch.setattr(run_mod.ShardState, "capture", staticmethod(lambda trainer: captured))
    trainer = SimpleNamespace(ready=True, progress=SimpleNamespace(step=20), abandon=lambda: None,
                              last_record={"step": 20, "loss": 1.0})
    run, left = _run_at(1, trainer)
    run.leave_generation("peer died")  # generation 1 ends at step 20
    assert (run.fault.generation, run.fault.step, run.fault.again) == (1, 20, 0) and run.carried is captured

    # generation 2 fails while it regroups: its trainer was built but never restored (step 0)
    run.generation, run.trainer = 2, SimpleNamespace(ready=False, progress=SimpleNamespace(step=0),
                                                     abandon=lambda: None)
    run.leave_generation("second peer died")
    assert (run.fault.generation, run.fault.step, run.fault.again) == (1, 20, 1), run.fault
    assert left == [1, 2] and run.last_record["step"] == 20, "the newest completed step's record is kept"
    assert run.reporter.told == ["no step"] * 2, "each leave tells the agent it is regrouping, not stalled"

    # generation 3 restored and trained to step 25, then failed: a new fault, from step 25
    run.generation, run.trainer = 3, SimpleNamespace(ready=True, progress=SimpleNamespace(step=25),
                                                     abandon=lambda: None, last_record={"step": 25, "loss": 0.5})
    run.leave_generation("third")
    assert (run.fault.generation, run.fault.step, run.fault.again) == (3, 25, 0)


# ---- the agent: a standby activated by a failed generation --------------------------------------------------------
def _supervisor(tmp_path):
    from phalanx.control.agent.supervisor import WorkerSupervisor

    return WorkerSupervisor("n1", "tok", 60.0, wake=lambda: None, work_dir=None)


def _assignment(tmp_path, generation: int, **rank) -> Assignment:
    return Assignment.model_validate({"job": "7", "generation": generation, "recovery": protocol.CHECKPOINTLESS, "argv": ["false"],
            "cwd": str(tmp_path), "env": {}, "log_dir": str(tmp_path / "logs"), "world_size": 2,
            "local_world_size": 1, "master_addr": "127.0.0.1", "master_port": 1, "store_addr": "",
            "checkpoint_dir": str(tmp_path), "ranks": [{"rank": 1, "local_rank": 0, **rank}]})


def test_the_agent_adopts_a_standby_a_failed_generation_activated_as_the_survivor(tmp_path):
    from phalanx.control.agent.supervisor import Standby

    sup = _supervisor(tmp_path)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        sup.standbys[0] = Standby("sb-1", 0, proc)
        # generation 2 activated the standby and failed before this agent heard of it; the controller's hold
        sup.apply([Assignment(job="7", generation=2, hold=True)], standby=0)
        assert 0 in sup.standbys and proc.poll() is None, "a held job's node keeps its standbys"
        # generation 3 counts on the slot's survivor: the activated standby
        sup.apply([_assignment(tmp_path, 3, standby="sb-1", carry=True)], standby=0)
        (w,) = sup.workers.values()
        assert (w.pid, w.generation, w.state) == (proc.pid, 3, "running") and not sup.standbys
    finally:
        proc.kill()
        proc.wait()


def test_an_activated_standby_that_died_is_reported_as_the_generations_fault(tmp_path):
    from phalanx.control.agent.supervisor import Standby

    sup = _supervisor(tmp_path)
    proc = subprocess.Popen(["sh", "-c", "kill -9 $$"])
    proc.wait()
    sup.standbys[0] = Standby("sb-1", 0, proc)
    sup.apply([_assignment(tmp_path, 3, standby="sb-1", carry=True)], standby=0)
    (w,) = sup.workers.values()
    assert (w.pid, w.state, w.exit_code) == (proc.pid, "exited", -9), w
    (report,) = sup.report()
    assert report["generation"] == 3 and report["exit_code"] == -9 and not report["stopped"]


# ---- the controller: no endless in-place loop ---------------------------------------------------------------------
def _policy(tmp_path):
    """A job's tables in SQLite (no cluster row: the policy reads jobs and generations) and its policy."""
    from phalanx.control.policy.inplace import InPlaceRecovery
    from phalanx.control.state.jobs import JobRecords
    from phalanx.control.state.store import SCHEMA, Store

    store = Store(tmp_path / "state.db")
    store._db.executescript(SCHEMA)
    records = JobRecords(store)
    job = records.add_job(name="j", kind="train", group="workers", nodes=2, workers_per_node=1, argv=[],
                          cwd=str(tmp_path), env={}, config=None, jobs_root=str(tmp_path), checkpoint_dir=None,
                          auto_resume=True, max_retries=0, recovery=protocol.CHECKPOINTLESS)
    return store, records, job, InPlaceRecovery(store, records, spec=None)


def test_repeated_failed_regroups_end_in_a_restart_not_a_loop(tmp_path):
    from phalanx.control.policy.inplace import MAX_FAILED_REGROUPS

    store, records, job, policy = _policy(tmp_path)
    records.add_generation(job.id, 1, ["a", "b"], "127.0.0.1", 1, None)
    records.update_generation(job.id, 1, outcome="node-fault", standbys={})
    for g in range(2, 2 + MAX_FAILED_REGROUPS):
        gen = records.add_generation(job.id, g, ["a", "c"], "127.0.0.1", 1, None)
        looping = policy.regroup_failing(job, gen)
        if g < 1 + MAX_FAILED_REGROUPS:
            assert looping is None, (g, looping)
            records.update_generation(job.id, g, outcome="node-fault")
    assert looping is not None and looping["kind"] == "regroup-failed", looping
    assert f"{MAX_FAILED_REGROUPS} in-place recoveries in a row" in looping["detail"]
    # one that restored resets the count
    records.update_generation(job.id, 1 + MAX_FAILED_REGROUPS, restored={"source": "peer-memory"})
    assert policy.regroup_failing(job, records.generation(job.id, 1 + MAX_FAILED_REGROUPS)) is None
    store.close()


def test_carried_standbys_name_the_standby_an_earlier_generation_activated(tmp_path):
    store, records, job, policy = _policy(tmp_path)
    records.add_generation(job.id, 1, ["a", "b"], "127.0.0.1", 1, None)
    records.update_generation(job.id, 1, outcome="node-fault")
    records.add_generation(job.id, 2, ["a", "s"], "127.0.0.1", 1, None)  # s's standby sb-9 took rank 1
    records.update_generation(job.id, 2, outcome="node-fault", standbys={"1": "sb-9"})
    gen3 = records.add_generation(job.id, 3, ["t", "s"], "127.0.0.1", 1, None)  # a died now
    assert policy.carried_standbys(job, gen3) == {("s", 0): "sb-9"}
    assert ("s", 0) in policy.survivor_slots(job, gen3)
    store.close()


def test_a_left_generation_the_controller_missed_is_told_once_its_store_is_back():
    """A rank that left a generation while the controller restarted (its store unreachable) tells the new
    store, or the controller would never regroup the job (the `stranded` rule reads that count)."""
    from phalanx.resilience.membership import Membership

    port = _free_port()
    server = protocol.namespaced(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), "tok")
    m = Membership(f"127.0.0.1:{port}", "7", "n1", 0, token="tok")
    m.left_untold = 2  # as leave_generation records it when report_left failed
    protocol.publish_generation(server, "7", 3, ["n0", "n1"], 1)
    assert m.wait_for_newer(2, timeout_s=5) == 3
    assert server.add(protocol.left_key("7", 2), 0) == 1 and m.left_untold is None


def test_a_worker_waits_at_exit_until_the_store_has_its_last_step():
    """A restart-mode job that ends just after a controller restart: the last step must reach the restarted
    store before the worker exits, or the controller records the job as finished at an older step."""
    port = _free_port()
    reporter = protocol.ProgressReporter(f"127.0.0.1:{port}", "j", 1, 0, beat_s=0.1, retry_s=0.2)
    reporter.report(40)  # no store yet (the controller is restarting): recorded, not published
    assert not reporter.flush(0.5), "nothing to publish to: flush gives up after its timeout"
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # the store is back
    assert reporter.flush(10.0)
    assert protocol.read_progress(server, "j", 1, [0])[0]["step"] == 40
    reporter.close()


def test_a_worker_moving_into_a_new_generation_beats_there_before_it_regroups():
    """A checkpointless survivor switches its progress keys as soon as it holds its rank in the new
    generation, and `switch` returns once the carried step and a beat are in the store there: a freeze during
    the process-group creation that follows is then seen by its agent (a stopped beat), not blamed on the peers
    that wait for it."""
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    reporter = protocol.ProgressReporter(f"127.0.0.1:{port}", "j", 1, 0, beat_s=0.1, retry_s=0.2)
    try:
        reporter.report(12)
        assert reporter.flush(10.0)
        assert protocol.read_progress(server, "j", 2, [3])[3] == {"step": None, "beat": None}
        assert reporter.switch(2, 3, wait_s=10.0)
        seen = protocol.read_progress(server, "j", 2, [3])[3]
        assert seen["step"] == 12 and seen["beat"] is not None
    finally:
        reporter.close()

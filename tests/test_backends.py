"""The contract every backend keeps (`phalanx.control.backends.base.Backend`), run against each backend: real
nodes (for `local`: agent processes on this machine, with no controller to talk to — they keep retrying,
which is all these tests need), real signals, real ports. The hosts and slurm backends start nothing on this
machine (agents join them): their own tests are at the end, and end to end in tests/test_hosts.py and
tests/test_slurm.py."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest

from phalanx.control.server.links import AgentLinks
from phalanx.control.backends import Backend, make_backend
from phalanx.control.backends.hosts import HostsBackend
from phalanx.control.backends.slurm import SlurmBackend
from phalanx.control.backends.slurm_commands import SlurmJob, SlurmNode, SlurmView, allocation_options
from phalanx.control.spec import SpecError, agent_settings, spec_from_dict
from phalanx.control.state.paths import ClusterPaths
from phalanx.control.state.store import Store

BACKENDS = ["local"]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class Cluster:
    """A cluster directory with its store and backend, and no controller: nodes are launched by hand."""

    def __init__(self, root, kind: str, worker_template: bool = False):
        """`worker_template` (local): the agents are forked from the cluster's host template, which imports torch
        first (~5 s of CPU); without, each agent is exec'd and, never healthy here, starts no template."""
        self.paths = ClusterPaths(root / "c1")
        self.paths.root.mkdir(parents=True, mode=0o700)
        group = {"name": "workers", "instance_type": "local.cpu-1", "count": 3, "spares": 0,
                 "warm_standby": False, "worker_template": worker_template}
        self.spec = spec_from_dict({"name": "c1", "backend": kind, "instance_groups": [group]})
        self.paths.write_token()
        self.store = Store(self.paths.db)
        self.store.initialize(self.spec)
        self.backend = make_backend(self.spec, self.paths)
        self.launched = []

    def launch(self):
        node = self.store.add_node("workers", is_spare=False, work_root=self.backend.work_root(), reason="test")
        handle = self.backend.launch(node)
        self.store.update_node(node.name, handle=handle)
        node = self.store.node(node.name)
        self.launched.append(node)
        return node

    def close(self):
        self.backend.teardown(self.launched, grace_s=3.0)
        self.backend.close()  # (as the controller does as it exits: what the backend itself runs ends)
        leaked = self.backend.sweep(self.store.nodes())
        self.store.close()
        assert not leaked, f"processes left behind: {leaked}"


@pytest.fixture(params=BACKENDS)
def cluster(request, tmp_path):
    c = Cluster(tmp_path, request.param)
    yield c
    c.close()


def test_make_backend_gives_the_backend_the_spec_names(cluster):
    assert isinstance(cluster.backend, Backend)
    for name, cls in (("hosts", HostsBackend), ("slurm", SlurmBackend)):
        backend = make_backend(cluster.spec.model_copy(update={"backend": name}), cluster.paths)
        assert isinstance(backend, Backend) and type(backend) is cls


def test_a_launched_node_runs_until_terminated_then_says_how_it_ended(cluster):
    node = cluster.launch()
    assert isinstance(node.handle, str) and node.handle  # opaque: each backend means its own thing by it
    assert cluster.backend.gone(node) is None
    assert node.work_dir.startswith(str(cluster.backend.work_root()))
    cluster.backend.terminate(node)
    why = wait_for(lambda: cluster.backend.gone(node), 10, "the node to end after terminate")
    assert node.handle in why
    cluster.backend.terminate(node)  # a node already gone: nothing happens


def test_kill_ends_the_whole_node_at_once(cluster):
    node = cluster.launch()
    killed = cluster.backend.kill(node)
    assert killed  # what was signalled
    if cluster.spec.backend == "local":
        assert int(node.handle) in killed  # the agent itself, with its session
    wait_for(lambda: cluster.backend.gone(node), 5, "the killed node to be gone")


def test_a_frozen_node_is_alive_but_stopped_and_terminate_still_ends_it(cluster):
    node = cluster.launch()
    cluster.backend.freeze(node)
    time.sleep(0.3)
    assert cluster.backend.gone(node) is None  # frozen is not gone: only silent
    cluster.backend.terminate(node)
    wait_for(lambda: cluster.backend.gone(node), 10, "the frozen node to end after terminate")
    with pytest.raises(ProcessLookupError):
        cluster.backend.freeze(node)


def test_signal_worker_reaches_only_the_nodes_own_workers(cluster):
    node = cluster.launch()
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(ProcessLookupError):
            cluster.backend.signal_worker(node, stranger.pid, signal.SIGKILL)
        with pytest.raises(ProcessLookupError):  # nor the agent itself
            cluster.backend.signal_worker(node, int(node.handle), signal.SIGKILL)
        assert stranger.poll() is None and cluster.backend.gone(node) is None
    finally:
        stranger.kill()
        stranger.wait()


def test_a_free_port_on_a_node_can_be_bound_at_its_host(cluster):
    node = cluster.launch()
    host, port = cluster.backend.node_host(node), cluster.backend.free_port(node)
    with socket.socket() as s:
        s.bind((host, port))
    env = cluster.backend.worker_env(node)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


def test_teardown_stops_every_running_node_and_sweep_finds_nothing_left(cluster):
    nodes = [cluster.launch(), cluster.launch()]
    assert cluster.backend.teardown(nodes, grace_s=3.0) == 2
    assert all(cluster.backend.gone(n) for n in nodes)
    assert cluster.backend.sweep(cluster.store.nodes()) == []
    assert cluster.backend.teardown(nodes, grace_s=3.0) == 0


def test_sweep_ends_what_a_dead_local_agent_left_in_its_session(tmp_path):
    """A process of a node whose agent died (a standby its template forked as the agent was killed) is still in the
    agent's session: `sweep` ends it, and leaves alone a session whose leader's pid another process holds."""
    from phalanx.control.backends.local import _proc_stat, session_members

    cluster = Cluster(tmp_path, "local")
    leader = subprocess.run(  # a session leader that leaves a child in its session and exits: a dead agent's
        [sys.executable, "-c", "import os, subprocess, sys; os.setsid(); "
         "d = subprocess.DEVNULL; print(subprocess.Popen(['sleep', '60'], stdin=d, stdout=d, stderr=d).pid)"],
        capture_output=True, text=True, check=True)
    orphan = int(leader.stdout)
    sid = _proc_stat(orphan)[2]  # the dead leader's pid
    stranger = subprocess.Popen(["sleep", "60"])  # alive, not an agent, leading no session of its own
    try:
        assert sid != orphan and session_members(sid) == [orphan]
        for handle in (sid, stranger.pid):
            node = cluster.store.add_node("workers", is_spare=False, work_root=cluster.backend.work_root(), reason="t")
            cluster.store.update_node(node.name, handle=str(handle))
        assert cluster.backend.sweep(cluster.store.nodes()) == [orphan]
        wait_for(lambda: not session_members(sid), 5, "the orphan to end")
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()
        cluster.close()


def test_local_agents_are_forked_from_one_host_template_and_each_node_is_its_own_session(tmp_path):
    """The local backend imports torch and the training code once per cluster (its host template) and forks every
    node's agent from it; the agent forks its node's worker template from itself at once. A node is still its
    session: the agent leads it, its template is in it, `kill` ends both; closing the backend (the controller's
    exit) ends the host template and no node. Freeze and terminate work on a forked agent as on an exec'd one, and
    its exit code reaches the backend (the host template reports it). A host template that dies leaves its agents
    running, and the next launch starts another."""
    from phalanx.control.backends.local import cmdline, session_members

    cluster = Cluster(tmp_path, "local", worker_template=True)
    try:
        nodes = [cluster.launch(), cluster.launch(), cluster.launch()]
        host_proc = cluster.backend._host.proc
        host = host_proc.pid
        assert "phalanx.zygote --for-host" in cmdline(host)
        templates = {}
        for node in nodes:
            agent = int(node.handle)
            assert parent(agent) == host
            # (the fork is reported as it happens; the child names itself in `ps` a moment later)
            wait_for(lambda: "node_agent --config" in cmdline(agent), 10, f"agent {agent} to take its own command line")
            # (not its own children: the template tries SCHED_IDLE in a throwaway fork of itself as it starts)
            template = wait_for(lambda: [p for p in session_members(agent) if parent(p) == agent
                                         and f"phalanx.zygote --for-node {node.name}" in cmdline(p)], 10,
                                "its worker template, a child of its agent")
            assert len(template) == 1, template
            templates[node.name] = template[0]
        # (the session also holds whatever the agent runs at that moment: a health check comes and goes)
        assert {int(nodes[0].handle), templates[nodes[0].name]} <= set(cluster.backend.kill(nodes[0]))
        wait_for(lambda: cluster.backend.gone(nodes[0]), 5, "the killed node to be gone")
        cluster.backend.freeze(nodes[2])
        time.sleep(0.3)
        assert cluster.backend.gone(nodes[2]) is None
        cluster.backend.terminate(nodes[2])
        why = wait_for(lambda: cluster.backend.gone(nodes[2]), 10, "the frozen node to end after terminate")
        assert why.startswith(f"agent process {nodes[2].handle} ") and "no longer running" not in why, why

        # the host template dies: its agents run on; the next launch forks from a new one
        host_proc.kill()
        host_proc.wait()
        time.sleep(0.3)
        assert cluster.backend.gone(nodes[1]) is None
        late = cluster.launch()
        host_proc = cluster.backend._host.proc
        assert host_proc.pid != host and parent(int(late.handle)) == host_proc.pid
        cluster.backend.terminate(nodes[1])  # forked by the dead one: nobody reports how it ended, and it says so
        why = wait_for(lambda: cluster.backend.gone(nodes[1]), 10, "the orphaned agent to end after terminate")
        assert "how it ended is unknown" in why, why

        cluster.backend.close()
        assert host_proc.poll() is not None, "close() waits for the host template to end"
        time.sleep(0.3)
        assert cluster.backend.gone(late) is None
        assert int(late.handle) in session_members(int(late.handle))
    finally:
        cluster.close()


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_state_db_from_before_node_handles_keeps_its_agents(tmp_path):
    """A cluster made by a Phalanx that kept the agent's pid in `nodes.pid` (protocol 1): opening its state.db
    copies each pid into the opaque `handle`, so `cluster delete` still finds and stops those agents."""
    import sqlite3

    from phalanx.control.state.schema import SCHEMA

    db = tmp_path / "state.db"
    old = SCHEMA.replace("last_heartbeat REAL, handle TEXT,", "last_heartbeat REAL, pid INTEGER,")
    assert old != SCHEMA
    with sqlite3.connect(db) as conn:
        conn.executescript(old)
        conn.execute("INSERT INTO groups (name, instance_type, count, spares) VALUES ('workers', 'local.cpu-1', 1, 0)")
        conn.execute("INSERT INTO nodes (name, group_name, state, is_spare, pid, work_dir, created_at, state_since) "
                     "VALUES ('workers-0', 'workers', 'healthy', 0, 4242, '/w', 0, 0)")
    store = Store(db)
    try:
        assert store.node("workers-0").handle == "4242"
    finally:
        store.close()


# ---- the hosts backend: agents join from other hosts, so it starts and signals nothing itself --------------
def test_the_hosts_backend_learns_each_node_from_its_agent_and_starts_nothing(tmp_path):
    group = {"name": "workers", "instance_type": "local.cpu-1", "count": 1}
    spec = spec_from_dict({"name": "c1", "backend": "hosts", "api": {"host": "198.18.0.2"},
                           "instance_groups": [group], "health": {"heartbeat_timeout_s": 1.0, "heartbeat_interval_s": 0.2}})
    paths = ClusterPaths(tmp_path / "c1")
    paths.root.mkdir(mode=0o700)
    store = Store(paths.db)
    store.initialize(spec)
    backend = make_backend(spec, paths, store)
    assert isinstance(backend, Backend) and backend.faults_through_agent
    node = store.add_node("workers", is_spare=False, work_root=backend.work_root(), reason="test")
    assert backend.launch(node) is None  # nothing started: the node waits for an agent to join it
    assert store.claim_node("workers", "hostA:41", "/w") .name == node.name
    assert store.claim_node("workers", "hostB:42", "/w") is None, "a node is claimed once"
    # the same agent again (its join's answer lost to a timeout): the node it claimed, until it has heartbeated
    assert store.claim_node("workers", "hostA:41", "/w").name == node.name
    with pytest.raises(RuntimeError, match="has not reported its address"):
        backend.node_host(store.node(node.name))
    store.update_node(node.name, report={"address": "198.18.0.11", "ifname": "eth0", "free_ports": [40001, 40002]},
                      last_heartbeat=time.time())
    node = store.node(node.name)
    assert node.work_dir == "/w/c1/workers-0" and node.handle == "hostA:41"
    assert store.claim_node("workers", "hostA:41", "/w") is None, "its agent heartbeats: a join again claims nothing"
    assert backend.node_host(node) == "198.18.0.11"
    assert [backend.free_port(node), backend.free_port(node)] == [40001, 40002], "never the same port twice in a row"
    assert backend.gone(node) is None and backend.kill(node) == [] and backend.teardown([node], 1.0) == 0
    backend.terminate(node)  # remembered: the agent's next heartbeat reply says terminate
    assert backend.gone(node) is None
    store.update_node(node.name, last_heartbeat=time.time() + 0.01)
    assert "told to terminate" in backend.gone(node)
    store.close()


def test_agents_joining_together_claim_nodes_by_index_members_first_in_one_batch_of_rows(tmp_path):
    """The rows of a group's missing nodes are written in one transaction, and a join finds its node on an index,
    not by sorting every waiting node: 4,096 agents started at once (one `srun` step) failed a cluster's creation
    while the provisioning and the joins took the store's lock a node at a time."""
    group = {"name": "workers", "instance_type": "local.cpu-1", "count": 3, "spares": 1}
    spec = spec_from_dict({"name": "c1", "backend": "hosts", "api": {"host": "198.18.0.2"},
                           "instance_groups": [group]})
    store = Store(tmp_path / "state.db", owner=True)
    store.initialize(spec)
    spare = store.add_node("workers", is_spare=True, work_root=tmp_path, reason="spare first")
    added = store.add_nodes("workers", [(False, "m0"), (False, "m1"), (True, "s1")], work_root=tmp_path)
    assert [n.name for n in added] == ["workers-1", "workers-2", "workers-3"] and [n.reason for n in added] == \
        ["m0", "m1", "s1"] and [n.is_spare for n in added] == [False, False, True]
    assert [e["to_state"] for e in store.events() if e["node"] == "workers-2"] == ["provisioning"]
    assert store.add_nodes("workers", [(False, "next")], work_root=tmp_path)[0].name == "workers-4", "never reused"
    claims = [store.claim_node("workers", f"host{i}:1", "/w") for i in range(5)]
    assert [c.name for c in claims] == ["workers-1", "workers-2", "workers-4", spare.name, "workers-3"], \
        "members before spares, oldest first"
    assert store.claim_node("workers", "host9:1", "/w") is None
    assert store.claim_node("workers", "host1:1", "/w").name == "workers-2", "the same agent again: its own node"
    named = store.add_node("workers", is_spare=False, work_root=tmp_path, reason="named")
    assert store.claim_node("workers", "hostN:1", "/w", name="workers-1") is None, "a named node already claimed"
    assert store.claim_node("workers", "hostN:1", "/w", name=named.name).name == named.name
    from phalanx.control.state.schema import JOIN_MINE, JOIN_WAITING

    for query, args in ((JOIN_WAITING, ("workers", "provisioning")), (JOIN_MINE, ("workers", "provisioning", "h"))):
        plan = " ".join(r[3] for r in store.execute(f"EXPLAIN QUERY PLAN {query.format(name='')}", args))
        assert "USING INDEX nodes_" in plan, plan
        assert "TEMP B-TREE" not in plan or query is JOIN_MINE, plan  # (a handle is on one node: nothing to sort)
    store.close()


def test_the_hosts_backend_takes_an_agent_whose_link_closed_for_gone_without_waiting_out_its_silence(tmp_path):
    group = {"name": "workers", "instance_type": "local.cpu-1", "count": 1}
    spec = spec_from_dict({"name": "c1", "backend": "hosts", "api": {"host": "198.18.0.2"},
                           "instance_groups": [group], "health": {"link_grace_s": 0.2}})
    paths = ClusterPaths(tmp_path / "c1")
    paths.root.mkdir(mode=0o700)
    store = Store(paths.db)
    store.initialize(spec)
    links = AgentLinks()
    backend = make_backend(spec, paths, store, links)
    store.add_node("workers", is_spare=False, work_root=backend.work_root(), reason="test")
    node = store.claim_node("workers", "hostA:41", "/w")
    store.update_node(node.name, last_heartbeat=time.time() - 1.0)
    links.opened(node.name, "hostA:41")
    backend.terminate(node)  # replaced: the dead agent will never answer, and its silence is 3 s away
    assert backend.gone(node) is None  # its link is open: it lives
    links.closed(node.name, "hostA:41", time.time() - 0.1)
    assert backend.gone(node) is None  # within link_grace_s
    links.opened(node.name, "hostA:41")
    links.closed(node.name, "hostA:41", time.time() - 0.3)  # closed for good, and no heartbeat since
    assert "its link closed" in backend.gone(node)
    store.close()


def test_backend_hosts_needs_an_address_other_hosts_reach():
    group = {"name": "workers", "instance_type": "local.cpu-1", "count": 1}
    with pytest.raises(SpecError, match="api.host: '0.0.0.0' is every address"):
        spec_from_dict({"name": "c1", "backend": "hosts", "api": {"host": "0.0.0.0"}, "instance_groups": [group]})


# ---- the slurm backend: what Slurm says about a node, as the reconciler hears it (`taken`) -----------------
def slurm_cluster(tmp_path, **settings):
    group = {"name": "workers", "instance_type": "local.cpu-1", "count": 2, "spares": 1}
    spec = spec_from_dict({"name": "c1", "backend": "slurm", "instance_groups": [group],
                           "slurm": {"partition": "gpu", "allocation_timeout_s": 30, **settings}})
    paths = ClusterPaths(tmp_path / "c1")
    paths.root.mkdir(mode=0o700)
    paths.write_token()
    store = Store(paths.db)
    store.initialize(spec)
    return spec, store, SlurmBackend(paths, spec, store)


def test_the_slurm_backend_asks_for_one_exclusive_allocation_and_names_it(tmp_path):
    spec, store, backend = slurm_cluster(tmp_path, account="ml", sbatch_options=["--time=7-0"])
    opts = allocation_options(spec, "workers", 3)
    for wanted in ("--no-kill", "--requeue", "--exclusive", "--open-mode=append", "--signal=B:USR2@120",
                   "--ntasks-per-node=1", "--partition=gpu", "--account=ml", "--time=7-0",
                   "--comment=phalanx cluster c1 group workers"):
        assert wanted in opts, (wanted, opts)
    assert opts[opts.index("--nodes") + 1] == "3" and opts[opts.index("--job-name") + 1] == "phalanx-c1"
    asks = lambda opts: [o for o in opts if o.startswith(("--gres", "--gpus"))]  # noqa: E731
    assert not asks(opts), "a CPU instance type asks for no GPUs"
    gpu = {"name": "workers", "instance_type": "gpu.8", "count": 2, "spares": 0}
    assert "--gres=gpu:8" in allocation_options(spec_from_dict({"name": "c1", "backend": "slurm",
                                                                "instance_groups": [gpu]}), "workers", 2)
    own = spec_from_dict({"name": "c1", "backend": "slurm", "instance_groups": [gpu],
                          "slurm": {"sbatch_options": ["--gpus-per-node=h100:8"]}})
    assert asks(allocation_options(own, "workers", 2)) == ["--gpus-per-node=h100:8"]
    store.update_cluster(api_host="198.18.0.2", api_port=8123)
    script = backend.batch_script("workers", 3)
    assert "srun --no-kill --kill-on-bad-exit=0 --ntasks-per-node=1 --whole --nodes 3 " in script
    assert "--join http://198.18.0.2:8123 --group workers" in script
    assert "token" not in script.lower() and backend.agent_env()["PHALANX_CLUSTER_TOKEN"] == backend.paths.read_token()
    store.close()


def test_the_slurm_backend_says_when_slurm_took_a_node_or_will_not_give_it(tmp_path):
    spec, store, backend = slurm_cluster(tmp_path)
    now = time.time()
    waiting = store.add_node("workers", is_spare=False, work_root=tmp_path, reason="test")
    joined = store.add_node("workers", is_spare=False, work_root=tmp_path, reason="test")
    backend._job_of[waiting.name], backend._submitted["7"] = "7", now - 10
    cancelled: list[str] = []
    backend._cancel = lambda job, why: cancelled.append(job)  # no scancel here
    store.update_node(joined.name, handle="slurm:6:n2:4242")
    joined = store.node(joined.name)

    def view(jobs, nodes):
        backend.poller.view = SlurmView(now, {j.id: j for j in jobs}, {n.name: n for n in nodes})

    assert backend.taken(waiting) is None, "Slurm not heard yet: heartbeats judge"
    view([SlurmJob("7", "PENDING", "Resources", ""), SlurmJob("6", "RUNNING", "None", "n[1-2]")],
         [SlurmNode("n2", "allocated", "")])
    assert backend.taken(waiting) is None and backend.taken(joined) is None  # pending within the timeout: waits
    backend._submitted["7"] = now - 31
    assert "still pending after 31 s (squeue reason: Resources" in backend.taken(waiting) and cancelled == ["7"]
    view([SlurmJob("6", "RUNNING", "None", "n[1-2]")], [SlurmNode("n2", "draining", "phalanx: hang: ...")])
    assert "Slurm job 7 ended (gone from squeue) before its agent joined" in backend.taken(waiting)
    assert backend.taken(joined) is None, "drained by Phalanx itself: already handled"
    view([SlurmJob("6", "RUNNING", "None", "n[1-2]")], [SlurmNode("n2", "draining", "bad DIMM")])
    assert backend.taken(joined) == ("Slurm node n2 is draining (reason: bad DIMM): Slurm or an operator took it "
                                     "from the job")
    view([SlurmJob("6", "CANCELLED", "None", "")], [SlurmNode("n2", "allocated", "")])
    assert backend.taken(joined) == "its Slurm job 6 ended (CANCELLED)"
    store.close()


def test_a_slurm_section_needs_backend_slurm_and_an_address_the_nodes_reach():
    group = {"name": "workers", "instance_type": "local.cpu-1", "count": 1}
    with pytest.raises(SpecError, match="slurm: set for backend 'local'; it applies to `backend: slurm` only"):
        spec_from_dict({"name": "c1", "slurm": {"partition": "gpu"}, "instance_groups": [group]})
    with pytest.raises(SpecError, match="slurm.remediator: must be 'drain', 'hyperpod' or 'report'"):
        spec_from_dict({"name": "c1", "backend": "slurm", "slurm": {"remediator": "reboot"},
                        "instance_groups": [group]})
    with pytest.raises(SpecError, match="api.host: '0.0.0.0' is every address; backend slurm"):
        spec_from_dict({"name": "c1", "backend": "slurm", "api": {"host": "0.0.0.0"}, "instance_groups": [group]})
    spec = spec_from_dict({"name": "c1", "backend": "slurm", "instance_groups": [group]})
    assert spec.slurm is None and spec.slurm_settings.remediator == "drain"


# ---- cluster up --slurm: the allocation it runs in, and the requeue fallback ----------------------------------
def test_cluster_up_slurm_needs_an_allocation_big_enough():
    from phalanx.control.client.cluster import ClusterRefused
    from phalanx.control.client.slurm_up import allocation_spec

    group = {"name": "workers", "instance_type": "local.cpu-1", "count": 2, "spares": 1}
    spec = spec_from_dict({"name": "c1", "api": {"host": "10.0.0.5"}, "instance_groups": [group]})
    with pytest.raises(ClusterRefused, match="runs inside a Slurm allocation .*SLURM_JOB_ID is not set"):
        allocation_spec(spec, {})
    with pytest.raises(ClusterRefused, match=r"3 nodes \(count \+ spares over every group\) but Slurm job 42 has 2: "
                                             r"submit with `sbatch --nodes 3`"):
        allocation_spec(spec, {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "2"})
    inside = allocation_spec(spec, {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "3"})
    assert inside.backend == "slurm" and inside.slurm.allocation == "42" and inside.api.host == "10.0.0.5"
    assert agent_settings(inside, "workers")["slurm_requeue"] == {"job": "42", "after_s": 60.0}
    assert agent_settings(spec, "workers")["slurm_requeue"] is None
    assert inside.slurm.account is None and inside.slurm.partition is None  # (Slurm's defaults: none was named)
    # the refills are one-node jobs of their own: charged to the allocation's account and partition...
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_ACCOUNT": "vision",
           "SLURM_JOB_PARTITION": "gpu"}
    inside = allocation_spec(spec, env)
    assert (inside.slurm.account, inside.slurm.partition) == ("vision", "gpu")
    assert {"--account=vision", "--partition=gpu"} <= set(allocation_options(inside, "workers", 1))
    # ...unless the spec names its own
    own = allocation_spec(spec_from_dict({"name": "c1", "backend": "slurm", "api": {"host": "10.0.0.5"},
                                          "instance_groups": [group], "slurm": {"account": "ml"}}), env)
    assert (own.slurm.account, own.slurm.partition) == ("ml", "gpu")


def fake_job_client(calls: list, described: dict, checkpoint=None):
    """`JobClient` as `cluster up --slurm --run` uses it: its job described as `described` (state, reason) at step
    12; cancels and checkpoint requests appended to `calls`, the request answered by `checkpoint(job, timeout_s)`."""
    class Jobs:
        def __init__(self, name):
            pass

        def submit(self, config, **kw):
            return {"id": "1", "nodes_requested": kw["nodes"], "recovery": "restart"}

        def describe(self, job):
            return {"generation": 1, "last_step": 12, **described}

        def checkpoint(self, job, timeout_s):
            calls.append(("checkpoint", job, timeout_s))
            return checkpoint(job, timeout_s)

        def cancel(self, job, wait):
            calls.append(("cancel", job))

    return Jobs


@pytest.mark.parametrize("restarts, code", [(0, 75), (3, 3)])
def test_a_job_short_of_nodes_past_spare_timeout_is_requeued_until_max_requeues(monkeypatch, restarts, code):
    """`cluster up --slurm --run`: no spare came for slurm.spare_timeout_s → cancel the job, `scontrol requeue`
    this allocation, exit 75; once slurm.max_requeues requeues are spent, exit 3 (do not requeue) instead."""
    from phalanx.control.client import slurm_up

    calls = []
    monkeypatch.setattr(slurm_up, "JobClient", fake_job_client(calls, {
        "state": "recovering", "reason": "waiting for 1 healthy node(s) to replace workers-1 (spare pool: empty)"}))
    monkeypatch.setattr(slurm_up, "slurm", lambda *argv, **kw: calls.append(argv) or "")
    monkeypatch.setattr(slurm_up.time, "sleep", lambda s: None)
    group = {"name": "workers", "instance_type": "local.cpu-1", "count": 2}
    spec = spec_from_dict({"name": "c1", "backend": "slurm", "instance_groups": [group],
                           "slurm": {"allocation": "42", "spare_timeout_s": 0.01, "max_requeues": 3}})
    said = []
    assert slurm_up._train(spec, "train.yaml", None, None, said.append, restarts) == code
    if code == 75:
        assert calls == [("cancel", "1"), ("scontrol", "requeue", "42")] and "requeueing Slurm job 42" in said[-1]
    else:
        assert calls == [] and "already requeued 3 times" in said[-1] and "exit 3 (do not requeue)" in said[-1]


@pytest.mark.parametrize("saves", [True, False])
def test_slurms_time_limit_warning_checkpoints_the_job_then_requeues_without_counting_a_failure(
        monkeypatch, tmp_path, saves):
    """`cluster up --slurm --run` warned by Slurm (USR2) before the time limit: the job is asked for a checkpoint
    (waited for at most slurm.time_limit_checkpoint_s), cancelled, the allocation requeued (exit 75) and the
    requeue counted as one at the time limit, which slurm.max_requeues does not cap. A checkpoint that does not
    come in time does not stop the requeue: the next run resumes from the newest one."""
    import threading

    from phalanx.control.client import slurm_up

    monkeypatch.setenv("PHALANX_HOME", str(tmp_path))
    calls = []

    def checkpoint(job, timeout_s):
        if not saves:
            raise TimeoutError("job 1 saved no checkpoint after step 12 within 30 s of the request")
        return {"job": job, "step": 12, "request": 5, "saved": {"step": 13, "time": 0.0, "request": 5}}

    monkeypatch.setattr(slurm_up, "JobClient", fake_job_client(calls, {"state": "running", "reason": None}, checkpoint))
    monkeypatch.setattr(slurm_up, "slurm", lambda *argv, **kw: calls.append(argv) or "")
    group = {"name": "workers", "instance_type": "local.cpu-1", "count": 2}
    spec = spec_from_dict({"name": "c1", "backend": "slurm", "instance_groups": [group],
                           "slurm": {"allocation": "42", "time_limit_checkpoint_s": 30, "max_requeues": 0}})
    warned, at_time_limit, said = threading.Event(), slurm_up.TimeLimitRequeues("c1", "42"), []
    warned.set()
    assert slurm_up._train(spec, "train.yaml", None, None, said.append, 0, warned, at_time_limit) == 75
    assert calls == [("checkpoint", "1", 30.0), ("cancel", "1"), ("scontrol", "requeue", "42")], calls
    assert ("job 1: checkpoint of step 13 committed" if saves else
            "no checkpoint after the warning (job 1 saved no checkpoint") in "\n".join(said), said
    assert "not counted against slurm.max_requeues" in said[-1]
    assert at_time_limit.count() == 1 and slurm_up.TimeLimitRequeues("c1", "42").count() == 1  # kept on disk
    at_time_limit.forget()
    assert at_time_limit.count() == 0


def test_a_join_whose_answer_times_out_is_sent_again_and_a_join_to_nothing_fails_at_once(tmp_path, monkeypatch):
    """Thousands of agents started at once (an srun on every host) may wait past a join's timeout: the agent joins
    again with the same handle (the controller gives it the node its first join claimed). Nothing listening at
    the URL is said at once, not retried for JOIN_RETRY_S."""
    import http.server
    import socketserver
    import threading

    from phalanx.control.agent import join as joining
    from phalanx.control.http import ControllerUnreachable
    from phalanx.protocol import PROTOCOL_VERSION

    bodies = []

    class Controller(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            if len(bodies) == 1:
                time.sleep(1.0)  # past the join's timeout: busy, not gone
            reply = json.dumps({"protocol": PROTOCOL_VERSION, "node": "workers-0", "cluster": "c1", "config": {},
                                "store_addr": "127.0.0.1:1", "on_create": None}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args):
            pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Controller)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(joining, "JOIN_TIMEOUT_S", 0.3)
    monkeypatch.setenv(joining.TOKEN_ENV, "t0ken")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        config = joining.join(url, None, "workers", name=None, work_root=tmp_path, address="127.0.0.1", ifname="lo")
        assert json.loads(config.read_text())["node"] == "workers-0"
        assert len(bodies) == 2 and bodies[0]["handle"] == bodies[1]["handle"], bodies
    finally:
        server.shutdown()
        server.server_close()
    started = time.monotonic()
    with pytest.raises(ControllerUnreachable) as err:
        joining.join(url, None, "workers", name=None, work_root=tmp_path, address="127.0.0.1", ifname="lo")
    assert not err.value.timed_out and time.monotonic() - started < 5, "nothing listens there: said at once"

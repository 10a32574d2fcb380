"""The control plane with real processes: a controller daemon, node agents, SQLite on disk, real sockets.

Every test gets its own PHALANX_HOME under tmp_path; its finalizer deletes every cluster there and then
proves (and enforces) that no process of the test is left behind — even when the test failed.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clusters import home, wait_for  # noqa: F401  (home is a fixture)
from phalanx.cli import app
from phalanx import protocol
from phalanx.control.backends.local import AGENT_MODULE, process_group_members, process_running, processes_mentioning
from phalanx.control.client.cluster import (ClusterClient, CreateFailed, controller_pid, create_cluster, delete_cluster,
                                     start_controller)
from phalanx.control.agent.health import (REPLACE_NODE, RESTART_JOB, GpuMonitor, check_workers, report,
                                    restart_job_failures, xid_check)
from phalanx.control.http import ApiError, request_json
from phalanx.control.state.paths import ClusterPaths, list_clusters
from phalanx.control.spec import SpecError, load_spec
from phalanx.control.state.store import IllegalTransition, NodeState, Store

runner = CliRunner()


# ---- fixtures and helpers ------------------------------------------------------------------------------
def write_spec(dir: Path, *, name="c1", count=2, spares=1, script: str | None = "echo configured $PHALANX_NODE_NAME",
               worker_template=False, **top) -> Path:
    # no warm standbys: they are a checkpointless feature (tests/test_checkpointless.py), and on a 2-core CI host
    # their torch imports would compete with the heartbeats these tests time. No worker template either, unless
    # asked: these tests run no worker, and each template imports torch (3.7 CPU-s; tests/test_template.py)
    group = {"name": "workers", "instance_type": "local.cpu-1", "count": count, "spares": spares,
             "warm_standby": False, "worker_template": worker_template}
    if script is not None:
        (dir / "on_create.sh").write_text("#!/bin/sh\n" + script + "\n")
        group["on_create"] = "on_create.sh"
    tree = {"name": name, "backend": "local", "instance_groups": [group], **top}
    path = dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def nodes_by_name(client: ClusterClient) -> dict[str, dict]:
    return {n["name"]: n for n in client.nodes()}


def live(nodes: dict[str, dict]) -> dict[str, dict]:
    return {k: n for k, n in nodes.items() if n["state"] not in ("terminated", "replacing")}


def agent_alive(node: dict) -> bool:
    return process_running(int(node["handle"]), AGENT_MODULE)  # a local node's handle is its agent's pid


def http(method: str, url: str, token: str | None = None) -> int:
    req = urllib.request.Request(url, method=method, data=b"{}" if method == "POST" else None,
                                 headers={"Content-Type": "application/json"})
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


# ---- spec validation: one clear error each, nothing started ---------------------------------------------
def test_malformed_spec_is_one_clear_error(tmp_path, home):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: c1\ninstance_groups: [\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)
    path = write_spec(tmp_path, count=0, bogus=1)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert "instance_groups.0.count" in str(err.value) and "bogus" in str(err.value)
    assert not home.exists(), "nothing may be created"


def test_unknown_instance_type_lists_the_valid_ones(tmp_path):
    path = write_spec(tmp_path)
    path.write_text(path.read_text().replace("local.cpu-1", "local.cpu-3"))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    msg = str(err.value)
    assert "instance_groups.0.instance_type" in msg and "'local.cpu-3'" in msg
    assert all(t in msg for t in ("local.cpu-1", "local.cpu-2", "local.cpu-4", "gpu.1", "gpu.8"))


def test_missing_lifecycle_script_names_the_path(tmp_path):
    path = write_spec(tmp_path)
    (tmp_path / "on_create.sh").unlink()
    with pytest.raises(SpecError, match=f"lifecycle script {tmp_path / 'on_create.sh'} does not exist"):
        load_spec(path)


def test_heartbeat_timeout_must_cover_two_intervals(tmp_path):
    path = write_spec(tmp_path, health={"heartbeat_interval_s": 1.0, "heartbeat_timeout_s": 1.5})
    with pytest.raises(SpecError, match="heartbeat_timeout_s=1.5 must be at least twice"):
        load_spec(path)


def test_backend_slurm_without_slurm_is_refused_at_create_and_starts_nothing(tmp_path, home, monkeypatch):
    path = write_spec(tmp_path, backend="slurm")
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))
    code = runner.invoke(app, ["cluster", "create", "-f", str(path)])
    assert code.exit_code == 2 and "sbatch, squeue, sinfo, scontrol, scancel not on PATH" in code.output, code.output
    assert not ClusterPaths.for_name("c1").root.exists()


@pytest.mark.slow
def test_api_port_in_use_is_one_clear_error_and_leaves_nothing(tmp_path, home):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["cluster", "create", "-f", str(write_spec(tmp_path, api={"port": port}))])
    flat = " ".join(result.output.split())
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in flat and "nothing was started" in flat
    assert list_clusters() == [] and processes_mentioning(str(home)) == []


def test_the_api_socket_listens_before_the_server_serves_so_an_early_agent_waits_and_is_not_refused():
    """The endpoint file (and a join command's URL) names the API port as soon as it is bound; an agent that
    connects before uvicorn serves waits in the backlog: a refused join is not retried."""
    import socket

    from phalanx.control.server.daemon import bind_api_socket

    sock = bind_api_socket("127.0.0.1", 0, fallback_to_any=False)
    try:
        with socket.create_connection(sock.getsockname(), timeout=5):  # ConnectionRefusedError before the fix
            pass
    finally:
        sock.close()


# ---- units: state machine, seam, health ----------------------------------------------------------------
def test_store_refuses_illegal_transitions_and_records_every_move(tmp_path):
    spec = load_spec(write_spec(tmp_path, script=None))
    store = Store(tmp_path / "state.db")
    store.initialize(spec)
    node = store.add_node("workers", is_spare=False, work_root=tmp_path / "nodes", reason="test")
    assert node.name == "workers-0" and node.state == NodeState.PROVISIONING
    with pytest.raises(IllegalTransition, match="provisioning → healthy"):
        store.transition(node.name, NodeState.HEALTHY, "skipping steps")
    for state in ("configuring", "health-checking", "healthy", "faulty", "replacing", "terminated"):
        store.transition(node.name, NodeState(state), f"to {state}")
    moves = [(e["from_state"], e["to_state"], e["reason"]) for e in store.events(node=node.name)]
    assert moves[0] == (None, "provisioning", "test") and moves[-1] == ("replacing", "terminated", "to terminated")
    assert len(moves) == 7
    assert store.add_node("workers", is_spare=True, work_root=tmp_path, reason="x").name == "workers-1"
    store.close()


def test_the_controllers_long_lived_objects_are_frozen_and_a_frozen_cycle_is_freed_at_the_refreeze():
    """`server/heap.py`: what was made since the last freeze is frozen within FREEZE_EVERY_S by `LongLived`'s own
    thread (never walked by a collection again), with no reconciler tick; every REFREEZE_S everything is unfrozen and
    collected once, so a frozen object that became cyclic garbage is freed then."""
    import gc
    import weakref

    from phalanx.control.server import heap

    class Row:
        pass

    now = [0.0]
    long_lived = heap.LongLived(clock=lambda: now[0])
    try:
        long_lived.freeze()
        frozen = gc.get_freeze_count()
        rows = [Row() for _ in range(20000)]  # made after the freeze
        deadline = time.monotonic() + 10
        while gc.get_freeze_count() < frozen + len(rows) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gc.get_freeze_count() >= frozen + len(rows) and long_lived.freezes >= 2, "frozen with no tick"
        cycle = Row()
        cycle.me = cycle
        alive = weakref.ref(cycle)
        long_lived.freeze()
        del cycle
        gc.collect()
        assert alive() is not None, "frozen: out of the collector's sight"
        long_lived.tick()
        assert alive() is not None, "no refreeze before REFREEZE_S"
        now[0] += heap.REFREEZE_S
        long_lived.tick()
        assert alive() is None, "unfrozen, collected, frozen again: the cycle is freed"
    finally:
        long_lived.close()
        gc.unfreeze()


def test_heartbeat_observations_are_batched_into_sqlite_without_losing_or_reverting_any(tmp_path, monkeypatch):
    """The controller (the store's owner) keeps a heartbeat's observations in memory and writes them in one
    transaction per reconciler tick (`Store.observe_node` / `flush_observed`): its own reads see them at once,
    another process's after the flush, and no write of the node in between loses or reverts them."""
    spec = load_spec(write_spec(tmp_path, script=None))
    owner = Store(tmp_path / "state.db", owner=True)
    owner.initialize(spec)
    a = owner.add_node("workers", is_spare=False, work_root=tmp_path, reason="test").name
    b = owner.add_node("workers", is_spare=False, work_root=tmp_path, reason="test").name
    reader = Store(tmp_path / "state.db")  # a CLI beside the controller
    owner.observe_node(a, last_heartbeat=10.0, health={"ok": True}, report={"phase": "ready"})
    owner.observe_node(b, last_heartbeat=11.0, acked_at=5.0)
    assert owner.node(a).last_heartbeat == 10.0 and owner.node(a).report == {"phase": "ready"}
    assert reader.node(a).last_heartbeat is None  # not in SQLite yet
    owner.transition(a, NodeState.CONFIGURING, "its row written and read back")  # the observations kept
    assert owner.node(a).last_heartbeat == 10.0 and reader.node(a).health == {"ok": True}
    owner.update_node(b, acked_at=7.0)  # written now: the older observation of it must not come back
    assert owner.flush_observed(every_s=3600.0) == 1  # (b: its heartbeat time; the first flush is never early)
    assert owner.flush_observed() == 0  # nothing left
    assert (reader.node(b).last_heartbeat, reader.node(b).acked_at) == (11.0, 7.0)
    owner.observe_node(b, last_heartbeat=12.0)
    assert owner.flush_observed(every_s=3600.0) == 0  # flushed less than an hour ago: kept for the next tick
    owner.close()  # closing writes what is left
    assert reader.node(b).last_heartbeat == 12.0
    reader.observe_node(a, last_heartbeat=13.0)  # not the owner: written at once
    assert Store(tmp_path / "state.db").node(a).last_heartbeat == 13.0

    # the links' beats, folded at a tick under one lock (`observe_beats`): an older time is ignored; a flush of
    # more nodes than FLUSH_ROWS writes them all, one transaction per FLUSH_ROWS
    monkeypatch.setattr("phalanx.control.state.store.FLUSH_ROWS", 1)
    owner = Store(tmp_path / "state.db", owner=True)
    owner.observe_beats({a: 20.0, b: 21.0})
    owner.observe_beats({a: 19.0, b: 22.0})
    assert (owner.node(a).last_heartbeat, owner.node(b).last_heartbeat) == (20.0, 22.0)
    assert reader.node(a).last_heartbeat == 13.0  # not in SQLite yet
    assert owner.flush_observed() == 2 and owner.flush_observed() == 0
    assert (reader.node(a).last_heartbeat, reader.node(b).last_heartbeat) == (20.0, 22.0)

    # many nodes' fields written at once (`update_nodes`, nodes.job at a launch): in SQLite and the owner's rows,
    # FLUSH_ROWS per transaction, and an older observation of a column written is not flushed over it
    owner.observe_node(a, acked_at=30.0, last_heartbeat=30.0)
    owner.update_nodes({a: {"job": "7", "acked_at": 31.0}, b: {"job": "7"}})
    assert [(owner.node(n).job, reader.node(n).job) for n in (a, b)] == [("7", "7"), ("7", "7")]
    assert owner.flush_observed() == 1 and reader.node(a).acked_at == 31.0 and reader.node(a).last_heartbeat == 30.0
    told = []  # which agents a write pokes: not for nodes.job (shown by list-nodes, in no heartbeat reply)
    owner.on_change = told.append
    owner.update_nodes({a: {"job": None}, b: {"job": None}})
    owner.update_nodes({a: {"directives": ["deep-check"]}, b: {"job": "8"}})
    assert told == [(a,)] and owner.node(b).job == "8"
    owner.on_change = None

    # more nodes waiting than FLUSH_RATE: flushed a second per FLUSH_RATE of them, not every FLUSH_S
    monkeypatch.setattr("phalanx.control.state.store.FLUSH_RATE", 1)
    owner.observe_beats({a: 40.0, b: 41.0})
    owner._flushed_at = time.monotonic() - 1.5  # (the last flush 1.5 s ago: two nodes wait, so two seconds)
    assert owner.flush_observed(every_s=1.0) == 0 and reader.node(a).last_heartbeat == 30.0
    owner._flushed_at = time.monotonic() - 2.5
    assert owner.flush_observed(every_s=1.0) == 2 and reader.node(a).last_heartbeat == 40.0
    owner.close()
    reader.close()


def test_seam_names_and_keys():
    p = protocol.WorkerPlacement("job7", 3, rank=5, world_size=8, local_rank=1, local_world_size=2, master_addr="h",
                             master_port=29500, store_addr="h:1234", checkpoint_dir="/ck", cluster_token="t")
    env = protocol.worker_env(p, base={"PATH": "/bin"})
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "1"
    assert env["PHALANX_GENERATION"] == "3" and env["PHALANX_STORE_ADDR"] == "h:1234" and env["PATH"] == "/bin"
    assert protocol.progress_key("job7", 3, 5) == "job7/gen3/progress/5"
    assert protocol.progress_key("job7", 3, 5).startswith(protocol.generation_prefix("job7", 3) + "/")
    assert protocol.parse_store_addr("h:1234") == ("h", 1234)


def test_gpu_check_skips_cpu_types_and_fails_gpu_types_without_nvml():
    cpu = GpuMonitor(0, "local.cpu-1").check()
    assert [c.status for c in cpu] == ["skipped"] and "expects no GPUs" in cpu[0].detail
    gpu = GpuMonitor(8, "gpu.8")
    if gpu._nvml is None:  # this machine: no NVML
        (check,) = gpu.check()
        assert check.status == "fail" and "expects 8 GPUs" in check.detail and not report([check])["ok"]


def test_a_clusters_leftover_scan_never_matches_another_cluster_whose_name_extends_it(tmp_path):
    """Deleting cluster `bench` must not take `bench-cold`'s processes for its own leftovers."""
    import subprocess

    cmd = [sys.executable, "-c", "import time; time.sleep(30)"]
    procs = [subprocess.Popen(cmd + [arg]) for arg in (f"{tmp_path}/bench/nodes/n0/agent.json",
                                                       f"{tmp_path}/bench-cold/nodes/n0/agent.json",
                                                       f"--cluster-dir={tmp_path}/bench")]
    try:
        found = wait_for(lambda: len(processes_mentioning(str(tmp_path))) == 3 and processes_mentioning(
            f"{tmp_path}/bench"), 10, "the processes to start")
        assert sorted(found) == sorted([procs[0].pid, procs[2].pid])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


class FakeNvml:
    """What GpuMonitor uses of pynvml, for a node with `count` GPUs: uncorrected ECC counts by index and XID
    events queued for the next check."""

    class NVMLError(Exception):
        pass

    class NVMLError_Timeout(NVMLError):  # noqa: N801 - pynvml's name
        pass

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, nvmlEventTypeXidCriticalError = 1, 0, 8

    def __init__(self, count: int):
        self.count, self.ecc, self.xids = count, {}, []

    def nvmlInit(self): pass  # noqa: E704, N802
    def nvmlDeviceGetCount(self): return self.count  # noqa: E704, N802
    def nvmlDeviceGetHandleByIndex(self, i): return i  # noqa: E704, N802
    def nvmlEventSetCreate(self): return "events"  # noqa: E704, N802
    def nvmlDeviceRegisterEvents(self, handle, kind, events): pass  # noqa: E704, N802
    def nvmlDeviceGetTotalEccErrors(self, handle, kind, counter): return self.ecc.get(handle, 0)  # noqa: E704, N802

    def nvmlEventSetWait_v2(self, events, timeout_ms):  # noqa: N802
        if not self.xids:
            raise self.NVMLError_Timeout()
        return type("EventData", (), {"eventData": self.xids.pop(0)})()


def test_gpu_checks_map_count_ecc_and_xids_to_actions(monkeypatch):
    """NVML's view mapped the HyperPod way: too few GPUs, uncorrected ECC errors or a hardware XID replace the
    node; an application-level XID (13, 31, 43, …) only restarts the job; XIDs are reported once."""
    nvml = FakeNvml(count=8)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every GPU of the host is the workers'
    gpu = GpuMonitor(8, "gpu.8")
    assert [(c.name, c.status) for c in gpu.check()] == [("gpu.count", "pass"), ("gpu.ecc", "pass"),
                                                         ("gpu.xid", "pass")]
    nvml.xids = [13, 13, 43]
    xid = gpu.check()[2]
    assert (xid.status, xid.action) == ("fail", RESTART_JOB) and "XID [13, 43]" in xid.detail
    assert report(gpu.check())["ok"], "a job-level XID does not fail the node, and it is reported once"
    nvml.xids = [13, 79]
    xid = gpu.check()[2]
    assert (xid.action, xid.detail) == (REPLACE_NODE, "XID [79]: hardware fault") and not report([xid])["ok"]
    nvml.ecc = {3: 2}
    ecc = gpu.check()[1]
    assert (ecc.status, ecc.action) == ("fail", REPLACE_NODE) and "{3: 2}" in ecc.detail
    nvml.count = 7
    short = GpuMonitor(8, "gpu.8").check()[0]
    assert (short.status, short.action) == ("fail", REPLACE_NODE) and "7 GPUs visible" in short.detail
    # NVML sees the host's 8; a step that Slurm gave 2 of them leaves 6 of gpu.8's workers without one
    nvml.count, nvml.ecc = 8, {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    (count, visible) = GpuMonitor(8, "gpu.8").check()[:2]
    assert count.status == "pass" and (visible.name, visible.status, visible.action) == ("gpu.visible", "fail",
                                                                                       REPLACE_NODE)
    assert "may use 2 GPUs (CUDA_VISIBLE_DEVICES='0,1'" in visible.detail and "at most 2 GPUs" in visible.detail
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    assert GpuMonitor(8, "gpu.8").check()[1].status == "pass"
    assert restart_job_failures(report([xid_check([31])]), since=0)[0]["detail"] == \
        "XID [31]: application-level fault"
    assert restart_job_failures(report([xid_check([31])]), since=time.time() + 60) == [], "an older report"
    # a dead worker is the scheduler's to judge (from the heartbeat's worker reports): the check only informs
    dead = check_workers({0: None, 1: -9})
    assert dead.status == "fail" and dead.action is None and restart_job_failures(report([dead]), since=0) == []


# ---- end to end: real controller, real agents ----------------------------------------------------------
@pytest.mark.slow
def test_create_lists_healthy_nodes_and_refuses_unauthenticated_requests(tmp_path, home):
    spec = write_spec(tmp_path)
    result = runner.invoke(app, ["cluster", "create", "-f", str(spec)])
    assert result.exit_code == 0, result.output
    assert "in-service" in result.output
    listed = runner.invoke(app, ["cluster", "list-nodes", "--json"])
    nodes = json.loads(listed.output)
    assert [(n["name"], n["state"], n["is_spare"]) for n in nodes] == [
        ("workers-0", "healthy", False), ("workers-1", "healthy", False), ("workers-2", "healthy", True)]
    assert all(n["health"]["ok"] and agent_alive(n) for n in nodes)
    lifecycle_log = Path(nodes[0]["work_dir"]) / "lifecycle.log"
    assert lifecycle_log.read_text().strip() == "configured workers-0"

    paths = ClusterPaths.for_name("c1")
    assert stat.S_IMODE(paths.token.stat().st_mode) == 0o600
    client = ClusterClient("c1")
    base, token = client.url(), paths.read_token()
    assert http("GET", f"{base}/v1/cluster") == 401
    assert http("GET", f"{base}/v1/cluster", token="wrong") == 401
    assert http("POST", f"{base}/v1/nodes/workers-0/heartbeat") == 401
    assert http("POST", f"{base}/v1/nodes/workers-0/faults", token="wrong") == 401
    assert http("GET", f"{base}/metrics") == 401
    assert http("GET", f"{base}/no/such/route") == 401  # checked before routing: nothing is revealed
    assert http("GET", f"{base}/metrics", token=token) == 200
    assert http("GET", f"{base}/v1/cluster", token=token) == 200

    # the heartbeat route (server/heartbeat_route.py, ahead of FastAPI's router) refuses with one clear error each
    good = {"protocol": protocol.PROTOCOL_VERSION, "handle": nodes[0]["handle"], "phase": "ready", "sent_at": 0.0}
    refusals = [("workers-0", {**good, "phase": 7}, 422, "phase"),
                ("workers-0", {**good, "wrokers": []}, 422, "wrokers"),
                ("workers-0", {**good, "protocol": protocol.PROTOCOL_VERSION + 1}, 409, "upgrade"),
                ("workers-9", good, 404, "no node named 'workers-9'"),
                ("workers-0", {**good, "handle": "not-its-agent"}, 410, "run by the agent with handle")]
    for name, body, status, words in refusals:
        with pytest.raises(ApiError) as refused:
            request_json("POST", f"{base}/v1/nodes/{name}/heartbeat", token, body)
        assert refused.value.status == status and words in refused.value.detail, (body, refused.value)

    info = client.describe()
    assert info["status"] == "in-service" and info["groups"][0]["spares_ready"] == 1
    described = runner.invoke(app, ["cluster", "describe", "c1"])  # the same through the CLI
    assert described.exit_code == 0 and "status in-service" in flat(described.output), described.output
    assert "workers local.cpu-1 2/2 1/1" in flat(described.output), described.output
    events = runner.invoke(app, ["cluster", "events", "--node", "workers-2"])
    assert events.exit_code == 0 and "healthy" in events.output and "initial spare" in flat(events.output)
    import torch.distributed as dist  # the rendezvous store the controller owns is a real TCPStore

    host, port = protocol.parse_store_addr(info["store"]["addr"])
    store = dist.TCPStore(host, port, is_master=False)
    store.set("probe", "1")
    assert store.get("probe") == b"1"


def flat(text: str) -> str:
    """Rich wraps and pads table cells: compare words, not layout."""
    return " ".join(text.replace("│", " ").replace("┃", " ").split())


def _check_replacement(client: ClusterClient, victim: str, spare: str, injected_at: float, within: tuple):
    def replaced():
        nodes = nodes_by_name(client)
        fresh = [n for n in live(nodes).values() if n["is_spare"] and n["state"] == "healthy"]
        return nodes if nodes[victim]["state"] == "terminated" and fresh else None

    nodes = wait_for(replaced, 20, f"{victim} to be replaced and the spare pool refilled")
    events = client.events(node=victim)
    faulty = next(e for e in events if e["to_state"] == "faulty")
    lo, hi = within
    assert lo <= faulty["time"] - injected_at <= hi, (faulty, injected_at)
    assert [e["to_state"] for e in events if e["time"] >= faulty["time"]] == ["faulty", "replacing", "terminated"]
    replacing = next(e for e in events if e["to_state"] == "replacing")
    assert f"replaced by spare {spare}" in replacing["reason"]
    promoted = [e for e in client.events(node=spare) if e["kind"] == "promoted"]
    assert len(promoted) == 1 and victim in promoted[0]["reason"]
    members = {k for k, n in live(nodes).items() if not n["is_spare"] and n["state"] == "healthy"}
    (new_spare,) = [k for k, n in live(nodes).items() if n["is_spare"]]
    assert members == {"workers-0", "workers-1", spare} - {victim}
    assert new_spare == "workers-3" and "refilling spare pool" in client.events(node=new_spare)[0]["reason"]
    assert not agent_alive(nodes[victim])
    wait_for(lambda: client.describe()["status"] == "in-service", 10, "the cluster to be back in service")
    return faulty


@pytest.mark.slow
@pytest.mark.parametrize("kind, reason, within", [
    ("kill-node", "killed by SIGKILL", (0.0, 3.0)),           # within the heartbeat timeout (3 s)
    ("fail-health", "health check failed: injected", (0.0, 3.0)),
    # alive but silent: the heartbeat timeout (3 s), counted from the last heartbeat (≤ 0.5 s before the freeze)
    ("freeze-node", "no heartbeat for", (2.5, 6.5)),
    ("gpu-xid", "gpu.xid: XID [79] (injected): hardware fault", (0.0, 3.0)),  # NVML's path, from the check on
])
def test_faulty_node_is_replaced_by_the_spare_and_the_pool_refilled(tmp_path, home, kind, reason, within):
    create_cluster(write_spec(tmp_path), timeout_s=60)
    client = ClusterClient("c1")
    injected_at = time.time()
    extra = ["--xid", "79"] if kind == "gpu-xid" else []
    result = runner.invoke(app, ["fault", "inject", "--node", "workers-0", "--kind", kind, *extra])
    assert result.exit_code == 0, result.output
    faulty = _check_replacement(client, "workers-0", "workers-2", injected_at, within)
    assert reason in faulty["reason"]
    if kind == "freeze-node":
        silent = float(faulty["reason"].split("no heartbeat for ")[1].split()[0])
        assert 3.0 <= silent < 6.0, faulty["reason"]  # never before the timeout; slack for a loaded host
    injected = [e for e in client.events(node="workers-0") if e["kind"] == "fault-injected"]
    assert len(injected) == 1 and kind in injected[0]["reason"]


@pytest.mark.slow
def test_failed_lifecycle_script_is_reported_with_its_output_and_nothing_runs(tmp_path, home):
    script = ('echo "mounting /fsx on $PHALANX_NODE_NAME"\n'
              'if [ "$PHALANX_NODE_NAME" = workers-1 ]; then echo "fatal: /fsx unreachable" >&2; exit 3; fi')
    path = write_spec(tmp_path, spares=0, script=script)
    result = runner.invoke(app, ["cluster", "create", "-f", str(path)])
    assert result.exit_code == 1
    with pytest.raises(CreateFailed) as err:  # the Python API says the same, with the node
        create_cluster(load_spec(path).model_copy(update={"name": "c2"}), timeout_s=60)
    for msg in (result.output, str(err.value)):
        flat = " ".join(msg.split())
        assert "workers-1" in flat and "exited with code 3" in flat
        assert "mounting /fsx on workers-1" in flat and "fatal: /fsx unreachable" in flat
    assert err.value.node == "workers-1"
    for name in ("c1", "c2"):
        paths = ClusterPaths.for_name(name)
        assert controller_pid(paths) is None
        store = Store(paths.db)
        assert store.cluster()["status"] == "failed"
        assert all(n.state == NodeState.TERMINATED and not process_running(int(n.handle), AGENT_MODULE)
                   for n in store.nodes())
        store.close()
    assert processes_mentioning(str(home)) == []


@pytest.mark.slow
def test_controller_sigkill_and_restart_leave_agents_untouched(tmp_path, home):
    create_cluster(write_spec(tmp_path), timeout_s=60)
    client = ClusterClient("c1")
    before = nodes_by_name(client)
    store_addr = client.describe()["store"]["addr"]
    pid = controller_pid(client.paths)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: controller_pid(client.paths) is None, 5, "the controller to die")
    time.sleep(3.5)  # longer than the heartbeat timeout: agents keep retrying, nobody marks anything
    assert all(agent_alive(n) for n in before.values())
    assert client.describe()["controller"]["running"] is False

    restarted_at = time.time()
    start_controller("c1")
    assert controller_pid(client.paths) not in (None, pid)

    def fresh_heartbeats():
        nodes = nodes_by_name(client)
        return nodes if all((n["last_heartbeat"] or 0) > restarted_at for n in nodes.values()) else None

    after = wait_for(fresh_heartbeats, 30, "every agent's heartbeat to reach the restarted controller")
    time.sleep(1.0)
    after = nodes_by_name(client)
    same = {k: (n["handle"], "healthy") for k, n in before.items()}
    assert {k: (n["handle"], n["state"]) for k, n in after.items()} == same
    events = client.events()
    assert not [e for e in events if e["to_state"] == "faulty"]
    assert any(e["kind"] == "controller" and "restarted" in e["reason"] for e in events)
    assert client.describe()["store"]["addr"] == store_addr  # the rendezvous store came back on its port

    # delete with the controller down stops the nodes directly; nothing is left for the fallback kill
    os.kill(controller_pid(client.paths), signal.SIGKILL)
    wait_for(lambda: controller_pid(client.paths) is None, 5, "the controller to die")
    result = runner.invoke(app, ["cluster", "delete", "c1"])
    assert result.exit_code == 0 and "is not running: stopped 3 nodes directly" in result.output, result.output
    assert "still running" not in result.output
    assert not any(agent_alive(n) for n in after.values())


def test_a_controller_paused_past_the_heartbeat_timeout_does_not_judge_its_agents_silent(tmp_path, home):
    """The controller stopped (SIGSTOP: a VM paused, a debugger, the host swapping) for longer than
    heartbeat_timeout_s: its agents were not silent, it was not listening. Once it runs again it reads what they sent
    before it judges them (`AgentLinks.heard_until`): no node is faulty."""
    path = write_spec(tmp_path)
    create_cluster(path, timeout_s=60)
    timeout = load_spec(path).health.heartbeat_timeout_s
    client = ClusterClient("c1")
    pid = controller_pid(client.paths)
    for _ in range(3):  # (three pauses: the reconciler and the server's loop race to run first after each)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(timeout + 1.5)
        resumed = time.time()
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: all((n["last_heartbeat"] or 0) > resumed for n in nodes_by_name(client).values()), 30,
                 "every agent's heartbeat after the pause")
    faulty = [(e["node"], e["reason"]) for e in client.events() if e["to_state"] == "faulty"]
    assert not faulty, faulty
    assert {n["state"] for n in nodes_by_name(client).values()} == {"healthy"}


@pytest.mark.slow
def test_delete_leaves_no_process_behind(tmp_path, home):
    # a lifecycle script that leaves a daemon running, as real ones do: it must die with its node
    script = 'sleep 300 &\necho $! > daemon.pid'
    create_cluster(write_spec(tmp_path, count=1, spares=1, script=script, worker_template=True), timeout_s=60)
    client = ClusterClient("c1")
    nodes = client.nodes()
    daemons = [int((Path(n["work_dir"]) / "daemon.pid").read_text()) for n in nodes]
    assert all(process_running(p, "sleep") for p in daemons)
    ctl = controller_pid(client.paths)
    result = runner.invoke(app, ["cluster", "delete", "c1"])
    assert result.exit_code == 0, result.output
    assert "still running" not in result.output  # nothing needed the fallback kill
    assert not ClusterPaths.for_name("c1").root.exists()
    assert not process_running(ctl, "phalanx")
    assert not any(process_running(int(n["handle"]), AGENT_MODULE) for n in nodes)
    assert not any(process_running(p, "sleep") for p in daemons)
    assert processes_mentioning(str(home)) == []


@pytest.mark.slow
def test_recovery_none_leaves_the_faulty_node_and_no_spares_means_a_fresh_node(tmp_path, home):
    create_cluster(write_spec(tmp_path, name="keep", count=1, spares=0, node_recovery="none"), timeout_s=60)
    create_cluster(write_spec(tmp_path, name="heal", count=1, spares=0), timeout_s=60)
    keep, heal = ClusterClient("keep"), ClusterClient("heal")
    keep.inject_fault("workers-0", "kill-node")
    heal.inject_fault("workers-0", "kill-node")
    wait_for(lambda: heal.nodes()[-1]["name"] == "workers-1" and heal.nodes()[-1]["state"] == "healthy", 20,
             "a freshly provisioned replacement")
    assert heal.nodes()[0]["state"] == "terminated" and not heal.nodes()[-1]["is_spare"]
    assert [n["state"] for n in keep.nodes()] == ["faulty"]
    assert keep.describe()["status"] == "degraded"
    assert any("node_recovery=none" in e["reason"] for e in keep.events())


@pytest.mark.slow
def test_deep_health_check_pairs_new_nodes_with_a_healthy_peer_and_fails_slow_links(tmp_path, home):
    deep = {"deep_health_check": True, "deep_check_size_mb": 1, "deep_check_iters": 3}
    create_cluster(write_spec(tmp_path, health=deep), timeout_s=120)
    client = ClusterClient("c1")
    healthy = {n: [e for e in client.events(node=n) if e.get("to_state") == "healthy"]
               for n in ("workers-0", "workers-1", "workers-2")}
    for name, events in healthy.items():  # creation: one round across every node of the group
        assert len(events) == 1 and "deep health check: bus bandwidth" in events[0]["reason"], events
        assert "across workers-0, workers-1, workers-2, 3 processes" in events[0]["reason"]
    # A replacement spare is checked against a healthy peer (a spare first, else a member without a job).
    client.inject_fault("workers-0", "kill-node")
    new = wait_for(lambda: [e for e in client.events(node="workers-3") if e.get("to_state") == "healthy"], 90,
                   "the refilled spare to pass its deep check")
    reason = new[0]["reason"]
    assert "deep health check: bus bandwidth" in reason and "across workers-1, workers-3" in reason, reason
    bw = float(reason.split("bus bandwidth ")[1].split()[0])
    assert bw >= 0.05

    # The same check with a threshold no link reaches: creation fails and names the figure and the setting.
    slow = write_spec(tmp_path, name="c2", spares=0, health={**deep, "deep_check_min_busbw_gbps": 1e6})
    with pytest.raises(CreateFailed) as err:
        create_cluster(slow, timeout_s=120)
    flat = " ".join(str(err.value).split())
    assert "deep health check: bus bandwidth" in flat and "below deep_check_min_busbw_gbps=1e+06" in flat, flat


def test_a_cluster_that_would_flood_one_controller_with_heartbeats_is_warned_about_with_the_fix():
    from phalanx.control.spec import heartbeat_load_warning, spec_from_dict

    def spec(count: int, interval: float):
        return spec_from_dict({"name": "big", "backend": "hosts", "health": {
            "heartbeat_interval_s": interval, "heartbeat_timeout_s": 6 * interval},
            "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": count, "spares": 4}]})

    assert heartbeat_load_warning(spec(4092, 0.5)) is None  # 8,192 a second: what one controller answered in full
    warning = heartbeat_load_warning(spec(16380, 0.5))
    assert "32,768 heartbeats a second" in warning and "raise health.heartbeat_interval_s to 2 or more" in warning
    assert heartbeat_load_warning(spec(16380, 2.0)) is None

"""Past one machine (backend `hosts`): the controller on one host, every node an agent that joined from a host
of its own (`phalanx agent --controller URL --token-file F --group G`), hosts made of Linux network namespaces
on a bridge (tests/netns.py, 198.18.0.0/24). Each host's agent sees an empty tmpfs where the controller's
directory is: a host shares only the checkpoint directory (and the code) with the controller. Nothing here
reaches a node through a local process handle: the controller knows each node from its heartbeats (its address, interface, free ports), MASTER_ADDR is the
address of the host of rank 0, gloo binds each host's own interface.

End to end, with real processes: a checkpointless job survives a killed host (the spare's host takes the rank,
state from the other replica's memory, the same loss at every step as a run without faults); a restart job
survives a host cut off the network (`ip link set down`): it resumes from the checkpoint on the spare, and
once the link is back the cut host's agent learns its node was replaced and exits; a checkpointless job
survives a frozen host (every process SIGSTOPped). A command job's rank logs reach the controller from the hosts.
Bad joins get one clear error each.

Needs root for the namespaces (CI runs as root); skipped, saying so, only where namespaces cannot be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusters import generations, home, wait_for  # noqa: F401  (home is a fixture)
from conftest import run_training, tiny_config
from netns import Hosts
from phalanx.control.client.cluster import ClusterClient, delete_cluster
from phalanx.control.client.jobs import JobClient
from phalanx.control.state.paths import ClusterPaths, list_clusters
from test_checkpointless import assert_same_losses, pids_by_rank, records
from test_jobs import step_at_least, write_config

pytestmark = pytest.mark.slow
PY = sys.executable
STEPS = 40
REPLICAS = {"dp_replicate": 2, "dp_shard": 1}


@pytest.fixture
def hosts(home, tmp_path):
    why = Hosts.available()
    if why:
        pytest.skip(f"multi-host tests: {why}")
    h = Hosts(4).up()
    yield h
    try:
        for name in list_clusters():
            if os.environ.get("PHALANX_TEST_KEEP"):  # debugging: keep the cluster's logs and database
                shutil.copytree(ClusterPaths.for_name(name).root, tmp_path / f"kept-{name}", dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.sock"))
            delete_cluster(name, timeout_s=20)  # while the hosts run: their agents are told to terminate
    finally:
        h.close()


def start_cluster(hosts: Hosts, tmp_path: Path, *, members: int = 2, spares: int = 1, warm_standby: bool = True,
                  name: str = "c1") -> str:
    """`phalanx cluster create` in the controller's namespace, then one agent per host joining it: h1..h(n).
    Returns the controller's URL once the cluster is in service."""
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "backend": "hosts", "api": {"host": hosts.controller_addr, "port": 0},
        "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": members, "spares": spares,
                             "warm_standby": warm_standby}],
        "health": {"heartbeat_timeout_s": 4.0, "hang_timeout_s": 60.0}}))
    create = hosts.run("c", [PY, "-m", "phalanx.cli", "cluster", "create", "-f", str(spec), "--timeout", "150"],
                       tmp_path / "create.log", env=host_env())
    paths = ClusterPaths.for_name(name)
    wait_for(lambda: paths.endpoint.is_file() and paths.token.is_file(), 60, "the controller's endpoint file")
    url = ClusterClient(name).url()
    assert url.startswith(f"http://{hosts.controller_addr}:"), url
    for i in range(1, members + spares + 1):
        join(hosts, tmp_path, f"h{i}", url, paths.token.read_text())
    assert create.wait(timeout=180) == 0, (tmp_path / "create.log").read_text()[-3000:]
    return url


def join(hosts: Hosts, tmp_path: Path, host: str, url: str, token: str, group: str = "workers") -> subprocess.Popen:
    """An agent on `host`, with its own copy of the token and its own work root. The controller's directory
    (PHALANX_HOME) is hidden under an empty tmpfs in the host's mount namespace: a host shares only the
    checkpoint directory (and the code) with the controller."""
    root = tmp_path / "hosts" / host
    root.mkdir(parents=True, exist_ok=True)
    (root / "token").write_text(token)
    hide = ["sh", "-c", 'mount -t tmpfs tmpfs "$0" && exec "$@"', os.environ["PHALANX_HOME"]]
    return hosts.run(host, [*hide, PY, "-m", "phalanx.cli", "agent", "--controller", url, "--token-file",
                            str(root / "token"), "--group", group, "--work-root", str(root / "work")],
                     root / "agent.out", env=host_env())


def host_env() -> dict:
    """This process's env as a host's: without conftest's GLOO_SOCKET_IFNAME=lo (each agent names its own)."""
    return {**{k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")},
            "OMP_NUM_THREADS": "1"}


def host_of(client: ClusterClient, hosts: Hosts, node: str) -> str:
    address = next(n for n in client.nodes() if n["name"] == node)["report"]["address"]
    return next(h for h in hosts.hosts if hosts.address(h) == address)


def config_for(run_dir: Path, data: Path, recovery: str, steps: int = STEPS):
    resilience = {"recovery": recovery, "regroup_timeout_s": 60.0, "recovery_timeout_s": 120.0}
    return tiny_config(run_dir, data, parallel=REPLICAS, resilience=resilience,
                       training={"max_steps": steps, "log_interval": 8},
                       lr_schedule={"warmup_steps": 3, "total_steps": steps}, checkpoint={"interval": 5, "keep": 10})


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_data) -> dict[int, float]:
    """Loss per step of the failure-free run, trained by `phalanx train --nproc 2` on this machine."""
    steps = run_training(config_for(tmp_path_factory.mktemp("ref-hosts"), demo_data, "checkpointless"), 2)
    return {s["step"]: s["loss"] for s in steps}


def agent_pid(hosts: Hosts, host: str) -> int:
    return next(p for p in hosts.pids(host) if "agent" in Path(f"/proc/{p}/cmdline").read_text())


def train_until_step_12(hosts: Hosts, tmp_path: Path, data: Path, recovery: str, name: str, **cluster):
    """A cluster of 2 members + 1 spare on h1..h3, a job of 2 ranks trained to step 12: (jobs, client, run dir,
    the node of rank 1, its host)."""
    start_cluster(hosts, tmp_path, **cluster)
    jobs, client = JobClient("c1"), ClusterClient("c1")
    run_dir = tmp_path / "run"
    jobs.submit(write_config(tmp_path / f"{name}.yaml", config_for(run_dir, data, recovery)), nodes=2,
                auto_resume=True, name=name)
    step_at_least(jobs, name, 12, timeout=120)
    victim = jobs.describe(name)["generations"][0]["nodes"][1]
    return jobs, client, run_dir, victim, host_of(client, hosts, victim)


def test_a_checkpointless_job_survives_a_killed_host(tmp_path, hosts, demo_data, reference):
    jobs, client, run_dir, victim, host = train_until_step_12(hosts, tmp_path, demo_data, "checkpointless", "cl")
    nodes = {n["name"]: n for n in client.nodes()}
    assert {n["report"]["address"] for n in nodes.values()} == {hosts.address(h) for h in ("h1", "h2", "h3")}
    assert {n["report"]["ifname"] for n in nodes.values()} == {"eth0"}
    first = jobs.describe("cl")["generations"][0]
    assert first["master_addr"] == hosts.address(host_of(client, hosts, first["nodes"][0])), first  # rank 0's host
    killed = hosts.kill(host)
    assert killed, "the victim host ran processes"
    info = jobs.wait("cl", timeout_s=180)

    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    gen1, gen2 = generations(info, 2)
    assert gen1["outcome"] == "node-fault" and gen2["outcome"] == "succeeded"
    assert gen2["nodes"][0] == gen1["nodes"][0] and gen2["nodes"][1] not in gen1["nodes"]
    before, after = pids_by_rank(info, 1), pids_by_rank(info, 2)
    assert after[0] == before[0], "the survivor kept its process"
    events = assert_same_losses(run_dir, reference, "killed host")
    restored = next(e for e in events if e["event"] == "state_restored")
    assert restored["source"] == "peer-memory" and restored["bytes"] > 0
    assert info["log_dir"].startswith(str(run_dir)), info["log_dir"]  # beside the checkpoints, which hosts share
    assert "rank 1 on node" in (Path(info["log_dir"]) / "rank1.log").read_text()
    victim_node = next(n for n in client.nodes() if n["name"] == victim)
    # its agent's link ended with its process: judged within link_grace_s, not after heartbeat_timeout_s
    assert victim_node["state"] in ("replacing", "terminated") and victim_node["fault_cause"] == "agent-gone"
    faulty = next(e for e in client.events(node=victim) if e.get("to_state") == "faulty")
    assert "its agent's link to the controller closed" in faulty["reason"], faulty


def test_a_restart_job_survives_a_host_cut_off_the_network(tmp_path, hosts, demo_data):
    jobs, client, run_dir, victim, cut = train_until_step_12(hosts, tmp_path, demo_data, "restart", "rs",
                                                             warm_standby=False)
    agent = agent_pid(hosts, cut)
    hosts.cut(cut)
    info = jobs.wait("rs", timeout_s=180)

    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    gen1, gen2 = info["generations"][0], info["generations"][-1]
    assert gen1["outcome"] == "node-fault" and victim not in gen2["nodes"]
    assert gen2["master_addr"] == hosts.address(host_of(client, hosts, gen2["nodes"][0]))
    _, events = records(run_dir)
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed and resumed[-1]["step"] >= 5, events  # from a checkpoint the first generation committed
    node = next(n for n in client.nodes() if n["name"] == victim)
    assert node["fault_cause"] == "heartbeat-timeout" and node["state"] == "terminated", node
    # the link comes back: the cut host's agent hears that its node was replaced, stops its worker and exits
    hosts.mend(cut)
    wait_for(lambda: not Path(f"/proc/{agent}").exists() or "Z" in Path(f"/proc/{agent}/stat").read_text().split()[2],
             30, "the cut host's agent to exit once it reaches the controller again")
    out = (tmp_path / "hosts" / cut / "agent.out").read_text()
    assert "controller does not know node" in out or "terminated" in out, out[-2000:]


def test_a_checkpointless_job_survives_a_frozen_host(tmp_path, hosts, demo_data, reference):
    jobs, client, run_dir, victim, frozen = train_until_step_12(hosts, tmp_path, demo_data, "checkpointless", "fz")
    assert hosts.freeze(frozen)
    info = jobs.wait("fz", timeout_s=180)

    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    gen1, gen2 = info["generations"][0], info["generations"][-1]
    assert gen1["outcome"] == "node-fault" and victim not in gen2["nodes"] and gen2["nodes"][0] == gen1["nodes"][0]
    assert_same_losses(run_dir, reference, "frozen host")
    node = next(n for n in client.nodes() if n["name"] == victim)
    assert node["fault_cause"] == "heartbeat-timeout", node


def test_a_command_jobs_rank_logs_reach_the_controller_from_the_hosts(tmp_path, hosts):
    """A command job's dir is in the controller's cluster directory, which the hosts do not see (an empty tmpfs
    there): each host's agent writes its rank's log on its node and ships it; `job logs -f` on the controller's
    side reads every rank's output and exit line, and ends with the job."""
    start_cluster(hosts, tmp_path, members=2, spares=0, warm_standby=False)
    jobs = JobClient("c1")
    say = "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'says hello', flush=True)"
    jobs.submit(command=[PY, "-c", say], nodes=2, name="hello", cwd=tmp_path)
    lines: list[str] = []
    info = jobs.follow("hello", write=lines.append)

    assert info["state"] == "succeeded", info["reason"]
    assert info["log_dir"].startswith(os.environ["PHALANX_HOME"]), info["log_dir"]  # the controller's, not shared
    for rank in (0, 1):
        assert f"[rank {rank}] rank {rank} of 2 says hello" in lines, lines
        assert f"[rank {rank}] === phalanx: rank {rank} exited with code 0 ===" in lines, lines
    hosts_logs = sorted((tmp_path / "hosts").rglob("job-logs/*/rank*.log"))
    assert len(hosts_logs) == 2, hosts_logs  # written on each host, in its node's work dir


def test_a_bad_join_gets_one_clear_error(tmp_path, hosts):
    url = start_cluster(hosts, tmp_path, members=1, spares=0)
    token = ClusterPaths.for_name("c1").token.read_text()

    def refused(host: str, token_text: str, group: str, why: str) -> None:
        proc = join(hosts, tmp_path, host, url, token_text, group=group)
        assert proc.wait(timeout=30) == 2
        out = (tmp_path / "hosts" / host / "agent.out").read_text()
        assert "could not join the cluster" in out and why in out, out
        assert "Traceback" not in out, out

    refused("h2", "not-the-token", "workers", "missing or wrong cluster token")
    refused("h3", token, "gpus", "no instance group 'gpus'")
    refused("h4", token, "workers", "no node of group workers waits for an agent")
    client = ClusterClient("c1")
    assert [n["name"] for n in client.nodes()] == ["workers-0"]
    # a fault injected from the controller reaches a node on another host through its agent: frozen, it falls
    # silent; it is replaced by a fresh node (no spares), which waits for an agent; one joins and it comes up
    agent = agent_pid(hosts, "h1")
    client.inject_fault("workers-0", "freeze-node")
    wait_for(lambda: Path(f"/proc/{agent}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T", 10,
             "the agent on h1 to stop itself")
    node = lambda name: next((n for n in client.nodes() if n["name"] == name), None)  # noqa: E731
    wait_for(lambda: (n := node("workers-1")) and n["state"] == "provisioning", 20, "a fresh node waiting for an agent")
    assert node("workers-0")["fault_cause"] == "heartbeat-timeout"
    join(hosts, tmp_path, "h2", url, token)
    wait_for(lambda: node("workers-1")["state"] == "healthy", 30, "the node h2's agent joined to come up")
    assert node("workers-1")["report"]["address"] == hosts.address("h2")

"""The Slurm backend on a real Slurm (tests/slurm.py: slurmctld and four slurmd, n1..n4, on this machine, munge
for authentication; Debian's slurm-wlm). Each slurmd runs in a network namespace of its own (tests/netns.py:
host hI, address 198.18.0.1I), so every node's agent, workers, batch script and step daemons live on a host
with its own address, and a host's death takes its link down before its processes die. `backend: slurm` asks Slurm for one allocation of members + spares,
whose `srun` step starts an agent on every node; the agents join the cluster; Phalanx does the rest.

Drills, end to end with real processes:
- a node's host dies mid-training (its link down, then its slurmd, agent and workers killed): the checkpointless
  job carries on on the spare with the same loss at every step as a run without faults, the survivor's state
  carried in its memory (it cuts its connections to the dead host once the next generation is out); the dead node is drained with the fault as
  Slurm's reason; a one-node job refills the spare pool on the free node.
- Slurm warns the allocation of its time limit (USR2): its agents relay it and the controller asks the restart
  job there for a checkpoint between its intervals; then an operator drains a node the job trains on: Phalanx
  replaces it (fault `scheduler`), the job resumes from its checkpoint on the spare, and the operator's reason
  stays as it was.
- the recipe's batch script (`sbatch recipes/slurm/run.sbatch`: `phalanx cluster up --slurm --run`) trains a
  restart job on a cluster inside its allocation. Slurm's warning before the time limit (USR2) makes it
  checkpoint the job between its intervals and requeue the allocation; the next run goes on from that step.
  Then its batch host dies (slurmd and every process of the batch step killed, the node marked down): Slurm
  requeues the job, the script starts again on the remaining nodes, removes the cluster the run before left,
  and the job resumes from its checkpoint to the end.
- a GPU instance type's allocation holds the nodes' GPUs (`--gres=gpu:N`; the test Slurm's GPUs are device files
  standing in), its agents' step and workers see them (CUDA_VISIBLE_DEVICES); more GPUs than a node has are refused.
- bad input and bad weather get one clear error and leave nothing behind: no Slurm commands on PATH,
  slurmctld unreachable, an unknown partition, an account Slurm refuses (unknown, or not this user's), an
  allocation pending past its timeout (squeue's reason).

The test Slurm enforces accounting, as most real clusters do (slurmdbd on a MariaDB of its own,
`AccountingStorageEnforce=associations`): root may submit under the accounts ml (its default) and vision (and root, which Slurm makes with the cluster).
The first drill's cluster asks for vision: its allocation and the refill after the fault run under it.

Needs root for the daemons (CI runs as root; `make test` installs slurm-wlm, munge, slurmdbd and mariadb-server):
fails, never skips, when Slurm cannot be brought up.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import yaml

from clusters import generations, home, keep_for_debugging, wait_for  # noqa: F401  (home is a fixture)
from phalanx.control.client.cluster import ClusterClient, ClusterRefused, CreateFailed, create_cluster, delete_cluster
from phalanx.control.client.jobs import JobClient
from phalanx.control.state.paths import ClusterPaths, list_clusters
from netns import Hosts
from slurm import LocalSlurm
from test_checkpointless import assert_same_losses, records
from test_hosts import STEPS, config_for, reference  # noqa: F401  (reference is a fixture)
from test_jobs import step_at_least, write_config

pytestmark = pytest.mark.slow
GPUS_PER_NODE = 2  # what slurm.conf gives every node (Gres=gpu:2, device files standing in for the GPUs)
ACCOUNTS = ("ml", "vision")  # the accounts root may use in the test Slurm's accounting (ml its default)


@pytest.fixture(scope="module")
def slurm_daemons(tmp_path_factory):
    why = LocalSlurm.available(accounting=True) or Hosts.available()
    if why:
        pytest.fail(f"the Slurm tests need a real Slurm on network namespaces: {why} (`make test` installs it "
                    "when run as root)")
    hosts = Hosts(4, tag=f"s{os.getpid() % 10000}").up()
    s = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=4, hosts=hosts, gpus=GPUS_PER_NODE, accounts=ACCOUNTS)
    try:
        s.start()
        yield s
    finally:
        s.stop()
        hosts.close()


@pytest.fixture
def slurm(slurm_daemons, home, monkeypatch):
    """The module's Slurm, every node idle; SLURM_CONF set for Phalanx. Afterwards: every cluster deleted,
    every job cancelled, every node back in service."""
    monkeypatch.setenv("SLURM_CONF", str(slurm_daemons.conf))
    monkeypatch.setenv("PHALANX_TEST_API_HOST", slurm_daemons.here)  # `create` puts it in the spec
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # conftest's "lo": each host's agent finds its own
        monkeypatch.delenv(name, raising=False)  # interface (the one that reaches the controller)
    yield slurm_daemons
    tracebacks = [f"{name}: {log[-3000:]}" for name in list_clusters()
                  if "Traceback" in (log := ClusterPaths.for_name(name).controller_log.read_text())]
    names = {f"phalanx-{name}" for name in list_clusters()}  # the Slurm jobs the backend submitted
    try:
        for name in list_clusters():
            keep_for_debugging(name, home.parent)
            delete_cluster(name, timeout_s=30)  # the backend cancels the cluster's Slurm jobs
        # cancelled (a job on a node whose slurmd was killed stays COMPLETING until Slurm marks the node down)
        wait_for(lambda: not [j for j in slurm_daemons.jobs() if j["name"] in names and j["state"] != "COMPLETING"],
                 15, "the cluster's Slurm jobs to be cancelled")
    finally:
        slurm_daemons.reset()
    assert not tracebacks, "\n".join(tracebacks)  # a controller error must not pass silently


def create(tmp_path: Path, name: str = "c1", *, count: int = 2, spares: int = 1, instance_type: str = "local.cpu-1",
           **slurm_settings) -> ClusterClient:
    """A cluster whose controller runs here, listening where the nodes' hosts reach it (`LocalSlurm.here`)."""
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump({
        "name": name, "backend": "slurm", "api": {"host": os.environ["PHALANX_TEST_API_HOST"]},
        "instance_groups": [{"name": "workers", "instance_type": instance_type, "count": count, "spares": spares}],
        "health": {"heartbeat_timeout_s": 4.0, "hang_timeout_s": 60.0},
        "slurm": {"work_root": str(tmp_path / "agents"), **slurm_settings}}))
    create_cluster(spec, timeout_s=120)
    return ClusterClient(name)


def place(node: dict) -> tuple[str, str, int]:
    """(Slurm job id, Slurm node, agent pid) from a node's handle `slurm:<job>:<node>:<pid>`."""
    kind, job, host, pid = node["handle"].split(":")
    assert kind == "slurm", node["handle"]
    return job, host, int(pid)


def test_a_checkpointless_job_survives_a_slurm_node_whose_slurmd_and_agent_die(tmp_path, slurm, demo_data, reference):
    client = create(tmp_path, account="vision")  # (not root's default account: Slurm is told which)
    (alloc,) = slurm.jobs()  # one allocation: members + spares
    assert alloc["name"] == "phalanx-c1" and alloc["state"] == "RUNNING", alloc
    assert alloc["comment"] == "phalanx cluster c1 group workers" and alloc["account"] == "vision", alloc
    places = {n["name"]: place(n) for n in client.nodes()}
    assert {p[0] for p in places.values()} == {alloc["id"]} and len({p[1] for p in places.values()}) == 3, places

    jobs, run_dir = JobClient("c1"), tmp_path / "run"
    jobs.submit(write_config(tmp_path / "cl.yaml", config_for(run_dir, demo_data, "checkpointless")), nodes=2,
                auto_resume=True, name="cl")
    step_at_least(jobs, "cl", 12, timeout=120)
    first = jobs.describe("cl")["generations"][0]["nodes"]
    # a member that is not the allocation's batch host (inside `cluster up` that host's death is the requeue's
    # case, tested below)
    batch_host = slurm.run("squeue", "-h", "-j", alloc["id"], "-o", "%B").stdout.strip()
    victim = next(n for n in first if places[n][1] != batch_host)
    # squeue stays truthful: the allocation's comment names the Phalanx job each of its nodes runs
    wait_for(lambda: all(f"{n} runs phalanx job 1" in slurm.jobs()[0]["comment"] for n in first), 10,
             "the allocation's comment to name the job")
    _, host, agent = places[victim]
    killed = slurm.kill_node(host)  # the node dies: its slurmd, its step daemon, its agent and the agent's workers
    assert agent in killed
    info = jobs.wait("cl", timeout_s=180)

    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    gen1, gen2 = generations(info, 2)
    survivor = next(n for n in gen1["nodes"] if n != victim)
    assert gen1["outcome"] == "node-fault" and survivor in gen2["nodes"] and victim not in gen2["nodes"], info
    events = assert_same_losses(run_dir, reference, "a Slurm node killed")
    restored = next(e for e in events if e["event"] == "state_restored")
    assert restored["source"] == "peer-memory", restored  # the survivor carried its state: no checkpoint read
    # the dead node goes back to Slurm drained, the fault as its reason
    wait_for(lambda: "drain" in slurm.node_states()[host], 30, f"Slurm node {host} to be drained")
    assert slurm.node_reason(host).startswith("phalanx: heartbeat-timeout"), slurm.node_reason(host)
    # and a one-node job on the free node refills the spare pool: its agent joins the running cluster
    free = ({"n1", "n2", "n3", "n4"} - {p[1] for p in places.values()}).pop()
    spare = wait_for(lambda: next((n for n in client.nodes() if n["is_spare"] and n["state"] == "healthy"), None),
                     90, "a fresh spare")
    job_id, spare_host, _ = place(spare)
    assert job_id != alloc["id"] and spare_host == free, (spare, slurm.jobs())
    assert {j["id"] for j in slurm.jobs()} >= {alloc["id"], job_id}
    assert next(j for j in slurm.jobs() if j["id"] == job_id)["account"] == "vision"  # the refill's account too


def test_a_restart_job_moves_off_a_node_an_operator_drains(tmp_path, slurm, demo_data):
    client = create(tmp_path)
    jobs, run_dir = JobClient("c1"), tmp_path / "run"
    jobs.submit(write_config(tmp_path / "rs.yaml", config_for(run_dir, demo_data, "restart")), nodes=2,
                auto_resume=True, name="rs")
    step_at_least(jobs, "rs", 12, timeout=120)
    victim = jobs.describe("rs")["generations"][0]["nodes"][1]
    allocation, host, _ = place(next(n for n in client.nodes() if n["name"] == victim))
    # Slurm's warning before the allocation's time limit (its --signal=B:USR2@120, sent now): the batch script's
    # srun passes it to the agents, which tell the controller; it asks the job for a checkpoint between intervals
    slurm.run("scancel", "--batch", "--signal=USR2", allocation)
    asked = wait_for(lambda: (c := jobs.describe("rs").get("last_checkpoint")) and c.get("requested") and c, 60,
                     "the checkpoint the time-limit warning asked for")
    assert any("Slurm's warning before the time limit of node" in e["reason"] for e in client.events()
               if e["kind"] == "checkpoint-requested")
    slurm.run("scontrol", "update", f"nodename={host}", "state=drain", "reason=bad DIMM (operator)")
    info = jobs.wait("rs", timeout_s=180)

    assert info["state"] == "succeeded" and info["last_step"] == STEPS, info["reason"]
    gen1, gen2 = info["generations"][0], info["generations"][-1]
    assert gen1["outcome"] == "node-fault" and victim not in gen2["nodes"], info["generations"]
    _, events = records(run_dir)
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed and resumed[-1]["step"] >= asked["step"], events  # from a checkpoint generation 1 committed
    assert [e["step"] for e in events if e["event"] == "checkpoint_saved" and e.get("requested")] == [asked["step"]]
    node = next(n for n in client.nodes() if n["name"] == victim)
    assert node["fault_cause"] == "scheduler", node
    faulty = next(e for e in client.events(node=victim) if e.get("to_state") == "faulty")
    assert f"Slurm node {host} is drain" in faulty["reason"] and "bad DIMM (operator)" in faulty["reason"], faulty
    assert slurm.node_reason(host) == "bad DIMM (operator)"  # the operator's reason is not overwritten


def test_a_gpu_instance_type_gets_its_gpus_from_slurm(tmp_path, slurm, monkeypatch):
    """A group of a GPU instance type (gpu.2: 2 GPUs, one worker each) asks Slurm for the GPUs (`--gres=gpu:2`):
    the allocation holds them, the agents' step sees them (Slurm sets CUDA_VISIBLE_DEVICES) and the agent's GPU
    check finds one for each worker (NVML stood in for by tests/fake_nvml), and each worker runs with them visible
    and its LOCAL_RANK choosing one. A step given fewer GPUs than the type has workers fails the node's check,
    saying so; an instance type with more GPUs than the nodes have is refused before anything starts."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(Path(__file__).parent / "fake_nvml"),
                                                                 os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("FAKE_NVML_GPUS", str(GPUS_PER_NODE))  # what NVML sees on every host
    client = create(tmp_path, "g1", count=1, spares=0, instance_type="gpu.2")
    (alloc,) = slurm.jobs()
    shown = slurm.run("scontrol", "-d", "show", "job", alloc["id"]).stdout  # -d: which GPUs each node gave
    assert f"TresPerNode=gres:gpu:{GPUS_PER_NODE}" in shown and "gpu:2(IDX:0-1)" in shown, shown
    (node,) = client.nodes()
    checks = {c["name"]: c for c in node["health"]["checks"]}
    assert checks["gpu.count"]["status"] == "pass" and "2 GPUs visible (expected 2)" in checks["gpu.count"]["detail"]
    assert checks["gpu.visible"] == {**checks["gpu.visible"], "status": "pass",
                                     "detail": "2 GPUs for the workers (CUDA_VISIBLE_DEVICES=0,1)"}
    jobs, seen = JobClient("g1"), tmp_path / "seen"
    jobs.submit(command=["sh", "-c", f'echo "$LOCAL_RANK $CUDA_VISIBLE_DEVICES" > {seen}-$RANK'], nodes=1, name="env")
    assert jobs.wait("env", timeout_s=60)["state"] == "succeeded"
    assert [(tmp_path / f"seen-{r}").read_text().split() for r in range(2)] == [["0", "0,1"], ["1", "0,1"]]
    delete_cluster("g1", timeout_s=30)
    wait_for(lambda: not [j for j in slurm.jobs() if j["state"] != "COMPLETING"], 15, "g1's allocation to end")

    with pytest.raises(CreateFailed, match=r"gpu\.visible: this agent's workers may use 1 GPUs \(CUDA_VISIBLE_DEVICES="
                                           r"'\d'; .* instance type gpu\.2 runs 2 workers"):
        create(tmp_path, "g3", count=1, spares=0, instance_type="gpu.2", sbatch_options=["--gres=gpu:1"])
    wait_for(lambda: not [j for j in slurm.jobs() if j["state"] != "COMPLETING"], 15, "g3's allocation to end")
    delete_cluster("g3", timeout_s=30)  # the failed cluster's record (its logs) stays until deleted
    with pytest.raises(ClusterRefused, match=r"\(1 node: count 1 \+ spares 0, GPUs per node 4 \(--gres=gpu:4\)\): "
                                             r"sbatch: .*Requested node configuration is not available.*an "
                                             r"instance_type whose GPU count \(4 for gpu\.4\) the partition's nodes "
                                             r"have"):
        create(tmp_path, "g2", count=1, spares=0, instance_type="gpu.4")
    assert list_clusters() == [] and not [j for j in slurm.jobs() if j["state"] != "COMPLETING"]


def test_bad_slurm_input_and_weather_get_one_clear_error_and_leave_nothing(tmp_path, slurm, monkeypatch):
    def refused(match: str, **settings) -> None:
        with pytest.raises(ClusterRefused, match=match):
            create(tmp_path, **settings)
        assert list_clusters() == [] and slurm.jobs() == []  # nothing started, nothing left

    refused(r"instance group workers \(3 nodes: count 2 \+ spares 1, partition nope\): sbatch: error: invalid "
            r"partition specified: nope.*Fix slurm\.partition", partition="nope")
    # (root may use its own account too: Slurm's accounting makes it with the cluster)
    assert slurm.user_accounts() == ["ml", "root", "vision"]
    refused(r"account nosuch\): .*Invalid account or account/partition combination specified\. Fix slurm\.account "
            r"\('nosuch': user root has no association with it; user root may submit under: ml, root, vision ",
            account="nosuch")
    refused(r"Requested node configuration is not available", sbatch_options=["--mincpus=64"])
    conf = tmp_path / "unreachable.conf"  # a slurm.conf whose controller port nothing listens on
    conf.write_text(slurm.conf.read_text().replace(f"SlurmctldPort={slurm.ctld_port}", "SlurmctldPort=9"))
    monkeypatch.setenv("SLURM_CONF", str(conf))
    refused(r"slurmctld is not reachable")
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    refused(r"sbatch, squeue, sinfo, scontrol, scancel not on PATH")
    monkeypatch.setenv("PATH", path)

    # 2 of the 4 nodes busy: an allocation of 3 pends ("Resources") past its timeout; creation fails saying so
    blocker = slurm.run("sbatch", "--parsable", "-N", "2", "--exclusive", "--output=/dev/null", "--wrap",
                        "sleep 600").stdout.strip()
    wait_for(lambda: any(j["id"] == blocker and j["state"] == "RUNNING" for j in slurm.jobs()), 30, "the blocker")
    with pytest.raises(CreateFailed, match=r"still pending after \d+ s \(squeue reason: Resources"):
        create(tmp_path, allocation_timeout_s=4)
    assert [j["id"] for j in slurm.jobs()] == [blocker]  # the pending allocation was cancelled


def test_the_recipe_batch_script_checkpoints_at_its_time_limit_and_is_requeued_and_again_when_its_batch_host_dies(
        tmp_path, slurm, demo_data):
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "slurm"
    shutil.copy(recipe / "run.sbatch", tmp_path / "run.sbatch")
    spec = (recipe / "cluster.yaml").read_text()
    assert "controller_lost_s: 60 " in spec
    (tmp_path / "cluster.yaml").write_text(spec.replace("controller_lost_s: 60 ", "controller_lost_s: 8 "))
    run_dir, steps = tmp_path / "run", 80  # (steps left for the second run to lose its batch host in)
    write_config(tmp_path / "train.yaml", config_for(run_dir, demo_data, "restart", steps=steps))
    script = (tmp_path / "run.sbatch").read_text()
    assert "#SBATCH --signal=B:USR2@120\nexec phalanx cluster up" in script  # the warning reaches `cluster up`
    (tmp_path / "run.sbatch").write_text(script.replace("--recovery checkpointless", "--recovery restart"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    job = slurm.run("sbatch", "--parsable", "run.sbatch", env=env, cwd=tmp_path).stdout.strip()
    out = tmp_path / f"phalanx-{job}.out"
    runs = lambda: (out.read_text() if out.exists() else "").count("job 1 submitted")  # noqa: E731

    def explained(wait, *args):
        try:
            return wait(*args)
        except AssertionError as err:  # say what Slurm and the job said
            job_info = slurm.run("scontrol", "show", "job", job, check=False)
            raise AssertionError(f"{err}\nsqueue: {slurm.jobs()}\nscontrol show job: {job_info.stdout}"
                                 f"{job_info.stderr}\nbatch output tail:\n{out.read_text(errors='replace')[-4000:]}"
                                 ) from None

    def requeued(why: str) -> None:
        explained(wait_for, lambda: any(j["id"] == job and j["state"] == "PENDING" for j in slurm.jobs()), 60, why)
        # Eligible now, not after Slurm's 120 s. Not in the second of the requeue: a slurmd refuses a job whose
        # credential is no newer than its revocation (seconds), and Slurm then ends the job for good
        time.sleep(2.0)

        def started() -> bool:
            state = next((j for j in slurm.jobs() if j["id"] == job), {})
            if state.get("state") == "PENDING" and state.get("reason") == "BeginTime":
                slurm.run("scontrol", "update", f"jobid={job}", "StartTime=now", check=False)
            return state.get("state") == "RUNNING"

        explained(wait_for, lambda: started() or time.sleep(1.0), 60, f"{why}: the job running again")

    # Slurm's warning before the time limit, sent now (`scancel --batch` signals the batch shell, as the script's
    # --signal=B:USR2@120 does): a checkpoint between the intervals (every 5 steps), then the requeue
    wait_for(lambda: runs() == 1, 120, "the job submitted")
    step_at_least(JobClient("slurm-demo"), "1", 7, timeout=120)
    slurm.run("scancel", "--batch", "--signal=USR2", job)
    requeued("the requeue at the time limit")
    text = out.read_text()
    saved = re.search(r"job 1: checkpoint of step (\d+) committed", text)
    assert "nears its time limit (USR2)" in text and saved, text[-3000:]
    asked = int(saved[1])

    # the second run goes on from that checkpoint (or a newer one: the job trained on until it was cancelled);
    # then its batch host dies: its slurmd and every process of the batch step (the controller with it). Under
    # --no-kill Slurm only removes the node from the job, which would run on without its script: the agents,
    # their controller silent for slurm.controller_lost_s, ask for the requeue
    explained(wait_for, lambda: runs() == 2, 120, "the job submitted again")
    step_at_least(JobClient("slurm-demo"), "1", asked + 15, timeout=120)  # the second run's cluster
    batch_host = slurm.run("squeue", "-h", "-j", job, "-o", "%B").stdout.strip()
    assert slurm.kill_node(batch_host)
    slurm.run("scontrol", "update", f"nodename={batch_host}", "state=down", "reason=host died (test)")
    requeued("the requeue after the batch host died")
    explained(wait_for, lambda: not any(j["id"] == job for j in slurm.jobs()), 240, "the requeued job to finish")

    text = out.read_text()
    assert f"Slurm job {job} was requeued (1 so far, 1 at its time limit): removing the cluster" in text, text
    assert f"Slurm job {job} was requeued (2 so far, 1 at its time limit): removing the cluster" in text, text
    assert "job 1: succeeded" in text, text[-3000:]
    assert "ExitCode=0:0" in slurm.run("scontrol", "show", "job", job).stdout
    trained, events = records(run_dir)
    assert max(s["step"] for s in trained) == steps
    asked_for = [e["step"] for e in events if e["event"] == "checkpoint_saved" and e.get("requested")]
    assert asked_for == [asked], events
    resumed = [e["step"] for e in events if e["event"] == "resumed"]
    # each run from the newest checkpoint (the second run's workers may have trained to the end while their
    # controller was dead: on a batch host that ran no worker, its death does not stop training)
    assert len(resumed) == 2 and asked <= resumed[0] <= resumed[1], events
    assert list_clusters() == []  # the last run deleted its cluster at the end
    assert not list((ClusterPaths.for_name("slurm-demo").root.parent / ".slurm-requeues").glob("*"))  # forgotten


def test_the_agents_ask_for_the_requeue_again_until_slurm_accepts(tmp_path, monkeypatch):
    """A refused `scontrol requeue` (slurmctld busy, the job mid-transition) is asked again 10 s later, never
    before, never after Slurm accepted. Slurm's answers come from a stand-in `scontrol` (refuses once)."""
    from phalanx.control.agent.slurm_allocation import SlurmAllocation

    asked = tmp_path / "asked"
    (tmp_path / "scontrol").write_text(
        f'#!/bin/sh\necho "$@" >> {asked}\n'
        f'[ "$(wc -l < {asked})" -gt 1 ] || {{ echo "Job is pending execution" >&2; exit 1; }}\n')
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    agent = SlurmAllocation({"job": "42", "after_s": 8.0})

    def ask(down_s: float, *, later_s: float = 0.0) -> list[str]:
        agent.next_ask -= later_s  # as if later_s had passed
        agent.controller_silent(down_s)
        return asked.read_text().splitlines() if asked.exists() else []

    monkeypatch.setenv("SLURM_JOB_ID", "7")  # an agent of another job (a refill): not its to ask
    assert ask(30.0) == []
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert ask(5.0) == []  # the controller silent for less than slurm.controller_lost_s
    assert ask(9.0) == ["requeue 42"]  # refused
    assert ask(12.0, later_s=3.0) == ["requeue 42"]  # not again before 10 s
    assert ask(19.0, later_s=7.5) == ["requeue 42", "requeue 42"]  # accepted
    assert ask(60.0, later_s=1e6) == ["requeue 42", "requeue 42"]  # and never asked again

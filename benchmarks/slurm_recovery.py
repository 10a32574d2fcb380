"""What one node failure costs a training job on a real Slurm, three ways on the same job, run side by side
(interleaved): Phalanx with a spare in the allocation (checkpointless, and restart from the checkpoint), and a
requeue-based recovery (the batch host dies; Slurm runs the batch script again on a fresh allocation).

The Slurm: tests/slurm.py — slurmctld and four slurmd (n1..n4) on this machine, munge, Debian's slurm-wlm
(needs root). The job: the tiny Llama preset (fp32, vocab 512, 64-token blocks of the bundled demo corpus),
2 ranks as 2 data-parallel replicas (one per node), global batch 8, micro batch 2, a synchronous checkpoint
every `--interval` steps (default 20), `--steps` steps (default 60). At `--fail-step` (default 30: 10 steps
after a checkpoint) a node dies: its slurmd, its step daemons and every process they started are SIGKILLed.

  checkpointless  `phalanx cluster create` with `backend: slurm`: one allocation of 2 members + 1 spare, an
                  agent on each; `--recovery checkpointless`. Rank 1's node dies (rank 0's when rank 1 runs on
                  the allocation's batch host, whose srun step holds every agent: that death is `requeue`'s
                  case). The controller marks it faulty (its agent's link closed; a host that closes nothing:
                  heartbeat timeout), promotes the spare, drains the dead node; the survivor keeps
                  its process, the spare's warm standby restores rank 1 from the other replica's memory.
  restart         the same cluster and kill, `--recovery restart`: the new generation on the spare resumes
                  from the newest checkpoint.
  requeue         `sbatch recipes/slurm/run.sbatch` as shipped but with 2 members and no spare (`phalanx cluster
                  up --slurm --run`, restart recovery): the batch host (rank 0's node, the controller's host)
                  dies. Slurm keeps a --no-kill job running without its script; the agents, their controller
                  silent for `--controller-lost` s, ask `scontrol requeue` (Slurm also requeues it itself once
                  the dead node is marked down, after SlurmdTimeout = 30 s here); a requeued job seen pending gets
                  `scontrol update StartTime=now` (Slurm may hold it ~120 s otherwise; `start_now` says whether it
                  was needed); the script runs again, removes the old cluster, creates a new one, and the job
                  resumes from the newest checkpoint.
  local-restart   the `restart` cluster, job and kill on the local backend (`phalanx fault inject kill-node`):
                  the target for Slurm's restart is this + 1 s.

Figures per run (`phalanx.train.timeline.recovery_figures`, times from the kill): first_step_after_s (kill → the first
step logged after it), steps_lost, downtime_s (wall time lost vs a failure-free run: from the last step before
the kill until training got past it again, minus one normal step).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/slurm_recovery.py --runs 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from report import RESULTS_DIR, median, write_results  # noqa: E402
from slurm import LocalSlurm  # noqa: E402  (the tests' real Slurm on this machine)

from phalanx.train.timeline import recovery_figures  # noqa: E402

FIGURES = ("first_step_after_s", "steps_lost", "downtime_s", "normal_step_s")
HEALTH = {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 120.0}  # --heartbeat-timeout


def job_tree(run_dir: Path, data: Path, steps: int, interval: int, recovery: str) -> dict:
    return {
        "parallel": {"dp_replicate": 2, "dp_shard": 1},
        "run_dir": str(run_dir), "seed": 7, "precision": "fp32",
        "model": {"preset": "tiny", "overrides": {"vocab_size": 512}},
        "data": {"path": str(data)},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": steps, "log_interval": 10},
        "optimizer": {"lr": 1e-3},
        "lr_schedule": {"warmup_steps": 5},
        "checkpoint": {"interval": interval, "keep": 2, "async": False},
        "resilience": {"recovery": recovery},
    }


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise TimeoutError(f"{what}: not within {timeout_s:g} s")


def last_step(metrics: Path) -> int:
    steps = [json.loads(line).get("step") for line in metrics.read_text().splitlines()
             if line.strip() and "event" not in line] if metrics.exists() else []
    return max((s for s in steps if s is not None), default=0)


class SpareHarness:
    """A cluster of 2 members + 1 spare in one Slurm allocation (`cluster create`, backend slurm); with `local`,
    the same cluster on the local backend (the baseline the Slurm restart is held to)."""

    def __init__(self, slurm: LocalSlurm, root: Path, recovery: str, local: bool = False):
        self.slurm, self.root, self.recovery, self.local = slurm, root, recovery, local
        self.name = f"local-{recovery}" if local else recovery

    def run(self, tree: dict, fail_step: int) -> dict:
        from phalanx.control.client.cluster import ClusterClient, create_cluster, delete_cluster
        from phalanx.control.client.jobs import JobClient
        from phalanx.train.config import config_from_dict

        cluster = f"bench-{self.name}"
        spec = self.root / f"{cluster}.json"
        spec.write_text(json.dumps({
            "name": cluster, "backend": "local" if self.local else "slurm",
            "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": 2, "spares": 1}],
            "health": HEALTH,
            **({} if self.local else {"slurm": {"work_root": str(self.root / "agents")}})}))
        create_cluster(spec, timeout_s=120)
        try:
            client, jobs = ClusterClient(cluster), JobClient(cluster)
            if self.recovery == "checkpointless":
                from phalanx.demo import spare_standby_warm

                wait_for(lambda: spare_standby_warm(client), 120, "the spare's warm standby")
            run_dir = Path(tree["run_dir"])
            job = jobs.submit(config_from_dict(tree), nodes=2, auto_resume=True, recovery=self.recovery)
            wait_for(lambda: last_step(run_dir / "metrics.jsonl") >= fail_step, 300, f"step {fail_step}")
            nodes = jobs.describe(job["id"])["generations"][-1]["nodes"]
            handles = {n["name"]: n["handle"] for n in client.nodes()}
            victim = nodes[1]
            if not self.local:  # the allocation's batch host runs the srun of every agent: its death is requeue's case
                allocation = handles[victim].split(":")[1]
                batch = self.slurm.run("squeue", "-h", "-j", allocation, "-o", "%B").stdout.strip()
                victim = next(n for n in (nodes[1], nodes[0]) if handles[n].split(":")[2] != batch)
            handle = handles[victim]
            host = "local" if self.local else handle.split(":")[2]
            killed_at = time.time()
            if self.local:
                client.inject_fault(victim, "kill-node")  # SIGKILL to the node's agent and its worker
            else:
                self.slurm.kill_node(host)
            info = jobs.wait(job["id"], timeout_s=600)
            if info["state"] != "succeeded":
                raise RuntimeError(f"{self.name}: job {info['state']}: {info['reason']}")
            faulty = [e["time"] for e in client.events(node=victim) if e.get("to_state") == "faulty"]
            figures = recovery_figures(run_dir / "metrics.jsonl", killed_at)
            return {**figures.as_dict(), "detect_s": faulty[0] - killed_at, "victim": victim, "slurm_node": host}
        finally:
            delete_cluster(cluster, timeout_s=60)
            if not self.local:
                self.slurm.reset()


class RequeueHarness:
    """`sbatch run.sbatch` (cluster up --slurm --run, 2 members, no spare); the batch host dies."""

    name = "requeue"

    def __init__(self, slurm: LocalSlurm, root: Path, controller_lost_s: float):
        self.slurm, self.root, self.controller_lost_s = slurm, root, controller_lost_s

    def run(self, tree: dict, fail_step: int) -> dict:
        run_dir = Path(tree["run_dir"])
        work = run_dir.parent / f"{run_dir.name}-sbatch"
        work.mkdir(parents=True)
        (work / "train.json").write_text(json.dumps(tree))
        (work / "cluster.json").write_text(json.dumps({
            "name": "bench-requeue", "backend": "slurm",
            "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": 2, "spares": 0}],
            "health": HEALTH,
            "slurm": {"work_root": str(self.root / "agents"), "controller_lost_s": self.controller_lost_s}}))
        (work / "run.sbatch").write_text(
            "#!/bin/bash\n"
            "#SBATCH --nodes=2 --exclusive --no-kill --requeue --open-mode=append --output=phalanx-%j.out\n"
            "phalanx cluster up --slurm -f cluster.json --run train.json --nodes 2 --recovery restart\n")
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        job = self.slurm.run("sbatch", "--parsable", "run.sbatch", env=env, cwd=work).stdout.strip()
        out = work / f"phalanx-{job}.out"
        try:
            wait_for(lambda: last_step(run_dir / "metrics.jsonl") >= fail_step, 300, f"step {fail_step}")
            batch_host = self.slurm.run("squeue", "-h", "-j", job, "-o", "%B").stdout.strip()
            killed_at = time.time()
            self.slurm.kill_node(batch_host)
            released, deadline = False, time.monotonic() + 300
            while "was requeued" not in out.read_text():  # the script started again
                if not released and any(j["id"] == job and j["state"] == "PENDING" for j in self.slurm.jobs()):
                    self.slurm.run("scontrol", "update", f"jobid={job}", "StartTime=now", check=False)
                    released = True  # (a requeue Slurm made itself, the batch host down, may start at once)
                if time.monotonic() > deadline:
                    raise TimeoutError("the requeued script did not start again within 300 s")
                time.sleep(0.2)
            restarted_at = time.time()
            while any(j["id"] == job for j in self.slurm.jobs()):
                time.sleep(0.5)
            text = out.read_text()
            if "succeeded" not in text:
                raise RuntimeError(f"requeue: the job did not succeed:\n{text[-2000:]}")
            figures = recovery_figures(run_dir / "metrics.jsonl", killed_at)
            return {**figures.as_dict(), "script_again_s": restarted_at - killed_at, "start_now": released,
                    "slurm_node": batch_host}
        finally:
            self.slurm.reset()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="runs per harness (interleaved)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--interval", type=int, default=20, help="checkpoint interval (steps)")
    parser.add_argument("--fail-step", type=int, default=30, help="kill the node when rank 0 logs this step")
    parser.add_argument("--controller-lost", type=float, default=10.0,
                        help="requeue: slurm.controller_lost_s (agents' wait before asking for the requeue)")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0,
                        help="health.heartbeat_timeout_s of every cluster (heartbeats every timeout / 6 s)")
    parser.add_argument("--harness", default="checkpointless,restart,requeue,local-restart",
                        help="comma-separated: checkpointless, restart, requeue (on Slurm), local-restart, "
                             "local-checkpointless (the same cluster on the local backend)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "slurm_recovery.json")
    args = parser.parse_args()
    HEALTH.update(heartbeat_timeout_s=args.heartbeat_timeout, heartbeat_interval_s=args.heartbeat_timeout / 6)
    why = LocalSlurm.available()
    if why:
        raise SystemExit(f"cannot run Slurm here: {why}")
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    root = Path(tempfile.mkdtemp(prefix="phalanx-slurm-recovery-"))
    os.environ["PHALANX_HOME"] = str(root / "home")
    from phalanx.data import prepare, write_demo_corpus

    corpus = write_demo_corpus(root / "corpus.jsonl")
    prepare([corpus], root / "tokens", block_size=64, vocab_size=512, val_percent=0.0, progress=False)
    slurm = LocalSlurm(root / "slurm", nodes=4)
    slurm.start()
    os.environ["SLURM_CONF"] = str(slurm.conf)
    harnesses = []
    for name in args.harness.split(","):
        if name == "requeue":
            harnesses.append(RequeueHarness(slurm, root, args.controller_lost))
        else:
            local = name.startswith("local-")
            harnesses.append(SpareHarness(slurm, root, name.removeprefix("local-"), local=local))
    samples: dict[str, list[dict]] = {h.name: [] for h in harnesses}
    ok = False
    try:
        for i in range(args.runs):
            for h in harnesses:
                recovery = "checkpointless" if h.name.endswith("checkpointless") else "restart"
                tree = job_tree(root / f"{h.name}-{i}", root / "tokens", args.steps, args.interval, recovery)
                sample = h.run(tree, args.fail_step)
                samples[h.name].append(sample)
                print(f"run {i + 1}/{args.runs} {h.name:>14}: " + "  ".join(
                    f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in sample.items()), flush=True)
        ok = True
    finally:
        slurm.stop()
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"kept {root} (logs of the failed run)", file=sys.stderr)
    medians = {name: {k: median([s[k] for s in runs]) for k in FIGURES} for name, runs in samples.items() if runs}
    print(f"\nmedians of {args.runs} runs (s; steps_lost in steps):")
    for name, m in medians.items():
        print(f"{name:>14} " + " ".join(f"{k} {m[k]:.3f}" for k in FIGURES))
    summary = {}
    if "checkpointless" in medians:
        summary.update(slurm_checkpointless_downtime_s=medians["checkpointless"]["downtime_s"],
                       slurm_steps_lost=medians["checkpointless"]["steps_lost"])
    if "restart" in medians:
        summary.update(slurm_restart_downtime_s=medians["restart"]["downtime_s"],
                       slurm_restart_steps_lost=medians["restart"]["steps_lost"])
    if "local-restart" in medians:
        summary["local_restart_downtime_s"] = medians["local-restart"]["downtime_s"]
        if "restart" in medians:
            summary["slurm_restart_minus_local_s"] = (medians["restart"]["downtime_s"]
                                                      - summary["local_restart_downtime_s"])
    if "requeue" in medians:
        summary.update(slurm_requeue_downtime_s=medians["requeue"]["downtime_s"],
                       slurm_requeue_steps_lost=medians["requeue"]["steps_lost"])
    path = write_results(args.out, {
        "benchmark": "slurm_recovery",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/slurm_recovery.py " + " ".join(sys.argv[1:]),
        "config": {"health": HEALTH, "steps": args.steps, "checkpoint_interval": args.interval,
                   "fail_step": args.fail_step,
                   "controller_lost_s": args.controller_lost, "slurm": "slurm-wlm (Debian 12), 4 slurmd on one host",
                   "requeue_start": "scontrol update StartTime=now if the requeued job is seen pending (runs: "
                                    "start_now)"},
        "runs": samples, "medians": medians, "summary": summary,
    })
    print(f"results: {path}")


if __name__ == "__main__":
    main()

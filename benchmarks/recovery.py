"""What one node failure costs a training job, three ways on the same job and the same failure step, run side
by side (interleaved): Phalanx checkpointless recovery, Phalanx restart-from-checkpoint, and torchrun's
`--max-restarts` as the outside baseline. Plus the steady-state cost of buddy snapshots (tokens/s on vs off).

The job: the tiny Llama preset (fp32, vocab 512, 64-token blocks of the bundled demo corpus), 4 ranks as
HSDP 2 replicas × 2 shards (the `buddy` harness: FSDP 4),
global batch 8, micro batch 2, a checkpoint every `--interval` steps (default 50, synchronous), `--steps`
steps in all (default 100). At `--fail-step` (default 75: 25 steps after the last checkpoint) one rank is
SIGKILLed the moment rank 0 logs that step:

  phalanx   a local cluster of 4 `local.cpu-1` nodes + 1 spare (created once; the pool is refilled between
            runs); the job is submitted with auto-resume; the kill is `phalanx fault inject --kind kill-node`
            on rank 1's node (SIGKILL to the node's agent and its worker). The controller marks the node
            faulty, stops the other ranks, promotes the spare and starts a new generation, which resumes
            from the newest checkpoint.
  checkpointless  the same cluster, job and kill, submitted with `--recovery checkpointless`. Survivors keep
            their processes and regroup; the spare's warm standby takes rank 1 and restores its shard from
            the other replica (rank 3).
  cold      checkpointless as above on a cluster of its own whose spare has no warm standby: the
            replacement is a new process, forked from the spare's worker template (torch already imported)
            when the new generation is assigned.
  cold-exec `cold` on a cluster without worker templates (`worker_template: false`): the replacement is a
            fresh `python -m phalanx.worker` that imports torch — what `cold` was before the templates.
  phalanx-exec  `phalanx` on a cluster without worker templates: every worker of the new generation is exec'd.
  buddy     checkpointless without a replica: the same job as FSDP over 4 ranks (`dp_replicate: 1`), buddy
            snapshots every step; the replacement restores from its buddy's snapshot and everyone rolls back
            to the newest snapshot all shards have.
  torchrun  `torchrun --standalone --nproc-per-node 4 --max-restarts 1 --monitor-interval 0.1 -m
            phalanx.train.worker` (the same worker and config); rank 1's process is SIGKILLed; torchrun's
            agent stops the group and restarts all 4 workers, which resume from the same checkpoint.

Figures per run (see `phalanx.train.timeline`; times from the kill, taken just before it is sent):
  detect_s       kill → the controller marked the node faulty (phalanx only; torchrun logs no such event)
  restart_s      kill → the new generation started on the spare (phalanx only)
  first_step_s   kill → the first training step logged after the restart
  steps_lost     committed steps computed again (last step before the kill − the checkpoint resumed from)
  downtime_s     wall time lost vs a failure-free run: from the last step before the kill until training got
                 past it again, minus one normal step (median step time before the kill)
  stall_s        checkpointless: kill → the survivors' next committed step, minus one normal step
  rejoin_s       checkpointless: the replacement's activation (a warm standby adopted as rank 1; its process
                 was spawned ahead, torch imported) → its first committed step (the job's next step); for
                 `cold` (no warm standby) from the new generation's start, before its agent spawns the process
                 (spawn, torch import, model build and restore all count)

Snapshot overhead (`--overhead-runs`, default 3): the same job (FSDP over 4 ranks) without a failure on the
same cluster, with `resilience.snapshot_interval` 0 and each of `--snapshot-intervals` (default 1,10), the order
rotating each round. Per run, after 10 warm-up steps: tokens/s over wall time (the step records' timestamps, so
the capture between steps counts) and rank 0's median CPU seconds per step (all its threads: the exchange running
beside the step counts). Ratios are on ÷ off of the medians (CPU: off ÷ on). The `buddy10` harness measures the
steps a fault costs at a snapshot every 10 steps, beside `buddy` (every step).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recovery.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, cpu_env, median, summary_of, write_results  # noqa: E402

from phalanx.control.backends.local import child_with_env  # noqa: E402
from phalanx.train.timeline import recovery_figures  # noqa: E402

NODES = 4
BLOCK_SIZE = 64  # tokens per sample of the benchmark's data (prepare_data)
FIGURES = ("detect_s", "restart_s", "first_step_s", "steps_lost", "downtime_s", "stall_s", "rejoin_s")


HSDP = {"dp_replicate": 2, "dp_shard": 2}
FSDP = {"dp_replicate": 1, "dp_shard": 4}


def job_tree(run_dir: Path, data: Path, steps: int, interval: int, parallel: dict = HSDP) -> dict:
    return {
        "parallel": dict(parallel),
        "run_dir": str(run_dir), "seed": 7, "precision": "fp32",
        "model": {"preset": "tiny", "overrides": {"vocab_size": 512}},
        "data": {"path": str(data)},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": steps, "log_interval": 25},
        "optimizer": {"lr": 1e-3},
        "lr_schedule": {"warmup_steps": 10},
        "checkpoint": {"interval": interval, "keep": 2, "async": False},
    }


def kill_tagged(name: str, value: str) -> list[int]:
    """SIGKILL every live process whose environment has `name=value` (torchrun starts its workers in sessions of
    their own: killing torchrun's process group does not reach them). Returns their pids."""
    wanted, killed = f"{name}={value}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted not in f.read().split(b"\0"):
                    continue
            os.kill(int(entry), signal.SIGKILL)
            killed.append(int(entry))
        except (OSError, ProcessLookupError):
            continue
    return killed


def wait_for_step(metrics: Path, step: int, proc_alive, timeout_s: float = 600, alive_every_s: float = 0.0) -> None:
    """Poll rank 0's metrics file until it logs `step` (every 10 ms: the kill lands within a step). `proc_alive`
    is asked at most every `alive_every_s` (a question to the controller's API costs it CPU the job's ranks share
    on this machine: at every poll it made the controller use 0.18 cores during training)."""
    deadline, offset, last, asked = time.monotonic() + timeout_s, 0, 0, 0.0
    while time.monotonic() < deadline:
        if metrics.exists():
            with open(metrics) as f:
                f.seek(offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            offset += len(complete.encode())
            for line in complete.splitlines():
                record = json.loads(line)
                if "event" not in record:
                    last = record["step"]
            if last >= step:
                return
        if time.monotonic() - asked >= alive_every_s:
            asked = time.monotonic()
            if not proc_alive():
                raise RuntimeError(f"the job ended before step {step} (last step {last})")
        time.sleep(0.01)
    raise TimeoutError(f"step {step} not reached in {timeout_s:g} s (last step {last})")


# ---- phalanx: a local cluster, kill-node, auto-resume --------------------------------------------------
class PhalanxHarness:
    name = "phalanx"
    recovery = "restart"
    parallel = HSDP
    cluster_name, warm_standby, worker_template = "bench", True, True

    def __init__(self, root: Path, cluster: "PhalanxHarness | None" = None):
        if cluster is not None:  # share another harness's cluster
            self.client, self.jobs, self.owner = cluster.client, cluster.jobs, False
            return
        self.owner = True
        from phalanx.control.client.cluster import ClusterClient, create_cluster
        from phalanx.control.client.jobs import JobClient

        os.environ["PHALANX_HOME"] = str(root / "home")
        spec = root / f"{self.cluster_name}.yaml"
        spec.write_text(json.dumps({
            "name": self.cluster_name, "backend": "local", "node_recovery": "automatic",
            "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": NODES, "spares": 1,
                                 "warm_standby": self.warm_standby, "worker_template": self.worker_template}],
            "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 120.0}}))
        create_cluster(spec, timeout_s=120)
        self.client, self.jobs = ClusterClient(self.cluster_name), JobClient(self.cluster_name)

    def spare_ready(self) -> bool:
        """A healthy spare with its worker template ready; for checkpointless, also its warm standby, warmed up."""
        spares = [n for n in self.client.nodes() if n["is_spare"] and n["state"] == "healthy"]
        if self.worker_template:  # its worker template has imported torch (else the replacement would be exec'd)
            spares = [n for n in spares if "worker template ready" in
                      (Path(n["work_dir"]) / "agent.log").read_text(errors="replace")]
        if self.recovery != "checkpointless" or not self.warm_standby:
            return bool(spares)
        from phalanx.demo import spare_standby_warm

        return bool(spares) and spare_standby_warm(self.client)

    def run(self, tree: dict, fail_step: int) -> dict:
        from phalanx.train.config import config_from_dict

        deadline = time.monotonic() + 120
        while not self.spare_ready():  # the previous run's replacement refills the pool
            if time.monotonic() > deadline:
                raise TimeoutError("the spare pool was not refilled within 120 s")
            time.sleep(0.2)
        run_dir = Path(tree["run_dir"])
        job = self.jobs.submit(config_from_dict(tree), nodes=NODES, auto_resume=True, name=run_dir.name,
                               recovery=self.recovery)
        wait_for_step(run_dir / "metrics.jsonl", fail_step,
                      lambda: self.jobs.describe(job["id"])["state"] in ("pending", "running"), alive_every_s=1.0)
        victim = self.jobs.describe(job["id"])["generations"][-1]["nodes"][1]
        killed_at = time.time()
        self.client.inject_fault(victim, "kill-node")
        info = self.jobs.wait(job["id"], timeout_s=600, poll_s=1.0)
        if info["state"] != "succeeded" or len(info["generations"]) != 2:
            raise RuntimeError(f"job {job['id']}: {info['state']} after {len(info['generations'])} generations: "
                               f"{info['reason']}")
        faulty = [e["time"] for e in self.client.events(node=victim) if e.get("to_state") == "faulty"]
        figures = recovery_figures(run_dir / "metrics.jsonl", killed_at)
        out = {"detect_s": faulty[0] - killed_at, "restart_s": info["generations"][1]["started_at"] - killed_at,
               "first_step_s": figures.first_step_after_s, "steps_lost": figures.steps_lost,
               "downtime_s": figures.downtime_s, "normal_step_s": figures.normal_step_s,
               "last_step": figures.last_step, "resumed_step": figures.resumed_step, "victim": victim}
        if self.recovery == "checkpointless":
            events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            generation = next(e for e in events if e.get("event") == "generation")
            restored = next(e for e in events if e.get("event") == "state_restored")
            if restored["source"] == "checkpoint":
                raise RuntimeError(f"job {job['id']}: fell back to the checkpoint ({restored['reason']})")
            # warm: the standby's adoption; cold: the generation's start, before the agent spawns the process
            activated = generation["rejoin_started_at"] if self.warm_standby else info["generations"][1]["started_at"]
            first_after = killed_at + figures.first_step_after_s
            out.update(stall_s=figures.first_step_after_s - figures.normal_step_s,
                       rejoin_s=first_after - activated if activated else None,
                       restore_source=restored["source"], restore_bytes=restored["bytes"],
                       restore_s=restored["seconds"], standby=bool(info["generations"][1]["standbys"]))
        return out

    def steady_run(self, tree: dict, warmup: int = 10) -> dict:
        """A failure-free run of `tree` on the cluster, after `warmup` steps: tokens/s over wall time (from the
        step records' timestamps, so work between steps, such as a snapshot's capture, counts) and rank 0's
        median CPU seconds per step (`compute_time_s`: its process's CPU time over the step, all threads, so a
        snapshot exchange running beside the step counts)."""
        from phalanx.train.config import config_from_dict

        run_dir = Path(tree["run_dir"])
        job = self.jobs.submit(config_from_dict(tree), nodes=NODES, name=run_dir.name, recovery=self.recovery)
        info = self.jobs.wait(job["id"], timeout_s=600, poll_s=1.0)
        if info["state"] != "succeeded":
            raise RuntimeError(f"job {job['id']}: {info['state']}: {info['reason']}")
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "event" not in r][warmup:]
        tokens_per_step = tree["training"]["global_batch_size"] * BLOCK_SIZE
        return {"tokens_per_s": tokens_per_step * (len(steps) - 1) / (steps[-1]["time"] - steps[0]["time"]),
                "cpu_s_per_step": median([r["compute_time_s"] for r in steps])}

    def close(self) -> None:
        from phalanx.control.client.cluster import delete_cluster

        if self.owner:
            delete_cluster(self.cluster_name, timeout_s=30)


class CheckpointlessHarness(PhalanxHarness):
    name = "checkpointless"
    recovery = "checkpointless"


class ColdCheckpointlessHarness(CheckpointlessHarness):
    """Checkpointless on a cluster without warm standbys (its own): the replacement is a fresh process."""
    name = "cold"
    cluster_name, warm_standby = "bench-cold", False


class ColdExecHarness(ColdCheckpointlessHarness):
    """`cold` without the nodes' worker templates (its own cluster): the replacement is exec'd, imports torch."""
    name = "cold-exec"
    cluster_name, worker_template = "bench-cold-exec", False


class ExecRestartHarness(PhalanxHarness):
    """`phalanx` (restart from checkpoint) without the nodes' worker templates (its own cluster): every worker
    of the new generation is exec'd and imports torch."""
    name = "phalanx-exec"
    cluster_name, worker_template = "bench-exec", False


class BuddyHarness(CheckpointlessHarness):
    """Checkpointless without a replica: FSDP over 4 ranks, buddy snapshots every step."""
    name = "buddy"
    parallel = FSDP
    tree = {"resilience": {"snapshot_interval": 1}}


class Buddy10Harness(BuddyHarness):
    """The same with a snapshot every 10 steps (the kill at step 75 rolls back to step 70's)."""
    name = "buddy10"
    tree = {"resilience": {"snapshot_interval": 10}}


# ---- torchrun: --max-restarts, the same worker and config ---------------------------------------------
class TorchrunHarness:
    name = "torchrun"
    parallel = HSDP

    def __init__(self, root: Path):
        self.root = root

    def run(self, tree: dict, fail_step: int) -> dict:
        from phalanx.train.config import config_from_dict, dump_config

        run_dir = Path(tree["run_dir"])
        run_dir.mkdir(parents=True)
        config_path = run_dir / "config.json"
        config_path.write_text(json.dumps(dump_config(config_from_dict(tree))))
        env = cpu_env()
        env["PHALANX_CONFIG"] = str(config_path)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NODES),
                "--max-restarts", "1", "--monitor-interval", "0.1", "-m", "phalanx.train.worker"]
        with open(run_dir / "torchrun.log", "w") as log:
            proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                wait_for_step(run_dir / "metrics.jsonl", fail_step, lambda: proc.poll() is None)
                pid = child_with_env(proc.pid, "RANK", "1")
                if pid is None:
                    raise RuntimeError("rank 1's worker process not found")
                killed_at = time.time()
                os.kill(pid, signal.SIGKILL)
                code = proc.wait(timeout=600)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                kill_tagged("PHALANX_CONFIG", str(config_path))  # its workers, in sessions of their own
        if code != 0:
            raise RuntimeError(f"torchrun exited with {code}; see {run_dir / 'torchrun.log'}")
        figures = recovery_figures(run_dir / "metrics.jsonl", killed_at)
        return {"first_step_s": figures.first_step_after_s, "steps_lost": figures.steps_lost,
                "downtime_s": figures.downtime_s, "normal_step_s": figures.normal_step_s,
                "last_step": figures.last_step, "resumed_step": figures.resumed_step}

    def close(self) -> None:
        pass


def prepare_data(root: Path) -> Path:
    from phalanx.data import prepare, write_demo_corpus

    corpus = write_demo_corpus(root / "corpus.jsonl")
    prepare([corpus], root / "tokens", block_size=BLOCK_SIZE, vocab_size=512, val_percent=0.0, progress=False)
    return root / "tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per harness (interleaved)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--interval", type=int, default=50, help="checkpoint interval (steps)")
    parser.add_argument("--fail-step", type=int, default=75, help="kill one rank when rank 0 logs this step")
    parser.add_argument("--harness", default="checkpointless,buddy,cold,phalanx,torchrun",
                        help="comma-separated: checkpointless (HSDP 2x2), buddy (checkpointless, FSDP 4), buddy10 "
                             "(buddy, a snapshot every 10 steps), cold (checkpointless, HSDP 2x2, no warm standby), "
                             "cold-exec (cold without worker templates), phalanx (restart from checkpoint), "
                             "phalanx-exec (phalanx without worker templates), torchrun")
    parser.add_argument("--overhead-runs", type=int, default=3,
                        help="rounds of failure-free runs, snapshots off and at each interval (0: skip)")
    parser.add_argument("--snapshot-intervals", default="1,10", help="snapshot intervals the rounds measure")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "recovery.json")
    args = parser.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")

    root = Path(tempfile.mkdtemp(prefix="phalanx-recovery-"))
    data = prepare_data(root)
    names = args.harness.split(",")
    harnesses, cluster = [], None
    for name in names:
        if name in ("phalanx", "checkpointless", "buddy", "buddy10"):
            kind = {"phalanx": PhalanxHarness, "checkpointless": CheckpointlessHarness, "buddy": BuddyHarness,
                    "buddy10": Buddy10Harness}[name]
            h = kind(root, cluster)
            cluster = cluster or h
        elif name in ("cold", "cold-exec", "phalanx-exec"):
            h = {"cold": ColdCheckpointlessHarness, "cold-exec": ColdExecHarness, "phalanx-exec": ExecRestartHarness}[
                name](root)
        else:
            h = TorchrunHarness(root)
        harnesses.append(h)
    samples: dict[str, list[dict]] = {h.name: [] for h in harnesses}
    intervals = [0] + [int(k) for k in args.snapshot_intervals.split(",")]
    overhead: dict[str, list[dict]] = {f"interval_{k}": [] for k in intervals}
    try:
        for i in range(args.runs):
            for h in harnesses:
                tree = {**job_tree(root / f"{h.name}-{i}", data, args.steps, args.interval, h.parallel),
                        **getattr(h, "tree", {})}
                sample = h.run(tree, args.fail_step)
                samples[h.name].append(sample)
                print(f"run {i + 1}/{args.runs} {h.name:>14}: " + "  ".join(
                    f"{k} {sample[k]:.2f}" if isinstance(sample[k], float) else f"{k} {sample[k]}"
                    for k in (*FIGURES, "normal_step_s") if k in sample), flush=True)
        ckl = next((h for h in harnesses if getattr(h, "recovery", None) == "checkpointless"), None) if cluster else None
        for i in range(args.overhead_runs if ckl is not None else 0):
            for interval in intervals[i % len(intervals):] + intervals[:i % len(intervals)]:  # order rotates
                tree = job_tree(root / f"overhead-{i}-{interval}", data, args.steps, args.interval, FSDP)
                tree["resilience"] = {"snapshot_interval": interval}
                run = ckl.steady_run(tree)
                overhead[f"interval_{interval}"].append(run)
                print(f"overhead {i + 1}/{args.overhead_runs}: snapshot_interval={interval}: "
                      f"{run['tokens_per_s']:,.0f} tokens/s, {run['cpu_s_per_step'] * 1e3:.1f} ms CPU per step "
                      "(rank 0)", flush=True)
    finally:
        for h in reversed(harnesses):
            h.close()

    columns = (*FIGURES, "normal_step_s")
    medians = {name: {k: median([s[k] for s in runs]) for k in columns if runs[0].get(k) is not None}
               for name, runs in samples.items() if runs}
    print(f"\nmedians of {args.runs} runs (s; steps_lost in steps):")
    print(f"{'':>14} " + " ".join(f"{k:>13}" for k in columns))
    for name, m in medians.items():
        print(f"{name:>14} " + " ".join(f"{m[k]:>13.3f}" if k in m else f"{'-':>13}" for k in columns))

    summary = {}
    if "phalanx" in medians:
        m = medians["phalanx"]
        summary.update(detect_s=m["detect_s"], restart_downtime_s=m["downtime_s"],
                       restart_steps_lost=m["steps_lost"], restart_first_step_s=m["first_step_s"],
                       restart_spare_in_service_s=m["restart_s"])
    if "checkpointless" in medians:
        m = medians["checkpointless"]
        summary.update(checkpointless_downtime_s=m["downtime_s"], survivor_stall_s=m["stall_s"],
                       rejoin_s=m["rejoin_s"], checkpointless_steps_lost=m["steps_lost"],
                       checkpointless_detect_s=m["detect_s"])
        summary.setdefault("detect_s", m["detect_s"])
    if "cold" in medians:
        m = medians["cold"]
        summary.update(cold_downtime_s=m["downtime_s"], cold_survivor_stall_s=m["stall_s"],
                       cold_rejoin_s=m["rejoin_s"], cold_steps_lost=m["steps_lost"])
    if "cold-exec" in medians:
        m = medians["cold-exec"]
        summary.update(cold_exec_downtime_s=m["downtime_s"], cold_exec_rejoin_s=m["rejoin_s"])
    if "phalanx-exec" in medians:
        m = medians["phalanx-exec"]
        summary.update(restart_exec_downtime_s=m["downtime_s"], restart_exec_first_step_s=m["first_step_s"])
    if "buddy" in medians:
        m = medians["buddy"]
        summary.update(buddy_downtime_s=m["downtime_s"], buddy_survivor_stall_s=m["stall_s"],
                       buddy_rejoin_s=m["rejoin_s"], buddy_steps_lost=m["steps_lost"])
    if "buddy10" in medians:
        m = medians["buddy10"]
        summary.update(buddy_every_10_downtime_s=m["downtime_s"], buddy_every_10_steps_lost=m["steps_lost"])
    if "torchrun" in medians:
        m = medians["torchrun"]
        summary.update(torchrun_downtime_s=m["downtime_s"], torchrun_steps_lost=m["steps_lost"],
                       torchrun_first_step_s=m["first_step_s"])
    if "phalanx" in medians and "torchrun" in medians:
        summary["restart_downtime_ratio_vs_torchrun"] = medians["phalanx"]["downtime_s"] / medians["torchrun"]["downtime_s"]
    if "phalanx-exec" in medians and "torchrun" in medians:
        summary["restart_exec_downtime_ratio_vs_torchrun"] = (medians["phalanx-exec"]["downtime_s"]
                                                              / medians["torchrun"]["downtime_s"])
    if "phalanx" in medians and "checkpointless" in medians:
        summary["downtime_ratio"] = medians["checkpointless"]["downtime_s"] / medians["phalanx"]["downtime_s"]
    if overhead["interval_0"]:
        off = {k: median([r[k] for r in overhead["interval_0"]]) for k in ("tokens_per_s", "cpu_s_per_step")}
        summary.update(snapshot_tokens_per_s_off=off["tokens_per_s"], snapshot_cpu_s_per_step_off=off["cpu_s_per_step"])
        for k in intervals[1:]:
            runs = overhead[f"interval_{k}"]
            on = {m: median([r[m] for r in runs]) for m in ("tokens_per_s", "cpu_s_per_step")}
            # pairwise: each run beside the off run of the same round
            pairs = [r["tokens_per_s"] / o["tokens_per_s"] for r, o in zip(runs, overhead["interval_0"])]
            name = "" if k == 1 else f"_every_{k}"
            summary.update({f"snapshot_tokens_per_s_on{name}": on["tokens_per_s"],
                            f"snapshot_throughput_ratio{name}": on["tokens_per_s"] / off["tokens_per_s"],
                            f"snapshot_cpu_s_per_step_on{name}": on["cpu_s_per_step"],
                            f"snapshot_cpu_per_step_ratio{name}": off["cpu_s_per_step"] / on["cpu_s_per_step"]})
            print(f"buddy snapshots every {k} step(s): {on['tokens_per_s']:,.0f} vs {off['tokens_per_s']:,.0f} "
                  f"tokens/s off (ratio {on['tokens_per_s'] / off['tokens_per_s']:.3f}; pairs "
                  f"{', '.join(f'{p:.3f}' for p in pairs)}); rank 0's CPU per step {on['cpu_s_per_step'] * 1e3:.1f} "
                  f"vs {off['cpu_s_per_step'] * 1e3:.1f} ms")
    path = write_results(args.out, {
        "benchmark": "recovery",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/recovery.py " + " ".join(sys.argv[1:]),
        "config": {"nodes": NODES, "steps": args.steps, "checkpoint_interval": args.interval,
                   "fail_step": args.fail_step, "job": job_tree(Path("<run_dir>"), Path("<data>"), args.steps,
                                                                args.interval),
                   "parallel": {h.name: h.parallel for h in harnesses}},
        "samples": samples, "medians": medians, "snapshot_overhead": overhead,
        "summary": {**{k: round(v, 4) for k, v in summary.items()},
                    # torchft runs in its own harness (benchmarks/torchft_recovery.py); its figures sit here too
                    **summary_of(args.out.with_name("recovery_torchft.json"), "torchft_")},
    })
    print(f"\nsummary: {json.dumps(summary)}\nwrote {path}")


if __name__ == "__main__":
    main()

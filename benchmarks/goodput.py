"""Goodput under a steady stream of failures, three ways on the same job and the same failure schedule, run
one after the other: Phalanx checkpointless, Phalanx restart-from-checkpoint, and torchrun `--max-restarts`.

The job is `benchmarks/recovery.py`'s (the tiny Llama, 4 ranks as HSDP 2 × 2, global batch 8, a synchronous
checkpoint every `--interval` steps) with no step limit in reach. From the job's start, every `--period`
seconds one rank's node is SIGKILLed (`phalanx fault inject --kind kill-node`; torchrun: the rank's process),
the ranks taken in turn 1, 2, 3, 0, 1, ... of the current generation; the spare pool refills on its own
between kills (a cluster of 4 `local.cpu-1` nodes + 1 spare). After `--duration` seconds the job is stopped.
Each Phalanx run waits for a ready spare and then 20 s, so that the previous job's nodes have their warm
standbys back: a checkpointless job starts on them, and without the pause the run after another started ~6 s
later than the first (measured: initialization 6.3 s vs 0.7 s), a difference that is not the faults'.

  goodput           committed samples ÷ (wall × failure-free throughput): the step the run had reached at the
                    end (steps redone after a rollback count once) ÷ the step the same harness reached in a
                    failure-free run of the same length (same job, same cluster, from submission: the start-up
                    is in both), run just before it (runs 1, 3, ...) or just after it (runs 2, 4, ...)
  ledger_goodput    Phalanx only: the job's goodput ledger's productive ÷ wall (`phalanx job goodput`), the
                    same time attributed from the run's own events
  kills             the faults injected; generations: the job's generations (Phalanx)

BENCHMARKS.md's setting is a SIGKILL every 30 s for 5 minutes; the default here is that period over 150 s (5
kills) to fit this 2-core machine's time: pass `--duration 300` for the full one.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/goodput.py --runs 1
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
from recovery import NODES, CheckpointlessHarness, PhalanxHarness, job_tree, kill_tagged, prepare_data  # noqa: E402
from report import RESULTS_DIR, cpu_env, median, write_results  # noqa: E402

from phalanx.control.backends.local import child_with_env  # noqa: E402

RANK_ORDER = (1, 2, 3, 0)
FOREVER = 1_000_000  # max_steps: never reached within the run
SETTLE_S = 20.0  # between runs on a cluster: every node's warm standby is back (a checkpointless job starts on them)


def steps_of(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if "event" not in r and "step" in r:
            out.append(r)
    return out


class PhalanxRun:
    """Submit, kill on schedule, stop at the deadline; the job's own figures."""

    def __init__(self, harness: PhalanxHarness):
        self.h = harness
        self.name = harness.name

    def _wait_spare(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.h.spare_ready():
            if time.monotonic() > deadline:
                raise TimeoutError("the spare pool was not refilled within 120 s")
            time.sleep(0.2)

    def run(self, tree: dict, duration: float, period: float | None) -> dict:
        from phalanx.train.config import config_from_dict

        self._wait_spare()
        time.sleep(SETTLE_S)  # the previous job's nodes take a fresh warm standby (checkpointless): start alike
        run_dir = Path(tree["run_dir"])
        start = time.time()
        job = self.h.jobs.submit(config_from_dict(tree), nodes=NODES, auto_resume=True, name=run_dir.name,
                                 recovery=self.h.recovery)
        kills, i = [], 0
        while (now := time.time()) < start + duration:
            due = start + period * (len(kills) + 1) if period else start + duration  # None: failure-free
            if now < due:
                time.sleep(min(0.2, due - now))
                continue
            info = self.h.jobs.describe(job["id"])
            if info["state"] not in ("pending", "running", "recovering"):
                raise RuntimeError(f"job {job['id']}: {info['state']} after {len(kills)} kills: {info['reason']}")
            gen = info["generations"][-1] if info["generations"] else None
            if info["state"] != "running" or gen is None:
                kills.append({"at": now - start, "skipped": f"job {info['state']}"})  # nothing running to kill
                continue
            rank = RANK_ORDER[i % len(RANK_ORDER)]
            i += 1
            self.h.client.inject_fault(gen["nodes"][rank], "kill-node")
            kills.append({"at": round(now - start, 3), "rank": rank, "node": gen["nodes"][rank],
                          "generation": gen["generation"]})
        end = time.time()
        steps = steps_of(run_dir / "metrics.jsonl")
        reached = max((s["step"] for s in steps if s["time"] <= end), default=0)
        progress = [[t, max((s["step"] for s in steps if s["time"] <= start + t), default=0)]
                    for t in range(5, int(duration) + 1, 5)]  # [seconds since submission, step reached]
        self.h.jobs.cancel(job["id"])
        info = self.h.jobs.describe(job["id"])
        ledger = self.h.jobs.goodput(job["id"], info)
        return {"wall_s": end - start, "reached_step": reached, "kills": kills,
                "generations": len(info["generations"]), "progress": progress, "ledger_goodput": ledger.goodput,
                "ledger_seconds": ledger.seconds}


class TorchrunRun:
    name = "torchrun"

    def __init__(self, root: Path):
        self.root = root

    def _launch(self, tree: dict, restarts: int):
        from phalanx.train.config import config_from_dict, dump_config

        run_dir = Path(tree["run_dir"])
        run_dir.mkdir(parents=True)
        config_path = run_dir / "config.json"
        config_path.write_text(json.dumps(dump_config(config_from_dict(tree))))
        env = cpu_env()
        env["PHALANX_CONFIG"] = str(config_path)
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NODES),
                "--max-restarts", str(restarts), "--monitor-interval", "0.1", "-m", "phalanx.train.worker"]
        log = open(run_dir / "torchrun.log", "w")
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log

    def run(self, tree: dict, duration: float, period: float | None) -> dict:
        run_dir = Path(tree["run_dir"])
        start = time.time()
        proc, log = self._launch(tree, 1000)
        kills, i = [], 0
        try:
            while (now := time.time()) < start + duration:
                due = start + period * (len(kills) + 1) if period else start + duration  # None: failure-free
                if now < due:
                    time.sleep(min(0.2, due - now))
                    continue
                if proc.poll() is not None:
                    raise RuntimeError(f"torchrun exited with {proc.returncode} after {len(kills)} kills")
                rank = RANK_ORDER[i % len(RANK_ORDER)]
                pid = child_with_env(proc.pid, "RANK", str(rank))
                if pid is None:  # between restarts: no worker of that rank right now
                    kills.append({"at": round(now - start, 3), "skipped": f"no rank {rank} process"})
                    continue
                i += 1
                os.kill(pid, signal.SIGKILL)
                kills.append({"at": round(now - start, 3), "rank": rank})
            end = time.time()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            stray = kill_tagged("PHALANX_CONFIG", str(run_dir / "config.json"))  # workers: sessions of their own
            if stray:
                print(f"torchrun: stopped {len(stray)} worker(s) it left running", flush=True)
        reached = max((s["step"] for s in steps_of(run_dir / "metrics.jsonl") if s["time"] <= end), default=0)
        return {"wall_s": end - start, "reached_step": reached, "kills": kills}

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="runs per harness")
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of each run (BENCHMARKS.md: 300)")
    parser.add_argument("--period", type=float, default=30.0, help="seconds between kills")
    parser.add_argument("--interval", type=int, default=25, help="checkpoint interval (steps)")
    parser.add_argument("--checkpointless-interval", type=int, default=None,
                        help="the checkpointless job's checkpoint interval (steps; default: --interval): its peers "
                             "hold the state a fault loses, so its checkpoint is only the fallback")
    parser.add_argument("--async-save", action="store_true", help="every harness saves its checkpoints "
                        "asynchronously (checkpoint.async: only the staging blocks training)")
    parser.add_argument("--harness", default="checkpointless,phalanx,torchrun")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "goodput.json")
    args = parser.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")

    root = Path(tempfile.mkdtemp(prefix="phalanx-goodput-"))
    data = prepare_data(root)
    names = args.harness.split(",")
    runners, cluster = [], None
    for name in names:
        if name in ("phalanx", "checkpointless"):
            h = (CheckpointlessHarness if name == "checkpointless" else PhalanxHarness)(root, cluster)
            cluster = cluster or h
            runners.append(PhalanxRun(h))
        else:
            runners.append(TorchrunRun(root))
    samples: dict[str, list[dict]] = {r.name: [] for r in runners}
    intervals = {r.name: args.interval for r in runners}
    if args.checkpointless_interval is not None and "checkpointless" in intervals:
        intervals["checkpointless"] = args.checkpointless_interval

    def tree(run_dir: Path, harness: str) -> dict:
        t = job_tree(run_dir, data, FOREVER, intervals[harness])
        t["checkpoint"]["async"] = args.async_save
        return t

    try:
        for i in range(args.runs):
            for r in runners:
                pair = [(f"{r.name}-free-{i}", None), (f"{r.name}-{i}", args.period)]
                if i % 2:  # alternate which runs first: the second run on a cluster is not the first's equal
                    pair.reverse()
                done = {name: r.run(tree(root / name, r.name), args.duration, period) for name, period in pair}
                free, s = done[f"{r.name}-free-{i}"], done[f"{r.name}-{i}"]
                s["order"] = "failure-free first" if i % 2 == 0 else "faulty first"
                s["failure_free"] = free
                s["goodput"] = s["reached_step"] / free["reached_step"]
                samples[r.name].append(s)
                killed = sum("rank" in k for k in s["kills"])
                print(f"run {i + 1}/{args.runs} {r.name:>14}: goodput {s['goodput']:.3f}  reached step "
                      f"{s['reached_step']} vs {free['reached_step']} failure-free in {s['wall_s']:.1f} s, "
                      f"{killed} kills" + (f"; ledger goodput {s['ledger_goodput']:.3f} ({s['generations']} "
                                           f"generations) vs {free['ledger_goodput']:.3f} failure-free"
                                           if "ledger_goodput" in s else ""), flush=True)
    finally:
        if cluster is not None:
            cluster.close()

    summary = {f"goodput_{'restart' if r.name == 'phalanx' else r.name}": round(median([s["goodput"] for s in samples[r.name]]), 4)
               for r in runners if samples[r.name]}
    summary.update({f"ledger_goodput_{'restart' if r.name == 'phalanx' else r.name}":
                    round(median([s["ledger_goodput"] for s in samples[r.name]]), 4)
                    for r in runners if samples[r.name] and "ledger_goodput" in samples[r.name][0]})
    summary.update(failure_period_s=args.period, wall_s=args.duration)
    path = write_results(args.out, {
        "benchmark": "goodput",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/goodput.py " + " ".join(sys.argv[1:]),
        "config": {"nodes": NODES, "spares": 1, "duration_s": args.duration, "period_s": args.period,
                   "checkpoint_interval": args.interval, "checkpoint_intervals": intervals, "async_save": args.async_save,
                   "rank_order": RANK_ORDER, "job": job_tree(Path("<run_dir>"), Path("<data>"), FOREVER, args.interval)},
        "samples": samples, "summary": summary,
    })
    print(f"\nsummary: {json.dumps(summary)}\nwrote {path}")


if __name__ == "__main__":
    main()

"""What resizing a running job costs: Phalanx's in-place resize against stop-checkpoint-relaunch (what
HyperPod's elastic training, Ray Train and torchrun do), on the same local cluster and job, run side by side
(interleaved).

The cluster: 4 local nodes (`local.cpu-1`: one worker each), no spares, warm standbys on, heartbeat 0.5 s. The
job: the tiny Llama preset (fp32, 2 layers, vocab 512, 64-token blocks of the bundled demo corpus), one rank
per replica (dp_shard 1), global batch 16, micro batch 2, `--steps` steps (default 110). Each run resizes 4 → 2
replicas when rank 0 has logged step `--down-step` (default 20), then 2 → 4 at `--up-step` (default 80).

  in-place   one elastic job (`elastic: {min_replicas: 1, max_replicas: 4}`, growth only on request);
             `phalanx job scale --replicas 2`, then `--replicas 4` once the freed nodes hold warm standbys
             again. Survivors keep their processes; leavers finish their step and exit; joiners (the warm
             standbys) restore from a peer replica's memory. No checkpoint is written or read.
  relaunch   the same job at a fixed size (min = max), a checkpoint after every step (so the stop loses
             nothing, as a save-on-stop would); at the same steps the job is cancelled (every process
             stopped) and submitted again at the new size, which loads the newest checkpoint. Its new workers
             are forked from the nodes' worker templates (torch already imported): Phalanx's own relaunch,
             the strictest baseline.
  relaunch-exec  `relaunch` on a second cluster without worker templates (`worker_template: false`): every
             relaunched worker is a fresh `python -m phalanx.worker` that imports torch, as torchrun and
             HyperPod's relaunch start them.
  fixed      the same config trained at a fixed 4 replicas by `phalanx train --nproc 4` (once): the loss every
             resized run is compared with.

Figures per resize (times from the request: `job scale`, or the cancel), read from metrics.jsonl:
  stall_s            survivors' stall: the gap between the last step before and the first step after, minus
                     one normal step at the new size (what the change cost the job's wall time)
  first_step_s       request → the first step logged at the new size (in place, scale up: the joiners' first
                     committed step)
  steps_lost         committed steps computed again
tokens/s at each size ÷ the relaunch job's tokens/s at that size (its fixed-size segments), medians of each
segment's steps after its first 5; in place at 2 replicas also only the steps after the freed nodes' warm
standbys are up (`_standbys_warm`): on this machine every "node" shares the same 2 cores, so a standby
importing torch on a freed node slows the job, which on real nodes it would not.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/elastic.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from report import RESULTS_DIR, median, write_results  # noqa: E402

from phalanx.train.timeline import attempts, normal_step_s  # noqa: E402

GLOBAL_BATCH = 16


def job_tree(run_dir: Path, data: Path, steps: int, replicas: tuple[int, int], interval: int) -> dict:
    lo, hi = replicas
    return {
        "run_dir": str(run_dir), "seed": 7, "precision": "fp32",
        "model": {"preset": "tiny", "overrides": {"vocab_size": 512, "n_layers": 2}},
        "data": {"path": str(data)},
        "parallel": {"dp_shard": 1},
        "elastic": {"min_replicas": lo, "max_replicas": hi, "stable_period_s": 0, "scale_up_delay_s": 1e9},
        "training": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2, "max_steps": steps,
                     "log_interval": 10},
        "optimizer": {"lr": 1e-3},
        "lr_schedule": {"warmup_steps": 5},
        "checkpoint": {"interval": interval, "keep": 2, "async": False},
        "resilience": {"recovery": "checkpointless", "regroup_timeout_s": 60.0},
    }


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    """Poll `predicate`: every 50 ms for a read of the metrics file, every 0.5 s for the API (a describe at 20 Hz
    costs the controller enough CPU on 2 cores to slow the job it measures)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"event"' not in line]
    return steps[-1]["step"] if steps else 0


def standbys_ready(client, nodes: list[str]) -> bool:
    """Each node's standby is warm: its agent reports it and its log's last line says it waits."""
    by_name = {n["name"]: n for n in client.nodes()}
    for name in nodes:
        node = by_name[name]
        log = Path(node["work_dir"]) / "standby-0.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        if not (node.get("report") or {}).get("standbys") or not lines or "waiting" not in lines[-1]:
            return False
    return True


def resize_figures(before: list[dict], after: list[dict], requested_at: float, lost: int) -> dict:
    step_s = normal_step_s(after)
    last, first = before[-1], after[0]
    return {"stall_s": round(first["time"] - last["time"] - step_s, 4),
            "first_step_s": round(first["time"] - requested_at, 4), "steps_lost": lost,
            "normal_step_s": round(step_s, 4)}


def steady_tokens_per_s(steps: list[dict]) -> float:
    """The median after a segment's first 5 steps (its warm-up; in place, also the freed nodes' standbys
    starting on the same 2 cores)."""
    return statistics.median(s["tokens_per_s"] for s in steps[5:])


def run_in_place(jobs, client, root: Path, data: Path, args, i: int) -> tuple[dict, Path]:
    run_dir = root / f"inplace-{i}"
    config = root / f"inplace-{i}.yaml"
    config.write_text(yaml.safe_dump(job_tree(run_dir, data, args.steps, (1, 4), interval=1000)))
    name = f"inplace-{i}"
    jobs.submit(config, name=name)
    metrics = run_dir / "metrics.jsonl"
    wait_for(lambda: last_step(metrics) >= args.down_step, 300, f"{name} step {args.down_step}")
    down_at = time.time()
    jobs.scale(name, 2)
    wait_for(lambda: jobs.describe(name)["replicas"] == 2, 60, f"{name} at 2 replicas", poll_s=0.5)
    freed = [n for n in jobs.describe(name)["generations"][0]["nodes"] if n not in jobs.describe(name)["nodes"]]
    wait_for(lambda: standbys_ready(client, freed), 120, "warm standbys on the freed nodes", poll_s=0.5)
    warm_at = time.time()
    wait_for(lambda: last_step(metrics) >= args.up_step, 300, f"{name} step {args.up_step}")
    up_at = time.time()
    jobs.scale(name, 4)
    info = jobs.wait(name, timeout_s=600, poll_s=1.0)
    if info["state"] != "succeeded":
        raise RuntimeError(f"{name} {info['state']}: {info['reason']}")
    runs = attempts(metrics)
    if len(runs) != 3:
        raise RuntimeError(f"{name}: expected 3 segments (4, 2, 4 replicas), got {len(runs)}")
    lost = [e["steps_lost"] for e in _events(metrics, "resumed")]
    return {"down": resize_figures(runs[0].steps, runs[1].steps, down_at, lost[0]),
            "up": {**resize_figures(runs[1].steps, runs[2].steps, up_at, lost[1]),
                   "joiners_were_standbys": len(info["generations"][-1]["standbys"]) == 2},
            "tokens_per_s": {"4": steady_tokens_per_s(runs[0].steps + runs[2].steps[5:]),
                             "2": steady_tokens_per_s(runs[1].steps),
                             # once the freed nodes' standbys are warm (they start on the same 2 cores)
                             "2_warm": statistics.median(s["tokens_per_s"] for s in runs[1].steps
                                                         if s["time"] > warm_at)}}, run_dir


def _events(metrics: Path, kind: str) -> list[dict]:
    return [r for line in metrics.read_text().splitlines() if (r := json.loads(line)).get("event") == kind]


def run_relaunch(jobs, root: Path, data: Path, args, i: int, tag: str = "relaunch") -> dict:
    run_dir = root / f"{tag}-{i}"
    metrics = run_dir / "metrics.jsonl"
    figures, segments = {}, []
    for seg, (size, until) in enumerate(((4, args.down_step), (2, args.up_step), (4, None))):
        config = root / f"{tag}-{i}-{seg}.yaml"
        config.write_text(yaml.safe_dump(job_tree(run_dir, data, args.steps, (size, size), interval=1)))
        name = f"{tag}-{i}-{seg}"
        jobs.submit(config, name=name)
        if until is None:
            info = jobs.wait(name, timeout_s=600, poll_s=1.0)
            if info["state"] != "succeeded":
                raise RuntimeError(f"{name} {info['state']}: {info['reason']}")
            break
        wait_for(lambda: last_step(metrics) >= until, 300, f"{name} step {until}")
        segments.append(time.time())
        jobs.cancel(name)
        jobs.wait(name, timeout_s=60, poll_s=0.1)
        wait_for(lambda: all(w["state"] != "running" for w in jobs.describe(name)["workers"]), 60, f"{name} stopped",
                 poll_s=0.1)
    runs = attempts(metrics)  # a relaunch resumes from the checkpoint: a `resumed` event starts each segment
    if len(runs) != 3:
        raise RuntimeError(f"{run_dir}: expected 3 segments, got {len(runs)}")
    for key, (a, b), at in (("down", (0, 1), segments[0]), ("up", (1, 2), segments[1])):
        lost = runs[a].steps[-1]["step"] - runs[b].resumed_step
        figures[key] = resize_figures(runs[a].steps, runs[b].steps, at, lost)
    figures["tokens_per_s"] = {"4": steady_tokens_per_s(runs[0].steps + runs[2].steps[5:]),
                               "2": steady_tokens_per_s(runs[1].steps)}
    return figures


def fixed_losses(root: Path, data: Path, steps: int) -> dict[int, float]:
    from phalanx.train.config import config_from_dict
    from phalanx.train.launch import launch
    from phalanx.train.metrics import read_metrics

    tree = job_tree(root / "fixed", data, steps, (4, 4), interval=1000)
    config = config_from_dict(tree)
    if launch(config, 4, threads_per_worker=1) != 0:
        raise RuntimeError("the fixed-size run failed")
    records, _ = read_metrics(config.run_dir)
    return {r["step"]: r["loss"] for r in records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=110)
    parser.add_argument("--down-step", type=int, default=20)
    parser.add_argument("--up-step", type=int, default=80)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "elastic.json")
    args = parser.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    root = Path(tempfile.mkdtemp(prefix="phalanx-elastic-"))
    os.environ["PHALANX_HOME"] = str(root / "home")
    from phalanx.control.client.cluster import ClusterClient, create_cluster, delete_cluster
    from phalanx.control.client.jobs import JobClient

    sys.path.insert(0, str(HERE))
    from recovery import prepare_data

    data = prepare_data(root)
    for name, template in (("bench", True), ("bench-exec", False)):
        spec = root / f"{name}.yaml"
        spec.write_text(yaml.safe_dump({
            "name": name, "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": 4,
                                               "spares": 0, "warm_standby": True, "worker_template": template}],
            "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 120.0}}))
        create_cluster(spec, timeout_s=120)
    jobs, client, exec_jobs = JobClient("bench"), ClusterClient("bench"), JobClient("bench-exec")
    rows: dict[str, list[dict]] = {"in-place": [], "relaunch": [], "relaunch-exec": []}
    inplace_dirs = []
    try:
        for i in range(args.runs):
            row, run_dir = run_in_place(jobs, client, root, data, args, i)
            rows["in-place"].append(row)
            inplace_dirs.append(run_dir)
            print(f"run {i} in-place: {json.dumps(row)}", flush=True)
            for tag, client_ in (("relaunch", jobs), ("relaunch-exec", exec_jobs)):
                row = run_relaunch(client_, root, data, args, i, tag)
                rows[tag].append(row)
                print(f"run {i} {tag}: {json.dumps(row)}", flush=True)
    finally:
        delete_cluster("bench")
        delete_cluster("bench-exec")
    reference = fixed_losses(root, data, args.steps)
    diffs = []
    for run_dir in inplace_dirs:
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if "event" not in r:
                diffs.append(abs(r["loss"] - reference[r["step"]]))

    def med(harness: str, key: str, figure: str) -> float:
        return median([r[key][figure] for r in rows[harness]])

    def downtime(harness: str) -> float:  # per resize: the mean of the scale-down and scale-up stalls
        return (med(harness, "down", "stall_s") + med(harness, "up", "stall_s")) / 2
    summary = {
        "scale_down_stall_s": med("in-place", "down", "stall_s"),
        "scale_up_stall_s": med("in-place", "up", "stall_s"),
        "joiner_s": med("in-place", "up", "first_step_s"),
        "elastic_steps_lost": max(r[k]["steps_lost"] for r in rows["in-place"] for k in ("down", "up")),
        "in_place_downtime_s": round(downtime("in-place"), 4),
        "relaunch_downtime_s": round(downtime("relaunch"), 4),
        "relaunch_exec_downtime_s": round(downtime("relaunch-exec"), 4),
        "relaunch_scale_down_stall_s": med("relaunch", "down", "stall_s"),
        "relaunch_scale_up_stall_s": med("relaunch", "up", "stall_s"),
        "downtime_ratio": round(downtime("in-place") / downtime("relaunch"), 4),
        "downtime_ratio_exec": round(downtime("in-place") / downtime("relaunch-exec"), 4),
        "max_abs_loss_diff": max(diffs),
        "tokens_per_s_ratio_4": round(median([r["tokens_per_s"]["4"] for r in rows["in-place"]])
                                      / median([r["tokens_per_s"]["4"] for r in rows["relaunch"]]), 4),
        "tokens_per_s_ratio_2": round(median([r["tokens_per_s"]["2"] for r in rows["in-place"]])
                                      / median([r["tokens_per_s"]["2"] for r in rows["relaunch"]]), 4),
        "tokens_per_s_ratio_2_standbys_warm": round(median([r["tokens_per_s"]["2_warm"] for r in rows["in-place"]])
                                                    / median([r["tokens_per_s"]["2"] for r in rows["relaunch"]]), 4),
    }
    path = write_results(args.out, {"config": vars(args) | {"out": str(args.out)}, "summary": summary, "runs": rows})
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What the controller's handling of one heartbeat costs as the cluster's job history grows.

The heartbeat's own handling — `server/heartbeat.answer_heartbeat`: record the node's report, ingest its workers,
build its reply (assignments, hurry, standbys) — over the controller's real policy objects and a
real SQLite state (`tests/fakes.FakeCluster`: `Store`, `JobScheduler`, `Reconciler` wired as the daemon wires
them, a fake backend and clock; no HTTP; past 64 nodes, the local backend's limit, the spec says `backend: hosts`).
For each H in `--history`, a fresh cluster of `--nodes` nodes gets H past jobs (each submitted, run on every node —
one worker row per rank — and cancelled, through `JobRecords`), then one command job running on every node; then
every node heartbeats `--rounds` times and the median time of one heartbeat is kept, and the median of `--rounds`
reconciler ticks (the controller's periodic decisions).

With `--baseline-tree DIR` (a checkout of another commit: `git worktree add /tmp/base <commit>`) each
measurement runs in a child process per tree (that tree's `src`, this tree's `tests/fakes.py`), the two trees
alternating `--repeats` times; the summary gives
both and their ratio. Writes benchmarks/results/heartbeat_cost.json (summary: us_per_heartbeat_h<H> and, with a
baseline, baseline_us_per_heartbeat_h<H> and ratio_h<H>; the same for ticks: us_per_tick_h<H>, tick_ratio_h<H>).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/heartbeat_cost.py --baseline-tree /tmp/base
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TREE = HERE.parent
RESULTS = HERE / "results" / "heartbeat_cost.json"


def measure(tree: Path, nodes: int, history: int, rounds: int) -> tuple[float, float]:
    """Median microseconds of one heartbeat's handling and of one reconciler tick (in this process, with `tree`'s
    code)."""
    sys.path[:0] = [str(tree / "src"), str(TREE / "tests")]  # the tree's policy, this tree's harness (fakes.py)
    from fakes import FakeCluster
    from phalanx.control.server.heartbeat import answer_heartbeat
    from phalanx.control.state.jobs import JobState
    from phalanx.protocol.messages import Heartbeat

    c = FakeCluster(Path(tempfile.mkdtemp(prefix="phalanx-hb-")), count=nodes, spares=0,
                    backend="local" if nodes <= 64 else "hosts").create()  # (the local backend runs at most 64)
    records, names = c.jobs.records, sorted(c.agents)
    for _ in range(history):
        past = records.add_job(name=None, kind="command", group="workers", nodes=nodes, workers_per_node=1,
                               argv=["true"], cwd="/", env={}, config=None, jobs_root=str(c.paths.jobs_dir),
                               checkpoint_dir=None, auto_resume=False, max_retries=0)
        for rank, name in enumerate(names):
            records.put_worker({"job": past.id, "generation": 1, "rank": rank, "node": name, "local_rank": 0,
                                "pid": 1000 + rank, "state": "exited", "exit_code": 0, "detail": "exited 0"})
        records.transition(past.id, JobState.CANCELLED, "a past job (benchmark)")
    job = c.submit(nodes=nodes)
    c.run_until(lambda: records.job(job.id).state == JobState.RUNNING and all(
        a.running(job.id) for a in c.agents.values()), "the job running on every node")
    c.steps(2)
    beats = []
    for name in names:
        agent = c.agents[name]
        beats.append((name, Heartbeat.model_validate(agent.body())))
    times = []
    for _ in range(rounds):
        for name, hb in beats:
            start = time.perf_counter()
            answer_heartbeat(c.store, c.jobs, c.deep, c.started_at, c.store.node(name), hb, c.clock())
            times.append(time.perf_counter() - start)
    ticks = []
    for _ in range(rounds):
        start = time.perf_counter()
        c.reconciler.tick()
        ticks.append(time.perf_counter() - start)
    assert records.job(job.id).state == JobState.RUNNING
    c.close()
    return 1e6 * statistics.median(times), 1e6 * statistics.median(ticks)


def child(tree: Path, nodes: int, history: int, rounds: int) -> tuple[float, float]:
    out = subprocess.run([sys.executable, __file__, "--child", str(tree), "--nodes", str(nodes), "--rounds",
                          str(rounds), "--history", str(history)], check=True, capture_output=True, text=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["us"], got["tick_us"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=64)
    parser.add_argument("--history", type=int, nargs="+", default=[0, 100, 1000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-tree", type=Path, help="a checkout of the commit to compare against")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.child is not None:
        us, tick_us = measure(args.child, args.nodes, args.history[0], args.rounds)
        print(json.dumps({"us": us, "tick_us": tick_us}))
        return

    sys.path.insert(0, str(HERE))
    from report import write_results

    trees = {"current": TREE, **({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})}
    runs, summary = [], {}
    for h in args.history:
        got: dict[str, list[float]] = {k: [] for k in trees}
        tick: dict[str, list[float]] = {k: [] for k in trees}
        for i in range(args.repeats):
            for kind in (list(trees) if i % 2 == 0 else list(reversed(trees))):  # alternating order
                us, tick_us = child(trees[kind], args.nodes, h, args.rounds)
                got[kind].append(us)
                tick[kind].append(tick_us)
        row = {"history_jobs": h, "nodes": args.nodes, **{f"{k}_us": [round(v, 1) for v in got[k]] for k in got},
               **{f"{k}_tick_us": [round(v, 1) for v in tick[k]] for k in tick}}
        med = {k: statistics.median(v) for k, v in got.items()}
        med_tick = {k: statistics.median(v) for k, v in tick.items()}
        summary[f"us_per_heartbeat_h{h}"] = round(med["current"], 1)
        summary[f"us_per_tick_h{h}"] = round(med_tick["current"], 1)
        if "baseline" in got:
            summary[f"baseline_us_per_heartbeat_h{h}"] = round(med["baseline"], 1)
            summary[f"ratio_h{h}"] = round(med["current"] / med["baseline"], 3)
            summary[f"baseline_us_per_tick_h{h}"] = round(med_tick["baseline"], 1)
            summary[f"tick_ratio_h{h}"] = round(med_tick["current"] / med_tick["baseline"], 3)
        runs.append(row)
        print(json.dumps(row), flush=True)
    baseline = trees.get("baseline")
    commit = (subprocess.run(["git", "-C", str(baseline), "rev-parse", "HEAD"], capture_output=True, text=True)
              .stdout.strip() if baseline else None)
    write_results(args.out, {"benchmark": "heartbeat_cost", "runs": runs, "baseline_commit": commit,
                             "summary": summary, "command": " ".join(["OMP_NUM_THREADS=1", "python", *sys.argv])})
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

"""What one /metrics scrape costs as a cluster's history grows: the controller's collector
(`phalanx.control.server.metrics.ClusterCollector`) against the number of events in state.db.

For each N in `--events` (default 1k, 10k, 100k) a fresh state.db is made (`Store.initialize`) with 3 nodes,
N node events inserted through the store's own sink (`Store.insert_event`, in one transaction), and one
running training job whose run dir holds a metrics.jsonl of `--steps` step records (default 20,000) and an
events.jsonl with a checkpoint save every 500 steps. Then:

  cold      the first scrape: the job's follower reads both files from the start (what a controller pays
            once per job, spread over several scrapes when the files exceed 4 MiB)
  scrape    a steady-state scrape, the median of `--runs` (default 15): aggregates, counters, the followers'
            appended bytes (none here) and the cached derived figures
  derive    a scrape that also recomputes the goodput ledger and the recovery phases (what one scrape in
            every `derive_every_s`, 5 s, pays while the job runs): median of `--runs`
  baseline  the previous collector's events read (`Store.events()` then a count, as /metrics did before this
            change), measured in the same run, interleaved with `scrape`

The claim: `scrape` and `derive` stay flat in N (ratio 100k / 1k ≈ 1) while the baseline grows with N.

`--nodes N`: instead, a scrape of a cluster of N heartbeating nodes (the controller's own view, `owner`), where the
one family with a sample per node dominates: the controller's route (`render_ages`: the family written by
`ClusterCollector.heartbeat_ages`) against prometheus_client's exposition of it (the baseline), interleaved, median
of `--runs`; summary nodes_scrape_s, nodes_baseline_s, nodes_ratio (baseline / ours).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/scrape.py --nodes 4096 \
        --out benchmarks/results/scrape_nodes_4096.json
Prints a table; writes benchmarks/results/scrape.json (summary: scrape_s_1k, scrape_s_10k, scrape_s_100k,
scrape_ratio_100k_1k, derive_s_100k, cold_s_100k, events_scan_s_100k).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/scrape.py
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from phalanx.control.server.job_runs import JobRuns
from phalanx.control.server.metrics import ClusterCollector
from phalanx.control.spec import ClusterSpec
from phalanx.control.state.jobs import JobRecords, JobState
from phalanx.control.state.store import Store
from phalanx.observability.events import Event, EventKind as K

RESULTS = Path(__file__).parent / "results" / "scrape.json"


def build(root: Path, n_events: int, n_steps: int) -> tuple[Store, str]:
    spec = ClusterSpec.model_validate({"name": "bench", "instance_groups": [
        {"name": "workers", "instance_type": "local.cpu-1", "count": 2, "spares": 1}]})
    store = Store(root / "state.db")
    store.initialize(spec)
    for spare in (False, False, True):
        store.add_node("workers", is_spare=spare, work_root=root, reason="bench")
    for name in ("workers-0", "workers-1", "workers-2"):
        store.update_node(name, last_heartbeat=time.time())
    records = JobRecords(store)
    run = root / "run"
    run.mkdir()
    job = records.add_job(name="bench", kind="train", group="workers", nodes=2, workers_per_node=1, argv=[],
                          cwd=str(root), env={}, config={"run_dir": str(run)}, jobs_root=str(root / "jobs"),
                          checkpoint_dir=str(run / "checkpoints"), auto_resume=True, max_retries=0)
    records.transition(job.id, JobState.RUNNING, "generation 1 started")
    records.add_generation(job.id, 1, ["workers-0", "workers-1"], "127.0.0.1", 29500, None)
    t0 = time.time() - n_steps * 0.1
    with open(run / "metrics.jsonl", "w") as f:
        for i in range(1, n_steps + 1):
            f.write(json.dumps({"step": i, "time": t0 + i * 0.1, "loss": 5.0 / i, "grad_norm": 1.0, "lr": 1e-3,
                                "tokens_per_s": 5000.0, "step_time_s": 0.09}) + "\n")
    (run / "checkpoints").mkdir(exist_ok=True)
    with open(run / "checkpoints" / "events.jsonl", "a") as f:
        for i in range(500, n_steps + 1, 500):
            f.write(Event(t0 + i * 0.1, K.CHECKPOINT_SAVED, "rank:0", job=job.id,
                          fields={"step": i, "seconds": 0.05}).to_json() + "\n")
    states = ("healthy", "faulty", "replacing", "terminated")
    with store.transaction():
        for i in range(n_events):
            store.insert_event(Event(t0 + i * 1e-3, K.TRANSITION, "controller", node=f"workers-{i % 3}",
                                     message="bench", fields={"from_state": states[i % 4],
                                                              "to_state": states[(i + 1) % 4]}))
    return store, job.id


def old_events_read(store: Store) -> int:
    """What the previous collector did at every scrape: every event, then two counts over them."""
    events = store.events()
    return sum(e["to_state"] == "faulty" for e in events) + sum(e["kind"] == "promoted" for e in events)


def timed(fn) -> float:
    gc.collect()  # (outside the timing: one sample's garbage — the baseline's 100k rows — is not the next one's)
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(n_events: int, n_steps: int, runs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        store, _ = build(Path(tmp), n_events, n_steps)
        try:
            runs_ = JobRuns()
            registry = CollectorRegistry(auto_describe=False)
            registry.register(ClusterCollector(store, runs_))
            scrape = lambda: generate_latest(registry)  # noqa: E731
            cold = timed(scrape)
            steady, baseline, derive = [], [], []
            for _ in range(runs):  # interleaved: scrape, baseline, scrape with the derived figures recomputed
                steady.append(timed(scrape))
                baseline.append(timed(lambda: old_events_read(store)))
                for f in runs_._followers.values():
                    f._derived = None  # (as when derive_every_s has passed)
                derive.append(timed(scrape))
            size = len(scrape())
        finally:
            store.close()
    return {"events": n_events, "steps": n_steps, "cold_s": cold, "scrape_s": statistics.median(steady),
            "derive_s": statistics.median(derive), "events_scan_s": statistics.median(baseline),
            "scrape_samples": steady, "derive_samples": derive, "events_scan_samples": baseline, "bytes": size}


def measure_nodes(n: int, runs: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = ClusterSpec.model_validate({"name": "bench", "backend": "hosts", "instance_groups": [
            {"name": "workers", "instance_type": "local.cpu-1", "count": n}]})  # (hosts: local stops at 64 nodes)
        store = Store(Path(tmp) / "state.db", owner=True)
        try:
            store.initialize(spec)
            for _ in range(n):
                store.add_node("workers", is_spare=False, work_root=Path(tmp), reason="bench")
            store.update_nodes({f"workers-{i}": {"last_heartbeat": time.time()} for i in range(n)})
            ours = ClusterCollector(store, JobRuns(), render_ages=True)
            theirs = ClusterCollector(store, JobRuns())
            scrape = lambda c: generate_latest(registry_of(c)) + (c.heartbeat_ages() if c.render_ages else b"")  # noqa
            ours_s, theirs_s = [], []
            for _ in range(runs):
                ours_s.append(timed(lambda: scrape(ours)))
                theirs_s.append(timed(lambda: scrape(theirs)))
            size = len(scrape(ours))
        finally:
            store.close()
    return {"nodes": n, "scrape_s": statistics.median(ours_s), "baseline_s": statistics.median(theirs_s),
            "scrape_samples": ours_s, "baseline_samples": theirs_s, "bytes": size}


def registry_of(collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--nodes", type=int, help="a scrape of N heartbeating nodes, ours against the library's")
    a = p.parse_args(argv)
    if a.nodes:
        r = measure_nodes(a.nodes, a.runs)
        summary = {"nodes_scrape_s": r["scrape_s"], "nodes_baseline_s": r["baseline_s"],
                   "nodes_ratio": r["baseline_s"] / r["scrape_s"]}
        print(f"{a.nodes} nodes: scrape {r['scrape_s'] * 1e3:.1f} ms (prometheus_client's exposition of every "
              f"node: {r['baseline_s'] * 1e3:.1f} ms, {summary['nodes_ratio']:.1f}x), {r['bytes']} bytes")
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"machine": platform.platform(), "python": sys.version.split()[0],
                                     "config": {"nodes": a.nodes, "runs": a.runs}, "rows": [r],
                                     "summary": summary}, indent=1))
        print(f"wrote {a.out}")
        return 0
    rows = [measure(n, a.steps, a.runs) for n in a.events]
    print(f"{'events':>8} {'scrape ms':>10} {'derive ms':>10} {'cold ms':>9} {'events scan ms':>15} {'bytes':>7}")
    for r in rows:
        print(f"{r['events']:>8} {r['scrape_s'] * 1e3:>10.2f} {r['derive_s'] * 1e3:>10.2f} {r['cold_s'] * 1e3:>9.1f} "
              f"{r['events_scan_s'] * 1e3:>15.2f} {r['bytes']:>7}")
    by = {r["events"]: r for r in rows}
    summary = {}
    for n, key in ((1_000, "1k"), (10_000, "10k"), (100_000, "100k")):
        if n in by:
            summary[f"scrape_s_{key}"] = by[n]["scrape_s"]
    lo, hi = rows[0], rows[-1]
    summary.update({f"scrape_ratio_{_k(hi['events'])}_{_k(lo['events'])}": hi["scrape_s"] / lo["scrape_s"],
                    f"derive_s_{_k(hi['events'])}": hi["derive_s"], f"cold_s_{_k(hi['events'])}": hi["cold_s"],
                    f"events_scan_s_{_k(hi['events'])}": hi["events_scan_s"]})
    print(f"scrape {_k(hi['events'])} / {_k(lo['events'])} events: {hi['scrape_s'] / lo['scrape_s']:.2f}x "
          f"(the previous collector's events read: {hi['events_scan_s'] / lo['events_scan_s']:.1f}x)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": platform.platform(), "python": sys.version.split()[0],
                                 "config": {"events": a.events, "steps": a.steps, "runs": a.runs},
                                 "rows": rows, "summary": summary}, indent=1))
    print(f"wrote {a.out}")
    return 0


def _k(n: int) -> str:
    return f"{n // 1000}k" if n % 1000 == 0 and n >= 1000 else str(n)


if __name__ == "__main__":
    sys.exit(main())

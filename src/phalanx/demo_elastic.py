"""`phalanx demo --elastic`: an elastic job on one machine, with real processes, through every kind of change.

A local cluster of N-1 worker nodes (no spares, warm standbys on) runs the recipe as an elastic job (one rank
per replica, 1 to N replicas, global batch kept). Then, one after the other:

  grow       `cluster scale workers --count N`: a node is provisioned and the job grows onto it
  fault      one node is SIGKILLed: with no spare the job shrinks in place at once, and grows back onto the
             replacement the controller provisions
  priority   a higher-priority job asks for 2 nodes: the elastic job gives them up (leavers finish their step),
             and takes them back when that job ends

Then the job is cancelled (it trains for `training.max_steps`, 100,000 unless overridden: the story is timed by
events, not steps) and the demo ends with a table of each change: sizes, cause, the survivors' stall, steps
lost, where the joiners' state came from. The cluster's state lives under `<run_dir>/home`; the cluster is
deleted at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from phalanx.control.client.cluster import ClusterClient, create_cluster, delete_cluster
from phalanx.control.client.jobs import JobClient
from phalanx.demo import Narrator
from phalanx.train.config import load_config
from phalanx.train.timeline import attempts, normal_step_s

CLUSTER = "demo-elastic"
SHOWN = {"resize", "fault-injected", "cluster"}


def write_spec(root: Path, nodes: int) -> Path:
    spec = {"name": CLUSTER, "backend": "local", "node_recovery": "automatic",
            "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": nodes, "spares": 0,
                                 "warm_standby": True}],
            "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 120.0}}
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_elastic_demo(recipe: Path, run_dir: Path, *, nodes: int = 4, overrides: list[str] = (),
                     console: Console | None = None) -> list[dict]:
    """Run the story; returns the table of changes it printed. Raises if the job does not succeed."""
    console = console or Console()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ["PHALANX_HOME"] = str(run_dir / "home")
    config = load_config(recipe, [f"run_dir={run_dir / 'train'}", "parallel.dp_replicate=1", "parallel.dp_shard=1",
                                  "training.max_steps=100000", "checkpoint.interval=1000",
                                  f"elastic={{min_replicas: 1, max_replicas: {nodes}, stable_period_s: 2, "
                                  f"scale_up_delay_s: 2}}", *overrides])
    say = Narrator(console)
    say.say(f"creating local cluster [bold]{CLUSTER}[/]: {nodes - 1} worker nodes, no spares, warm standbys on")
    create_cluster(write_spec(run_dir, nodes - 1), timeout_s=120)
    client, jobs = ClusterClient(CLUSTER), JobClient(CLUSTER)
    try:
        job = jobs.submit(config, name="elastic")
        e = config.elastic
        say.say(f"elastic job {job['id']} submitted: {e.min_replicas}-{e.max_replicas} replicas of one node, global "
                f"batch {config.training.global_batch_size}")
        say.seen_event = 0

        def watch(until, what: str, timeout_s: float = 120.0) -> dict:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                info = jobs.describe(job["id"])
                _events(say, client)
                if info["state"] in ("succeeded", "failed", "cancelled"):
                    raise RuntimeError(f"the job {info['state']} (step {info['last_step']}) before {what}; "
                                       f"{info['reason']}")
                if until(info):
                    return info
                time.sleep(0.25)
            raise RuntimeError(f"timed out waiting for {what}")

        def running_at(replicas: int):
            return lambda i: i["state"] == "running" and i["replicas"] == replicas and (i["last_step"] or 0) > 0

        def train_on(steps: int = 10) -> None:
            at = jobs.describe(job["id"])["last_step"] or 0
            watch(lambda i: (i["last_step"] or 0) >= at + steps, f"{steps} more steps")

        watch(running_at(nodes - 1), f"{nodes - 1} replicas training")
        train_on()
        say.say(f"[bold]grow[/]: phalanx cluster scale workers --count {nodes}")
        client.call("POST", "/v1/groups/workers/scale", {"count": nodes})
        info = watch(running_at(nodes), f"{nodes} replicas")
        train_on()
        victim = info["nodes"][-1]
        say.say(f"[bold red]fault[/]: kill-node {victim} (no spare in the pool)")
        client.inject_fault(victim, "kill-node")
        watch(running_at(nodes - 1), "the shrink after the fault")
        watch(running_at(nodes), "growing back onto the replacement")
        train_on()
        say.say("[bold]priority[/]: a job of priority 10 asks for 2 nodes")
        urgent = jobs.submit(command=[sys.executable, "-c", "import time; time.sleep(8)"], nodes=2, name="urgent",
                             priority=10)
        watch(lambda i: jobs.describe(urgent["id"])["state"] == "running", "the urgent job to start")
        say.say(f"job {urgent['id']} (priority 10) running on 2 nodes; the elastic job trains on "
                f"{jobs.describe(job['id'])['replicas']} replica(s)")
        jobs.wait(urgent["id"], timeout_s=60)
        watch(running_at(nodes), "growing back after the urgent job")
        train_on()
        say.say("every kind of change shown; cancelling the job")
        jobs.cancel(job["id"])
        info = jobs.wait(job["id"], timeout_s=60)
        _events(say, client)
        rows = changes(info, Path(config.run_dir) / "metrics.jsonl")
        print_changes(console, rows, info)
        return rows
    finally:
        say.say("deleting the cluster")
        delete_cluster(CLUSTER, timeout_s=30)


def _events(say: Narrator, client: ClusterClient) -> None:
    for e in client.events(since_id=say.seen_event):
        say.seen_event = max(say.seen_event, e["id"])
        if e["kind"] in SHOWN or (e["kind"] == "transition" and e["to_state"] in ("faulty", "healthy")):
            who = e.get("node") or (f"job {e['job']}" if e.get("job") else "cluster")
            say.say(f"[magenta]{who}[/]: {e['reason']}")


def changes(info: dict, metrics: Path) -> list[dict]:
    """One row per generation change: sizes, cause, the stall between the last step before and the first after
    (minus one normal step at the new size), steps lost, where the state came from."""
    segments = attempts(metrics)
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    restored = [e for e in events if e.get("event") == "state_restored"]
    resumed = [e for e in events if e.get("event") == "resumed"]
    gens, rows = info["generations"], []
    for i, (old, new) in enumerate(zip(gens, gens[1:])):
        before, after = segments[i].steps, segments[i + 1].steps if i + 1 < len(segments) else []
        stall = (after[0]["time"] - before[-1]["time"] - normal_step_s(after)) if len(after) > 3 and before else None
        rows.append({"generation": new["generation"], "from": len(old["nodes"]), "to": len(new["nodes"]),
                     "cause": old["outcome"], "why": _why(old["end_reason"] or ""),
                     "stall_s": round(stall, 2) if stall is not None else None,
                     "steps_lost": resumed[i]["steps_lost"] if i < len(resumed) else None,
                     "state_from": restored[i]["source"] if i < len(restored) else None})
    return rows


def _why(reason: str) -> str:
    """A resize's reason is in its parentheses ("resize 4 → 2 replicas (job scale request ...); ..."); a fault's
    is its first clause."""
    head = reason.split(";")[0]
    if head.startswith("resize ") and "(" in head:
        return head[head.index("(") + 1:head.rindex(")")]
    return head[:60]


def print_changes(console: Console, rows: list[dict], info: dict) -> None:
    table = Table(title=f"Phalanx elastic demo: job {info['id']} at step {info['last_step']}, every change in place")
    for col in ("gen", "replicas", "cause", "survivors' stall", "steps lost", "state from"):
        table.add_column(col, no_wrap=True)
    table.add_column("why")
    for r in rows:
        table.add_row(str(r["generation"]), f"{r['from']} → {r['to']}", r["cause"],
                      "-" if r["stall_s"] is None else f"{r['stall_s']:.2f} s", str(r["steps_lost"]),
                      r["state_from"] or "-", r["why"])
    console.print(table)

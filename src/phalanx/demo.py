"""`phalanx demo`: the whole story on one machine, with real processes.

Creates a local cluster (N worker nodes + 1 spare, each node an agent process), submits a training recipe
with auto-resume, SIGKILLs one node halfway through (the same `kill-node` fault an operator injects), shows
the controller detecting it and putting the spare in service, then prints what the failure cost and deletes
the cluster. Recovery is checkpointless by default: the surviving workers keep their processes and regroup,
the spare's warm standby takes the lost rank and restores its state from a peer's memory; with
`recovery="restart"` every worker restarts from the newest checkpoint instead. The cluster's state lives under `<run_dir>/home`
(its PHALANX_HOME), so the demo never touches your own clusters.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from phalanx.control.client.cluster import ClusterClient, create_cluster, delete_cluster
from phalanx.control.client.jobs import JobClient
from phalanx.train.config import load_config
from phalanx.train.timeline import recovery_figures

CLUSTER = "demo"
# events worth a line while the demo runs (the rest is in `phalanx cluster events`)
SHOWN_KINDS = {"fault-injected", "promoted", "recovery", "generation", "hang", "job", "worker-exit"}
SHOWN_STATES = {"faulty", "terminated", "healthy"}  # node transitions


def write_cluster_spec(root: Path, nodes: int, spares: int) -> Path:
    script = root / "on_create.sh"
    script.write_text('#!/bin/sh\necho "configuring $PHALANX_NODE_NAME (lifecycle script)"\n')
    spec = {"name": CLUSTER, "backend": "local", "node_recovery": "automatic",
            "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": nodes,
                                 "spares": spares, "on_create": str(script)}],
            "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 120.0}}
    path = root / "cluster.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def spare_standby_warm(client: ClusterClient) -> bool:
    """A healthy spare whose warm standby worker has finished warming up (its log says it is waiting)."""
    for n in client.nodes():
        if n["is_spare"] and n["state"] == "healthy" and n.get("work_dir"):
            log = Path(n["work_dir"]) / "standby-0.log"
            if log.exists() and "waiting" in log.read_text(errors="replace"):
                return True
    return False


class Narrator:
    def __init__(self, console: Console):
        self.console, self.t0, self.seen_event, self.told = console, time.monotonic(), 0, set()

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{time.monotonic() - self.t0:6.1f}s[/] {text}")

    def events(self, client: ClusterClient) -> list[dict]:
        new = client.events(since_id=self.seen_event)
        for e in new:
            self.seen_event = max(self.seen_event, e["id"])
            shown = e["kind"] in SHOWN_KINDS or (e["kind"] == "transition" and e["to_state"] in SHOWN_STATES)
            if shown and (e.get("node"), e["reason"]) not in self.told:  # one line per distinct message
                self.told.add((e.get("node"), e["reason"]))
                who = e.get("node") or (f"job {e['job']}" if e.get("job") else "cluster")
                self.say(f"[magenta]{who}[/]: {e['reason']}")
        return new


def run_demo(recipe: Path, run_dir: Path, *, nodes: int = 4, overrides: list[str] = (),
             recovery: str = "checkpointless", console: Console | None = None) -> dict:
    """Run the demo; returns the summary it printed. Raises if the job does not succeed."""
    console = console or Console()
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ["PHALANX_HOME"] = str(run_dir / "home")
    config = load_config(recipe, [f"run_dir={run_dir / 'train'}", *overrides])
    max_steps, interval = config.training.max_steps, config.checkpoint.interval
    fail_after = max_steps // 2
    say = Narrator(console)

    say.say(f"creating local cluster [bold]{CLUSTER}[/]: {nodes} worker nodes + 1 spare, one agent process each "
            f"(PHALANX_HOME={run_dir / 'home'})")
    create_cluster(write_cluster_spec(run_dir, nodes, 1), timeout_s=120)
    client, jobs = ClusterClient(CLUSTER), JobClient(CLUSTER)
    try:
        say.seen_event = max((e["id"] for e in client.events()), default=0)  # creation is summarized below
        spare = [n["name"] for n in client.nodes() if n["is_spare"]]
        say.say(f"cluster in service: {', '.join(n['name'] for n in client.nodes() if not n['is_spare'])} healthy, "
                f"{', '.join(spare)} standing by as spare")
        if recovery == "checkpointless":  # the spare's warm standby takes the failed rank: have it ready first
            say.say("waiting for the spare's warm standby worker (torch imported, one FSDP step run)")
            deadline = time.monotonic() + 90
            while not spare_standby_warm(client) and time.monotonic() < deadline:
                time.sleep(0.25)
        job = jobs.submit(config, nodes=nodes, auto_resume=True, max_retries=1, name="demo", recovery=recovery)
        say.say(f"job {job['id']} submitted: {recipe} on {nodes} nodes, auto-resume, {recovery} recovery, "
                f"{max_steps} steps, checkpoint every {interval} steps")

        killed_at, victim, shown_step = None, None, 0
        while True:
            info = jobs.describe(job["id"])
            say.events(client)
            step = info["last_step"] or 0
            if step >= shown_step + 10 or (step and not shown_step):
                shown_step = step
                say.say(f"step {step}/{max_steps} ({info['state']}, generation {info['generation']})")
            if killed_at is None and step >= fail_after and info["state"] == "running":
                victim = info["generations"][-1]["nodes"][1]  # rank 1's node: rank 0 writes the metrics
                say.say(f"[bold red]injecting a node failure[/]: kill-node {victim} (SIGKILL to its agent and "
                        f"workers) at step {step}")
                client.inject_fault(victim, "kill-node")
                killed_at = next(e["time"] for e in reversed(client.events(node=victim))
                                 if e["kind"] == "fault-injected")
            if info["state"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.25)
        say.events(client)
        if info["state"] != "succeeded":
            raise RuntimeError(f"the demo job {info['state']}: {info['reason']} (logs: phalanx job logs "
                               f"{job['id']} with PHALANX_HOME={run_dir / 'home'})")
        if len(info["generations"]) < 2:
            raise RuntimeError(f"the job finished (step {info['last_step']}) before the injected failure took "
                               f"effect, so there was no recovery to show; give it more steps "
                               f"(training.max_steps=...)")
        summary = summarize(info, client, config.run_dir, victim, killed_at)
        print_summary(console, summary)
        return summary
    finally:
        say.say("deleting the cluster")
        delete_cluster(CLUSTER, timeout_s=30)
        say.say("done: every agent and worker stopped")


def summarize(info: dict, client: ClusterClient, run_dir: Path, victim: str | None, killed_at: float | None) -> dict:
    gens = info["generations"]
    replaced = [(a, b) for a, b in zip(gens[0]["nodes"], gens[-1]["nodes"]) if a != b]
    summary = {"job": info["id"], "state": info["state"], "steps": info["last_step"],
               "generations": len(gens), "node_faults": info["node_faults"],
               "nodes_replaced": [f"{a} → {b}" for a, b in replaced],
               "wall_s": round(gens[-1]["ended_at"] - gens[0]["started_at"], 1), "metrics": str(run_dir / "metrics.jsonl")}
    if killed_at is not None:
        faulty = [e["time"] for e in client.events(node=victim) if e.get("to_state") == "faulty"]
        figures = recovery_figures(Path(run_dir) / "metrics.jsonl", killed_at)
        summary.update(failed_node=victim, fault_detected_s=round(faulty[0] - killed_at, 2) if faulty else None,
                       restarted_s=round(gens[1]["started_at"] - killed_at, 2), **figures.as_dict())
        refilled = [n["name"] for n in client.nodes() if n["is_spare"] and n["state"] == "healthy"]
        summary["spare_pool"] = refilled
        summary.update(checkpointless_figures(Path(run_dir) / "metrics.jsonl", killed_at, figures))
    return summary


def checkpointless_figures(metrics: Path, killed_at: float, figures) -> dict:
    """From the recovery events rank 0 logged: where the state came from, the survivors' stall (kill → their
    next committed step, minus one normal step) and the replacement's rejoin (its activation → that step)."""
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    restored = [e for e in events if e.get("event") == "state_restored"]
    generation = [e for e in events if e.get("event") == "generation"]
    if not restored:
        return {}
    next_step_at = killed_at + figures.first_step_after_s
    out = {"restored_from": restored[0]["source"], "restored_bytes": restored[0]["bytes"],
           "restored_s": restored[0]["seconds"], "restore_reason": restored[0].get("reason"),
           "survivor_stall_s": round(figures.first_step_after_s - figures.normal_step_s, 3)}
    started = generation[0].get("rejoin_started_at") if generation else None
    if started:
        out["rejoin_s"] = round(next_step_at - started, 3)
    return out


def print_summary(console: Console, s: dict) -> None:
    table = Table(title="Phalanx demo: what the failure cost", show_header=False)
    table.add_row("job", f"{s['job']} {s['state']} at step {s['steps']} after {s['generations']} generation(s)")
    table.add_row("wall time", f"{s['wall_s']} s")
    if "failed_node" in s:
        table.add_row("failure", f"node {s['failed_node']} SIGKILLed after step {s['last_step']}")
        table.add_row("fault detected", f"{s['fault_detected_s']} s after the kill")
        table.add_row("new generation", f"{s['restarted_s']} s after the kill (spare in service)")
        table.add_row("first step after the fault", f"{s['first_step_after_s']:.2f} s after the kill")
        if s.get("restored_from") in ("peer-memory", "buddy-snapshot"):
            table.add_row("recovery", f"checkpointless: survivors kept their processes; the replacement restored "
                                      f"{s['restored_bytes'] / 2**20:.1f} MiB from {s['restored_from']} in "
                                      f"{s['restored_s']:.2f} s, resuming at step {s['resumed_step']}")
            table.add_row("[bold]survivor stall[/]", f"{s['survivor_stall_s']:.2f} s (kill → next committed step, "
                                                    f"minus one normal step)")
            if "rejoin_s" in s:
                table.add_row("[bold]replacement rejoin[/]", f"{s['rejoin_s']:.2f} s (activated → first committed "
                                                            f"step)")
        else:
            why = f" ({s['restore_reason']})" if s.get("restore_reason") else ""
            table.add_row("resumed from", f"checkpoint at step {s['resumed_step']}{why}")
        table.add_row("[bold]steps lost (redone)[/]", str(s["steps_lost"]))
        table.add_row("time lost to the failure", f"{s['downtime_s']:.1f} s (normal step {s['normal_step_s']:.2f} s)")
    table.add_row("nodes replaced", ", ".join(s["nodes_replaced"]) or "none")
    if "spare_pool" in s:
        table.add_row("spare pool", ", ".join(s["spare_pool"]) or "refilling")
    table.add_row("metrics", s["metrics"])
    console.print(table)

"""`phalanx job ...` (typer + rich). Thin: parses arguments, calls `phalanx.control.client.jobs.JobClient`, prints.
Exit codes: 0 ok, 1 the operation failed, 2 bad input or a refusal (nothing started). While the controller
is down, `list` and `describe` show the last recorded jobs, with every state that may have changed since as
`unknown (controller down since …; last recorded running)` and a warning naming `phalanx cluster start`.
Imports no torch unless a training config is submitted.

    phalanx job submit CONFIG.yaml --nodes N [--auto-resume] [--max-retries K] [--name NAME] [key=value ...]
    phalanx job submit --nodes N [options] -- CMD ARGS...      any torch.distributed program (env:// rendezvous)
    phalanx job list | describe ID | logs ID [-f] [--rank R] | cancel ID
    phalanx job goodput ID [--json]      where the job's wall time went (the goodput ledger, from its run's files)
"""

from __future__ import annotations

import json
import sys
import time
from typing import Optional

import typer
from rich.table import Table

from phalanx.control.client.cli import _ago, _down_since, _fail, _first_line, _guard, _warn_offline, _when, err, out

job_app = typer.Typer(help="Run training jobs (and any torch.distributed program) on a cluster, with "
                           "auto-resume.", no_args_is_help=True)
ClusterOpt = typer.Option(None, "--cluster", help="cluster name (optional when only one exists)")
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def _client(cluster: str | None):
    from phalanx.control.client.jobs import JobClient

    return _guard(lambda: JobClient(cluster))


# the runtime's bad-input errors, looked up only among modules already imported: an error class whose module
# was never imported cannot have been raised, and importing them here would import torch for a `job list`
BAD_INPUT_ERRORS = (("phalanx.train.config", "ConfigError"), ("phalanx.data.errors", "DataError"),
                    ("phalanx.parallel.dims", "ParallelConfigError"), ("phalanx.models.hf", "HFFormatError"))


def _bad_input(e: Exception) -> bool:
    from phalanx.control.client.jobs import JobError

    loaded = [getattr(sys.modules.get(module), name, None) for module, name in BAD_INPUT_ERRORS]
    return isinstance(e, (JobError, *[c for c in loaded if isinstance(c, type)]))


def _job_guard(fn):
    """`_guard` plus the job errors: a refused job or a config that fails preflight is bad input (exit 2)."""
    try:
        return _guard(fn)
    except TimeoutError as e:
        _fail(str(e), 1)
    except Exception as e:  # typer.Exit from _guard is not bad input: re-raised as is
        if not _bad_input(e):
            raise
        _fail(str(e), 2)


def _state(j: dict) -> str:
    """A job's state; unknown when read offline and not final (it may have changed since)."""
    from phalanx.control.client.jobs import FINAL_STATES

    if "controller_down_since" not in j or j["state"] in FINAL_STATES:
        return j["state"]
    return f"unknown ({_down_since(j['controller_down_since'])}; last recorded {j['state']})"


@job_app.command("submit")
def submit(
    args: Optional[list[str]] = typer.Argument(None, help="CONFIG.yaml followed by key=value overrides, or "
                                                          "after `--` a command to run on every worker"),
    nodes: Optional[int] = typer.Option(None, "--nodes", "-N", help="nodes to run on (each runs its instance "
                                        "type's workers-per-node ranks); not for an elastic job"),
    auto_resume: bool = typer.Option(False, "--auto-resume", help="on a node fault (crash, lost heartbeat, "
                                     "failed health check, hang) replace the node and resume from the newest "
                                     "checkpoint"),
    max_retries: int = typer.Option(0, "--max-retries", min=0, help="restarts after an application error "
                                    "(non-zero exit with every node healthy)"),
    recovery: Optional[str] = typer.Option(None, "--recovery", help="restart (every process restarts from the "
                                           "newest checkpoint) or checkpointless (survivors keep running, the "
                                           "replacement restores from peers' memory; implies --auto-resume); "
                                           "default: the config's resilience.recovery"),
    straggler_factor: Optional[float] = typer.Option(None, "--straggler-factor", help="a rank whose compute per "
                                                     "step is above this × its peers' median is slow (default 2)"),
    straggler_steps: Optional[int] = typer.Option(None, "--straggler-steps", min=1, help="slow reports in a row "
                                                  "that make a rank a straggler (default 5)"),
    straggler_policy: Optional[str] = typer.Option(None, "--straggler-policy", help="report (an event) or "
                                                   "replace-node (its node replaced as a faulty one); default "
                                                   "report"),
    min_replicas: Optional[int] = typer.Option(None, "--min-replicas", min=1, help="elastic: the fewest "
                                               "data-parallel replicas to run with (sets elastic.min_replicas)"),
    max_replicas: Optional[int] = typer.Option(None, "--max-replicas", min=1, help="elastic: grow up to this many "
                                               "replicas (elastic.max_replicas)"),
    replica_step: Optional[int] = typer.Option(None, "--replica-step", min=1, help="elastic: allowed counts are "
                                               "min, min+step, ... (elastic.replica_step)"),
    stable_period: Optional[float] = typer.Option(None, "--stable-period", min=0, help="elastic: seconds between "
                                                  "two capacity-driven changes (elastic.stable_period_s)"),
    scale_up_delay: Optional[float] = typer.Option(None, "--scale-up-delay", min=0, help="elastic: seconds idle "
                                                   "nodes stay free before the job grows onto them"),
    priority: int = typer.Option(0, "--priority", help="a pending job of higher priority takes nodes from "
                                 "running elastic jobs (above their min_replicas)"),
    name: Optional[str] = typer.Option(None, "--name", help="job name (default: the run dir or the command)"),
    group: Optional[str] = typer.Option(None, "--group", help="instance group (needed with several)"),
    cluster: Optional[str] = ClusterOpt,
) -> None:
    """Submit a training config (validated before anything starts) or, after `--`, any command."""
    args = args or []
    if not args:
        _fail("give a training config (CONFIG.yaml [key=value ...]) or a command after `--`", 2)
    client = _client(cluster)
    common = dict(nodes=nodes, auto_resume=auto_resume, max_retries=max_retries, name=name, group=group,
                  recovery=recovery, straggler_factor=straggler_factor, straggler_steps=straggler_steps,
                  straggler_policy=straggler_policy, priority=priority)
    elastic = [f"elastic.{key}={value}" for key, value in (
        ("min_replicas", min_replicas), ("max_replicas", max_replicas), ("replica_step", replica_step),
        ("stable_period_s", stable_period), ("scale_up_delay_s", scale_up_delay)) if value is not None]
    if args[0].endswith(CONFIG_SUFFIXES):
        config, overrides = args[0], args[1:]
        stray = [a for a in overrides if "=" not in a]
        if stray:
            _fail(f"unexpected argument {stray[0]!r}: after the config only key=value overrides are allowed "
                  f"(a command goes after `--`)", 2)
        job = _job_guard(lambda: client.submit(config, overrides=[*overrides, *elastic], **common))
    else:
        if elastic:
            _fail("--min-replicas/--max-replicas need a training config: a command's replicas are unknown to "
                  "Phalanx", 2)
        job = _job_guard(lambda: client.submit(command=args, **common))
    for line in job.get("warnings", []):
        err.print(f"[yellow]warning:[/] {line}")
    size = (f"elastic {job['elastic']['min_replicas']}-{job['elastic']['max_replicas']} replicas of "
            f"{job['elastic']['nodes_per_replica']} node(s), starting with what is free, "
            if job.get("elastic") else "")
    out.print(f"submitted job {job['id']} ({job['name']}): {size}{job['nodes_requested']} nodes × "
              f"{job['workers_per_node']} workers = world size {job['world_size']}, auto-resume "
              f"{'on' if job['auto_resume'] else 'off'}, max-retries {job['max_retries']}, recovery "
              f"{job['recovery']}; state {job['state']}")


@job_app.command("scale")
def scale(
    job: str = typer.Argument(..., help="job id or name"),
    replicas: int = typer.Option(..., "--replicas", min=1, help="data-parallel replicas to run (one of the "
                                 "job's allowed sizes)"),
    cluster: Optional[str] = ClusterOpt,
) -> None:
    """Resize an elastic job in place: leaving replicas finish their step and exit, joiners restore from peers."""
    client = _client(cluster)
    j = _job_guard(lambda: client.scale(job, replicas))
    out.print(f"job {j['id']}: scale to {replicas} replicas requested (now {j['replicas']}); it changes at the "
              f"next step boundary, `phalanx job describe {j['id']}` shows the sizes")


@job_app.command("checkpoint")
def checkpoint(
    job: str = typer.Argument(..., help="job id or name"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="return once the checkpoint is committed"),
    timeout: float = typer.Option(300.0, "--timeout", min=1, help="seconds to wait for it"),
    cluster: Optional[str] = ClusterOpt,
) -> None:
    """Checkpoint a running training job now, between its intervals (before maintenance, a time limit, a test
    of something risky): its ranks save after the next step they all see the request in."""
    client = _client(cluster)
    r = _job_guard(lambda: client.checkpoint(job, wait=wait, timeout_s=timeout))
    if "saved" in r:
        out.print(f"job {r['job']}: checkpoint of step {(r['saved'] or {}).get('step')} committed")
    else:
        out.print(f"job {r['job']}: checkpoint requested at step {r['step']}; its ranks save after the next step "
                  f"they all see it in (`phalanx job describe {r['job']}` shows the last checkpoint)")


@job_app.command("list")
def list_jobs(cluster: Optional[str] = ClusterOpt, as_json: bool = typer.Option(False, "--json")) -> None:
    """Jobs like squeue: id, name, state, nodes, generation, attempts, step, time, nodes or reason."""
    client = _client(cluster)
    jobs = _job_guard(client.list)
    if client.offline_since is not None:
        _warn_offline(client.cluster.name, client.offline_since, "job states are")
    if as_json:
        out.print_json(json.dumps(jobs))
        return
    t = Table("JOBID", "NAME", "STATE", "NODES", "GEN", "ATTEMPTS", "STEP", "TIME", "NODELIST(REASON)")
    for j in jobs:
        where = ",".join(j["nodes"]) if j["state"] == "running" else f"({_first_line(j['reason'], 70)})"
        t.add_row(j["id"], j["name"], _state(j), str(j["nodes_requested"]), str(j["generation"]),
                  str(j["attempts"]), "-" if j["last_step"] is None else str(j["last_step"]),
                  _duration(j["created_at"], j["ended_at"]), where)
    out.print(t)


def _duration(start: float, end: float | None) -> str:
    s = int((end or time.time()) - start)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@job_app.command("describe")
def describe(job: str = typer.Argument(..., help="job id or name"), cluster: Optional[str] = ClusterOpt,
             as_json: bool = typer.Option(False, "--json")) -> None:
    """State and why, attempts, retries, generations (nodes, rendezvous, outcome), workers, events."""
    client = _client(cluster)
    info = _job_guard(lambda: client.describe(job))
    if client.offline_since is not None:
        _warn_offline(client.cluster.name, client.offline_since, "the job is shown")
    ledger, missing = _ledger(client, info)
    info["goodput"] = ledger.to_dict() if ledger is not None else {"error": missing}
    if as_json:
        out.print_json(json.dumps(info))
        return
    out.print(f"[bold]job {info['id']}[/] ({info['name']}, {info['kind']})  state [bold]{_state(info)}[/]  "
              f"last step {info['last_step'] if info['last_step'] is not None else '-'}")
    out.print(f"reason: {info['reason']}")
    out.print(f"{info['nodes_requested']} nodes × {info['workers_per_node']} workers (group {info['group_name']}); "
              f"auto-resume {'on' if info['auto_resume'] else 'off'}; attempts {info['attempts']}; retries "
              f"{info['retries']}/{info['max_retries']}; node faults {info['node_faults']}; submitted "
              f"{_ago(info['created_at'])}")
    e = info.get("elastic")
    if e:
        target = f", scale requested to {e['target']}" if e["target"] else ""
        out.print(f"elastic: {e['min_replicas']}-{e['max_replicas']} replicas (valid {e['valid']}) of "
                  f"{e['nodes_per_replica']} node(s), now {info['replicas']}{target}; priority {info['priority']}")
    out.print(f"command: {' '.join(info['argv'])}  (cwd {info['cwd']})")
    saved = info.get("last_checkpoint")
    newest = (f" (newest: step {saved['step']}, {_ago(saved['time'])}{', asked for' if saved.get('requested') else ''})"
              if saved else "")
    out.print(f"checkpoints: {info['checkpoint_dir']}{newest}  logs: {info['log_dir']}")
    t = Table("gen", "size", "nodes", "rendezvous", "started", "steps", "outcome", "why it ended", title="generations")
    for g in info["generations"]:
        steps = f"{g['start_step']}→{g['last_step']}" if g["start_step"] is not None else "-"
        size = f"{len(g['nodes']) // e['nodes_per_replica']} replicas" if e else f"{len(g['nodes'])} nodes"
        t.add_row(str(g["generation"]), size, ",".join(g["nodes"]), f"{g['master_addr']}:{g['master_port']}",
                  _when(g["started_at"]), steps, g["outcome"] or ("stopping" if g["stop_at"] else "running"),
                  _first_line(g["end_reason"], 80))
    out.print(t)
    w = Table("gen", "rank", "node", "pid", "state", "exit", "step", title="workers")
    for r in info["workers"]:
        exit_ = r["detail"] or "-"
        if r["hang"]:
            exit_ += f" (hung: {r['hang']})"
        elif r["stopped"]:
            exit_ += " (stopped)"
        w.add_row(str(r["generation"]), str(r["rank"]), r["node"], str(r["pid"] or "-"), r["state"], exit_,
                  "-" if r["step"] is None else str(r["step"]))
    out.print(w)
    e = Table("time", "kind", "transition", "reason", title="events")
    for ev in info["events"][-25:]:
        move = f"{ev['from_state'] or '∅'} → {ev['to_state']}" if ev["to_state"] else ""
        e.add_row(_when(ev["time"]), ev["kind"], move, ev["reason"])
    out.print(e)
    out.print(_goodput_line(ledger) if ledger is not None else f"goodput: unavailable ({missing})")


def _ledger(client, info: dict):
    """(the job's goodput ledger, None) or (None, why not: the missing run file, named)."""
    try:
        return client.goodput(info["id"], info), None
    except OSError as e:  # RunFilesMissing (the message names the file), or a file that cannot be read
        return None, str(e) if isinstance(e, FileNotFoundError) else f"{type(e).__name__}: {e}"


def _goodput_line(ledger) -> str:
    from phalanx.observability.goodput import CATEGORIES

    parts = ", ".join(f"{c} {ledger.seconds[c]:.1f} s" for c in CATEGORIES[1:] if ledger.seconds[c] >= 0.05)
    return (f"goodput: [bold]{ledger.goodput:.1%}[/] (productive {ledger.seconds['productive']:.1f} s of "
            f"{ledger.wall:.1f} s wall" + (f"; {parts}" if parts else "") + ")")


@job_app.command("goodput")
def goodput(job: str = typer.Argument(..., help="job id or name"), cluster: Optional[str] = ClusterOpt,
            as_json: bool = typer.Option(False, "--json")) -> None:
    """Where the job's wall time since submission went, by category, and the goodput ratio (productive / wall),
    computed from its run's events.jsonl and metrics.jsonl (docs/observability.md)."""
    from phalanx.observability.goodput import CATEGORIES

    client = _client(cluster)
    info = _job_guard(lambda: client.describe(job))
    ledger, missing = _ledger(client, info)
    if ledger is None:
        _fail(f"job {info['id']}: no goodput ledger: {missing}", 1)
    if as_json:
        out.print_json(json.dumps({"job": info["id"], **ledger.to_dict()}))
        return
    t = Table("category", "seconds", "share", title=f"job {info['id']} ({info['name']}, {_state(info)})")
    for c in CATEGORIES:
        t.add_row(c, f"{ledger.seconds[c]:.2f}", f"{ledger.share(c):.1%}")
    out.print(t)
    out.print(f"goodput [bold]{ledger.goodput:.1%}[/] (productive / wall); wall {ledger.wall:.2f} s since submission"
              + ("" if info["ended_at"] else " (the job is still active: up to now)"))


@job_app.command("logs")
def logs(job: str = typer.Argument(..., help="job id or name"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job finishes"),
         rank: Optional[int] = typer.Option(None, "--rank", help="one rank only (default: all, prefixed)"),
         cluster: Optional[str] = ClusterOpt) -> None:
    """Every generation's output of the job's workers (one file per rank, appended across restarts)."""
    client = _client(cluster)
    if follow:
        info = _job_guard(lambda: client.follow(job, rank, write=lambda line: print(line, flush=True)))
        err.print(f"job {info['id']} {info['state']}: {info['reason']}")
    else:
        print(_job_guard(lambda: client.logs(job, rank)), end="")


@job_app.command("cancel")
def cancel(job: str = typer.Argument(..., help="job id or name"), cluster: Optional[str] = ClusterOpt,
           no_wait: bool = typer.Option(False, "--no-wait", help="return before the workers are stopped")) -> None:
    """Cancel a job; returns once its workers are stopped."""
    info = _job_guard(lambda: _client(cluster).cancel(job, wait=not no_wait))
    out.print(f"job {info['id']} cancelled" + ("" if no_wait else "; its workers are stopped"))

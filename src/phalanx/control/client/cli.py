"""`phalanx cluster ...` and `phalanx fault ...` (typer + rich). Thin: parses arguments, calls
`phalanx.control.client.cluster`, prints. Exit codes: 0 ok, 1 the operation failed, 2 bad input or a refusal
(nothing started).

Output that is not a terminal (a pipe, a file) is not cut at 80 columns: tables keep their whole width.
While the controller is down, what is shown comes from SQLite as last recorded: states that could have
changed since are shown as unknown, with when the controller last recorded anything and the command that
restarts it. Imports no torch (nor anything that does): these commands must start fast.
"""

from __future__ import annotations

import json
import os
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.table import Table

PIPE_WIDTH = 4096  # columns when the output is not a terminal (COLUMNS, when set, wins)


class WideConsole(Console):
    """rich's Console, except that it is wide when it does not write to a terminal: rich then assumes 80
    columns, which cut `phalanx job list | cat` (or a redirect) mid-name."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self._width is None and not self.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
            return ConsoleDimensions(PIPE_WIDTH, size.height)
        return size

    @size.setter
    def size(self, new_size) -> None:
        Console.size.fset(self, new_size)


cluster_app = typer.Typer(help="Create and operate a self-healing cluster (backend local; hosts: agents join "
                                "from other hosts; slurm: Slurm allocates the nodes).", no_args_is_help=True)
fault_app = typer.Typer(help="Inject faults for tests and drills (they take the real fault paths).",
                        no_args_is_help=True)
out = WideConsole(highlight=False)
err = WideConsole(stderr=True, highlight=False)
NameArg = typer.Argument(None, help="cluster name (optional when only one cluster exists)")


def _fail(message: str, code: int = 1):
    err.print(f"[red]error:[/] {escape(message)}", markup=True)  # a message's own [brackets] are text
    raise typer.Exit(code)


def _guard(fn):
    """Run an operation, turning the control plane's errors into one clear line and an exit code."""
    from phalanx.control.client.cluster import ClusterError, ClusterRefused
    from phalanx.control.http import ApiError, ControllerUnreachable
    from phalanx.control.spec import SpecError

    try:
        return fn()
    except (SpecError, ClusterRefused) as e:
        _fail(str(e), 2)
    except (ClusterError, ControllerUnreachable) as e:
        _fail(str(e), 1)
    except ApiError as e:
        _fail(f"controller refused: {e.detail} (HTTP {e.status})", 2 if e.status in (404, 409, 422) else 1)


def _ago(t: float | None) -> str:
    return "-" if t is None else f"{time.time() - t:.1f}s ago"


def _first_line(text: str | None, width: int) -> str:
    """The first line of a reason, at most `width` characters ("" for none: a running generation has none)."""
    return (text or "").partition("\n")[0][:width]


def _when(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


FINAL_CLUSTER_STATUSES = ("failed", "deleted")


def _down_since(t: float | None) -> str:
    """'controller down since 12:03:04' (the last time it recorded anything) for offline views."""
    if t is None:
        return "controller down"
    day = "" if time.localtime(t)[:3] == time.localtime()[:3] else time.strftime("%Y-%m-%d ", time.localtime(t))
    return f"controller down since {day}{time.strftime('%H:%M:%S', time.localtime(t))}"


def _warn_offline(cluster: str, since: float | None, what: str) -> None:
    """One line on stderr: what follows is the last recorded state, not a live one."""
    err.print(f"[yellow]warning:[/] {_down_since(since)} (cluster {cluster}): {what} as last recorded, not live; "
              f"`phalanx cluster start {cluster}` restarts it", markup=True)


@cluster_app.command("create")
def create(
    file: Path = typer.Option(..., "--file", "-f", help="cluster spec (YAML or JSON)"),
    timeout: float = typer.Option(300.0, help="seconds to wait for every node to be healthy"),
) -> None:
    """Start the controller and the nodes; return when the cluster is in service."""
    from phalanx.control.client.cluster import create_cluster
    from phalanx.control.state.paths import ClusterPaths

    def show(info: dict) -> None:
        out.print(f"cluster {info['name']}: {info['status']}")
        if info["backend"] == "hosts" and info["status"] == "creating":
            for g in info["groups"]:  # the nodes wait for agents started on their hosts
                out.print(f"waiting for {g['count'] + g['spares']} agents of group {g['name']}; on each host "
                          f"(with a copy of the token file):\n  phalanx agent --controller {info['controller']['api']} "
                          f"--token-file {ClusterPaths.for_name(info['name']).token} --group {g['name']}", soft_wrap=True)
        if info["backend"] == "slurm" and info["status"] == "creating":
            out.print("Slurm allocates the nodes and starts their agents (`squeue --name "
                      f"phalanx-{info['name']}` shows the allocation)", soft_wrap=True)

    # CreateFailed (a ClusterError) → exit 1 with the failed node, its reason and the script's output tail
    info = _guard(lambda: create_cluster(file, timeout_s=timeout, on_status=show))
    _print_describe(info)


@cluster_app.command("up")
def up(
    file: Path = typer.Option(..., "--file", "-f", help="cluster spec (YAML or JSON); its backend becomes slurm"),
    slurm: bool = typer.Option(False, "--slurm", help="inside a Slurm allocation (a batch script, salloc): its "
                                                     "nodes are the cluster's"),
    run: Optional[Path] = typer.Option(None, "--run", help="a training config: submit it with auto-resume, wait for "
                                                           "it, delete the cluster, exit 0 / 3 (do not requeue) / "
                                                           "75 (requeued)"),
    nodes: Optional[int] = typer.Option(None, "--nodes", "-N", help="with --run: nodes for the job (default: the "
                                                                     "group's count)"),
    recovery: Optional[str] = typer.Option(None, "--recovery", help="with --run: restart or checkpointless"),
    timeout: float = typer.Option(600.0, help="seconds to wait for every node to be healthy"),
) -> None:
    """Bring a cluster up in the Slurm allocation this runs in (`sbatch recipes/slurm/run.sbatch`)."""
    from phalanx.control.backends.slurm_commands import SlurmError
    from phalanx.control.client.slurm_up import cluster_up

    if not slurm:
        _fail("cluster up needs --slurm (inside a Slurm allocation); elsewhere use `phalanx cluster create -f SPEC`", 2)

    def guarded() -> int:
        try:
            return cluster_up(file, run=run, nodes=nodes, recovery=recovery, timeout_s=timeout,
                              say=lambda line: out.print(line, soft_wrap=True))
        except SlurmError as e:
            _fail(str(e), 1)

    raise typer.Exit(_guard(guarded))


@cluster_app.command("describe")
def describe(name: Optional[str] = NameArg, as_json: bool = typer.Option(False, "--json")) -> None:
    """Status, instance groups (members, spares), controller and rendezvous store."""
    from phalanx.control.client.cluster import ClusterClient

    info = _guard(lambda: ClusterClient(name).describe())
    if as_json:
        out.print_json(json.dumps(info))
    else:
        _print_describe(info)


def _status(info: dict) -> str:
    """The cluster's status; unknown while its controller is down (the recorded one may be stale)."""
    c = info["controller"]
    if c.get("running", True) or info["status"] in FINAL_CLUSTER_STATUSES:
        return info["status"]
    return f"unknown ({_down_since(c.get('down_since'))}; last recorded {info['status']})"


def _print_describe(info: dict) -> None:
    c = info["controller"]
    running = c.get("running", True)
    out.print(f"[bold]{info['name']}[/]  status [bold]{_status(info)}[/] ({info['status_reason']})  "
              f"backend {info['backend']}  node_recovery {info['node_recovery']}")
    out.print(f"controller: pid {c['pid']} {'running' if running else '[red]not running[/]'}  api {c['api']}  "
              f"rendezvous store {info['store']['addr']}")
    if running and c["api"]:
        out.print(f"dashboard: {c['api']}/dashboard (sign in with the cluster token: `phalanx cluster dashboard`)")
    if not running and info["status"] not in FINAL_CLUSTER_STATUSES:
        out.print(f"[red]{_down_since(c.get('down_since'))}[/]: groups below as last recorded; "
                  f"`phalanx cluster start {info['name']}` restarts it")
    t = Table("group", "instance type", "members healthy", "spares ready", "on_create")
    for g in info["groups"]:
        t.add_row(g["name"], g["instance_type"], f"{g['members_healthy']}/{g['count']}",
                  f"{g['spares_ready']}/{g['spares']}", g["on_create"] or "-")
    out.print(t)


@cluster_app.command("dashboard")
def dashboard(name: Optional[str] = NameArg,
              show_token: bool = typer.Option(False, "--token", help="also print the token to paste into its sign-in")
              ) -> None:
    """The live web dashboard's address (the controller serves it) and where its sign-in token is."""
    from phalanx.control.client.cluster import ClusterClient

    client = _guard(lambda: ClusterClient(name))
    out.print(f"{_guard(client.url)}/dashboard", soft_wrap=True)
    out.print(f"sign in with the cluster token, in {client.paths.token} (readable by you only)"
              + (f":\n{client.token}" if show_token else "; `--token` prints it"), soft_wrap=True)


@cluster_app.command("list-nodes")
def list_nodes(name: Optional[str] = NameArg, all_nodes: bool = typer.Option(False, "--all", help="include terminated"),
               as_json: bool = typer.Option(False, "--json")) -> None:
    """Name, group, role, state, health, job, agent handle and last heartbeat of every node."""
    from phalanx.control.client.cluster import ClusterClient

    client = _guard(lambda: ClusterClient(name))
    nodes = _guard(client.nodes)
    if client.offline_since is not None:
        _warn_offline(client.name, client.offline_since, "node states and heartbeats are")
    if not all_nodes:
        nodes = [n for n in nodes if n["state"] != "terminated"]
    if as_json:
        out.print_json(json.dumps(nodes))
        return
    t = Table("node", "group", "role", "state", "health", "job", "agent", "last heartbeat", "reason")
    for n in nodes:
        t.add_row(n["name"], n["group"], "spare" if n["is_spare"] else "member", n["state"], _health(n["health"]),
                  n["job"] or "-", str(n["handle"] or "-"), _ago(n["last_heartbeat"]),
                  _first_line(n["reason"], 60))
    out.print(t)


def _health(h: dict | None) -> str:
    if not h:
        return "-"
    failed = [c["name"] for c in h["checks"] if c["status"] == "fail"]
    return "ok" if not failed else "FAIL " + ",".join(failed)


@cluster_app.command("events")
def events(name: Optional[str] = NameArg, node: Optional[str] = typer.Option(None, help="only this node"),
           limit: int = typer.Option(50, help="the last N events"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """State transitions, faults, promotions and controller restarts, oldest first, each with its reason."""
    from phalanx.control.client.cluster import ClusterClient

    rows = _guard(lambda: ClusterClient(name).events(node=node, limit=limit))
    if as_json:
        out.print_json(json.dumps(rows))
        return
    t = Table("time", "node", "kind", "transition", "reason")
    for e in rows:
        move = f"{e['from_state'] or '∅'} → {e['to_state']}" if e["to_state"] else ""
        t.add_row(_when(e["time"]), e["node"] or "-", e["kind"], move, e["reason"])
    out.print(t)


@cluster_app.command("delete")
def delete(name: Optional[str] = NameArg,
           keep_files: bool = typer.Option(False, "--keep-files",
                                           help="keep the cluster dir (logs, state.db)")) -> None:
    """Stop every node and the controller (nothing is left running); remove the cluster dir."""
    from phalanx.control.client.cluster import delete_cluster

    info = _guard(lambda: delete_cluster(name, keep_files=keep_files))
    out.print(f"cluster {info['name']} deleted" + (" (files kept)" if keep_files else ""))


@cluster_app.command("scale")
def scale(group: str = typer.Argument(..., help="instance group to resize"),
          count: int = typer.Option(..., "--count", min=0, help="member nodes the group should have"),
          name: Optional[str] = typer.Option(None, "--cluster", help="cluster name (optional when only one "
                                             "exists)")) -> None:
    """Grow or shrink an instance group: new members are provisioned (elastic jobs grow onto them), idle
    members beyond the count are retired."""
    from phalanx.control.client.cluster import ClusterClient

    reply = _guard(lambda: ClusterClient(name).call("POST", f"/v1/groups/{group}/scale", {"count": count}))
    out.print(f"group {reply['group']}: {reply['before']} → {reply['count']} members; {reply['detail']}")


@cluster_app.command("start")
def start(name: Optional[str] = NameArg) -> None:
    """Start a stopped controller; it rebuilds its view from SQLite and the agents' heartbeats."""
    from phalanx.control.client.cluster import start_controller

    _print_describe(_guard(lambda: start_controller(name)))


@cluster_app.command("stop")
def stop(name: Optional[str] = NameArg) -> None:
    """Stop only the controller; nodes keep running (`cluster start` brings it back)."""
    from phalanx.control.client.cluster import stop_controller

    pid = _guard(lambda: stop_controller(name))
    out.print(f"controller pid {pid} stopped; nodes keep running")


@cluster_app.command("list")
def list_clusters_command() -> None:
    """Clusters under PHALANX_HOME and their status."""
    from phalanx.control.client.cluster import ClusterClient
    from phalanx.control.state.paths import list_clusters, phalanx_home

    names = list_clusters()
    if not names:
        out.print(f"no clusters under {phalanx_home()}; create one with `phalanx cluster create -f SPEC`")
        return
    t = Table("cluster", "status", "controller")
    for name in names:
        info = _guard(lambda: ClusterClient(name).describe())
        c = info["controller"]
        if c["running"]:
            controller = "running"
        elif info["status"] in FINAL_CLUSTER_STATUSES:
            controller = "not running"
        else:
            controller = f"not running: {_down_since(c.get('down_since'))} (`phalanx cluster start {name}`)"
        t.add_row(name, _status(info), controller)
    out.print(t)


class FaultKind(str, Enum):
    kill_node = "kill-node"
    fail_health = "fail-health"
    freeze_node = "freeze-node"
    kill_worker = "kill-worker"
    hang_worker = "hang-worker"
    gpu_xid = "gpu-xid"


@fault_app.command("inject")
def inject(node: str = typer.Option(..., "--node", help="node name (see `cluster list-nodes`)"),
           kind: FaultKind = typer.Option(..., "--kind", help="kill-node: SIGKILL the node's processes; "
                                          "fail-health: the agent reports a failing check; freeze-node: SIGSTOP "
                                          "the agent (heartbeats stop); kill-worker: SIGKILL one job worker; "
                                          "hang-worker: SIGSTOP one job worker (its progress stops); gpu-xid: "
                                          "the node's GPU check reports an XID (--xid)"),
           rank: Optional[int] = typer.Option(None, "--rank", help="worker faults: the rank (default: the "
                                              "node's lowest running rank)"),
           xid: Optional[int] = typer.Option(None, "--xid", help="gpu-xid: the XID (13, 31, 43, …: the job "
                                             "restarts on the same nodes; 48, 79, …: the node is replaced)"),
           cluster: Optional[str] = typer.Option(None, help="cluster name (optional when only one exists)")) -> None:
    """Inject a fault into a node; the controller detects and handles it like a real one."""
    from phalanx.control.client.cluster import ClusterClient

    if kind is FaultKind.gpu_xid and xid is None:
        _fail("--xid is required with --kind gpu-xid (e.g. --xid 13: the job restarts on the same nodes; "
              "--xid 79: the node is replaced)", 2)
    if kind is not FaultKind.gpu_xid and xid is not None:
        _fail(f"--xid goes with --kind gpu-xid only, not --kind {kind.value}; drop --xid", 2)
    if rank is not None and kind not in (FaultKind.kill_worker, FaultKind.hang_worker):
        _fail(f"--rank goes with --kind kill-worker or hang-worker only, not --kind {kind.value}; drop --rank", 2)
    reply = _guard(lambda: ClusterClient(cluster).inject_fault(node, kind.value, rank=rank, xid=xid))
    out.print(f"{node}: {reply['kind']} — {reply['detail']}")


def observe(cluster: Optional[str] = typer.Option(None, "--cluster", help="cluster name (optional when only one "
                                                  "exists)"),
            port: int = typer.Option(9090, "--port", help="Prometheus listens on 127.0.0.1:PORT"),
            interval: float = typer.Option(2.0, "--interval", help="scrape interval, seconds"),
            foreground: bool = typer.Option(False, "--foreground/--detach",
                                            help="run Prometheus until Ctrl-C, or detached (the default) until "
                                                 "`phalanx observe --stop` or `cluster delete`"),
            stop: bool = typer.Option(False, "--stop", help="stop the cluster's Prometheus")) -> None:
    """Start Prometheus (the `prometheus` binary) scraping the cluster's controller; prints its URL.
    Dashboards: import deploy/grafana/phalanx.json into Grafana with this Prometheus as its data source."""
    from phalanx.control.client.observe import start_observer, stop_observer

    if stop:
        pid = _guard(lambda: stop_observer(cluster))
        out.print(f"Prometheus pid {pid} stopped" if pid else "no Prometheus was running for this cluster")
        return
    if interval <= 0:
        _fail(f"--interval {interval:g}: give a positive number of seconds (e.g. 2)", 2)
    started = _guard(lambda: start_observer(cluster, port=port, interval_s=interval, detach=not foreground))
    if not foreground:
        again = " (already running)" if started.get("already_running") else ""
        out.print(f"Prometheus{again}: {started['url']}  (pid {started['pid']}, scraping every {interval:g} s; "
                  f"config {started['config']}; `phalanx observe --stop` stops it)")
        return
    out.print(f"Prometheus: http://127.0.0.1:{port}  (pid {started.pid}; Ctrl-C stops it)")
    try:
        started.wait()
    except KeyboardInterrupt:
        started.terminate()
        started.wait(timeout=15)
    if started.returncode not in (0, -15, None):
        _fail(f"prometheus exited with code {started.returncode}", 1)

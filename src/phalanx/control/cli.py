"""`phalanx cluster ...` and `phalanx fault ...` (typer + rich). Thin: parses arguments, calls
`phalanx.control.cluster`, prints. Exit codes: 0 ok, 1 the operation failed, 2 bad input (nothing started).
"""

from __future__ import annotations

import json
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

cluster_app = typer.Typer(help="Create and operate a self-healing cluster (local backend).", no_args_is_help=True)
fault_app = typer.Typer(help="Inject faults for tests and drills (they take the real fault paths).",
                        no_args_is_help=True)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)
NameArg = typer.Argument(None, help="cluster name (optional when only one cluster exists)")


def _fail(message: str, code: int = 1):
    err.print(f"[red]error:[/] {message}", markup=True)
    raise typer.Exit(code)


def _guard(fn):
    """Run an operation, turning the control plane's errors into one clear line and an exit code."""
    from phalanx.control.cluster import ClusterError
    from phalanx.control.http import ApiError, ControllerUnreachable
    from phalanx.control.spec import SpecError

    try:
        return fn()
    except SpecError as e:
        _fail(str(e), 2)
    except (ClusterError, ControllerUnreachable) as e:
        _fail(str(e), 1)
    except ApiError as e:
        _fail(f"controller refused: {e.detail} (HTTP {e.status})", 2 if e.status in (404, 409, 422) else 1)


def _ago(t: float | None) -> str:
    return "-" if t is None else f"{time.time() - t:.1f}s ago"


def _when(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


@cluster_app.command("create")
def create(
    file: Path = typer.Option(..., "--file", "-f", help="cluster spec (YAML or JSON)"),
    timeout: float = typer.Option(300.0, help="seconds to wait for every node to be healthy"),
) -> None:
    """Start the controller and the nodes; return when the cluster is in service."""
    from phalanx.control.cluster import create_cluster

    def show(info: dict) -> None:
        out.print(f"cluster {info['name']}: {info['status']}")

    # CreateFailed (a ClusterError) → exit 1 with the failed node, its reason and the script's output tail
    info = _guard(lambda: create_cluster(file, timeout_s=timeout, on_status=show))
    _print_describe(info)


@cluster_app.command("describe")
def describe(name: Optional[str] = NameArg, as_json: bool = typer.Option(False, "--json")) -> None:
    """Status, instance groups (members, spares), controller and rendezvous store."""
    from phalanx.control.cluster import ClusterClient

    info = _guard(lambda: ClusterClient(name).describe())
    if as_json:
        out.print_json(json.dumps(info))
    else:
        _print_describe(info)


def _print_describe(info: dict) -> None:
    c = info["controller"]
    running = c.get("running", True)
    out.print(f"[bold]{info['name']}[/]  status [bold]{info['status']}[/] ({info['status_reason']})  "
              f"backend {info['backend']}  node_recovery {info['node_recovery']}")
    out.print(f"controller: pid {c['pid']} {'running' if running else '[red]not running[/]'}  api {c['api']}  "
              f"rendezvous store {info['store']['addr']}")
    t = Table("group", "instance type", "members healthy", "spares ready", "on_create")
    for g in info["groups"]:
        t.add_row(g["name"], g["instance_type"], f"{g['members_healthy']}/{g['count']}",
                  f"{g['spares_ready']}/{g['spares']}", g["on_create"] or "-")
    out.print(t)


@cluster_app.command("list-nodes")
def list_nodes(name: Optional[str] = NameArg, all_nodes: bool = typer.Option(False, "--all", help="include terminated"),
               as_json: bool = typer.Option(False, "--json")) -> None:
    """Name, group, role, state, health, job, pid and last heartbeat of every node."""
    from phalanx.control.cluster import ClusterClient

    nodes = _guard(lambda: ClusterClient(name).nodes())
    if not all_nodes:
        nodes = [n for n in nodes if n["state"] != "terminated"]
    if as_json:
        out.print_json(json.dumps(nodes))
        return
    t = Table("node", "group", "role", "state", "health", "job", "pid", "last heartbeat", "reason")
    for n in nodes:
        t.add_row(n["name"], n["group"], "spare" if n["is_spare"] else "member", n["state"], _health(n["health"]),
                  n["job"] or "-", str(n["pid"] or "-"), _ago(n["last_heartbeat"]),
                  (n["reason"] or "").splitlines()[0][:60])
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
    from phalanx.control.cluster import ClusterClient

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
    from phalanx.control.cluster import delete_cluster

    info = _guard(lambda: delete_cluster(name, keep_files=keep_files))
    out.print(f"cluster {info['name']} deleted" + (" (files kept)" if keep_files else ""))


@cluster_app.command("start")
def start(name: Optional[str] = NameArg) -> None:
    """Start a stopped controller; it rebuilds its view from SQLite and the agents' heartbeats."""
    from phalanx.control.cluster import start_controller

    _print_describe(_guard(lambda: start_controller(name)))


@cluster_app.command("stop")
def stop(name: Optional[str] = NameArg) -> None:
    """Stop only the controller; nodes keep running (`cluster start` brings it back)."""
    from phalanx.control.cluster import stop_controller

    pid = _guard(lambda: stop_controller(name))
    out.print(f"controller pid {pid} stopped; nodes keep running")


@cluster_app.command("list")
def list_clusters_command() -> None:
    """Clusters under PHALANX_HOME and their status."""
    from phalanx.control.cluster import ClusterClient
    from phalanx.control.paths import list_clusters

    t = Table("cluster", "status", "controller")
    for name in list_clusters():
        info = _guard(lambda: ClusterClient(name).describe())
        t.add_row(name, info["status"], "running" if info["controller"]["running"] else "not running")
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
    from phalanx.control.cluster import ClusterClient

    reply = _guard(lambda: ClusterClient(cluster).inject_fault(node, kind.value, rank=rank, xid=xid))
    out.print(f"{node}: {reply['kind']} — {reply['detail']}")

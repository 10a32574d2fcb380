"""The Python API of cluster operations; the `phalanx cluster` CLI is a thin layer over it.

    create_cluster(spec_path)      validate, lay out the cluster dir, start the controller detached, wait
                                   until every node is healthy (or raise CreateFailed naming the node, the
                                   reason and the lifecycle script's output tail; nothing is left running)
    start_controller(name)         restart a stopped controller (nodes were left running)
    stop_controller(name)          stop only the controller
    delete_cluster(name)           stop every node and the controller (and its Prometheus, `observe.py`),
                                   prove nothing is left, remove the dir
    ClusterClient(name)            describe / nodes / events / inject_fault over the HTTP API
                                   (jobs: `phalanx.control.client.jobs.JobClient`)

Talks to a running controller only over HTTP (with the token); reads SQLite directly only to describe a
cluster whose controller is not running and to find what to stop when the controller is gone. Such a read
is the last *recorded* state, not a live one: `ClusterClient.offline_since` says when the controller last
recorded anything (None after a live read), and the CLI shows non-final states as unknown.

Errors: `ClusterRefused` for a request refused before anything started (an unknown or ambiguous cluster
name, a duplicate name, an API port in use: bad input, exit 2 in the CLI); `ClusterError` for an operation
that failed (exit 1). The cluster dir is private: mode 0700, its files 0600, and the controller starts with
umask 077 (so do the agents, lifecycle scripts and workers it starts).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from phalanx.control.backends.local import CONTROLLER_MODULE, process_running
from phalanx.control.http import ApiError, ControllerUnreachable, request_json
from phalanx.control.state.paths import (PRIVATE_UMASK, ClusterPaths, list_clusters, open_private_log, phalanx_home,
                                   write_private)
from phalanx.control.spec import ClusterSpec, SpecError, heartbeat_load_warning, load_spec
from phalanx.control.state.describe import describe
from phalanx.control.state.store import ClusterStatus, NodeState, Store, open_existing



class ClusterError(RuntimeError):
    """An operation on a cluster that cannot be done (the message says why and what to do)."""


class ClusterRefused(ClusterError):
    """A request refused before anything started: bad input (an unknown, ambiguous or duplicate cluster name,
    an API port in use). The CLI exits 2."""


class CreateFailed(ClusterError):
    def __init__(self, message: str, node: str | None = None):
        super().__init__(message)
        self.node = node


def resolve_name(name: str | None) -> str:
    if name:
        if not ClusterPaths.for_name(name).db.exists():
            known = ", ".join(list_clusters()) or "none"
            raise ClusterRefused(f"no cluster named {name!r} under {phalanx_home()} (known: {known}); "
                                 f"`phalanx cluster list` shows them")
        return name
    known = list_clusters()
    if len(known) == 1:
        return known[0]
    if not known:
        raise ClusterRefused(f"no clusters under {phalanx_home()}; create one with `phalanx cluster create -f SPEC`")
    raise ClusterRefused(f"several clusters ({', '.join(known)}); name one")


def controller_pid(paths: ClusterPaths) -> int | None:
    """The pid of this cluster's running controller, or None."""
    try:
        pid = int(paths.pid_file.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return pid if process_running(pid, str(paths.root)) else None


class ClusterClient:
    def __init__(self, name: str | None = None, *, timeout_s: float = 5.0):
        self.name = resolve_name(name)
        self.paths = ClusterPaths.for_name(self.name)
        self.token = self.paths.read_token()
        self.timeout_s = timeout_s
        self.offline_since: float | None = None  # set by a read served from SQLite: the controller's last record

    def url(self) -> str:
        ep = self.paths.read_endpoint()
        if ep is None or controller_pid(self.paths) is None:
            raise ControllerUnreachable(f"the controller of cluster {self.name} is not running "
                                        f"(`phalanx cluster start {self.name}` restarts it)")
        return f"http://{ep['connect_host']}:{ep['api_port']}"

    def call(self, method: str, path: str, body: dict | None = None):
        return request_json(method, self.url() + path, self.token, body, timeout=self.timeout_s)

    def _read_store(self, read):
        """The read-only view straight from SQLite, for when the controller is not running. Sets
        `offline_since`: the last time the controller recorded anything (a heartbeat, an event)."""
        store = open_existing(self.paths.db)
        try:
            self.offline_since = last_recorded(store)
            return read(store)
        finally:
            store.close()

    def describe(self) -> dict:
        """From the controller; from SQLite when it is down: then `controller.running` is False and
        `controller.down_since` the last time it recorded anything (the status is the last recorded)."""
        try:
            info = self.call("GET", "/v1/cluster")
            info["controller"]["running"] = True
            self.offline_since = None
        except ControllerUnreachable:
            info = self._read_store(describe)
            info["controller"]["running"] = False
            info["controller"]["down_since"] = self.offline_since
        return info

    def nodes(self) -> list[dict]:
        """From the controller; from SQLite when it is down (then heartbeats are as last recorded)."""
        try:
            nodes = self.call("GET", "/v1/nodes")
            self.offline_since = None
            return nodes
        except ControllerUnreachable:
            return self._read_store(lambda s: [n.public() for n in s.nodes()])

    def events(self, *, since_id: int = 0, node: str | None = None, limit: int | None = None) -> list[dict]:
        """The event history (from SQLite directly when the controller is down)."""
        query = f"?since_id={since_id}" + (f"&node={node}" if node else "") + (f"&limit={limit}" if limit else "")
        try:
            rows = self.call("GET", "/v1/events" + query)
            self.offline_since = None
            return rows
        except ControllerUnreachable:
            return self._read_store(lambda s: s.events(since_id=since_id, node=node, limit=limit))

    def inject_fault(self, node: str, kind: str, *, rank: int | None = None, xid: int | None = None) -> dict:
        """kill-node | fail-health | freeze-node | kill-worker | hang-worker (`rank`: which worker) | gpu-xid
        (`xid`: what the node's GPU check reports)."""
        body = {"kind": kind, **({"rank": rank} if rank is not None else {}), **({"xid": xid} if xid else {})}
        return self.call("POST", f"/v1/nodes/{node}/faults", body)


def last_recorded(store: Store) -> float | None:
    """When the controller last wrote to SQLite: its newest heartbeat or event (its `stopped` event, after a
    clean stop). Offline reads are as of this moment."""
    times = [r[0] for r in store.execute("SELECT MAX(last_heartbeat) FROM nodes UNION ALL SELECT MAX(time) FROM "
                                         "events UNION ALL SELECT controller_started_at FROM cluster")]
    times = [t for t in times if t is not None]
    return max(times) if times else None


# ---- lifecycle of the controller and the cluster ------------------------------------------------------
def _spawn_controller(paths: ClusterPaths) -> subprocess.Popen:
    # umask 077: the controller's files (state.db, logs, job dirs) and, inherited, those of the agents,
    # lifecycle scripts and workers it starts are private to this user
    with open_private_log(paths.controller_log) as log:
        return subprocess.Popen(
            [sys.executable, "-m", CONTROLLER_MODULE, "--cluster-dir", str(paths.root)],
            cwd=paths.root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            umask=PRIVATE_UMASK,
        )


def _check_api_port(spec: ClusterSpec) -> None:
    """Refuse a fixed `api.port` that cannot be bound now (the controller binds it the same way)."""
    host, port = spec.api.host, spec.api.port
    if not port:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise ClusterRefused(f"api.port: cannot listen on {host}:{port} (spec api.host/api.port): "
                                 f"{err.strerror}; choose another port, or 0 to pick a free one (nothing was "
                                 f"started)") from None


def _log_tail(paths: ClusterPaths, lines: int = 15) -> str:
    try:
        return "\n".join(paths.controller_log.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no controller log)"


def _wait_for_api(paths: ClusterPaths, proc: subprocess.Popen, timeout_s: float) -> ClusterClient:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"the controller exited with code {proc.returncode} while starting; "
                               f"its log ({paths.controller_log}) ends:\n{_log_tail(paths)}")
        ep = paths.read_endpoint()
        if ep and ep.get("pid") == proc.pid:
            client = ClusterClient(paths.name)
            try:
                client.call("GET", "/v1/cluster")
                return client
            except ControllerUnreachable:
                pass  # listening socket not accepting yet
        time.sleep(0.1)
    raise ClusterError(f"the controller did not answer within {timeout_s:g} s; log:\n{_log_tail(paths)}")


def create_cluster(spec: ClusterSpec | Path | str, *, timeout_s: float = 300.0, on_status=None) -> dict:
    """Create a cluster and wait until it is in service. Returns `describe()`. Raises SpecError (nothing
    started), ClusterError, or CreateFailed (which node failed and why; everything already stopped)."""
    if not isinstance(spec, ClusterSpec):
        spec = load_spec(spec)
    if spec.backend == "slurm":  # no sbatch, slurmctld down, an unknown partition: say so before starting anything
        from phalanx.control.backends.slurm_commands import SlurmError, preflight

        try:
            preflight(spec)
        except SlurmError as err:
            raise ClusterRefused(f"{err} (nothing was started)") from None
    paths = ClusterPaths.for_name(spec.name)
    if paths.root.exists():
        raise ClusterRefused(f"cluster {spec.name!r} already exists at {paths.root}; choose another name, or "
                             f"`phalanx cluster delete {spec.name}` first")
    _check_api_port(spec)
    if warning := heartbeat_load_warning(spec):  # (a warning: the figure is one machine's)
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    paths.root.parent.mkdir(parents=True, exist_ok=True)
    try:
        paths.root.mkdir(mode=0o700)
    except FileExistsError:  # another `cluster create` of the same name got there first
        raise ClusterRefused(f"cluster {spec.name!r} already exists at {paths.root}; choose another name") from None
    paths.root.chmod(0o700)  # mkdir's mode is filtered by the umask
    write_private(paths.spec, spec.model_dump_json(indent=2))
    paths.write_token()
    write_private(paths.db, "")  # SQLite keeps an empty file's mode, and gives its -wal/-shm the same
    store = Store(paths.db)
    store.initialize(spec)
    store.close()

    proc = _spawn_controller(paths)
    try:
        client = _wait_for_api(paths, proc, timeout_s=60)
    except ClusterError as err:  # e.g. api.port taken: nothing else started, so leave nothing behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(paths.root)
        raise ClusterError(f"{err}\n(nothing was started; {paths.root} was removed)") from None
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        info = client.describe()
        if on_status and info["status"] != last:
            on_status(info)
        last = info["status"]
        if info["status"] in (ClusterStatus.IN_SERVICE.value, ClusterStatus.DEGRADED.value):
            return info
        if info["status"] == ClusterStatus.FAILED.value or proc.poll() is not None:
            break
        if time.monotonic() > deadline:
            delete_cluster(spec.name, keep_files=True)
            raise CreateFailed(f"cluster {spec.name} was not ready within {timeout_s:g} s; everything was "
                               f"stopped. Files kept in {paths.root}")
        time.sleep(0.2)
    try:
        proc.wait(timeout=30)  # a failed creation stops its nodes, then the controller exits
    except subprocess.TimeoutExpired:
        pass  # delete_cluster below takes over
    info = delete_cluster(spec.name, keep_files=True)
    store = open_existing(paths.db)
    try:
        reason = store.cluster()["status_reason"] or "unknown"
        faulty = [e["node"] for e in store.events() if e["to_state"] == NodeState.FAULTY.value]
    finally:
        store.close()
    leftovers = f" (had to kill {info['killed']} leftover processes)" if info["killed"] else ""
    raise CreateFailed(f"cluster {spec.name} failed to create: {reason}\nNothing is left running{leftovers}; "
                       f"files kept in {paths.root} (`phalanx cluster events {spec.name}`; "
                       f"`phalanx cluster delete {spec.name}` removes them)", node=faulty[0] if faulty else None)


def start_controller(name: str | None = None, *, timeout_s: float = 60.0) -> dict:
    """Start the controller of an existing cluster whose controller is not running."""
    paths = ClusterPaths.for_name(resolve_name(name))
    pid = controller_pid(paths)
    if pid:
        raise ClusterRefused(f"the controller of cluster {paths.name} is already running (pid {pid})")
    store = open_existing(paths.db)
    try:
        status = store.cluster()["status"]
    finally:
        store.close()
    if status in (ClusterStatus.FAILED.value, ClusterStatus.DELETED.value):
        raise ClusterRefused(f"cluster {paths.name} is {status}; "
                             f"`phalanx cluster delete {paths.name}` and create it again")
    paths.root.chmod(0o700)  # a cluster created before its dir was made private
    proc = _spawn_controller(paths)
    return _wait_for_api(paths, proc, timeout_s).describe()


def stop_controller(name: str | None = None, *, timeout_s: float = 30.0) -> int:
    """Stop only the controller (nodes keep running). Returns its pid."""
    client = ClusterClient(name)
    pid = controller_pid(client.paths)
    if pid is None:
        raise ClusterRefused(f"the controller of cluster {client.name} is not running")
    client.call("POST", "/v1/controller/stop")
    if not _wait_gone(pid, str(client.paths.root), timeout_s):
        raise ClusterError(f"controller pid {pid} did not stop within {timeout_s:g} s")
    return pid


def _wait_gone(pid: int, marker: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while process_running(pid, marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def delete_cluster(name: str | None = None, *, keep_files: bool = False, timeout_s: float = 30.0) -> dict:
    """Stop every node and the controller, then make sure no process of the cluster is left (killing any
    that is, and saying so). Removes the cluster dir unless keep_files. Works with the controller down."""
    paths = ClusterPaths.for_name(resolve_name(name))
    root = str(paths.root)
    pid = controller_pid(paths)
    if pid:
        try:
            ClusterClient(paths.name).call("DELETE", "/v1/cluster")
        except (ControllerUnreachable, ApiError) as err:
            print(f"warning: controller pid {pid} did not take the delete request ({err}); next: SIGKILL it "
                  f"and stop the nodes directly", file=sys.stderr)
        if not _wait_gone(pid, root, timeout_s):
            print(f"warning: controller pid {pid} still running after {timeout_s:g} s; next: SIGKILL",
                  file=sys.stderr)
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, root, 5)
    stopped = _stop_nodes_directly(paths)  # none left when the controller did its job
    if stopped:
        why = "did not stop them" if pid else "is not running"
        print(f"controller of cluster {paths.name} {why}: stopped {stopped} nodes directly", file=sys.stderr)
    killed = _kill_leftovers(paths)
    from phalanx.control.client.observe import stop_observer  # (it imports this module)

    stop_observer(paths=paths)  # its Prometheus, if `phalanx observe` started one
    if keep_files:
        store = open_existing(paths.db)
        try:
            for n in store.nodes(include_terminated=False):
                store.transition(n.name, NodeState.TERMINATED, "cluster deleted while its controller was not running")
            if store.cluster()["status"] not in (ClusterStatus.FAILED.value, ClusterStatus.DELETED.value):
                store.set_status(ClusterStatus.DELETED, "every node and the controller stopped")
        finally:
            store.close()
    else:
        shutil.rmtree(paths.root)
    return {"name": paths.name, "controller_pid": pid, "killed": killed}


def _stop_nodes_directly(paths: ClusterPaths) -> int:
    """With the controller down: the backend stops every running node (terminate, kill after the grace)."""
    from phalanx.control.backends import make_backend
    from phalanx.control.policy.reconciler import TERMINATE_GRACE_S

    store = open_existing(paths.db)
    try:
        backend, nodes = make_backend(store.spec(), paths), store.nodes(include_terminated=False)
    finally:
        store.close()
    return backend.teardown(nodes, TERMINATE_GRACE_S)


def _kill_leftovers(paths: ClusterPaths) -> list[int]:
    """SIGKILL whatever of this cluster still runs (the backend finds it). Empty after a clean delete."""
    from phalanx.control.backends import make_backend

    if not paths.db.exists():
        return []
    store = open_existing(paths.db)
    try:
        backend, nodes = make_backend(store.spec(), paths), store.nodes()
    finally:
        store.close()
    killed = backend.sweep(nodes)
    for pid in killed:
        print(f"warning: process {pid} of cluster {paths.name} was still running after delete; killed it",
              file=sys.stderr)
    return killed


__all__ = ["ClusterClient", "ClusterError", "ClusterRefused", "CreateFailed", "SpecError", "create_cluster",
           "delete_cluster", "start_controller", "stop_controller", "resolve_name", "controller_pid"]

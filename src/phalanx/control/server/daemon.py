"""The controller daemon: `python -m phalanx.control.server.daemon --cluster-dir DIR`, one per cluster.

`phalanx cluster create` / `cluster start` start it detached (its own session; output in
DIR/controller.log; pid in DIR/controller.pid). It owns:
  - the truth, in DIR/state.db (`Store`);
  - the reconciler thread (`Reconciler.tick` every TICK_S), with the job scheduler (`scheduler.py`);
  - the HTTP API (FastAPI on uvicorn, loopback by default, cluster token required);
  - the rendezvous store, a `torch.distributed.TCPStore(is_master=True)`: it lives here, not in rank 0,
    so it outlives any worker. Workers publish their progress there (`protocol.progress_key`); the scheduler's
    tick reads every rank's step (the job's step, the straggler rule). It listens on the API's connect address only
    (`protocol.serve_store`; torch alone would listen on every interface), and every key the controller reads or
    writes goes through `protocol.namespaced` (under the namespace derived from the cluster token) — the trust
    boundary is in docs/control-plane.md.

A restart rebuilds everything from SQLite: the same API and store ports are reused when free (agents
re-read DIR/endpoint.json anyway), heartbeat timeouts count from when the API serves again (the reconciler
waits for it), and running agents and their
workers are not touched. The store comes back empty: workers re-publish their progress at their next step
(their process groups never depended on it: each generation rendezvouses on its own MASTER_PORT).
Exits: SIGTERM or POST /v1/controller/stop stop the controller only; DELETE /v1/cluster and a failed
creation stop every node first (cancelling their jobs).

Must not know: models, training, anything a worker does beyond the seam.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn

from phalanx import protocol
from phalanx.control.server.api import build_app
from phalanx.control.server.heap import LongLived
from phalanx.control.server.job_runs import JobRuns
from phalanx.control.server.links import AgentLinks
from phalanx.control.backends import make_backend
from phalanx.control.backends.local import process_running
from phalanx.control.policy.deep_check import DeepCheckCoordinator
from phalanx.control.state.paths import ClusterPaths
from phalanx.control.policy.reconciler import TERMINATE_GRACE_S, Reconciler
from phalanx.control.policy.scheduler import JobScheduler
from phalanx.control.state.store import ClusterStatus, NodeState, open_existing
from phalanx.observability.events import EventKind as E
from phalanx.process import exit_without_teardown
from phalanx.protocol.messages import FULL_HEARTBEAT_MAX_S

TICK_S = 0.2
MIN_TICK_GAP_S = 0.02  # pokes coalesce: at most one tick per this gap however many heartbeats bring news
log = logging.getLogger("phalanx.controller")


def connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def bind_api_socket(host: str, port: int, fallback_to_any: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        if not (fallback_to_any and port):
            sock.close()
            raise SystemExit(f"error: cannot listen on {host}:{port} (spec api.host/api.port): {err.strerror}; "
                             f"choose another port, or 0 to pick a free one") from None
        log.warning("API port %d is taken (%s); next: listening on a free port (agents re-read endpoint.json)",
                    port, err)
        sock.bind((host, 0))
    # listening from now: an agent that reads the endpoint file (or is handed the URL) and connects before uvicorn
    # serves waits in the backlog instead of being refused (a join is not retried on a refusal)
    sock.listen(2048)
    return sock


class RendezvousStore:
    """The controller-owned TCPStore, listening on `host` only (the address agents and workers are given), and
    every key under the cluster's namespace: calls on this object are the namespaced store's.

    Its socket is bound and listening when this returns, so the port is known (a restart reuses `port` when it
    is free, else takes a free one); torch's server on that socket starts in a thread. Importing torch takes
    ~2 s of a core, and neither the API nor the agents' start need it: the controller serves meanwhile. A
    client that connects first waits in the listen backlog; a call here waits for the start."""

    def __init__(self, host: str, port: int | None, token: str):
        self.sock = None
        if port:
            try:
                self.sock = protocol.listen_socket(host, port)
            except OSError as err:
                log.warning("rendezvous store port %d is taken (%s); next: a free port (describe shows it)",
                            port, err)
        self.sock = self.sock or protocol.listen_socket(host, 0)
        self.port = self.sock.getsockname()[1]
        self._keys, self._error, self._started = None, None, threading.Event()
        threading.Thread(target=self._start, args=(host, token), name="rendezvous-store", daemon=True).start()

    def _start(self, host: str, token: str) -> None:
        try:
            server = protocol.serve_store(host, self.port, sock=self.sock)  # the control plane has no model code
            self._keys = protocol.namespaced(server, token)
            self._server = server  # (it owns the listening socket)
        except Exception as err:  # noqa: BLE001 - said on every call, and in the log now
            self._error = err
            log.error("the rendezvous store on %s:%d did not start (%r); jobs cannot run: restart the controller",
                      host, self.port, err)
        finally:
            self._started.set()

    def settle(self, timeout: float) -> None:
        """Wait for the start to end, so the process never exits while the thread is inside torch's import."""
        self._started.wait(timeout)

    def __getattr__(self, name: str):
        self._started.wait()
        if self._error is not None:
            raise RuntimeError(f"the rendezvous store did not start: {self._error!r}")
        return getattr(self._keys, name)


class Controller:
    def __init__(self, paths: ClusterPaths):
        self.paths = paths
        self.store = open_existing(paths.db, owner=True)  # the only writer while it runs
        self.spec = self.store.spec()
        self.token = paths.read_token()
        self.log = log
        self.links = AgentLinks()  # each agent's open request: its end says the agent process ended
        self.store.on_change = self.links.poke  # news for an agent: it heartbeats now, not at its next full one
        self.backend = make_backend(self.spec, paths, self.store, self.links)
        self.server: uvicorn.Server | None = None
        self.rendezvous: RendezvousStore | None = None  # the namespaced TCPStore, once bound
        self.jobs: JobScheduler | None = None
        self.runs = JobRuns()  # what /metrics reads about each job's training (its run files, followed)
        self.deep_checks = DeepCheckCoordinator(self.spec, self.backend, self.store.changed)
        self.started_at: float | None = None
        self._exit = threading.Event()
        self._poked = threading.Event()  # a heartbeat brought news a decision waits on: tick now
        self.heap = LongLived()  # short garbage collections: what lives longer than 0.1 s frozen (heap.py)
        self._stop_nodes_reason: str | None = None
        self._nodes_stopped = False  # stopped while the API still served (backend hosts)

    def request_exit(self, stop_nodes_reason: str | None) -> None:
        """Stop the controller; with a reason, stop every node first."""
        if stop_nodes_reason and not self._stop_nodes_reason:
            self._stop_nodes_reason = stop_nodes_reason
            if getattr(self.backend, "faults_through_agent", False) and self.server is not None:
                # agents on other hosts hear `terminate` only in a heartbeat reply: stop them while the API serves
                self._exit.set()
                threading.Thread(target=self._stop_nodes_then_exit, name="stop-nodes", daemon=True).start()
                return
        self._exit.set()
        if self.server is not None:
            self.server.should_exit = True

    def _stop_nodes_then_exit(self) -> None:
        try:
            self.stop_all_nodes(self._stop_nodes_reason)
            self._nodes_stopped = True
        finally:
            self.server.should_exit = True

    def _claim_pid_file(self) -> None:
        try:
            other = int(self.paths.pid_file.read_text())
        except (FileNotFoundError, ValueError):
            other = None
        if other and other != os.getpid() and process_running(other, str(self.paths.root)):
            raise SystemExit(f"controller already running for {self.paths.root} (pid {other})")
        self.paths.pid_file.write_text(str(os.getpid()))

    def run(self) -> int:
        self._claim_pid_file()
        self.backend.start()  # (local: its host template imports torch while this controller starts)
        cluster = self.store.cluster()
        if cluster["status"] in (ClusterStatus.FAILED.value, ClusterStatus.DELETED.value):
            raise SystemExit(f"cluster {cluster['name']} is {cluster['status']}; delete it and create it again")
        restart = cluster["controller_started_at"] is not None
        self.started_at = started_at = time.time()
        host = self.spec.api.host
        sock = bind_api_socket(host, cluster["api_port"] if restart else self.spec.api.port, fallback_to_any=restart)
        api_port = sock.getsockname()[1]
        self.rendezvous = rendezvous = RendezvousStore(connect_host(host), cluster["store_port"], self.token)
        self.store.update_cluster(controller_pid=os.getpid(), controller_started_at=started_at,
                                  api_host=connect_host(host), api_port=api_port, store_port=rendezvous.port)
        self.paths.write_endpoint({"pid": os.getpid(), "api_host": host, "connect_host": connect_host(host),
                                   "api_port": api_port, "store_port": rendezvous.port})
        if restart:
            for g in self.store.groups():
                self.store.update_group(g["name"], provision_failures=0)
            live = self.store.nodes(include_terminated=False)
            what = (f"controller restarted (pid {os.getpid()}); view rebuilt from SQLite: {len(live)} live nodes, "
                    f"heartbeat timeouts count from now")
        else:
            what = f"controller started (pid {os.getpid()})"
        what += f"; API on {connect_host(host)}:{api_port}, rendezvous store on {connect_host(host)}:{rendezvous.port}"
        self.store.record_event(E.CONTROLLER, what)
        log.info(what)

        self.store_addr = store_addr = f"{connect_host(host)}:{rendezvous.port}"
        self.jobs = JobScheduler(
            self.store, self.backend, jobs_root=self.paths.jobs_dir, store_addr=lambda: store_addr,
            read_progress=lambda job, gen, ranks, **how: protocol.read_progress(rendezvous, job, gen, ranks,
                                                                                beats=False, **how),
            rendezvous=rendezvous,
        )
        self.jobs.token = self.token
        if restart:
            self.jobs.republish()  # checkpointless workers watch their job's generation key
        reconciler = Reconciler(self.store, self.backend, started_at=started_at, request_exit=self.request_exit,
                                jobs=self.jobs, deep_checks=self.deep_checks, links=self.links)
        # (no proxy-header rewriting, no Server or Date header: per-request work that every heartbeat would pay
        # and nothing here reads)
        self.server = ControllerServer(self.links, uvicorn.Config(
            build_app(self), log_level="warning", access_log=False, lifespan="off", proxy_headers=False,
            server_header=False, date_header=False,
            # an agent that keeps its connection sends a full heartbeat at least every FULL_HEARTBEAT_MAX_S (20 s):
            # uvicorn's default 5 s would close many of them just before their next request, at thousands of nodes
            timeout_keep_alive=int(3 * FULL_HEARTBEAT_MAX_S)))
        self.heap.freeze()  # everything made so far lives as long as the controller: out of the collector's sight
        loop = threading.Thread(target=self._reconcile_loop, args=(reconciler,), name="reconciler", daemon=True)
        loop.start()
        # uvicorn restores the handler it found and re-raises the signal after a graceful shutdown; this one
        # lets cleanup below run instead of dying there.
        signal.signal(signal.SIGTERM, lambda s, f: log.info("SIGTERM: controller stops, nodes keep running"))
        # Slurm's warning before the time limit goes to the batch shell (`--signal=B:`), not to this controller in
        # a session of its own (tried on the test Slurm), but `scancel --full --signal=USR2` reaches every process
        # of the batch step: not this one's to act on (cluster up checkpoints the job), and USR2 would end it
        signal.signal(signal.SIGUSR2, lambda s, f: log.info("USR2: an allocation's time limit is near (Slurm's "
                                                            "warning); the batch script checkpoints its job"))
        try:
            if not self._exit.is_set():
                self.server.run(sockets=[sock])
        finally:
            self._exit.set()
            loop.join(timeout=10)
            rendezvous.settle(timeout=30)
            if self._stop_nodes_reason:
                if not self._nodes_stopped:
                    self.stop_all_nodes(self._stop_nodes_reason)
                if self.store.cluster()["status"] == ClusterStatus.DELETING.value:
                    self.store.set_status(ClusterStatus.DELETED, "every node and the controller stopped")
            self.backend.close()
            self.store.record_event(E.CONTROLLER, f"controller stopped (pid {os.getpid()})")
            self.paths.endpoint.unlink(missing_ok=True)
            self.paths.pid_file.unlink(missing_ok=True)
            log.info("controller exiting")
        return 0

    def _reconcile_loop(self, reconciler: Reconciler) -> None:
        # Agents can only reach us once the API serves; until then their silence is ours (a slow start under
        # load), so heartbeat timeouts count from that moment.
        while not self._exit.is_set() and not (self.server is not None and self.server.started):
            self._exit.wait(0.05)
        reconciler.started_at = time.time()
        while not self._exit.is_set():
            self._poked.clear()
            started = time.monotonic()
            try:
                reconciler.tick()
            except Exception:
                log.exception("reconciler tick failed; next: retrying in %.1f s", TICK_S)
            self.heap.tick()  # (the periodic full collection of everything frozen: heap.py)
            ended = time.monotonic()
            self._exit.wait(MIN_TICK_GAP_S)
            self._poked.wait(TICK_S - MIN_TICK_GAP_S)
            # a tick at thousands of nodes takes tens of ms and holds the locks heartbeats are answered under: a
            # poked tick waits at least as long as the last one took, so ticks poked by every heartbeat with news
            # (a job launching on every node) take at most about half the controller's time. (Not the regular
            # cadence: pacing it too made a 1,024-node cluster's bring-up, whose ticks are long, twice as slow.)
            left = (ended - started) - (time.monotonic() - ended)
            if self._poked.is_set() and left > 0:
                self._exit.wait(left)

    def poke(self) -> None:
        """Tick now (within MIN_TICK_GAP_S of the last), not at the next TICK_S: a heartbeat brought news for a
        job changing generation (`server/heartbeat.py`)."""
        self._poked.set()

    def stop_all_nodes(self, reason: str) -> None:
        if self.jobs is not None:
            self.jobs.cancel_all(reason.splitlines()[0])
        nodes = [n for n in self.store.nodes() if n.state != NodeState.TERMINATED]
        log.info("stopping %d nodes (%s)", len(nodes), reason.splitlines()[0])
        for n in nodes:
            self.backend.terminate(n)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        while time.monotonic() < deadline and any(n.handle and self.backend.gone(n) is None for n in nodes):
            time.sleep(0.05)
        for n in nodes:
            stubborn = n.handle and self.backend.gone(n) is None
            if stubborn:
                log.warning("node %s did not stop within %.0f s of SIGTERM; SIGKILL", n.name, TERMINATE_GRACE_S)
            self.backend.kill(n)  # the agent if stubborn, and anything left in its process group
            self.backend.forget(n)
            self.store.transition(n.name, NodeState.TERMINATED, f"{reason.splitlines()[0]}"
                                  f"{' (SIGKILL after SIGTERM grace)' if stubborn else ''}")


class ControllerServer(uvicorn.Server):
    """uvicorn's server, which ends the agents' links before its graceful shutdown waits for open responses."""

    def __init__(self, links: AgentLinks, config: uvicorn.Config):
        super().__init__(config)
        self.links = links

    async def shutdown(self, sockets=None) -> None:
        self.links.stop()
        await super().shutdown(sockets)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Phalanx cluster controller")
    parser.add_argument("--cluster-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s controller %(levelname)s %(name)s: %(message)s")
    return Controller(ClusterPaths(args.cluster_dir.resolve())).run()


if __name__ == "__main__":
    # Everything is saved (SQLite commits as it goes) and every node stopped: skip the interpreter's teardown, which
    # with torch loaded (the rendezvous store) took ~0.7 s here, and which a thread still in torch could abort.
    exit_without_teardown(main())

"""Where nodes come from. The `local` backend: a node is an agent process on this machine, in its own
session (so the session is the node: the agent, its lifecycle script, and its workers, each worker in a
process group of its own inside that session), with its own work dir.

    launch(node)      write WORK_DIR/agent.json, start `python -m phalanx.control.agent.node_agent` → handle:
                      the agent's pid, as text (the store keeps it opaque). Forked from the cluster's host template
                      (`python -m phalanx.zygote --for-host`, started with the controller: torch, the training
                      code and the agent imported once for every node; the first launch waits for it) when a
                      group keeps worker templates; exec'd when there is none or it fails
    gone(node)        None while the node's agent runs, else why it is gone (exit code / signal)
    terminate(node)   SIGTERM the agent (it stops its workers and exits); SIGCONT in case it is frozen
    kill(node)        SIGKILL the whole node (its session) — what a power loss does
    freeze(node)      SIGSTOP the agent: alive but silent, like a hung host or a partitioned network
    signal_worker(node, pid, sig)   a signal to one worker of the node (fault injection)
    node_host(node)   the address other nodes reach it at (MASTER_ADDR when it hosts rank 0)
    free_port(node)   a port free on that host now (a generation's MASTER_PORT)
    work_root()       CLUSTER_DIR/nodes (each node's work dir is under it)
    worker_env()      gloo on loopback, one OpenMP thread per rank (every node shares this machine)
    teardown(nodes)   the controller is down (`cluster delete`): terminate, then kill after the grace
    sweep(nodes)      after a delete: SIGKILL anything of the cluster still running (found through /proc)
    start()           the controller starts: its host template starts importing
    close()           the controller exits: its host template ends (the agents it forked run on)

Processes are always identified by pid *and* command line (a pid alone may have been reused).
Implements `base.Backend`. Knows nothing about the reconciler's policy, HTTP or SQLite.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from phalanx.control.state.paths import PRIVATE_UMASK, ClusterPaths, open_private_log
from phalanx.control.spec import ClusterSpec, agent_settings
from phalanx.control.state.store import Node
from phalanx.control.agent.template import TEMPLATE_MODULE, TemplateUnavailable, WorkerTemplate
from phalanx.control.agent.worker import describe_exit
from phalanx.zygote import AGENT_MODULE  # (re-exported: the tests name agents by it)

CONTROLLER_MODULE = "phalanx.control.server.daemon"  # what `cluster start` runs (`python -m`)
log = logging.getLogger("phalanx.backend.local")
HOST_TEMPLATE_WAIT_S = 60.0  # the first launch waits this long for the host template's imports, then execs


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, process group, session) of a live process, None if there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[2]), int(fields[3])


def argv(pid: int) -> list[str]:
    """The process's arguments ([] when it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


def cmdline(pid: int) -> str:
    return " ".join(argv(pid))


def process_running(pid: int | None, marker: str) -> bool:
    """A live (not zombie) process `pid` whose command line contains `marker`."""
    if not pid:
        return False
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z" and marker in cmdline(pid)


def processes_mentioning(path: str) -> list[int]:
    """Live processes whose command line names `path` or something under it (used to prove nothing was left
    behind). A path matches whole components only: /c/bench does not match a process of /c/bench-cold."""
    path = path.rstrip("/")
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[0] != "Z" and any(
                    a == path or a.endswith("=" + path) or path + "/" in a for a in argv(int(entry))):
                found.append(int(entry))
    return found


def child_with_env(parent: int, name: str, value: str) -> int | None:
    """A live child of `parent` whose environment has `name=value` (e.g. the worker of RANK=1 that torchrun's
    agent started), or None."""
    wanted = f"{name}={value}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[1]) == parent and wanted in env:
            return int(entry)
    return None


def process_group_members(pgid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[0] != "Z" and stat[1] == pgid:
                found.append(int(entry))
    return found


def session_members(sid: int) -> list[int]:
    """Live processes of session `sid` (a local node: its agent is the session leader)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[0] != "Z" and stat[2] == sid:
                found.append(int(entry))
    return found


def _pid(node: Node) -> int | None:
    """The agent's pid: what a local node's handle holds."""
    return int(node.handle) if node.handle else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalBackend:
    def __init__(self, paths: ClusterPaths, spec: ClusterSpec):
        self.paths = paths
        self.spec = spec
        self._children: dict[str, subprocess.Popen] = {}  # agents this controller process started (or forked)
        self._host: WorkerTemplate | None = None  # the host template, once started

    def agent_config_path(self, node: Node) -> Path:
        return Path(node.work_dir) / "agent.json"

    def _marker(self, node: Node) -> str:
        return str(self.agent_config_path(node))

    def launch(self, node: Node) -> int:
        group = self.spec.group(node.group)
        work = Path(node.work_dir)
        work.mkdir(parents=True, exist_ok=True, mode=0o700)
        cfg = {
            **agent_settings(self.spec, node.group), "node": node.name, "work_dir": str(work),
            "on_create": str(group.on_create) if group.on_create else None,
            "token_file": str(self.paths.token), "endpoint_file": str(self.paths.endpoint),
        }
        config_path = self.agent_config_path(node)
        config_path.write_text(json.dumps(cfg, indent=2))
        argv = [sys.executable, "-m", AGENT_MODULE, "--config", str(config_path)]
        host = self._host_template()
        if host is not None:
            try:
                forked = host.fork(argv, dict(os.environ), work, work / "agent.log", session=True,
                                   umask=PRIVATE_UMASK)
            except TemplateUnavailable as why:
                log.warning("node %s: its agent is exec'd, not forked from the host template (%s)", node.name, why)
            else:
                self._children[node.name] = forked
                return str(forked.pid)
        with open_private_log(work / "agent.log") as out:  # umask 077: the node's files are this user's only
            proc = subprocess.Popen(
                argv, cwd=work, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                umask=PRIVATE_UMASK,
            )
        self._children[node.name] = proc
        return str(proc.pid)

    def start(self) -> None:
        if any(g.worker_template for g in self.spec.instance_groups) and self._host is None:
            self._host = WorkerTemplate(str(self.paths.root), self.paths.root, host=True)
            self._host.start()

    def _host_template(self) -> WorkerTemplate | None:
        """The cluster's host template, ready (started now if `start` did not, waited for up to
        HOST_TEMPLATE_WAIT_S, its import no longer yielding); None when no group keeps worker templates, or it is
        not there."""
        self.start()
        if self._host is None:
            return None
        return self._host if self._host.wait_ready(HOST_TEMPLATE_WAIT_S) else None

    def close(self) -> None:
        if self._host is not None:
            self._host.close()

    def gone(self, node: Node) -> str | None:
        """None while the node's agent process runs; otherwise a phrase saying how it ended."""
        child = self._children.get(node.name)
        if child is not None:
            code = child.poll()
            if code is None:
                return None
            if self._host is not None and child.pid in self._host.unseen:
                return f"agent process {child.pid} is no longer running (how it ended is unknown: the host template " \
                       f"that forked it ended first)"
            return f"agent process {child.pid} {describe_exit(code)}"
        if process_running(_pid(node), self._marker(node)):
            return None
        return f"agent process {node.handle} is no longer running"

    def _signal_agent(self, node: Node, sig: signal.Signals) -> bool:
        if node.handle and self.gone(node) is None:
            os.kill(_pid(node), sig)
            return True
        return False

    def terminate(self, node: Node) -> None:
        if self._signal_agent(node, signal.SIGTERM):
            os.kill(_pid(node), signal.SIGCONT)

    def freeze(self, node: Node) -> None:
        if not self._signal_agent(node, signal.SIGSTOP):
            raise ProcessLookupError(f"node {node.name}: agent process {node.handle} is not running")

    def signal_worker(self, node: Node, pid: int, sig: signal.Signals) -> None:
        """Send `sig` to one worker process of `node` (refused for a pid outside the node or its agent)."""
        agent = _pid(node)
        if not agent or pid == agent or pid not in session_members(agent):
            raise ProcessLookupError(f"process {pid} is not a running worker of node {node.name}")
        os.kill(pid, sig)

    def node_host(self, node: Node) -> str:
        return "127.0.0.1"  # every local node is this machine

    def free_port(self, node: Node) -> int:
        return free_port(self.node_host(node))

    def kill(self, node: Node) -> list[int]:
        """SIGKILL every process of the node (the agent's session). Returns the pids signalled."""
        if not node.handle:
            return []
        members: list[int] = []
        # the agent, its lifecycle script, its workers; scanned again until no new one shows: a worker its template
        # forked after the scan (a standby being made) was left running in the session, parentless
        while fresh := [p for p in session_members(_pid(node)) if p not in members]:
            for pid in fresh:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # exited between the scan and the signal: the goal is reached
            members += fresh
        child = self._children.get(node.name)
        if child is not None:
            child.wait()
        return members

    def work_root(self) -> Path:
        return self.paths.root / "nodes"

    def worker_env(self, node: Node | None = None) -> dict[str, str]:
        # every node shares this machine: gloo on loopback, one thread per rank (2-core CI machines)
        return {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}

    def teardown(self, nodes: list[Node], grace_s: float) -> int:
        running = [n for n in nodes if n.handle and self.gone(n) is None]
        for n in running:
            self.terminate(n)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(self.gone(n) is None for n in running):
            time.sleep(0.05)
        for n in running:
            self.kill(n)  # stubborn agents, and whatever they left in their process group
        return len(running)

    def flush(self) -> list[tuple[Node, str]]:
        return []  # launch started each node already

    def polled(self) -> bool:
        return True  # `gone` asks the agent processes themselves

    def taken(self, node: Node) -> str | None:
        return None  # no scheduler takes nodes away

    def remediate(self, node: Node, reason: str, cause: str) -> None:
        return None  # no scheduler to hand a faulty node back to

    def sweep(self, nodes: list[Node]) -> list[int]:
        victims: set[int] = set()
        for n in nodes:
            # the node's session while its agent runs, and once its agent is dead (a zombie, or its pid free): what is
            # left in it then is that agent's (a pid taken again by another process leads a session of its own)
            stat = _proc_stat(_pid(n)) if n.handle else None
            if n.handle and (stat is None or stat[0] == "Z" or process_running(_pid(n), self._marker(n))):
                victims.update(session_members(_pid(n)))
        ours = (CONTROLLER_MODULE, AGENT_MODULE, f"{TEMPLATE_MODULE} --for-host")
        victims.update(p for p in processes_mentioning(str(self.paths.root)) if any(m in cmdline(p) for m in ours))
        if self._host is not None and self._host.proc is not None:
            victims.discard(self._host.proc.pid)  # (this process's own, running: `close()` ends it)
        killed = []
        for pid in sorted(victims):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # exited by itself meanwhile
            killed.append(pid)
        return killed

    def forget(self, node: Node) -> None:
        child = self._children.pop(node.name, None)
        if child is not None:
            child.wait()

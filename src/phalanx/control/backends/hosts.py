"""The `hosts` backend: nodes whose agents run on other hosts and join the cluster themselves.

A node of this backend is a row that waits for an agent: the reconciler provisions it as usual (`launch`
starts nothing and returns no handle), and an agent started on some host — by hand, by a lifecycle script,
by `srun` — claims it with `phalanx agent --controller URL --token-file F --group G` (the API's
`POST /v1/join`). From then on the node lives as any other: heartbeats, health checks, jobs, faults.

Nothing here reaches another host: the controller acts on a joined node only through its agent's heartbeat
replies (terminate, injected faults as directives: `faults_through_agent`), and learns what it needs from
its heartbeats: the address its workers are reached at, the interface holding it, and ports free there.

    launch(node)      nothing to start: None (the node waits for an agent to join it)
    gone(node)        after `terminate`: the agent has been answered once since (its reply said terminate),
                      its link closed (the agent process ended: `server/links.py`), or it stayed silent past
                      heartbeat_timeout_s; None before
    terminate(node)   remembered; the agent's next heartbeat reply says terminate (the node is replacing, or
                      the cluster is ending)
    kill/freeze/signal_worker   not from here: fault injection goes to the agent as a directive
    node_host(node)   the address the agent reported
    free_port(node)   one of the ports the agent reported free, never the same one twice in a row
    worker_env()      nothing: each agent gives its workers its own interface (GLOO/NCCL_SOCKET_IFNAME)
    teardown/sweep    nothing to signal on other hosts; agents stop when the controller answers terminate,
                      or when it says their node is unknown

Implements `base.Backend`. Knows nothing about the reconciler's policy, HTTP or jobs.
"""

from __future__ import annotations

import signal
import time
from collections import deque
from pathlib import Path

from phalanx.control.spec import ClusterSpec
from phalanx.control.state.paths import ClusterPaths
from phalanx.control.state.store import Node


class HostsBackend:
    # the controller reaches a node only through its agent's heartbeat replies: kill-node, freeze-node and worker
    # signals go as directives (api.py), and nodes are stopped while the API still serves (daemon.py)
    faults_through_agent = True

    def __init__(self, paths: ClusterPaths, spec: ClusterSpec, store=None, links=None):
        self.paths = paths
        self.spec = spec
        self.store = store  # the controller's store: a node's newest heartbeat (None outside the controller)
        self.links = links  # the controller's `AgentLinks`: when an agent's link closed (None outside it)
        self._told: dict[str, float] = {}  # node → when it was asked to terminate
        self._given: dict[str, deque] = {}  # node → ports handed out lately

    def launch(self, node: Node) -> None:
        return None

    def _fresh(self, node: Node) -> Node:
        return (self.store.node(node.name) if self.store is not None else None) or node

    def gone(self, node: Node) -> str | None:
        told = self._told.get(node.name)
        if told is None:
            return None
        heard = self._fresh(node).last_heartbeat
        if heard is not None and heard > told:
            return f"its agent (handle {node.handle}) was told to terminate at its heartbeat"
        closed = (self.links.lost(node.name, node.handle, heard, time.time(), self.spec.health.link_grace_s)
                  if self.links is not None else None)
        if closed is not None:
            return f"its agent (handle {node.handle}) ended: its link closed {closed:.1f} s ago"
        silent = time.time() - max(told, heard or 0.0)
        if silent > self.spec.health.heartbeat_timeout_s:
            return f"its agent (handle {node.handle}) has been silent for {silent:.1f} s since it was asked to stop"
        return None

    def terminate(self, node: Node) -> None:
        self._told.setdefault(node.name, time.time())

    def kill(self, node: Node) -> list[int]:
        return []  # a joined node's processes are on its host: its agent kills them (directive `kill-node`)

    def freeze(self, node: Node) -> None:
        raise ProcessLookupError(f"node {node.name} runs on another host: freeze it through its agent")

    def signal_worker(self, node: Node, pid: int, sig: signal.Signals) -> None:
        raise ProcessLookupError(f"node {node.name} runs on another host: signal its workers through its agent")

    def forget(self, node: Node) -> None:
        self._told.pop(node.name, None)
        self._given.pop(node.name, None)

    def node_host(self, node: Node) -> str:
        address = (self._fresh(node).report or {}).get("address")
        if not address:
            raise RuntimeError(f"node {node.name} has not reported its address yet (its agent's heartbeat carries it)")
        return address

    def free_port(self, node: Node) -> int:
        ports = (self._fresh(node).report or {}).get("free_ports") or []
        if not ports:
            raise RuntimeError(f"node {node.name} has not reported a free port yet (its agent's heartbeat carries "
                               f"them)")
        given = self._given.setdefault(node.name, deque(maxlen=64))
        port = next((p for p in ports if p not in given), ports[0])
        given.append(port)
        return int(port)

    def work_root(self) -> Path:
        return self.paths.root / "nodes"  # a placeholder: a joined node's work dir is the one its agent reports

    def worker_env(self, node: Node | None = None) -> dict[str, str]:
        return {}

    def teardown(self, nodes: list[Node], grace_s: float) -> int:
        return 0

    def flush(self) -> list[tuple[Node, str]]:
        return []  # launch started each node already

    def polled(self) -> bool:
        return False  # `gone`: a terminate asked for, a link's close, a heartbeat (what the reconciler hears)

    def taken(self, node: Node) -> str | None:
        return None  # no scheduler takes nodes away

    def remediate(self, node: Node, reason: str, cause: str) -> None:
        return None  # no scheduler to hand a faulty node back to

    def start(self) -> None:
        return None  # nothing of its own runs beside the controller

    def close(self) -> None:
        return None  # nothing of its own runs beside the controller

    def sweep(self, nodes: list[Node]) -> list[int]:
        return []

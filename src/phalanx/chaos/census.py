"""Who runs on the machine for one cluster, read from /proc: the controller, each live node's session (its
agent, its worker template, its warm standbys, its workers), what is left in the sessions of nodes already retired, and which TCP
ports those processes listen on. `phalanx chaos` takes one census before a trial and one after the job
ended, and `invariants.check_leaks` compares them.

Only processes of the cluster are counted (the controller's pid, the nodes' sessions): other clusters and
other people's processes on the same machine are never looked at. Knows nothing about jobs or training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from phalanx.control.agent.template import TEMPLATE_MODULE
from phalanx.control.backends.local import cmdline, process_running, session_members


@dataclass
class NodeCensus:
    agent: int
    members: list[int]  # live processes of the node's session, the agent included
    standbys: int  # warm standby processes the agent says it keeps (its last heartbeat)
    job: str | None = None  # the job the node runs, if any
    template: int | None = None  # the node's worker template (`python -m phalanx.zygote`), if it runs


@dataclass
class Census:
    controller: int | None
    nodes: dict[str, NodeCensus] = field(default_factory=dict)
    retired: dict[str, list[int]] = field(default_factory=dict)  # retired node → its session's live processes
    listening: dict[int, int] = field(default_factory=dict)  # port → pid, for the processes above

    def pids(self) -> set[int]:
        out = {self.controller} if self.controller else set()
        for n in self.nodes.values():
            out.update(n.members)
        for members in self.retired.values():
            out.update(members)
        return out

    def ports_of(self, pid: int | None) -> list[int]:
        return sorted(p for p, owner in self.listening.items() if owner == pid)


def listening_ports(pids: set[int]) -> dict[int, int]:
    """TCP ports in LISTEN state owned by one of `pids` (port → pid), from /proc/net/tcp{,6} and the
    processes' socket descriptors."""
    inodes: dict[str, int] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":  # LISTEN
                inodes[fields[9]] = int(fields[1].rsplit(":", 1)[1], 16)
    found: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                port = inodes.get(target[8:-1])
                if port is not None:
                    found[port] = pid
    return found


def agent_pid(node: dict) -> int | None:
    """The pid of a node's agent. The soak runs on the local backend, whose opaque node handle is that pid (as
    text); None before the agent was started."""
    return int(node["handle"]) if node.get("handle") else None


def take_census(nodes: list[dict], controller: int | None) -> Census:
    """`nodes`: the cluster's nodes as `ClusterClient.nodes()` lists them (terminated ones included)."""
    census = Census(controller=controller if process_running(controller, "phalanx") else None)
    for n in nodes:
        agent = agent_pid(n)
        if agent is None:
            continue
        members = session_members(agent)
        if n["state"] in ("terminated", "replacing"):
            if members:
                census.retired[n["name"]] = members
            continue
        standbys = len(((n.get("report") or {}).get("standbys")) or {})
        template = next((p for p in members if f"-m {TEMPLATE_MODULE} " in cmdline(p)), None)
        census.nodes[n["name"]] = NodeCensus(agent=agent, members=members, standbys=standbys, job=n.get("job"),
                                             template=template)
    census.listening = listening_ports(census.pids())
    return census

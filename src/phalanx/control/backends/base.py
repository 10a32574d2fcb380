"""The `Backend` interface: where a cluster's nodes come from and how the controller acts on them. Policy
(the reconciler, the scheduler, the API's fault injection, `cluster delete`) decides; a backend acts.

A node is known to policy by its row in the cluster's store (`state.store.Node`); what the backend needs to
find it again — the local backend's agent pid, later a Slurm step — is the opaque *handle* `launch` returns,
which the store keeps (`Node.handle`: for the local backend, the agent's pid as text) and every
heartbeat confirms (`Heartbeat.handle`: the agent reports `PHALANX_NODE_HANDLE` when its backend set it, else
its pid). Policy never reads a handle's meaning, never signals a process itself, never scans /proc.

Implementations: `local.py` (each node an agent process on this machine), `hosts.py` (agents that join
from other hosts), `slurm.py` (agents Slurm starts, which join). The contract every backend must
keep is tests/test_backends.py, run against each of them.

Must not know: jobs, generations, recovery policy.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Protocol, runtime_checkable

from phalanx.control.state.store import Node


@runtime_checkable
class Backend(Protocol):
    def launch(self, node: Node) -> str:
        """Start the node's agent (it registers itself by heartbeat). Returns the node's handle. OSError when
        the node cannot be started (the reconciler marks it faulty)."""

    def gone(self, node: Node) -> str | None:
        """None while the node's agent runs; otherwise a phrase saying how it ended."""

    def terminate(self, node: Node) -> None:
        """Ask the node's agent to stop (it stops its workers first); no-op when it is gone."""

    def kill(self, node: Node) -> list[int]:
        """Stop everything of the node at once (agent, lifecycle script, workers); what was signalled."""

    def freeze(self, node: Node) -> None:
        """Stop the node's agent without ending it (fault injection: a stalled host). ProcessLookupError
        when it is not running."""

    def signal_worker(self, node: Node, pid: int, sig: signal.Signals) -> None:
        """Send `sig` to one worker process of `node`; ProcessLookupError for a pid that is not one."""

    def forget(self, node: Node) -> None:
        """The node is terminated: release what the backend holds for it."""

    def node_host(self, node: Node) -> str:
        """The address the node's workers are reached at (MASTER_ADDR when it hosts rank 0)."""

    def free_port(self, node: Node) -> int:
        """A TCP port free on that node (a generation's MASTER_PORT, a deep check's)."""

    def work_root(self) -> Path:
        """The directory under which each node gets its work directory (`work_root()/<node name>`)."""

    def worker_env(self, node: Node | None = None) -> dict[str, str]:
        """Environment every worker on the node gets from the backend (e.g. which interface gloo uses)."""

    def teardown(self, nodes: list[Node], grace_s: float) -> int:
        """The controller is not running: stop these nodes directly (terminate, then kill after `grace_s`).
        Returns how many were running."""

    def flush(self) -> list[tuple[Node, str]]:
        """End of a reconciler tick: start what `launch` queued (the slurm backend submits one allocation for
        the nodes of one tick). The nodes that could not be started, each with why."""

    def polled(self) -> bool:
        """Whether `gone` and `taken` must be asked about every node at this reconciler tick: True when their
        answers change by themselves (local: an agent process exits; Slurm: a fresh view of its nodes); False
        when they change only with what the reconciler hears anyway (a heartbeat, a link's close, a terminate it
        asked for), and a healthy node is then observed only when its row changed or its silence is due."""

    def taken(self, node: Node) -> str | None:
        """Why the node's scheduler took it away or will not give it (Slurm: drained or down from outside, its
        job ended, its allocation pending too long); None while it holds (and for backends without one)."""

    def remediate(self, node: Node, reason: str, cause: str) -> None:
        """The node went faulty (`cause`: one of store.FAULT_CAUSES): hand it back to its scheduler (Slurm:
        drain it with the fault as reason). No-op for backends without a scheduler."""

    def sweep(self, nodes: list[Node]) -> list[int]:
        """After a delete: kill whatever of the cluster still runs (a leak). Returns the pids killed."""

    def start(self) -> None:
        """The controller starts: start what the backend itself runs, without waiting for it (local: its host
        template, which then imports while the controller starts up)."""

    def close(self) -> None:
        """The controller is exiting: release what the backend itself runs (local: its host template). The nodes
        are not touched."""

"""Agent side of the deep health check: a timed all_reduce across a new node and a healthy peer, run while the
node is health-checking, failing it below a bus-bandwidth threshold (`health.deep_check_min_busbw_gbps`).
How rounds are formed and judged is the controller's side, `phalanx.control.policy.deep_check`.

`DeepCheckRunner` starts `procs_per_node` probe processes (`deep_probe.py`: one per device slot) for each new
round its heartbeat replies name, and reports the round's result in its heartbeats. Single-node groups run the
probe across the node's own slots (intra-node bandwidth); a single process has no bandwidth to measure and
passes with that said.

Standard library only. Must not know: how rounds are paired or judged.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from phalanx.control.agent.slurm_allocation import ignoring_usr2
from phalanx.protocol.messages import DeepCheckPart

log = logging.getLogger("phalanx.deep_check")
PROBE_MODULE = "phalanx.control.agent.deep_probe"


class DeepCheckRunner:
    """Runs this node's probe processes for the newest round it was given; reports that round's result."""

    def __init__(self, work_dir: Path):
        self.dir = Path(work_dir) / "deep-check"
        self.round: DeepCheckPart | None = None
        self.procs: list[tuple[int, subprocess.Popen]] = []
        self.started = 0.0
        self._result: dict | None = None

    def apply(self, assignment: DeepCheckPart | None) -> None:
        if assignment is None or (self.round is not None and assignment.id == self.round.id):
            return
        self.stop()
        self.round, self._result, self.started = assignment, None, time.monotonic()
        a = assignment
        self.dir.mkdir(parents=True, exist_ok=True)
        world = len(a.nodes) * a.procs_per_node
        for local in range(a.procs_per_node):
            rank = a.node_rank * a.procs_per_node + local
            env = {**os.environ, **a.env, "RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_RANK": str(local), "MASTER_ADDR": a.master_addr, "MASTER_PORT": str(a.master_port)}
            out = self.dir / f"{a.id}-rank{rank}.json"
            with open(self.dir / f"{a.id}-rank{rank}.log", "wb") as logf:
                proc = subprocess.Popen(
                    ignoring_usr2([sys.executable, "-m", PROBE_MODULE, "--out", str(out), "--size-mb", str(a.size_mb),
                                   "--iters", str(a.iters), "--timeout-s", str(a.timeout_s)]),
                    env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    start_new_session=False)
            self.procs.append((rank, proc))
        log.info("deep health check round %s: started %d probe process(es), ranks %d-%d of %d, across %s",
                 a.id, len(self.procs), self.procs[0][0], self.procs[-1][0], world, ", ".join(a.nodes))

    def result(self) -> dict | None:
        """The current round's result once every probe exited (or was killed past the timeout)."""
        if self.round is None or self._result is not None:
            return self._result
        a = self.round
        if any(p.poll() is None for _, p in self.procs):
            if time.monotonic() - self.started < a.timeout_s + 30:
                return None
            self.stop()
        ranks, problems = [], []
        for rank, proc in self.procs:
            out = self.dir / f"{a.id}-rank{rank}.json"
            try:
                ranks.append(json.loads(out.read_text()))
            except (OSError, json.JSONDecodeError):
                tail = (self.dir / f"{a.id}-rank{rank}.log").read_text(errors="replace")[-400:]
                problems.append(f"rank {rank} probe exited with {proc.returncode} and no result: {tail.strip()}")
        self._result = {"id": a.id, "ranks": ranks, "problems": problems}
        return self._result

    def stop(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
        self.procs = []



"""The agent's warm standby pool: per idle slot, a `python -m phalanx.worker --standby` process started
ahead of time (forked from the node's worker template when it has one; torch imported, warmed up, waiting on
`protocol.standby_key`), and its adoption as a rank once the
controller assigns that slot (the controller writes the rank's env to the store, signed; the standby starts
at once, the assignment names it, and the supervisor adopts the process).

Part of `WorkerSupervisor` (a mixin over its lock, workers and standbys). Must not know: scheduling policy.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from phalanx import protocol
from phalanx.protocol.messages import Assignment, RankSlot
from phalanx.control.agent.worker import STOP_GRACE_S, Worker, forget_progress, signal_group

log = logging.getLogger("phalanx.agent.workers")


@dataclass
class Standby:
    """A warm worker process waiting to be told which rank to become (`python -m phalanx.worker
    --standby`, torch imported). The controller tells it through the store; its agent adopts it."""

    id: str
    local_rank: int
    proc: subprocess.Popen  # (or a template's ForkedProcess: the same calls)


class StandbyPool:
    def _adopt(self, a: Assignment, r: RankSlot) -> Worker | None:
        """The warm standby the controller told to become this rank (through the store), if it is alive. A
        standby that an earlier generation activated and this agent never adopted (that generation failed
        first) may be this slot's survivor (`carry`): adopted the same way, or, if it died meanwhile, reported
        as this generation's fault like any survivor that could not be carried (see `_carry`)."""
        sb = self.standbys.get(r.local_rank)
        if not r.standby or sb is None or sb.id != r.standby:
            return None
        code = sb.proc.poll()
        if code is not None and not r.carry:
            return None
        del self.standbys[r.local_rank]
        w = Worker(a.job, a.generation, r.rank, r.local_rank, pid=sb.proc.pid, started_at=time.time(),
                   proc=sb.proc, log_path=Path(a.log_dir) / f"rank{r.rank}.log", last_change=time.monotonic(),
                   progress_file=self._standby_progress(sb.id))
        w.log_path.parent.mkdir(parents=True, exist_ok=True)
        if code is not None:
            self._exited(w, code)
            log.warning("warm standby %s (pid %d), activated for job %s, %s before it could be carried into "
                        "generation %d as rank %d; reporting it as that generation's fault", sb.id, w.pid, w.job,
                        w.detail, w.generation, w.rank)
            self.wake()
            return w
        self._log_line(w, f"=== phalanx: job {w.job} generation {w.generation} rank {w.rank} on node {self.node}: "
                          f"warm standby {sb.id} (pid {w.pid}) adopted {time.strftime('%H:%M:%S')} ===")
        log.info("warm standby %s (pid %d) became rank %d/%d of job %s generation %d", sb.id, w.pid, w.rank,
                 a.world_size, w.job, w.generation)
        return w

    def _standby_progress(self, sid: str) -> Path:
        """Where standby `sid` writes its progress once activated (`protocol.PROGRESS_FILE`)."""
        return self.progress_dir / f"standby.{sid}"

    def _keep_standbys(self, wanted: int, stop_extra: bool = True) -> None:
        """Keep `wanted` standby processes (slots 0..wanted-1); stop the rest (if `stop_extra`). Called under
        the lock."""
        for slot, sb in list(self.standbys.items()):
            if sb.proc.poll() is not None:
                log.warning("warm standby %s exited with %s; next: start another if still wanted", sb.id,
                            sb.proc.returncode)
                forget_progress(self._standby_progress(sb.id))
                del self.standbys[slot]
            elif slot >= wanted and stop_extra:
                signal_group(sb.proc.pid, signal.SIGTERM)
                try:
                    sb.proc.wait(timeout=STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    signal_group(sb.proc.pid, signal.SIGKILL)
                    sb.proc.wait()
                del self.standbys[slot]
        addr = self.store_addr()
        if self.work_dir is None or not addr:
            return
        if self.template is not None and self.template.coming():
            return  # forked once the node's template has imported torch (one import per node, not two at once)
        for slot in range(wanted):
            if slot in self.standbys:
                continue
            self._standby_seq += 1
            sid = f"{self.node}.{slot}.{os.getpid()}.{self._standby_seq}"
            env = {**os.environ, protocol.STORE_ADDR: addr, protocol.NODE: self.node, protocol.LOCAL_RANK: str(slot),
                   protocol.STANDBY_ID: sid, protocol.CLUSTER_TOKEN: self.token,
                   protocol.PROGRESS_FILE: str(self._standby_progress(sid))}
            log_path = self.work_dir / f"standby-{slot}.log"
            with open(log_path, "ab") as out:
                proc, how = self._spawn([sys.executable, "-m", protocol.TRAIN_WORKER_MODULE, "--standby"], env,
                                        self.work_dir, log_path, out)
            self.standbys[slot] = Standby(sid, slot, proc)
            log.info("warm standby %s started (pid %d, %s)", sid, proc.pid, how)

    def standby_ids(self) -> dict[str, str]:
        with self.lock:
            return {str(s): sb.id for s, sb in self.standbys.items() if sb.proc.poll() is None}


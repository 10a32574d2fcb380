"""One worker process as its agent sees it (`Worker`: pid, state, exit, the progress its hang rule
judges, what the heartbeat reports), and the process-group helpers the supervisor and the standby pool
share: every worker runs in a process group of its own, so a stop reaches its children.

Must not know: scheduling policy, torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from phalanx import protocol

STOP_GRACE_S = 3.0


def describe_exit(code: int) -> str:
    if code == protocol.EXIT_STUCK:
        return (f"exited with code {code} (stuck in a generation's process-group creation, or in a collective with "
                "a frozen peer, after a newer one was published; a fresh process takes its rank)")
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


def own_process_group() -> dict:
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10


def forget_progress(path: Path | None) -> None:
    """A worker ended: the progress file it wrote for its agent goes (`protocol.write_local`'s, and its temp)."""
    if path is not None:
        for p in (path, path.with_name(path.name + ".tmp")):
            p.unlink(missing_ok=True)


def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass  # the whole group is gone already: what the signal was for


@dataclass
class Worker:
    job: str
    generation: int
    rank: int
    local_rank: int
    pid: int | None
    started_at: float
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    ship_log: bool = False  # its log is on this node only: shipped to the controller (`log_ship.py`)
    exit_logged: bool = False  # its exit line is in its log
    state: str = "running"  # running | stopping | exited
    exit_code: int | None = None
    detail: str | None = None
    hang: str | None = None
    stopped: bool = False  # stopped on the controller's request: not a fault
    stop_sent_at: float | None = None  # monotonic
    killed_after_grace: bool = False
    ended_at: float | None = None
    progress_file: Path | None = None  # where it writes its progress for this agent (`protocol.PROGRESS_FILE`)
    last_step: int | None = None  # the last step it wrote there (`protocol.read_local`)
    last_change: float = 0.0  # monotonic time its step last changed (or the clock restarted)
    last_beat: int | None = None  # its liveness counter, as last read
    last_beat_change: float = 0.0
    frozen: bool = False  # hung with its liveness beat stopped too
    reported_exit: bool = False  # a heartbeat carrying its exit was answered
    carried_from: list | None = None  # checkpointless: [generation, rank] this process served before
    launch: tuple | None = None  # (argv, env, cwd, deadline) of a worker not started yet: it waits for the node's
    #                              template until the deadline (monotonic), then it is exec'd

    @property
    def assignment(self) -> tuple[str, int]:
        return self.job, self.generation

    def as_report(self) -> dict:
        return {"job": self.job, "generation": self.generation, "rank": self.rank, "local_rank": self.local_rank,
                "pid": self.pid, "state": self.state, "exit_code": self.exit_code, "detail": self.detail,
                "hang": self.hang, "frozen": self.frozen, "stopped": self.stopped, "started_at": self.started_at,
                "ended_at": self.ended_at, "carried_from": self.carried_from}

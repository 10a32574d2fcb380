"""Landing one trial's faults in a running job, through the paths an operator (or a real failure) takes:

    kill-node, kill-worker, hang-worker, fail-health   `ClusterClient.inject_fault` (`phalanx fault inject`)
    agent-death                                        SIGKILL to the node's agent process only (its workers live on)
    controller-restart                                 SIGKILL to the controller (its pid file), then `cluster start`
    two-nodes, second-fault                            kill-node twice: at once, or `delay_s` apart
    slow-rank                                          the drill's `slow` action (the rank sleeps in the phase);
                                                       without a drill, SIGSTOP + SIGCONT of its worker

Where in a step: the job runs with `PHALANX_DRILL` set to a `slow` drill on the target rank, so that rank
announces itself in its log and sleeps inside the phase; the fault is injected the moment the announcement
appears (`hit` = "drill"). Where no drill fires — restart-mode workers do not install one — the fault is timed
from outside instead (`hit` = "timed"): when rank 0 has logged the step before (the checkpoint phase: the step
itself, whose save follows at once), or, for the regroup phase of a restart, once the next generation started.

Knows the control plane only through its public API and the files it documents (pid file, node work dirs,
job logs); knows nothing about what the invariants are.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from phalanx.chaos.census import agent_pid
from phalanx.chaos.plan import Trial
from phalanx.control.backends.local import process_running
from phalanx.control.client.cluster import ClusterClient, controller_pid, start_controller
from phalanx.control.http import ApiError, ControllerUnreachable
from phalanx.control.client.jobs import FINAL_STATES, JobClient
from phalanx.resilience.drill import DrillSpec

ANNOUNCE = "=== phalanx drill: slow rank"
POLL_S = 0.01


class InjectionError(RuntimeError):
    """The trial's fault could not be delivered (the job ended first, the node was gone, ...)."""


def drill_for(trial: Trial, *, hold_s: float, slow_s: float) -> DrillSpec:
    """The slow drill that holds the target rank inside the trial's phase (long enough to land an outside
    fault there; for a slow rank, the slowness itself)."""
    return DrillSpec(rank=trial.rank, step=trial.step, at=trial.phase, action="slow",
                     seconds=slow_s if trial.kind == "slow-rank" else hold_s)


class Tail:
    """Reads a growing text file incrementally (a rank's log, rank 0's metrics.jsonl)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = Path(path), 0, ""

    def lines(self) -> list[str]:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        *complete, self.partial = (self.partial + chunk).split("\n")
        return complete


class Injector:
    def __init__(self, client: ClusterClient, jobs: JobClient, job: dict, run_dir: Path, trial: Trial, *,
                 workers_per_node: int = 1, stop_slow_s: float = 1.5, timeout_s: float = 120.0,
                 drill_in_restart: bool = False):
        """`drill_in_restart`: restart-mode workers install the drill too (they do not today)."""
        self.client, self.jobs, self.job, self.trial = client, jobs, job, trial
        self.drills = trial.mode == "checkpointless" or drill_in_restart
        self.metrics = Tail(Path(run_dir) / "metrics.jsonl")
        self.wpn, self.stop_slow_s, self.timeout_s = workers_per_node, stop_slow_s, timeout_s
        self.last_step = 0  # the step of rank 0's newest step record (lower again after a rollback)
        self.steps_seen = 0  # step records read so far
        self.delivered: list[dict] = []  # one entry per fault that reached the cluster
        self.hit: str | None = None
        self.deadline = time.monotonic() + timeout_s

    # ---- the moment ---------------------------------------------------------------------------------
    def run(self) -> None:
        t = self.trial
        announced = self._announcement()
        if t.phase == "regroup":
            self._wait(lambda i: self._logged(t.step - 1), f"step {t.step - 1}")
            first = self.jobs.describe(self.job["id"])["generation"]
            self.hit = "first fault"
            self._deliver_one("kill-worker", t.first, self._layout())
            seen = self.steps_seen
            # checkpointless: the target, a survivor, announces itself once it has joined the next generation's
            # process group; restart: the next generation started (its processes are starting). Failing both,
            # training went on after the fault took effect (a later generation, steps logged again): the
            # regroup is over, inject anyway. (Steps logged alone are not enough: the first fault reaches its
            # worker through the agent's next heartbeat, and a fast job logs steps meanwhile.)
            since: dict[str, int] = {}

            def trained_on(i: dict) -> bool:  # two step records logged since a later generation appeared
                if i["generation"] <= first:
                    return False
                self._logged(0)
                return self.steps_seen > since.setdefault("seen", self.steps_seen) + 1

            self._wait(lambda i: announced() or (t.mode == "restart" and i["generation"] > first
                                                 and i["state"] == "running") or trained_on(i),
                       "the regroup after the first fault")
            self.hit = "drill" if announced.seen else "timed" if self.steps_seen <= seen + 1 else "late"
        else:
            # without a drill: rank 0 logged the step before (the fault lands early in the step), or the step
            # itself for the checkpoint (its save starts right after) and the optimizer (the update is done).
            # With one, a step past the phase means the drill never fired: inject anyway, said so.
            fallback = t.step - 1 if t.phase in ("forward", "backward") else t.step
            if self.drills:
                fallback = t.step + 1
            self._wait(lambda i: announced() or self._logged(fallback), f"the {t.phase} of step {t.step}")
            self.hit = "drill" if announced.seen else "late" if self.drills else "timed"
        self._deliver(self._layout())

    def _layout(self) -> list[str]:
        return self.jobs.describe(self.job["id"])["generations"][-1]["nodes"]

    def _logged(self, step: int) -> bool:
        for line in self.metrics.lines():
            record = json.loads(line)
            if "event" not in record:
                self.last_step = record["step"]
                self.steps_seen += 1
        return self.last_step >= step

    def _announcement(self):
        log = Tail(Path(self.jobs.describe(self.job["id"])["log_dir"]) / f"rank{self.trial.rank}.log")

        def seen() -> bool:
            if any(ANNOUNCE in line for line in log.lines()):
                seen.seen = True
            return seen.seen

        seen.seen = False
        return seen

    def _wait(self, ready, what: str) -> dict:
        """Poll until `ready(job description)`; the description is refreshed every 0.2 s."""
        info, refreshed = self.jobs.describe(self.job["id"]), time.monotonic()
        while not ready(info):
            if info["state"] in FINAL_STATES:
                raise InjectionError(f"the job ended ({info['state']}: {info['reason']}) before {what}, at "
                                     f"step {self.last_step}")
            if time.monotonic() > self.deadline:
                raise InjectionError(f"{what} not reached within {self.timeout_s:g} s (job {info['state']}, last "
                                     f"step {self.last_step})")
            time.sleep(POLL_S)
            if time.monotonic() - refreshed > 0.2:
                info, refreshed = self.jobs.describe(self.job["id"]), time.monotonic()
        return info

    # ---- the faults ---------------------------------------------------------------------------------
    def _deliver(self, layout: list[str]) -> None:
        t = self.trial
        if t.kind == "two-nodes":
            self._deliver_one("kill-node", t.rank, layout)
            self._deliver_one("kill-node", t.other, layout)
        elif t.kind == "second-fault":
            self._deliver_one("kill-node", t.rank, layout)
            time.sleep(t.delay_s)
            self._deliver_one("kill-node", t.other, layout)
        else:
            self._deliver_one(t.kind, t.rank, layout)

    def _deliver_one(self, kind: str, rank: int, layout: list[str]) -> None:
        node = layout[rank // self.wpn]
        at = time.time()
        if kind in ("kill-node", "fail-health"):
            detail = self._api(lambda: self.client.inject_fault(node, kind))["detail"]
        elif kind in ("kill-worker", "hang-worker"):  # retried while the rank's process is not running yet
            detail = self._api(lambda: self.client.inject_fault(node, kind, rank=rank), retry_409=True)["detail"]
        elif kind == "agent-death":
            detail = self._kill_agent(node)
        elif kind == "controller-restart":
            detail = self._restart_controller()
        elif kind == "slow-rank":
            detail = (f"rank {rank} sleeps inside the phase (drill)" if self.hit == "drill"
                      else self._pause_worker(rank))
        else:  # pragma: no cover - the plan validates kinds
            raise InjectionError(f"unknown fault kind {kind}")
        self.delivered.append({"kind": kind, "rank": rank, "node": node, "at": at, "hit": self.hit,
                               "step": self.last_step, "detail": detail})

    def _api(self, call, retry_409: bool = False) -> dict:
        while True:
            try:
                return call()
            except ApiError as err:
                if not (retry_409 and err.status == 409) or time.monotonic() > self.deadline:
                    raise InjectionError(f"fault refused: {err}") from None
            except ControllerUnreachable as err:
                raise InjectionError(f"fault not delivered: {err}") from None
            time.sleep(0.05)

    def _node(self, name: str) -> dict:
        return next(n for n in self.client.nodes() if n["name"] == name)

    def _kill_agent(self, node: str) -> str:
        n = self._node(node)
        marker = str(Path(n["work_dir"]) / "agent.json")
        pid = agent_pid(n)
        if not process_running(pid, marker):
            raise InjectionError(f"node {node}: agent pid {pid} is not running")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            raise InjectionError(f"node {node}: agent pid {pid} exited first") from None
        return f"SIGKILL to agent pid {pid} of {node} (its workers live on)"

    def _restart_controller(self) -> str:
        paths = self.client.paths
        pid = controller_pid(paths)
        if pid is None:
            raise InjectionError("the controller is not running")
        os.kill(pid, signal.SIGKILL)
        while process_running(pid, str(paths.root)):
            time.sleep(POLL_S)
        down = time.monotonic()
        start_controller(paths.name, timeout_s=90)
        return (f"SIGKILL to controller pid {pid}; `cluster start` had it serving again "
                f"{time.monotonic() - down:.1f} s later")

    def _pause_worker(self, rank: int) -> str:
        """A slow rank without a drill: its worker stopped for `stop_slow_s` (under the hang detector's
        threshold), then continued."""
        while True:  # in a regroup, the next generation's process may not be running yet
            info = self.jobs.describe(self.job["id"])
            pid = next((w["pid"] for w in info["workers"] if w["rank"] == rank and w["state"] == "running"
                        and w["generation"] == info["generation"] and w.get("pid")), None)
            if pid is not None:
                break
            if info["state"] in FINAL_STATES or time.monotonic() > self.deadline:
                raise InjectionError(f"rank {rank} has no running worker to slow down (job {info['state']})")
            time.sleep(0.05)
        try:
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(self.stop_slow_s)
            finally:
                os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            raise InjectionError(f"rank {rank}'s worker pid {pid} exited before it could be slowed") from None
        return f"worker pid {pid} stopped for {self.stop_slow_s:g} s, then continued"

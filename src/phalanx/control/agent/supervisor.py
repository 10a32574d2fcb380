"""The agent's workers: start the processes the controller assigns, stop the ones it no longer wants,
notice exits and hangs, and report them.

An *assignment* (in a heartbeat reply) is one generation of one job on this node:
`protocol.messages.Assignment` (job, generation, argv, env, the rendezvous, its `ranks` as `RankSlot`s),
validated by the agent when the reply arrives.

Workers are started with `protocol.worker_env`, each in a process group of its own (a stop reaches its
children) inside the node's session (killing the node kills them too). Output goes to LOG_DIR/rank{R}.log,
appended across generations, with a header and a footer line per run; where the node does not see LOG_DIR (an
assignment's `ship_log`), to the node's `job-logs/<job>/rank{R}.log`, shipped to the controller (`log_ship.py`;
the node keeps its recent jobs' logs).
A worker the controller stops gets SIGTERM (and SIGCONT, in case it is stopped), then SIGKILL after STOP_GRACE_S.

Hang detection is `hang.py`'s rule, on the progress each worker writes for its agent in this node's progress dir
(`PHALANX_PROGRESS_FILE`, one file per process started, `protocol.read_local`), read at every `poll`; warm
standbys are `standby.py`'s pool (both mixed in here). A hung
worker it kills is also a `hang` event (source "agent:<node>") in the run's events.jsonl (the assignment's
checkpoint_dir; phalanx.observability.run_events), beside the controller's own record of the hang.

Standard library and the protocol's messages only. Knows nothing about the scheduler's policy.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Callable

from phalanx import protocol
from phalanx.protocol.messages import Assignment, RankSlot
from phalanx.control.agent.hang import judge_hang
from phalanx.control.agent.log_ship import JobLogs, LogShipper
from phalanx.control.agent.slurm_allocation import ignoring_usr2
from phalanx.control.agent.standby import Standby, StandbyPool
from phalanx.control.agent.template import WAIT_S, TemplateUnavailable, WorkerTemplate, forkable, on_this_host
from phalanx.control.agent.worker import (STOP_GRACE_S, Worker, describe_exit, forget_progress,
                                          own_process_group, signal_group)
from phalanx.observability.events import EventKind, EventLog
from phalanx.observability.run_events import RunEventFiles, job_run_dir

log = logging.getLogger("phalanx.agent.workers")


class WorkerSupervisor(StandbyPool):
    def __init__(self, node: str, token: str, hang_timeout_s: float, *, wake: Callable[[], None],
                 work_dir: Path | None = None, store_addr: Callable[[], str | None] = lambda: None,
                 template: WorkerTemplate | None = None, controller_url: Callable[[], str | None] | None = None):
        self.node = node
        # (the rank logs of assignments that ask for it, shipped to the controller at `controller_url()`)
        self.shipper = LogShipper(node, token, controller_url) if controller_url is not None else None
        self.template = template  # the node's worker template (workers forked, torch already imported), if any
        self.token = token
        self.hang_timeout_s = hang_timeout_s
        self.wake = wake  # send a heartbeat now (an exit must reach the controller within one)
        self.lock = threading.Lock()
        self.workers: dict[tuple[str, int, int], Worker] = {}
        self.desired: set[tuple[str, int]] = set()
        self.held: set[str] = set()  # checkpointless jobs between generations: keep their workers as they are
        self.work_dir = work_dir
        # where each worker writes its progress: the hang rule's input, on this node (an earlier agent's go)
        if work_dir is not None:
            self.progress_dir = work_dir / "progress"
        else:  # (a supervisor with no node dir, as in tests: a directory of its own, removed with it)
            self.progress_dir = Path(tempfile.mkdtemp(prefix="phalanx-progress-"))
            weakref.finalize(self, shutil.rmtree, self.progress_dir, ignore_errors=True)
        shutil.rmtree(self.progress_dir, ignore_errors=True)
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        self.store_addr = store_addr  # the controller's store (standbys wait on it)
        self.standbys: dict[int, Standby] = {}
        self._standby_seq = 0
        self._standbys_wanted = 0  # as the last reply said (`poll` starts them once the template is ready)
        self._standbys_kept_at = 0.0  # (monotonic) when `poll` last did: at most once a second
        self.run_dirs: dict[str, Path] = {}  # job → its run dir (checkpoint_dir), from its assignments
        self.events = EventLog(f"agent:{node}", [RunEventFiles(self.run_dirs.get, what="the agent's events")])

    # ---- what the controller wants (called with each heartbeat reply) ---------------------------------
    def apply(self, assignments: list[Assignment], *, standby: int = 0) -> None:
        now = time.monotonic()
        with self.lock:
            self.held = {a.job for a in assignments if a.hold}
            assignments = [a for a in assignments if not a.hold]
            self.desired = {(a.job, a.generation) for a in assignments}
            for a in assignments:  # (a job's run dir never changes: recorded once, not at every reply)
                if a.checkpoint_dir and a.job not in self.run_dirs:
                    self.run_dirs[a.job] = job_run_dir(a.cwd, a.checkpoint_dir)
            for a in assignments:
                for r in a.ranks:
                    key = (a.job, a.generation, r.rank)
                    if key not in self.workers:
                        w = self._carry(a, r) if a.recovery == protocol.CHECKPOINTLESS else None
                        self.workers[key] = w or self._adopt(a, r) or self._start(a, r.rank, r.local_rank)
            for w in self.workers.values():
                if w.assignment not in self.desired and w.job not in self.held and w.state == "running":
                    self._stop(w, now)
            # while a job holds this node between generations, a standby the failed generation activated may
            # be the survivor the next one counts on (`_adopt`): none is stopped until that generation comes
            self._standbys_wanted = standby
            self._keep_standbys(standby, stop_extra=not self.held)

    def _carry(self, a: Assignment, r: RankSlot) -> Worker | None:
        """Checkpointless: the worker of this job on the same slot (a survivor of an older generation) serves
        the new one, in the same process. When the controller counts on that survivor (`carry`) but it died
        in the meantime, the death is this generation's: it is reported as such (its peers are regrouping with
        it and fail), and the controller starts the next generation — a fresh process here would join a
        generation its peers have already left."""
        def serves(w: Worker) -> bool:  # (one still waiting to start would start with the old generation's env)
            return (w.state == "running" and w.launch is None) or (r.carry and w.state == "exited" and not w.stopped)

        old = next((w for w in self.workers.values() if w.job == a.job and w.local_rank == r.local_rank
                    and w.generation < a.generation and serves(w)), None)
        if old is None:
            return None
        del self.workers[(old.job, old.generation, old.rank)]
        old.carried_from = [old.generation, old.rank]
        old.generation, old.rank = a.generation, r.rank
        old.last_step, old.last_beat = None, None
        old.last_change = old.last_beat_change = time.monotonic()
        if old.state == "exited":
            old.reported_exit = False
            log.warning("worker pid %d of job %s %s before it could be carried into generation %d as rank %d; "
                        "reporting it as that generation's fault", old.pid, old.job, old.detail, old.generation,
                        old.rank)
            self.wake()
            return old
        self._log_line(old, f"=== phalanx: pid {old.pid} carried into generation {old.generation} as rank "
                            f"{old.rank} (checkpointless) ===")
        log.info("worker pid %d of job %s carried into generation %d as rank %d", old.pid, old.job, old.generation,
                 old.rank)
        return old

    def _log_line(self, w: Worker, line: str) -> None:
        try:
            with open(w.log_path, "ab") as out:
                out.write((line + "\n").encode())
        except OSError as err:
            log.warning("could not write to %s: %s", w.log_path, err)

    def _start(self, a: Assignment, rank: int, local_rank: int) -> Worker:
        placement = protocol.WorkerPlacement(
            job_id=a.job, generation=a.generation, rank=rank, world_size=a.world_size,
            local_rank=local_rank, local_world_size=a.local_world_size, master_addr=a.master_addr,
            master_port=a.master_port, store_addr=a.store_addr, checkpoint_dir=a.checkpoint_dir,
            cluster_token=self.token, config_path=a.config_path, node=self.node, recovery=a.recovery or "restart",
        )
        env = protocol.worker_env(placement, base={**os.environ, **a.env})
        ship = a.ship_log and self.shipper is not None and self.work_dir is not None
        job_logs = JobLogs(self.work_dir / "job-logs") if ship else None
        log_path = job_logs.path(a.job, rank) if ship else Path(a.log_dir) / f"rank{rank}.log"
        w = Worker(a.job, a.generation, rank, local_rank, pid=None, started_at=time.time(),
                   log_path=log_path, last_change=time.monotonic(),
                   progress_file=self.progress_dir / f"{a.job}.{a.generation}.{rank}", ship_log=ship)
        if ship:
            if not log_path.parent.exists():  # a new job on this node: the logs of old ones go (all shipped)
                try:
                    log_path.parent.mkdir(parents=True)  # (an error here is `_launch`'s to report)
                    job_logs.prune(busy={a.job, *self.shipper.watched_jobs(), *(o.job for o in self.workers.values())})
                except OSError as err:
                    log.warning("could not make %s or remove old jobs' logs: %s", log_path.parent, err)
            self.shipper.watch(a.job, rank, log_path, base=job_logs.base(a.job, rank))
        env[protocol.PROGRESS_FILE] = str(w.progress_file)  # (named per process: a survivor keeps its own)
        argv = on_this_host(a.argv)
        if self.template is not None and forkable(argv) and self.template.importing():
            w.launch = (argv, env, a.cwd, time.monotonic() + WAIT_S)  # started by `poll` once the template is ready
            w.detail = "waiting for the node's worker template (importing torch)"
            self.template.hurry()
            log.info("worker rank %d/%d of job %s generation %d waits for the node's worker template (importing "
                     "torch; at most %.0f s, then exec'd)", rank, a.world_size, w.job, w.generation, WAIT_S)
            return w
        return self._launch(w, argv, env, a.cwd)

    def _launch(self, w: Worker, argv: list[str], env: dict, cwd: str) -> Worker:
        w.launch, w.detail, w.started_at, w.last_change = None, None, time.time(), time.monotonic()
        try:
            w.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(w.log_path, "ab") as out:
                out.write(f"=== phalanx: job {w.job} generation {w.generation} rank {w.rank} on node {self.node}, "
                          f"started {time.strftime('%H:%M:%S')} ===\n".encode())
                out.flush()
                w.proc, how = self._spawn(argv, env, cwd, w.log_path, out)
        except OSError as err:
            w.state, w.exit_code, w.ended_at = "exited", 127, time.time()
            w.detail = f"could not be started ({' '.join(argv)[:200]} in {cwd}): {err}"
            log.error("worker rank %d of job %s generation %d %s; reporting it, the controller decides what happens "
                      "next", w.rank, w.job, w.generation, w.detail)
            self.wake()
            return w
        w.pid = w.proc.pid
        log.info("started worker rank %d/%s of job %s generation %d (pid %d, %s, MASTER_PORT %s, log %s)", w.rank,
                 env.get(protocol.WORLD_SIZE), w.job, w.generation, w.pid, how, env.get(protocol.MASTER_PORT),
                 w.log_path)
        return w

    def _spawn(self, argv: list[str], env: dict, cwd, log_path: Path, out) -> tuple:
        """(a Popen-like process, how it started): forked from the node's worker template when it can (torch
        already imported), else a plain exec with output to `out`."""
        if self.template is not None:
            try:
                return self.template.fork(argv, env, cwd, log_path), "forked from the node's worker template"
            except TemplateUnavailable as why:
                how = f"exec'd: {why}"
        else:
            how = "exec'd"
        return subprocess.Popen(ignoring_usr2(argv), cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, **own_process_group()), how

    def _launch_due(self, w: Worker, now: float) -> None:
        """A worker waiting for the node's template: started once the template is ready, gone, or WAIT_S late."""
        argv, env, cwd, deadline = w.launch
        if self.template.importing() and now < deadline:
            self.template.hurry()  # (again: a template that had not yet lowered itself when first hurried)
            return
        if not self.template.ready:
            log.warning("the node's worker template is %s; worker rank %d of job %s is exec'd instead",
                        f"still importing after {WAIT_S:.0f} s" if self.template.importing() else "gone", w.rank,
                        w.job)
        self._launch(w, argv, env, cwd)
        self.wake()  # (its pid reaches the controller now, not at the next interval)

    def _stop(self, w: Worker, now: float) -> None:
        if w.launch is not None:  # never started: nothing to signal
            w.launch, w.stopped = None, True
            w.state, w.exit_code, w.ended_at = "exited", -signal.SIGTERM, time.time()
            w.detail = "stopped before it started (it was waiting for the node's worker template)"
            log.info("worker rank %d of job %s generation %d %s", w.rank, w.job, w.generation, w.detail)
            self.wake()
            return
        # one this agent already killed for a hang stays a hang: the controller stops a generation as soon as
        # another rank's exit arrives, often before the hung worker's own exit is seen (a forked worker's comes
        # through its template), and a stopped worker's exit is not a fault
        w.state, w.stopped, w.stop_sent_at = "stopping", w.hang is None, now
        log.info("stopping worker rank %d of job %s generation %d (pid %d): no longer assigned; SIGTERM, SIGKILL "
                 "after %.0f s", w.rank, w.job, w.generation, w.pid, STOP_GRACE_S)
        signal_group(w.pid, signal.SIGTERM)
        signal_group(w.pid, signal.SIGCONT)

    # ---- watching (a thread of the agent, every ~0.1 s) -------------------------------------------------
    def poll(self) -> None:
        now, exited, shipped = time.monotonic(), False, []
        with self.lock:
            for w in self.workers.values():
                if w.launch is not None:
                    self._launch_due(w, now)
                if w.proc is None or w.state == "exited":
                    continue
                code = w.proc.poll()
                if code is not None and w.ship_log:
                    shipped.append((w, code))  # (below, without the lock: its last lines go before its exit)
                elif code is not None:
                    self._exited(w, code)
                    exited = True
                elif w.state == "running" and not w.hang:
                    self._watch(w, now)
                elif w.state == "stopping" and not w.killed_after_grace and now - w.stop_sent_at > STOP_GRACE_S:
                    log.warning("worker rank %d of job %s (pid %d) still running %.0f s after SIGTERM; next: SIGKILL",
                                w.rank, w.job, w.pid, STOP_GRACE_S)
                    w.killed_after_grace = True
                    signal_group(w.pid, signal.SIGKILL)
            # standbys wait for the node's template (`_keep_standbys`): started once it is ready, not at the next
            # reply, which a steady agent gets only every FULL_HEARTBEAT_MAX_S or so
            if len(self.standbys) < self._standbys_wanted and self.template is not None and self.template.ready \
                    and now - self._standbys_kept_at >= 1.0:
                self._standbys_kept_at = now
                self._keep_standbys(self._standbys_wanted, stop_extra=not self.held)
        for w, code in shipped:  # its log's end reaches the controller before its exit, which ends a `job logs -f`
            self._exit_line(w, code)
            self.shipper.ship_now(w.job, w.rank)
            with self.lock:
                if w.state != "exited":  # (`stop_all` may have seen it meanwhile)
                    self._exited(w, code)
                    exited = True
        if exited:
            self.wake()

    def _watch(self, w: Worker, now: float) -> None:
        """The worker's progress as it wrote it (`protocol.read_local`): a new step or beat is noted when seen, then
        the hang rule judges. A worker that wrote none (a program that reports no progress) is not judged; one
        whose job holds this node between generations waits on purpose (not a hang); a survivor that has not
        moved to the new generation yet, or that left its generation and waits for the next, has no step in it
        (regrouping)."""
        if w.job in self.held:
            w.last_change = w.last_beat_change = now
            return
        seen = protocol.read_local(w.progress_file) if w.progress_file is not None else None
        if seen is None:
            return
        generation, step, beat = seen
        if generation == w.generation and step != w.last_step:  # (no step: it left its generation, regrouping)
            w.last_step, w.last_change = step, now
        if beat != w.last_beat:
            w.last_beat, w.last_beat_change = beat, now
        self._judge_hang(w, now)

    def _judge_hang(self, w: Worker, now: float) -> None:
        verdict = judge_hang(w, now, self.hang_timeout_s)
        if verdict is None:
            return
        w.hang, w.frozen = verdict.hang, verdict.frozen
        log.error("worker rank %d of job %s generation %d (pid %d) hung, %s; next: SIGKILL it and report the hang",
                  w.rank, w.job, w.generation, w.pid, w.hang)
        signal_group(w.pid, signal.SIGKILL)
        self.events.emit(EventKind.HANG, w.hang, job=w.job, node=self.node, generation=w.generation, rank=w.rank,
                         pid=w.pid, frozen=w.frozen)  # (a run file it cannot write is a warning, never raised)

    def _exit_line(self, w: Worker, code: int) -> None:
        if w.exit_logged:  # (once: `poll` writes it before shipping, `stop_all` may meet the same exit)
            return
        w.exit_logged = True
        how = (" (stopped by its agent)" if w.stopped else "") + (f" (hung: {w.hang})" if w.hang else "")
        self._log_line(w, f"=== phalanx: rank {w.rank} {describe_exit(code)}{how} ===")

    def _exited(self, w: Worker, code: int) -> None:
        w.state, w.exit_code, w.ended_at = "exited", code, time.time()
        forget_progress(w.progress_file)
        w.detail = describe_exit(code)
        self._exit_line(w, code)
        if w.stopped:
            log.info("worker rank %d of job %s generation %d stopped (%s)", w.rank, w.job, w.generation, w.detail)
        elif code != 0 and not w.hang:
            log.warning("worker rank %d of job %s generation %d (pid %d) %s; reporting it, the controller decides "
                        "what happens next", w.rank, w.job, w.generation, w.pid, w.detail)
        else:
            log.info("worker rank %d of job %s generation %d %s", w.rank, w.job, w.generation, w.detail)

    # ---- reporting -------------------------------------------------------------------------------------
    def report(self) -> list[dict]:
        with self.lock:
            return [w.as_report() for w in self.workers.values()]

    def acknowledged(self, reported: list[dict]) -> None:
        """A heartbeat carrying `reported` was answered: exits in it are known to the controller. Forget
        exited workers the controller no longer assigns."""
        with self.lock:
            for r in reported:
                w = self.workers.get((r["job"], r["generation"], r["rank"]))
                if w is not None and r["state"] == "exited":
                    w.reported_exit = True
            # (a checkpointless job between generations keeps its exited workers: the next generation may
            # count on one of them as a survivor, see `_carry`)
            for key in [k for k, w in self.workers.items() if w.state == "exited" and w.reported_exit
                        and w.assignment not in self.desired and w.job not in self.held]:
                del self.workers[key]

    def exit_codes(self) -> dict[int, int | None]:
        """Rank → exit code (None while running) of the workers currently assigned (the workers check)."""
        with self.lock:
            return {w.rank: w.exit_code for w in self.workers.values() if w.assignment in self.desired}

    def stop_all(self, grace_s: float = STOP_GRACE_S) -> None:
        """The agent is exiting: SIGTERM every worker, SIGKILL what is left after `grace_s`."""
        with self.lock:
            self._keep_standbys(0)
            self.desired, self.held = set(), set()
            for w in self.workers.values():
                if w.launch is not None:
                    self._stop(w, time.monotonic())
            running = [w for w in self.workers.values() if w.proc is not None and w.state != "exited"]
            for w in running:
                if w.state == "running":
                    self._stop(w, time.monotonic())
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in running):
            time.sleep(0.05)
        for w in running:
            if w.proc.poll() is None:
                log.warning("worker rank %d of job %s (pid %d) ignored SIGTERM; SIGKILL", w.rank, w.job, w.pid)
                signal_group(w.pid, signal.SIGKILL)
            code = w.proc.wait()
            with self.lock:
                if w.state != "exited":  # (the watch thread may have seen it first)
                    self._exited(w, code)
        if self.shipper is not None:
            self.shipper.close()  # (the exit lines just written too)
        if self.template is not None:
            self.template.close()

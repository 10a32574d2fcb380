"""The job scheduler: turns submitted jobs into generations of workers on healthy nodes, and heals them.

It runs inside the controller, in two places:
  heartbeats   `ingest()` records what an agent reports about its workers (pid, state, exit code, hang);
               `assignments()` tells the node which workers to run, with each rank's progress read from the
               rendezvous store (the agent's hang detector judges it)
  each tick    `observe()` (before node recovery): a generation whose ranks all exited 0 succeeds the job; a
               fault stops the generation; a stopped generation is classified and the job is set to restart
               or fail. `advance()` (after node recovery, so a promoted spare is already a member): start the
               next generation of pending and recovering jobs on free healthy nodes, or wait for them

Like the reconciler it decides only from SQLite, so a restarted controller carries on where the last one
stopped and running workers are left alone (their generation is still the one assigned).

Fault policy, decided once every worker of the generation is confirmed gone:
  node fault   a node of the job is not healthy (agent gone, heartbeat lost, health check failed) or one of
               its workers froze (the node is marked faulty here; the reconciler replaces it from the spare
               pool). With auto-resume the job restarts on healthy nodes — the survivors plus promoted spares,
               waiting for one if none is free — and resumes from its newest checkpoint; without, it fails
  restart-job  a node's health check failed with the action "restart-job" (an application-level GPU XID:
               13, 31, 43, …): the node stays; with auto-resume the job restarts on the same nodes from its
               newest checkpoint (not counted against max_retries); without, it fails
  app error    a worker exited non-zero while every node is healthy, or every rank stalled alive (a deadlock;
               see workers.py): the job restarts on the same nodes, up to max_retries times, then fails

Checkpointless jobs end a generation by a hardware-like fault without stopping its survivors: that policy,
and what their workers report through the store, is `inplace.InPlaceRecovery`.

Every generation gets a fresh MASTER_PORT (picked free on the rank-0 node), so a restart never meets the
previous generation's rendezvous. One log line per fault says what happened and what happens next.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from phalanx import protocol
from phalanx.control.agent.health import restart_job_failures
from phalanx.control.policy.inplace import NODE_FAULTS, InPlaceRecovery
from phalanx.control.policy.straggler_policy import StragglerPolicy
from phalanx.control.policy.stragglers import StragglerWatch
from phalanx.control.state.jobs import FaultKind, Outcome, ACTIVE, Generation, Job, JobRecords, JobState, WorkerRecord
from phalanx.control.state.store import Node, NodeState, Store
from phalanx.control.policy.admission import Admission
from phalanx.control.policy.assignments import Assignments, all_ranks_exited_0
from phalanx.control.policy.elastic import Elasticity
from phalanx.observability.events import EventKind as E

log = logging.getLogger("phalanx.scheduler")
J, S = JobState, NodeState


class JobScheduler(Admission, Assignments, StragglerPolicy, Elasticity):
    """Admission (`admission.py`), the heartbeat side (`assignments.py`), the straggler policy (`straggler_policy.py`)
    and elastic sizes (`elastic.py`) are its mixins; the generations' lifecycle and the fault policy are here."""

    def __init__(self, store: Store, backend, *, jobs_root: Path,
                 read_progress: Callable[..., dict[int, dict] | None] | None,  # protocol.read_progress's
                 store_addr: Callable[[], str | None], rendezvous=None,
                 clock: Callable[[], float] = time.time):
        self.store = store
        self.clock = clock  # the time policy decides by (tests drive a fake one)
        self.backend = backend
        self.spec = store.spec()
        self.records = JobRecords(store)
        self.jobs_root = jobs_root
        self.read_progress = read_progress
        self.store_addr = store_addr
        self.rendezvous = rendezvous  # the controller's TCPStore (checkpointless generations, warm standbys)
        self.token = ""  # the cluster token: workers' env; signs standby assignments (set by the controller)
        self.lock = threading.RLock()  # heartbeats (API threads) and ticks (reconciler thread) take turns
        self._said: dict[str, str] = {}  # job → the waiting line last logged
        self._shown: tuple | None = None  # the active jobs `_show_node_jobs` last wrote into the nodes' rows
        self._steps_read: dict[str, float] = {}  # job → when a tick last read its ranks' steps
        self.inplace = InPlaceRecovery(store, self.records, self.spec, rendezvous, clock)  # checkpointless jobs
        self._watches: dict[tuple[str, int], StragglerWatch] = {}  # (job, generation) → the straggler rule's state
        self._flagged: dict[str, list[dict]] = {}  # job → its stragglers so far (`stragglers()`)
        self._grow_seen: dict[str, float] = {}  # elastic job → since when free nodes would let it grow
        self._time_limits: dict[str, float] = {}  # node → the time-limit warning its agent relayed (handled)
        self._asked_at: dict[str, float] = {}  # job → when a time-limit warning last asked it for a checkpoint
        self._nodes_fine: dict[str, tuple] = {}  # job → (generation, `Store.version`) at which its nodes were fine

    # ---- ticks: observe (before node recovery) ------------------------------------------------------
    def observe(self, now: float, mark_faulty: Callable[[Node, str, str], None]) -> None:
        fetched = self._fetch_running(now)  # (the store's round trips, before the lock heartbeats are answered under)
        with self.lock:
            for job in self.records.jobs((J.RUNNING,)):
                gen = self.records.generation(job.id, job.generation)
                if gen is not None and gen.stop_at is None:
                    self._check_running(job, gen, now, mark_faulty, fetched.get((job.id, gen.generation)))
            for gen in self.records.generations(open_only=True):
                if gen.stop_at is not None:
                    self._finish_stopping(gen, now, mark_faulty)
            self._show_node_jobs()

    def _check_running(self, job: Job, gen: Generation, now: float, mark_faulty, fetched: tuple | None = None) -> None:
        rows = self.records.workers(job=job.id, generation=gen.generation)
        done = all_ranks_exited_0(job, rows)
        if done:  # its last steps, in full: they reached the store before each worker exited
            fetched = self._fetch_steps(job, gen, [w.rank for w in rows], all_or_none=False)
        if fetched is not None:
            self._record_steps(job, gen, fetched)
            rows = self.records.workers(job=job.id, generation=gen.generation)  # (with the steps just read)
        self._track_progress(job, gen, rows, now)
        self._judge_stragglers(job, gen, rows, mark_faulty)
        if done:
            done = f"all {job.world_size} ranks exited 0"
            self.records.update_generation(job.id, gen.generation, stop_at=now, ended_at=now, outcome=Outcome.SUCCEEDED,
                                           end_reason=done)
            step = self.records.job(job.id).last_step
            self.records.transition(job.id, J.SUCCEEDED, done + (f" (last step {step})" if step is not None else ""))
            log.info("job %s succeeded: %s after %d attempts", job.id, done, job.attempts)
            return
        self.inplace.note_restored(job, gen)
        if self.inplace.finished(job, gen, rows, now):
            return
        faults = self._faults(job, gen, rows) or self.inplace.stranded(job, gen, now)
        if not faults:
            return
        self._record_faults(job, gen, faults, mark_faulty)
        if job.recovery == protocol.CHECKPOINTLESS and all(self.inplace.recoverable(f) for f in faults):
            looping = self.inplace.regroup_failing(job, gen)
            if looping is None:
                return self.inplace.recover(job, gen, faults)
            faults = self._record_faults(job, gen, [looping], mark_faulty)
        # stop_at: taken now, under the lock — a reply with a later sent_at no longer carries this generation
        self.records.update_generation(job.id, gen.generation, stop_at=self.clock())
        first = faults[0]["detail"]
        self.records.transition(job.id, J.RECOVERING, f"generation {gen.generation} stopping: {first}")
        log.warning("job %s generation %d: %s; next: stop its other workers, then restart or fail the job by the "
                    "fault policy", job.id, gen.generation, first)

    def _faults(self, job: Job, gen: Generation, rows: list[WorkerRecord]) -> list[dict]:
        found = self._node_faults(job, gen)
        for w in rows:
            if w.state == "exited" and not w.stopped and w.exit_code != 0:
                if w.hang:
                    found.append({"kind": FaultKind.HANG if w.frozen else FaultKind.STALL, "node": w.node, "rank": w.rank,
                                  "time": w.ended_at,
                                  "detail": f"rank {w.rank} on {w.node} hung ({w.hang}); killed by its agent"})
                else:
                    found.append({"kind": FaultKind.EXIT, "node": w.node, "rank": w.rank, "time": w.ended_at,
                                  "code": w.exit_code, "detail": f"rank {w.rank} on {w.node} {w.detail}"})
        return found

    def _node_faults(self, job: Job, gen: Generation) -> list[dict]:
        """The nodes not healthy, or whose health check asks for a job restart; not scanned again while nothing was
        written since a scan that found none (`Store.version`; 4,096 nodes: 25-110 ms a tick, under the lock)."""
        seen, found = (gen.generation, self.store.version), []
        if seen[1] is not None and self._nodes_fine.get(job.id) == seen:
            return found
        for name in gen.nodes:
            node = self.store.node(name)
            if node is None or node.state != S.HEALTHY:
                why = (node.reason or "").splitlines()[0] if node else "unknown node"
                found.append({"kind": FaultKind.NODE, "node": name, "rank": None, "time": self.clock(),
                              "detail": f"node {name} {node.state.value if node else 'gone'}: {why}"})
            elif failed := restart_job_failures(node.health, since=gen.started_at):
                what = "; ".join(f"{c['name']}: {c['detail']}" for c in failed)
                found.append({"kind": FaultKind.RESTART_JOB, "node": name, "rank": None, "time": node.health["checked_at"],
                              "detail": f"node {name} health check asks for a job restart ({what})"})
        if seen[1] is not None and not found:
            self._nodes_fine[job.id] = seen
        return found

    def _record_faults(self, job: Job, gen: Generation, faults: list[dict], mark_faulty) -> list[dict]:
        current = self.records.generation(job.id, gen.generation).faults
        have = {(f["kind"], f["node"], f["rank"]) for f in current}
        new = [f for f in faults if (f["kind"], f["node"], f["rank"]) not in have]
        if not new:
            return current
        for f in new:
            if f["kind"] == FaultKind.HANG:
                self.store.record_event(E.HANG, f["detail"], node=f["node"], job=job.id)
                node = self.store.node(f["node"])
                if node is not None and node.state == S.HEALTHY:
                    mark_faulty(node, f"worker {f['detail']} (a hang is a node fault)", "hang")
        self.records.update_generation(job.id, gen.generation, faults=current + new)
        return current + new

    def _track_progress(self, job: Job, gen: Generation, rows: list[WorkerRecord], now: float) -> None:
        steps = [w.step for w in rows]
        if len(steps) < job.world_size or any(s is None for s in steps):
            return
        step = min(steps)
        if gen.start_step is None:
            self.records.update_generation(job.id, gen.generation, start_step=step, last_step=step)
        elif gen.first_step_at is None and step > gen.start_step:
            self.records.update_generation(job.id, gen.generation, first_step_at=now)
        if step != gen.last_step:
            self.records.update_generation(job.id, gen.generation, last_step=step)
        if step != job.last_step:
            self.records.update_job(job.id, last_step=step)

    def _stop_generation(self, job: Job, reason: str) -> None:
        gen = self.records.generation(job.id, job.generation) if job.generation else None
        if gen is not None and gen.stop_at is None:
            self.records.update_generation(job.id, gen.generation, stop_at=self.clock(), end_reason=reason)

    def _finish_stopping(self, gen: Generation, now: float, mark_faulty) -> None:
        job = self.records.job(gen.job)
        fault_path = job.state == J.RECOVERING and job.generation == gen.generation
        if fault_path:  # late evidence (a hang report, a node found faulty) still counts
            rows = self.records.workers(job=job.id, generation=gen.generation)
            self._record_faults(job, gen, self._faults(job, gen, rows), mark_faulty)
        if not self._all_stopped(gen):
            return
        if not fault_path:
            self.records.update_generation(job.id, gen.generation, ended_at=now, outcome=Outcome.CANCELLED
                                           if job.state == J.CANCELLED else job.state.value)
            return
        self._conclude(job, self.records.generation(job.id, gen.generation), now)

    def _all_stopped(self, gen: Generation) -> bool:
        live: dict[str, list] = {}  # node → its live rows (one read of the generation, not one per node)
        for w in self.records.workers(job=gen.job, generation=gen.generation):
            if w.live:
                live.setdefault(w.node, []).append(w)
        for name in gen.nodes:
            node = self.store.node(name)
            rows = live.get(name, [])
            gone = node is None or node.state == S.TERMINATED or (node.handle and self.backend.gone(node))
            if gone:
                if node is not None and node.state != S.TERMINATED:
                    self.backend.kill(node)  # whatever of the node survived its agent dies with it
                for w in rows:
                    self.records.update_worker(w.job, w.generation, w.rank, state="lost",
                                               detail=f"its node {name} is gone")
                continue
            if (node.acked_at or 0) < gen.stop_at or rows:
                return False
        return True

    def _conclude(self, job: Job, gen: Generation, now: float) -> None:
        """Every worker of the stopped generation is gone: classify the faults and restart or fail."""
        looping = [f for f in gen.faults if f["kind"] == FaultKind.REGROUP_FAILED]
        if looping:  # not in place again: fresh processes, on healthy nodes, from the newest checkpoint
            return self._resume_or_fail(job, gen, now, Outcome.REGROUP_FAILED, looping[0]["detail"],
                                        "with fresh processes on healthy nodes", "on healthy nodes")
        node_faults = [f for f in gen.faults if f["kind"] in NODE_FAULTS]
        if node_faults:
            root = next((f for f in node_faults if f["kind"] == FaultKind.HANG), node_faults[0])
            bad = sorted({f["node"] for f in node_faults})
            self.records.update_job(job.id, node_faults=job.node_faults + 1)
            return self._resume_or_fail(job, gen, now, Outcome.NODE_FAULT, root["detail"],
                                        f"on healthy nodes (replacing {', '.join(bad)})", "on a replacement node")
        gpu = [f for f in gen.faults if f["kind"] == FaultKind.RESTART_JOB]
        if gpu:  # the node is sound, the job's processes on it are not: restart on the same nodes, not a retry
            return self._resume_or_fail(job, gen, now, Outcome.RESTART_JOB, gpu[0]["detail"], "on the same nodes",
                                        "on the same nodes")
        exits = sorted((f for f in gen.faults if f["kind"] in (FaultKind.EXIT, FaultKind.STALL)), key=lambda f: f["time"] or 0)
        root = exits[0]["detail"] if exits else gen.end_reason or "generation stopped"
        self.records.update_generation(job.id, gen.generation, ended_at=now, outcome=Outcome.APP_ERROR, end_reason=root)
        if job.retries < job.max_retries:
            why = (f"{root} (application error: every node healthy); next: retry {job.retries + 1}/"
                   f"{job.max_retries} on the same nodes")
            self.records.update_job(job.id, retries=job.retries + 1, reason=why)
            self.store.record_event(E.RECOVERY, why, job=job.id)
            log.warning("job %s generation %d: %s", job.id, gen.generation, why)
        else:
            why = (f"{root} (application error: every node healthy); {job.retries} retries used "
                   f"(max_retries={job.max_retries}), so the job is not restarted")
            self.records.transition(job.id, J.FAILED, why)
            log.error("job %s failed: %s", job.id, why)

    def _resume_or_fail(self, job: Job, gen: Generation, now: float, outcome: str, detail: str, where: str,
                        hint: str) -> None:
        """A fault that is not the application's: with auto-resume the job restarts `where` (`advance` starts
        the next generation), without it the job fails and says how to get the restart."""
        self.records.update_generation(job.id, gen.generation, ended_at=now, outcome=outcome, end_reason=detail)
        if job.auto_resume:
            resume = "from the newest checkpoint" if job.kind == "train" else "(the command is run again)"
            why = f"{detail}; next: restart {where} {resume}"
            self.records.update_job(job.id, reason=why)
            self.store.record_event(E.RECOVERY, why, job=job.id)
            log.warning("job %s generation %d ended (%s): %s", job.id, gen.generation, outcome, why)
        else:
            why = (f"{detail}; auto-resume is off, so the job is not restarted (submit with --auto-resume to "
                   f"restart it {hint} from its newest checkpoint)")
            self.records.transition(job.id, J.FAILED, why)
            log.error("job %s failed: %s", job.id, why)

    def _show_node_jobs(self) -> None:
        """nodes.job (shown by `cluster list-nodes`) = the active job holding the node; looked at again only when
        the active jobs or their generations changed (every node, every tick, was a tenth of a tick at 4,096)."""
        active = self.records.jobs(ACTIVE)
        shown = tuple((j.id, j.generation, j.state, len(j.nodes)) for j in active)
        if shown == self._shown:
            return
        holder = {n: j.id for j in active for n in j.nodes}
        self.store.update_nodes({node.name: {"job": holder.get(node.name)} for node in
                                 self.store.nodes(include_terminated=False) if node.job != holder.get(node.name)})
        self._shown = shown

    def relaunched_since(self) -> float | None:
        """The start of the oldest generation that a fault or a resize began and that has not made its first step
        yet (None: there is none, or a job is between generations and may be waiting for a node). The reconciler
        holds spare refills back meanwhile (`Reconciler.refill`)."""
        with self.lock:
            if self.records.jobs((J.RECOVERING,)):
                return None
            starts = [gen.started_at for job in self.records.jobs((J.RUNNING,))
                      if (gen := self.records.generation(job.id, job.generation)) is not None
                      and gen.generation > 1 and gen.first_step_at is None]
            return min(starts, default=None)

    # ---- ticks: advance (after node recovery) -------------------------------------------------------
    def advance(self, now: float) -> None:
        with self.lock:
            self.rescale(now)  # elastic jobs: requests, preemption, growth (elastic.py)
            waiting = [j for j in self.records.jobs((J.RECOVERING,))
                       if (g := self.records.generation(j.id, j.generation)) is not None and g.ended_at is not None]
            pending = sorted(self.records.jobs((J.PENDING,)), key=lambda j: (-j.priority, j.seq))
            for job in waiting + pending:
                nodes, why = self._choose_nodes(job)
                if nodes is None:
                    self._wait(job, why)
                else:
                    self._launch(job, nodes)

    def _usable(self, job: Job) -> tuple[list[str], list[str]]:
        """(the job's own nodes it can keep, free nodes it could take): healthy members of its group that no other
        job holds and no other job's worker still runs on (a stopped generation's nodes are confirmed clean)."""
        taken = {n for j in self.records.jobs(ACTIVE) if j.id != job.id for n in j.nodes}
        taken |= {n for g in self.records.generations(open_only=True) if g.job != job.id for n in g.nodes}
        # (a node this job's own resize left is busy too until its workers have exited)
        live_workers = {w.node for w in self.records.workers()
                        if w.live and (w.job != job.id or w.node not in job.node_index)}
        ok = [n.name for n in self.store.nodes(include_terminated=False)
              if n.state == S.HEALTHY and not n.is_spare and n.group == job.group_name and n.name not in taken
              and n.name not in live_workers]
        usable = set(ok)
        return [n for n in job.nodes if n in usable], [n for n in ok if n not in job.node_index]

    def _choose_nodes(self, job: Job) -> tuple[list[str] | None, str]:
        keep, free = self._usable(job)
        if job.elastic is not None:  # as many replicas as fit, from min up to its cap (elastic.py)
            return self.elastic_nodes(job, keep, free)
        nodes = self.store.nodes(include_terminated=False)
        ok = set(keep) | set(free)
        need = job.nodes_requested - len(keep)
        if len(free) < need:
            if job.state == J.PENDING:
                return None, (f"waiting for {job.nodes_requested} free healthy nodes of group {job.group_name} "
                              f"({len(free)} free now)")
            lost = [n for n in job.nodes if n not in ok and self._node_state(n) != S.HEALTHY] or \
                [n for n in job.nodes if n not in ok]
            spares = [n for n in nodes if n.group == job.group_name and n.is_spare]
            pool = (f"{sum(n.state == S.HEALTHY for n in spares)} healthy spares, "
                    f"{sum(n.state != S.HEALTHY for n in spares)} being provisioned")
            why = f"waiting for {need - len(free)} healthy node(s) to replace {', '.join(lost)} (spare pool: {pool})"
            if self.spec.node_recovery == "none":
                why += "; node_recovery=none, so none is coming: cancel the job or repair the cluster"
            return None, why
        chosen = [n if n in ok else free.pop(0) for n in job.nodes]
        chosen += free[:job.nodes_requested - len(chosen)]
        return chosen, ""

    def _node_state(self, name: str) -> NodeState | None:
        node = self.store.node(name)
        return node.state if node else None

    def _wait(self, job: Job, why: str) -> None:
        if self._said.get(job.id) != why:
            self._said[job.id] = why
            self.records.update_job(job.id, reason=why)
            self.store.record_event(E.WAITING, why, job=job.id)
            log.info("job %s %s", job.id, why)

    def _launch(self, job: Job, nodes: list[str]) -> None:
        self._said.pop(job.id, None)
        g = job.generation + 1
        first = self.store.node(nodes[0])
        addr, port = self.backend.node_host(first), self.backend.free_port(first)
        gen = self.records.add_generation(job.id, g, nodes, addr, port, self.store_addr())
        per = job.workers_per_node
        self._publish(job, gen)
        layout = ", ".join(f"{n}: ranks {i * per}-{i * per + per - 1}" if per > 1 else f"{n}: rank {i}"
                           for i, n in enumerate(nodes))
        what = f"generation {g} on {len(nodes)} nodes ({layout}); MASTER_ADDR={addr} MASTER_PORT={port}"
        prev = self.records.generation(job.id, g - 1) if g > 1 else None
        if prev is not None and prev.outcome == Outcome.STRANDED:
            what += "; checkpointless: every process regroups in place"
        elif prev is not None and self.inplace.in_place(job, prev):
            what += "; checkpointless: survivors regroup in place, replacements restore from peers' memory"
        elif g > 1:
            what += "; resuming from the newest checkpoint" if job.kind == "train" else "; restarting the command"
        self.records.transition(job.id, J.RUNNING, what, generation=g, attempts=job.attempts + 1, nodes=nodes,
                                nodes_requested=len(nodes))
        self.store.record_event(E.GENERATION, what, job=job.id)
        log.info("job %s: %s", job.id, what)

    def _say(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said[key] = line
            log.warning(line)

"""The controller's side of checkpointless recovery: generations that end without stopping their survivors.

`JobScheduler` asks this policy, for a `--recovery checkpointless` job:

  recoverable   is a fault one the survivors recover from in their own processes (a node's fault, a process
                killed by a signal, a collective broken with nobody dead) rather than the application's?
  recover       end the generation at once (outcome node-fault | process-fault | stranded), survivors kept
  survivor_slots / standby_nodes
                which slots of the next generation a carried survivor serves, and which nodes' ranks a warm
                standby may take
  stranded      ranks left the generation (`protocol.left_key`) and no real fault followed within a heartbeat
                timeout: a network error; a fault of its own, so nobody waits out a timeout
  finished      rank 0 reported the last step done everywhere (`protocol.finished_key`): exits after that,
                or workers whose node stopped relaying, end the job as succeeded
  note_restored the new rank 0's report of how it restored (`protocol.recovered_key`) becomes the generation's
                `restored` and the controller's events
  republish     a restarted controller's store is empty: publish every active job's generation again

It decides from SQLite and the rendezvous store only, like the scheduler; it keeps in memory only when it
first saw ranks leave a generation. Knows nothing about models or training state.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Callable

from phalanx import protocol
from phalanx.protocol.messages import RecoverySummary
from phalanx.control.state.jobs import FaultKind, Outcome, ACTIVE, Generation, Job, JobRecords, JobState, WorkerRecord
from phalanx.control.state.store import NodeState, Store
from phalanx.observability.events import EventKind as E

log = logging.getLogger("phalanx.scheduler")
J, S = JobState, NodeState
NODE_FAULTS = (FaultKind.NODE, FaultKind.HANG)
IN_PLACE_OUTCOMES = (Outcome.NODE_FAULT, Outcome.PROCESS_FAULT, Outcome.STRANDED)
MAX_FAILED_REGROUPS = 3  # in-place recoveries in a row that never restored: then restart from the checkpoint


class InPlaceRecovery:
    def __init__(self, store: Store, records: JobRecords, spec, rendezvous=None,
                 clock: Callable[[], float] = time.time):
        self.store, self.records, self.spec = store, records, spec
        self.clock = clock  # the scheduler's clock
        self.rendezvous = rendezvous  # the controller's TCPStore
        self._left_seen: dict[tuple[str, int], float] = {}  # (job, generation) → when ranks were seen leaving it

    # ---- who serves the next generation ----------------------------------------------------------------
    def in_place(self, job: Job, gen: Generation) -> bool:
        """The generation ended by a fault its survivors recover from in their own processes."""
        return job.recovery == protocol.CHECKPOINTLESS and gen.outcome in IN_PLACE_OUTCOMES

    def _previous_in_place(self, job: Job, gen: Generation) -> Generation | None:
        if job.recovery != protocol.CHECKPOINTLESS or gen.generation == 1:  # (asked on every heartbeat)
            return None
        prev = self.records.generation(job.id, gen.generation - 1)
        return prev if prev is not None and self.in_place(job, prev) else None

    def survivor_slots(self, job: Job, gen: Generation) -> set[tuple[str, int]]:
        """The (node, local rank) slots of `gen` a surviving process of the previous generation must serve —
        every slot of a node kept from it, except the slots whose process was a fault there. The agent
        reports such a survivor that died before it could be carried as a fault of `gen` (its peers are
        already regrouping with it), never silently starting a fresh process in its place."""
        prev = self._previous_in_place(job, gen)
        if prev is None:
            return set()
        per = job.workers_per_node
        faulted = {(f["node"], f["rank"] % per) for f in prev.faults if f.get("rank") is not None}
        return {(n, i) for n in gen.nodes if n in prev.node_index for i in range(per)} - faulted

    def carried_standbys(self, job: Job, gen: Generation) -> dict[tuple[str, int], str]:
        """Slots of `gen` whose survivor is a warm standby that an earlier generation activated through the
        store (the standby starts at once; its agent adopts it with its next heartbeat reply). When that
        generation failed before the agent heard of it, the agent still holds the process as an idle standby:
        naming it here lets the agent adopt it as the slot's survivor instead of starting a second process
        for the same rank."""
        out: dict[tuple[str, int], str] = {}
        per, later = job.workers_per_node, gen
        while (prev := self._previous_in_place(job, later)) is not None:
            for node in set(gen.nodes) & set(prev.nodes):
                for i in range(per):
                    sid = prev.standbys.get(str(protocol.rank_of(prev.node_index, node, i, per)))
                    if sid is not None:
                        out.setdefault((node, i), sid)
            later = prev
        return out

    def standby_nodes(self, job: Job, gen: Generation) -> list[str]:
        """Nodes of `gen` whose ranks a warm standby may take: every node of a training job's generation,
        except those whose workers survive into it."""
        if job.kind != "train":
            return []
        prev = self._previous_in_place(job, gen)
        return list(gen.nodes) if prev is None else [n for n in gen.nodes if n not in prev.node_index]

    # ---- faults ------------------------------------------------------------------------------------------
    @staticmethod
    def recoverable(fault: dict) -> bool:
        """A node's fault, a process killed by a signal (or one that gave up on a generation it was stuck in,
        `protocol.EXIT_STUCK`), or a broken collective: the peers' state is intact. A worker that exited with
        another error code (a bug, a bad batch) or a stall is the application's."""
        code = fault.get("code") or 0
        killed = fault["kind"] == FaultKind.EXIT and (code < 0 or code == protocol.EXIT_STUCK)
        return fault["kind"] in (*NODE_FAULTS, FaultKind.STRANDED) or killed

    def stranded(self, job: Job, gen: Generation, now: float) -> list[dict]:
        """Ranks left the generation after a failed collective, yet no worker exited and every node is healthy
        past the time a real fault takes to show (a heartbeat timeout): a network error broke the collective.
        Without a new generation the survivors would wait out their recovery timeout, so this is a fault of
        its own, recovered in place with every process."""
        if job.recovery != protocol.CHECKPOINTLESS or self.rendezvous is None:
            return []
        try:
            left = self.rendezvous.add(protocol.left_key(job.id, gen.generation), 0)
        except RuntimeError:
            return []
        key = (job.id, gen.generation)
        if not left:
            self._left_seen.pop(key, None)
            return []
        first = self._left_seen.setdefault(key, now)
        grace = self.spec.health.heartbeat_timeout_s + 2 * self.spec.health.heartbeat_interval_s
        if now - first < grace:
            return []
        del self._left_seen[key]
        return [{"kind": FaultKind.STRANDED, "node": None, "rank": None, "time": first,
                 "detail": f"{left} rank(s) left generation {gen.generation} after a failed collective and no "
                           f"worker or node fault followed within {grace:g} s (a network error?)"}]

    def regroup_failing(self, job: Job, gen: Generation) -> dict | None:
        """A fault of its own when `gen` is the MAX_FAILED_REGROUPS-th recovery in a row to fail before it
        restored any state: recovering in place again would loop, so the job restarts from its checkpoint
        with fresh processes (outcome regroup-failed). None otherwise."""
        failed, g = 0, self.records.generation(job.id, gen.generation) or gen
        while g.restored is None and (prev := self._previous_in_place(job, g)) is not None:
            failed, g = failed + 1, prev
        if failed < MAX_FAILED_REGROUPS:
            return None
        return {"kind": FaultKind.REGROUP_FAILED, "node": None, "rank": None, "time": self.clock(),
                "detail": f"{failed} in-place recoveries in a row failed before restoring any state (generations "
                          f"{gen.generation - failed + 1}-{gen.generation})"}

    def recover(self, job: Job, gen: Generation, faults: list[dict]) -> None:
        """End the generation now without stopping its survivors; the failed ranks' nodes are replaced (or,
        for a killed process on a healthy node, the node keeps its place) and the scheduler's `advance`
        starts the next generation, which the survivors join from their own processes."""
        now = self.clock()
        node_fault = any(f["kind"] in NODE_FAULTS for f in faults)
        first = faults[0]["detail"]
        bad = sorted({f["node"] for f in faults if f["kind"] in NODE_FAULTS})
        stranded = all(f["kind"] == FaultKind.STRANDED for f in faults)
        outcome = Outcome.NODE_FAULT if node_fault else Outcome.STRANDED if stranded else Outcome.PROCESS_FAULT
        self.records.update_generation(job.id, gen.generation, stop_at=now, ended_at=now, end_reason=first,
                                       outcome=outcome)
        if node_fault:
            self.records.update_job(job.id, node_faults=job.node_faults + 1)
        for w in self.records.workers(job=job.id, generation=gen.generation):
            if w.node in bad and w.live:  # nobody reports them again: the agent died with its node, or kills them
                self.records.update_worker(job.id, gen.generation, w.rank, state="lost",
                                           detail=f"its node {w.node} failed; not carried into the next generation")
        if stranded:
            what = (f"{first}; next: every process regroups in generation {gen.generation + 1} on the same nodes "
                    f"and continues from the newest step all of them hold")
        else:
            what = (f"{first}; next: survivors keep running and wait for generation {gen.generation + 1}"
                    + (f" with {', '.join(bad)} replaced" if bad else " (a new process in the failed one's place)")
                    + "; the lost state comes from peers' memory where they hold it, else from the newest "
                      "checkpoint (the generation's state_restored event says which)")
        self.records.transition(job.id, J.RECOVERING, what)
        self.store.record_event(E.RECOVERY, what, job=job.id)
        log.warning("job %s generation %d (checkpointless): %s", job.id, gen.generation, what)

    # ---- what the workers report -------------------------------------------------------------------------
    def finished(self, job: Job, gen: Generation, rows: list[WorkerRecord], now: float) -> bool:
        """Once rank 0 has said training finished (every rank past the last step and the final checkpoint), a
        rank that dies on its way out loses nothing: wait for all to exit, then succeed. True once handled."""
        if job.recovery != protocol.CHECKPOINTLESS or self.rendezvous is None:
            return False
        try:
            if not self.rendezvous.check([protocol.finished_key(job.id)]):
                return False
            finished = json.loads(self.rendezvous.get(protocol.finished_key(job.id)))
        except (RuntimeError, ValueError):
            return False
        # a worker on a node that is no longer healthy may never be reported again (its agent froze, or was
        # terminated before it could report the exit): training finished, so it is not waited for
        nodes = {n: self.store.node(n) for n in gen.nodes}
        unhealthy = {n: node.state.value if node else "gone" for n, node in nodes.items()
                     if node is None or node.state != S.HEALTHY}
        if any(w.state != "exited" and w.node not in unhealthy for w in rows):
            return True  # the others are on their way out
        bad = [f"rank {w.rank} {w.detail}" if w.state == "exited" else
               f"rank {w.rank} not seen exiting: its node {w.node} is {unhealthy[w.node]}"
               for w in rows if w.state != "exited" or w.exit_code != 0]
        done = "training finished" + (f" (then {'; '.join(bad)} on the way out)" if bad else "")
        step = finished["step"]  # rank 0's word: a rank whose agent stopped relaying may show an older step
        self.records.update_generation(job.id, gen.generation, stop_at=now, ended_at=now, outcome=Outcome.SUCCEEDED,
                                       end_reason=done, last_step=step)
        self.records.update_job(job.id, last_step=step)
        self.records.transition(job.id, J.SUCCEEDED, f"{done} (last step {step})")
        log.info("job %s succeeded: %s after %d attempts", job.id, done, job.attempts)
        return True

    def note_restored(self, job: Job, gen: Generation) -> None:
        """Once the generation's rank 0 reports how it restored its state, record it (and its recovery's
        events) once."""
        if job.recovery != protocol.CHECKPOINTLESS or gen.restored is not None or self.rendezvous is None:
            return
        key = protocol.recovered_key(job.id, gen.generation)
        try:
            if not self.rendezvous.check([key]):
                return
            summary = RecoverySummary.model_validate_json(self.rendezvous.get(key)).model_dump(exclude_none=True)
        except (RuntimeError, ValueError) as err:  # (a pydantic ValidationError is a ValueError)
            if not isinstance(err, RuntimeError):
                log.warning("job %s generation %d: unreadable recovery summary (%s); next: not recorded", job.id,
                            gen.generation, str(err).splitlines()[0])
            return
        told = {e["event"]: e for e in summary.pop("events", [])}
        self.records.update_generation(job.id, gen.generation, restored=summary)
        g = gen.generation
        if "fault_detected" in told:
            e = told["fault_detected"]
            self.store.record_event(E.FAULT_DETECTED, f"generation {e['generation']}: {e['detected_by']} rank(s) saw "
                                    f"the fault at step {e['step']}: {e['what']}", job=job.id)
        if "pg_rebuilt" in told:
            e = told["pg_rebuilt"]
            self.store.record_event(E.PG_REBUILT, f"generation {g}: process groups built in {e['seconds']:.3f} s, "
                                    f"every rank arrived {e['all_arrived_after_fault_s']:.3f} s after the fault",
                                    job=job.id)
        self.store.record_event(E.STATE_RESTORED, f"generation {g} restored from {summary['source']} "
                                f"at step {summary['step']}: {summary['bytes']} bytes moved in "
                                f"{summary['seconds']:.3f} s" + (f" ({summary['reason']})" if summary.get("reason")
                                                                  else ""), job=job.id)
        if "resumed" in told:
            e = told["resumed"]
            self.store.record_event(E.RESUMED, f"generation {g}: training resumed at step {e['step']} on "
                                    f"{e['world_size']} ranks, {e['steps_lost']} committed step(s) redone",
                                    job=job.id)

    # ---- the store ---------------------------------------------------------------------------------------
    def publish(self, job: Job, gen: Generation) -> None:
        """The generation's layout and number, which checkpointless workers watch."""
        if job.recovery == protocol.CHECKPOINTLESS and self.rendezvous is not None:
            prev = self.records.generation(job.id, gen.generation - 1) if gen.generation > 1 else None
            cause = "resize" if prev is not None and prev.outcome == Outcome.RESIZED else "fault"
            protocol.publish_generation(self.rendezvous, job.id, gen.generation, gen.nodes, job.workers_per_node,
                                        cause)

    def republish(self) -> None:
        """A restarted controller's store is empty: publish the current generation of every active job again."""
        for job in self.records.jobs(ACTIVE):
            gen = self.records.generation(job.id, job.generation)
            if gen is not None:
                self.publish(job, gen)

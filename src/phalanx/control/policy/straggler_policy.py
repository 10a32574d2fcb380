"""The scheduler's side of the straggler rule (`stragglers.py` decides): its input — the compute seconds per
step the ranks publish (`protocol.step_time_key`), read at each heartbeat with their progress — and its
verdicts, at each tick: one `straggler` event per (job, generation, rank), then the job's `straggler_policy`:
`report` (nothing more) or `replace-node` (the node is marked faulty through the reconciler's fault path: the
spare pool replaces it and the scheduler's node-fault policy recovers the job). `stragglers(job)` lists what
was flagged, for the metrics exporter.

Part of `JobScheduler` (a mixin over its store, records, lock and rendezvous). Must not know: how the times
are measured, processes, HTTP.
"""

from __future__ import annotations

import logging

from phalanx import protocol
from phalanx.control.policy.stragglers import StragglerSettings, StragglerWatch
from phalanx.control.state.jobs import Generation, Job, WorkerRecord
from phalanx.control.state.store import NodeState
from phalanx.observability.events import EventKind as E

log = logging.getLogger("phalanx.scheduler")
S = NodeState


class StragglerPolicy:
    def stragglers(self, job_id: str) -> list[dict]:
        """The job's flagged stragglers, every generation (this controller's life): for the metrics exporter."""
        with self.lock:
            return [dict(s) for s in self._flagged.get(job_id, [])]

    def _fetch_step_times(self, job: Job, gen: Generation, ranks: list[int], all_or_none: bool = False) -> dict | None:
        """The compute seconds the ranks published (`protocol.step_time_key`), read by a tick for every rank
        (`all_or_none`: None, nothing read, unless all reported); without the lock (`_fetch_steps`)."""
        if self.rendezvous is None:
            return None
        try:
            return protocol.read_step_times(self.rendezvous, job.id, gen.generation, ranks, all_or_none=all_or_none)
        except (RuntimeError, ValueError) as err:  # torch's store errors; a value no worker of ours writes
            self._say(f"times:{job.id}", f"job {job.id}: cannot read step times ({err}); the straggler rule skips "
                                         f"them, next: retrying at the next tick")
            return None

    def _note_step_times(self, job: Job, gen: Generation, times: dict | None) -> None:
        """What `_fetch_step_times` read, into the job's watch (under the lock)."""
        if times is None:
            return
        watch = self._watches.get((job.id, gen.generation))
        if watch is None:  # a new generation: the old one's state goes
            for key in [k for k in self._watches if k[0] == job.id]:
                del self._watches[key]
            watch = self._watches[(job.id, gen.generation)] = StragglerWatch(job.world_size,
                                                                             StragglerSettings.of(job.straggler))
        for rank, (step, seconds) in times.items():
            watch.record(rank, step, seconds)

    def _judge_stragglers(self, job: Job, gen: Generation, rows: list[WorkerRecord], mark_faulty) -> None:
        """Tick side: each new straggler once — an event, then the job's straggler_policy."""
        watch = self._watches.get((job.id, gen.generation))
        for s in watch.take_new() if watch is not None else []:
            k, policy = watch.settings, watch.settings.policy
            node = next((w.node for w in rows if w.rank == s.rank), None)
            then = ("its node is treated as faulty: replaced from the spare pool, the job recovers as from a node "
                    "fault" if policy == "replace-node" else "reported only, the job goes on")
            what = (f"rank {s.rank} on {node} is a straggler in generation {gen.generation}: {s.seconds:.3f} s of "
                    f"compute per step vs its peers' median {s.median_s:.3f} s ({s.ratio:.1f}×, over "
                    f"straggler_factor={k.factor:g} for {s.reports} reports in a row, the last at step {s.step}); "
                    f"straggler_policy={policy}: {then}")
            record = {"generation": gen.generation, "rank": s.rank, "step": s.step, "seconds": round(s.seconds, 6),
                      "median_s": round(s.median_s, 6), "factor": k.factor, "steps": k.steps, "policy": policy}
            self._flagged.setdefault(job.id, []).append({"job": job.id, "node": node, **record})
            self.store.record_event(E.STRAGGLER, what, node=node, job=job.id, **record)
            log.warning("job %s: %s", job.id, what)
            target = self.store.node(node) if node is not None else None
            if policy == "replace-node" and target is not None and target.state == S.HEALTHY:
                mark_faulty(target, f"straggler: rank {s.rank} of job {job.id} computes {s.ratio:.1f}× slower than "
                                    f"its peers' median (straggler_policy=replace-node)", "straggler")

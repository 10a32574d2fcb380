"""Assignments: what each node's agent should run, told in its heartbeat reply, and what its agent reports
back. `ingest()` records the agent's worker reports; `assignments()` builds the node's part of each running
generation (ranks, env); `_fetch_running()` reads the ranks' steps at each tick, before the lock, and
`_record_steps()` records them; `_publish()` writes a checkpointless generation's layout and the warm standbys'
signed assignments to the rendezvous store.

Part of `JobScheduler` (a mixin over its store, records and rendezvous). Must not know: fault policy (the
scheduler decides; this only tells), how an agent starts a process.
"""

from __future__ import annotations

import logging
from pathlib import Path

from phalanx import protocol
from phalanx.control.state.jobs import ACTIVE, Generation, Job, JobState, WorkerRecord
from phalanx.control.state.store import Node, NodeState
from phalanx.observability.events import EventKind as E
from phalanx.protocol.messages import Assignment, RankSlot, WorkerReport

log = logging.getLogger("phalanx.scheduler")
J, S = JobState, NodeState
FAST_POLL_S = 0.05  # a hurried agent's heartbeat period (next_heartbeat_s)...
FAST_POLL_PER_S = 1000.0  # ...stretched so a generation's nodes send at most this many heartbeats a second
HURRY_S = 10.0  # hurry at most this long after a generation ended or started
EVERY_TICK_RANKS = 1024  # a running job of up to this many ranks has its steps read at every tick...
RANK_READS_PER_S = 4096.0  # ...a larger one's at most this many ranks a second (4,096 ranks: once a second)


class Assignments:
    # ---- heartbeats ---------------------------------------------------------------------------------
    def ingest(self, node: Node, reports: list[WorkerReport], acked_at: float | None) -> bool:
        """Record an agent's worker reports (one row per job, generation and rank). True when a worker's row
        changed (news the scheduler may act on now)."""
        changed = False
        with self.lock:
            self.records.set_node_ack(node.name, acked_at)
            if self.records.unchanged_reports(node.name, reports):
                return False
            keys = {(r.job, r.generation, r.rank) for r in reports}
            known = {(w.job, w.generation, w.rank): w for w in self.records.reported_workers(node.name, keys)}
            seen = set()
            for r in reports:
                key = (r.job, r.generation, r.rank)
                seen.add(key)
                old = known.get(key)
                row = {"job": r.job, "generation": r.generation, "rank": r.rank, "node": node.name,
                       "local_rank": r.local_rank, "pid": r.pid, "state": r.state, "exit_code": r.exit_code,
                       "detail": r.detail, "hang": r.hang, "frozen": int(r.frozen), "stopped": int(r.stopped),
                       "step": old.step if old else None, "started_at": r.started_at, "ended_at": r.ended_at}
                if old is not None and all(getattr(old, k) == v for k, v in row.items()):
                    continue
                changed = True
                self.records.put_worker(row)
                if r.carried_from:  # a survivor now serves this generation
                    g, rank = r.carried_from
                    seen.add((r.job, g, rank))
                    self.records.update_worker(r.job, g, rank, state="carried",
                                               detail=f"process carried into generation {r.generation} as rank "
                                                      f"{r.rank}")
                if r.state == "exited" and (old is None or old.state != "exited") and not r.stopped \
                        and r.exit_code != 0:
                    what = f"rank {r.rank} (pid {r.pid}) on {node.name} {r.detail}"
                    self.store.record_event(E.WORKER_EXIT, what + (f"; hung: {r.hang}" if r.hang else ""),
                                            node=node.name, job=r.job)
            for key, old in known.items():
                if key not in seen and old.live:
                    changed = True
                    self.records.update_worker(*key, state="lost", detail="no longer reported by its agent")
            self.records.ingested(node.name, reports)
        return changed

    def assignments(self, node: Node) -> tuple[float, list[Assignment], int]:
        """(sent_at, the workers `node` must run, the warm standbys it should keep). sent_at is taken first,
        under the lock: an agent that echoes it back has seen every stop decided before it."""
        with self.lock:
            sent_at = self.clock()
            if node.state != S.HEALTHY:
                return sent_at, [], 0
            out = []
            for job in self.records.jobs(ACTIVE):
                gen = self.records.generation(job.id, job.generation)
                if gen is None:
                    continue
                if node.name not in gen.node_index:
                    if self.leaving(job, gen, node.name, sent_at):  # a resize left it: its workers exit by themselves
                        out.append(Assignment(job=job.id, generation=gen.generation, hold=True, ranks=[]))
                    continue
                if job.state == J.RECOVERING:
                    if self.inplace.in_place(job, gen):  # survivors wait in their processes for the next generation
                        out.append(Assignment(job=job.id, generation=gen.generation, hold=True, ranks=[]))
                    continue
                if gen.stop_at is not None:
                    continue
                per = job.workers_per_node
                first = protocol.rank_of(gen.node_index, node.name, 0, per)
                survivors = self.inplace.survivor_slots(job, gen)
                carried = self.inplace.carried_standbys(job, gen) if survivors else {}
                ranks = [RankSlot(rank=first + i, local_rank=i,
                                  standby=gen.standbys.get(str(first + i)) or carried.get((node.name, i)),
                                  carry=(node.name, i) in survivors) for i in range(per)]
                out.append(Assignment(
                    recovery=job.recovery, job=job.id, generation=gen.generation, argv=job.argv, cwd=job.cwd,
                    env=self._worker_env(job), log_dir=str(Path(job.job_dir) / "logs"), world_size=job.world_size,
                    ship_log=self._nodes_elsewhere() and job.kind != "train",  # (its job dir is the controller's)
                    local_world_size=per, master_addr=gen.master_addr, master_port=gen.master_port,
                    store_addr=gen.store_addr or "", checkpoint_dir=job.checkpoint_dir,
                    config_path=str(Path(job.job_dir) / "config.json") if job.kind == "train" else None,
                    ranks=ranks))
            return sent_at, out, self.standby_wanted(node)

    def next_heartbeat_s(self, node: Node, now: float) -> float | None:
        """How soon `node`'s agent should heartbeat again, when sooner than its interval: while a job on it changes
        generation. A restart otherwise waits for a heartbeat twice — for the agents to stop and acknowledge the
        old generation, then to hear of the new one — up to an interval each. A node is hurried while its job's
        generation is stopping, while the job waits to relaunch (up to HURRY_S; a spare of its group too: it may
        be the replacement), and from a launch until the node reports its workers (up to HURRY_S). The poll is
        stretched so that the hurried nodes send at most FAST_POLL_PER_S heartbeats a second, and is never asked
        when stretched to the interval or past it (a generation of 4,096 nodes: 4.1 s, which at the default 0.5 s
        interval left every agent silent past heartbeat_timeout_s); None: the interval."""
        interval = self.spec.health.heartbeat_interval_s
        with self.lock:
            for job in self.records.jobs(ACTIVE):
                gen = self.records.generation(job.id, job.generation)
                if gen is None:
                    continue
                mine = node.name in gen.node_index
                if gen.stop_at is not None and gen.ended_at is None:
                    hurry = mine  # its workers must stop and the agent say so
                elif job.state == J.RECOVERING:
                    hurry = (mine or (node.is_spare and node.group == job.group_name)) and \
                        now - (gen.ended_at or gen.stop_at or now) < HURRY_S
                else:  # running: until this node reports the generation's workers
                    hurry = mine and now - gen.started_at < HURRY_S and not self.records.any_reported(
                        job.id, gen.generation, protocol.rank_of(gen.node_index, node.name, 0, job.workers_per_node),
                        job.workers_per_node)
                if hurry:
                    poll = max(FAST_POLL_S, len(gen.nodes) / FAST_POLL_PER_S)
                    return poll if poll < interval else None
        return None

    def standby_wanted(self, node: Node) -> int:
        """Warm standby workers `node`'s agent should keep: one per slot on an idle healthy node of a group
        with warm_standby (a spare, or a member no job holds)."""
        if node.state != S.HEALTHY or not self.spec.group(node.group).warm_standby:
            return 0
        with self.lock:
            busy = any(node.name in j.node_index for j in self.records.jobs(ACTIVE))
            return 0 if busy else self.spec.group(node.group).profile.worker_slots

    def _worker_env(self, job: Job) -> dict:
        env = dict(self.backend.worker_env())
        env.update(job.env)
        return env

    def _fetch_running(self, now: float) -> dict[tuple[str, int], tuple]:
        """Each running generation's steps, read at once (`_fetch_steps`, all or none), for the ranks that reported:
        at every tick, a job of more than EVERY_TICK_RANKS ranks at most RANK_READS_PER_S ranks a second. Not a
        finished one (every rank exited 0): `_check_running` reads its last steps in full."""
        out = {}
        for job in self.records.jobs((J.RUNNING,)):
            gen = self.records.generation(job.id, job.generation)
            if gen is None or gen.stop_at is not None:
                continue
            rows = self.records.workers(job=job.id, generation=gen.generation)
            if all_ranks_exited_0(job, rows):
                continue
            if len(rows) <= EVERY_TICK_RANKS or \
                    now - self._steps_read.get(job.id, float("-inf")) >= len(rows) / RANK_READS_PER_S:
                self._steps_read[job.id] = now
                out[(job.id, gen.generation)] = self._fetch_steps(job, gen, [w.rank for w in rows], all_or_none=True)
        return out

    def _fetch_steps(self, job: Job, gen: Generation, ranks: list[int], *, all_or_none: bool) -> tuple | None:
        """A tick's read of every rank's last step (`protocol.read_progress`: two round trips to the store, however
        many ranks) and of their step times (the straggler rule's input), without the scheduler's lock (`observe`
        reads before it takes it: at 4,096 ranks the round trips held heartbeats waiting). `all_or_none`: nothing is
        read until every rank has published its step (a job still starting): a read of every rank must not cost a
        round trip per rank. The agents' hang rules do not depend on it: each reads its own workers' progress on
        its node. (ranks, progress, step times) for `_record_steps`; None: nothing read."""
        if self.read_progress is None:
            return None
        if gen.store_addr != self.store_addr():
            self._say(f"store:{job.id}:{gen.generation}", f"job {job.id}: the rendezvous store moved from "
                      f"{gen.store_addr} to {self.store_addr()} (controller restart, old port taken); the job's step "
                      f"is not tracked for generation {gen.generation}, next: tracked again from the next generation")
            return None
        try:
            progress = self.read_progress(job.id, gen.generation, ranks, all_or_none=all_or_none)
        except RuntimeError as err:  # torch's store errors
            self._say(f"read:{job.id}", f"job {job.id}: cannot read progress from the rendezvous store ({err}); the "
                                        f"job's step is not tracked meanwhile, next: retrying at the next tick")
            return None
        self._said.pop(f"read:{job.id}", None)
        if progress is None:  # (all_or_none, and not every rank reported yet)
            return None
        return ranks, progress, self._fetch_step_times(job, gen, ranks, all_or_none=all_or_none)

    def _record_steps(self, job: Job, gen: Generation, fetched: tuple) -> None:
        """What `_fetch_steps` read, under the lock: the steps into the worker rows (where `_track_progress` finds
        the job's step), the step times into the straggler watch."""
        ranks, progress, times = fetched
        self._note_step_times(job, gen, times)
        self.records.record_steps(job.id, gen.generation, {r: (progress.get(r) or {}).get("step") for r in ranks})

    def _publish(self, job: Job, gen: Generation) -> None:
        """Store keys of a new generation: the layout and number (checkpointless workers watch them), and the
        env of every rank a warm standby may take (it starts at once, without waiting for a heartbeat)."""
        if self.rendezvous is None:
            return
        per = job.workers_per_node
        try:
            used = {}
            for name in self.inplace.standby_nodes(job, gen):
                node = self.store.node(name)
                ready = ((node.report or {}).get("standbys") or {}) if node is not None else {}
                for local in range(per):
                    standby = ready.get(str(local))
                    if standby is None:
                        continue  # its agent starts a fresh process for this rank
                    rank = protocol.rank_of(gen.node_index, name, local, per)
                    env = protocol.worker_env(self._placement(job, gen, name, rank, local), base=self._worker_env(job))
                    self.rendezvous.set(protocol.standby_key(standby), protocol.standby_assignment(
                        self.token, standby, env, str(Path(job.job_dir) / "logs" / f"rank{rank}.log")))
                    used[str(rank)] = standby
            if used:
                self.records.update_generation(job.id, gen.generation, standbys=used)
            self.inplace.publish(job, gen)
        except RuntimeError as err:  # the store is the controller's own: this is a bug or a dying controller
            log.error("job %s generation %d: could not publish to the rendezvous store (%s)", job.id,
                      gen.generation, err)

    def republish(self) -> None:
        """A restarted controller's store is empty: publish the current generation of every active
        checkpointless job again (its workers watch for it)."""
        with self.lock:
            self.inplace.republish()

    def _placement(self, job: Job, gen: Generation, node: str, rank: int, local: int) -> protocol.WorkerPlacement:
        return protocol.WorkerPlacement(
            job_id=job.id, generation=gen.generation, rank=rank, world_size=job.world_size, local_rank=local,
            local_world_size=job.workers_per_node, master_addr=gen.master_addr, master_port=gen.master_port,
            store_addr=gen.store_addr or "", checkpoint_dir=job.checkpoint_dir, cluster_token=self.token,
            config_path=str(Path(job.job_dir) / "config.json") if job.kind == "train" else None, node=node,
            recovery=job.recovery)


def all_ranks_exited_0(job: Job, rows: list[WorkerRecord]) -> bool:
    return len(rows) == job.world_size and all(w.state == "exited" and w.exit_code == 0 for w in rows)

"""Elastic jobs: how many data-parallel replicas a job runs, and when that number changes.

Part of `JobScheduler` (a mixin over its store, records and lock). A resize is checkpointless recovery driven by
capacity instead of a fault: the running generation ends with outcome `resized` without stopping anyone, and
the next one starts at once on the new node list. Survivors keep their processes (their slots are carried), a
joining node's warm standby or fresh process restores its shards from a peer replica's memory, and a leaving
node's workers are held (`leaving`) while they finish the step they are in and exit on their own. No
checkpoint is written or read.

  admit        at submit: the job's elastic record (settings, ranks and nodes per replica, the sizes that can
               hold its global batch), or one clear refusal naming the field
  fit          the largest allowed size that the usable nodes and the job's cap (max, or a `job scale`
               target) allow: the size a job starts, restarts or shrinks to after a fault with no spare
  rescale      each tick: a higher-priority job waiting for nodes takes them from lower-priority elastic jobs
               (above their min); a `job scale` target is applied at once; free nodes are grown onto after
               `scale_up_delay_s` of being free and `stable_period_s` after the last change, only when no
               other job of the group is waiting for nodes, and once their warm standbys are up (at most
               STANDBY_WAIT_S more)
  scale        the `job scale ID --replicas N` request: checked (elastic, allowed, holds the batch) and recorded

Must not know: processes, how workers regroup (`resilience/`), HTTP.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from phalanx import protocol
from phalanx.control.policy.admission import JobRequestError
from phalanx.control.state.jobs import FINAL, Job, JobState, Outcome
from phalanx.observability.events import EventKind as E
from phalanx.protocol.elastic import ElasticSettings, split_batch

log = logging.getLogger("phalanx.scheduler")
J = JobState
LEAVE_GRACE_S = 60.0  # a leaving replica's workers are held this long to finish their step and exit by themselves
STANDBY_WAIT_S = 60.0  # growth waits at most this long past the delay for the joining nodes' warm standbys


def admit(config: dict, group_count: int, workers_per_node: int) -> dict:
    """The elastic record of a job whose config has an `elastic:` section, or a `JobRequestError` (422) naming
    the field."""
    try:
        settings = ElasticSettings.model_validate(config["elastic"])
    except ValidationError as err:
        first = err.errors()[0]
        where, msg = ".".join(map(str, first["loc"])), first["msg"].removeprefix("Value error, ")
        raise JobRequestError(422, f"elastic.{where}: {msg}" if where else msg) from None
    parallel, training = config.get("parallel", {}), config.get("training", {})
    rpr = max(int(parallel.get("dp_shard", -1)), 1) * int(parallel.get("tensor_parallel_degree", 1))
    if rpr % workers_per_node:
        raise JobRequestError(422, f"elastic: one replica is {rpr} rank(s) (parallel.dp_shard × tensor_parallel_degree) but "
                            f"a node runs {workers_per_node} workers; a replica must fill whole nodes: set dp_shard "
                            f"× tp to a multiple of {workers_per_node}")
    npr = rpr // workers_per_node
    gb, mb = int(training.get("global_batch_size", 32)), int(training.get("micro_batch_size", 4))
    valid = settings.valid_sizes(gb, mb, rpr)
    refused = [r for r in settings.sizes() if r not in valid]
    if refused:
        raise JobRequestError(422, f"elastic: {refused} replica(s) cannot hold training.global_batch_size={gb} in micro-"
                            f"batches of {mb} ({rpr} rank(s) per replica); sizes that can: {valid or 'none'}; "
                            f"set elastic.min/max_replicas or allowed_replicas to those")
    if settings.min_replicas * npr > group_count:
        raise JobRequestError(422, f"elastic.min_replicas={settings.min_replicas} needs {settings.min_replicas * npr} nodes "
                            f"({npr} per replica) but the group has {group_count} worker nodes; lower "
                            f"min_replicas or grow the group (`phalanx cluster scale`)")
    return {**settings.model_dump(), "ranks_per_replica": rpr, "nodes_per_replica": npr, "valid": valid,
            "target": None, "changed_at": None}


class Elasticity:
    # ---- how many replicas fit ------------------------------------------------------------------------------
    def fit(self, job: Job, usable: int) -> int | None:
        """The largest valid replica count ≤ the job's cap that `usable` nodes hold (None below min)."""
        e = job.elastic
        cap = e["target"] or e["max_replicas"]
        return max((r for r in e["valid"] if r <= cap and r * e["nodes_per_replica"] <= usable), default=None)

    def elastic_nodes(self, job: Job, keep: list[str], free: list[str]) -> tuple[list[str] | None, str]:
        e = job.elastic
        r = self.fit(job, len(keep) + len(free))
        if r is None:
            need = e["min_replicas"] * e["nodes_per_replica"]
            return None, (f"waiting for {need} healthy nodes of group {job.group_name} for min_replicas="
                          f"{e['min_replicas']} ({len(keep) + len(free)} usable now)")
        n, free, kept = r * e["nodes_per_replica"], list(free), set(keep)
        # a replacement takes a lost node's place (its survivors keep their ranks); without one, the rest close up
        slots = [name if name in kept else (free.pop(0) if free else None) for name in job.nodes]
        chosen = [name for name in slots if name is not None]
        return chosen[:n] + free[:max(0, n - len(chosen))], ""

    # ---- each tick ---------------------------------------------------------------------------------------------
    def rescale(self, now: float) -> None:
        pending = sorted(self.records.jobs((J.PENDING,)), key=lambda j: (-j.priority, j.seq))
        waiting_groups: set[str] = set()
        leaving: set[str] = set()
        if pending:  # nodes a resize left whose workers still finish their step: free in a moment, given up
            held = {j.id: set(j.nodes) for j in self.records.jobs((J.RUNNING, J.RECOVERING))}
            leaving = {w.node for w in self.records.workers() if w.live and w.node not in held.get(w.job, ())}
        for p in pending:  # (one that fits starts in this tick, after this: its nodes are not grown onto either)
            waiting_groups.add(p.group_name)
            _, free = self._usable(p)
            need = (p.elastic["min_replicas"] * p.elastic["nodes_per_replica"] if p.elastic else p.nodes_requested)
            coming = sum(1 for n in leaving if (node := self.store.node(n)) is not None and node.group == p.group_name)
            if len(free) + coming < need:
                self._preempt(p, need - len(free) - coming, now)
        for job in self.records.jobs((J.RUNNING,)):
            if job.elastic is None:
                continue
            gen = self.records.generation(job.id, job.generation)
            if gen is None or gen.stop_at is not None:
                continue
            self._grow_or_shrink(job, gen, now, others_waiting=job.group_name in waiting_groups)

    def _preempt(self, p: Job, short: int, now: float) -> None:
        """Shrink lower-priority elastic jobs of `p`'s group, lowest priority first, toward their min, until
        `short` nodes are freed; nothing when they cannot free enough together."""
        victims = sorted((j for j in self.records.jobs((J.RUNNING,)) if j.elastic is not None
                          and j.group_name == p.group_name and j.priority < p.priority), key=lambda j: (j.priority, -j.seq))
        plan = []
        for v in victims:
            if short <= 0:
                break
            e, r = v.elastic, v.replicas
            npr = e["nodes_per_replica"]
            smaller = [s for s in e["valid"] if e["min_replicas"] <= s < r]
            if not smaller:
                continue
            enough = [s for s in smaller if (r - s) * npr >= short]
            s = max(enough) if enough else min(smaller)
            plan.append((v, s))
            short -= (r - s) * npr
        if short > 0:
            return
        for v, s in plan:
            gen = self.records.generation(v.id, v.generation)
            if gen is not None and gen.stop_at is None:
                self.resize(v, gen, v.nodes[:s * v.elastic["nodes_per_replica"]],
                            f"preempted by job {p.id} (priority {p.priority} > {v.priority})", now)

    def _grow_or_shrink(self, job: Job, gen, now: float, *, others_waiting: bool) -> None:
        e, r = job.elastic, job.replicas
        _, free = self._usable(job)
        target = e["target"]
        s = self.fit(job, len(job.nodes) + (0 if others_waiting else len(free)))
        if s is None or s == r:
            self._grow_seen.pop(job.id, None)
            return
        npr = e["nodes_per_replica"]
        if s < r:  # only a `job scale` target lowers the cap below the running size
            return self.resize(job, gen, job.nodes[:s * npr], f"job scale request ({target} replicas)", now)
        grown = job.nodes + free[:(s - r) * npr]
        if target is not None and target > r:  # requested: at once
            return self.resize(job, gen, grown, f"job scale request ({target} replicas)", now)
        seen = self._grow_seen.setdefault(job.id, now)
        since_change = now - (e["changed_at"] or gen.started_at)
        if now - seen < e["scale_up_delay_s"] or since_change < e["stable_period_s"]:
            return
        joining = grown[len(job.nodes):]
        if not self._standbys_ready(joining) and now - seen < e["scale_up_delay_s"] + STANDBY_WAIT_S:
            return  # their warm standbys are still starting: joining now would stall the survivors longer
        self.resize(job, gen, grown, f"{(s - r) * npr} idle healthy node(s) free for {now - seen:.0f} s", now)

    def _standbys_ready(self, names: list[str]) -> bool:
        """Every node of a warm-standby group has its standbys warmed up and waiting (`protocol.standby_warm_key`;
        a group without standbys: always)."""
        for name in names:
            node = self.store.node(name)
            group = self.spec.group(node.group) if node is not None else None
            if group is None or not group.warm_standby or self.rendezvous is None:
                continue
            ids = list(((node.report or {}).get("standbys") or {}).values())
            try:
                warm = len(ids) >= group.profile.worker_slots and all(
                    self.rendezvous.check([protocol.standby_warm_key(sid)]) for sid in ids)
            except RuntimeError:  # the controller's own store: only while it restarts
                warm = False
            if not warm:
                return False
        return True

    # ---- the change ---------------------------------------------------------------------------------------------
    def resize(self, job: Job, gen, nodes: list[str], why: str, now: float) -> None:
        """End `gen` in place (outcome resized, nobody stopped) and start the next generation on `nodes`."""
        e = job.elastic
        npr, rpr = e["nodes_per_replica"], e["ranks_per_replica"]
        r0, r1 = len(gen.nodes) // npr, len(nodes) // npr
        cfg = (job.config or {}).get("training", {})
        gb, mb = cfg.get("global_batch_size", 32), cfg.get("micro_batch_size", 4)
        settings = ElasticSettings.model_validate({k: e[k] for k in ElasticSettings.model_fields if k in e})
        b0, b1 = settings.batch_at(gb, r0), settings.batch_at(gb, r1)
        a0, a1 = split_batch(b0, mb, r0 * rpr)[0], split_batch(b1, mb, r1 * rpr)[0]
        if settings.scale_batch:
            f0, f1 = settings.lr_factor(r0), settings.lr_factor(r1)
            what = (f"resize {r0} → {r1} replicas ({why}); global batch {b0} → {b1} (scale_batch), micro-batches "
                    f"per rank {a0} → {a1}, peak learning rate × {f1 / f0:.4g} ({settings.lr_scaling or 'linear'})")
        else:
            what = (f"resize {r0} → {r1} replicas ({why}); global batch {gb} kept: micro-batches per rank {a0} → "
                    f"{a1}, learning rate unchanged")
        self.records.update_generation(job.id, gen.generation, stop_at=now, ended_at=now, outcome=Outcome.RESIZED,
                                       end_reason=what)
        self.records.update_job(job.id, elastic={**e, "changed_at": now})
        self.store.record_event(E.RESIZE, what, job=job.id)  # before the job → recovering: the ledger tells them apart
        self.records.transition(job.id, J.RECOVERING, f"{what}; next: survivors regroup in place")
        log.info("job %s generation %d: %s", job.id, gen.generation, what)
        self._grow_seen.pop(job.id, None)
        self._launch(self.records.job(job.id), nodes)

    def leaving(self, job: Job, gen, node: str, now: float) -> bool:
        """`node` ran the generation before `gen`, which a resize ended, and is not in `gen`: its workers are
        finishing their last step and exiting by themselves (the agent holds them, up to LEAVE_GRACE_S)."""
        if job.elastic is None or gen.generation < 2 or now - gen.started_at > LEAVE_GRACE_S:
            return False
        prev = self.records.generation(job.id, gen.generation - 1)
        return prev is not None and prev.outcome == Outcome.RESIZED and node in prev.node_index

    # ---- the API ------------------------------------------------------------------------------------------------
    def scale(self, key: str, replicas: int) -> Job:
        with self.lock:
            job = self.find(key)
            if job.elastic is None:
                raise JobRequestError(422, f"job {job.id} is not elastic (submit it with an elastic: section or "
                                              f"--min-replicas/--max-replicas to resize it)")
            if job.state in FINAL:
                raise JobRequestError(409, f"job {job.id} is already {job.state.value}")
            e = job.elastic
            if replicas not in e["valid"]:
                lo = " (below min_replicas)" if replicas < e["min_replicas"] else ""
                raise JobRequestError(422, f"--replicas {replicas}{lo} is not a size job {job.id} can run; valid: "
                                              f"{e['valid']}")
            self.records.update_job(job.id, elastic={**e, "target": replicas})
            self.store.record_event(E.RESIZE, f"scale requested: {replicas} replicas (now {job.replicas})",
                                    job=job.id)
            log.info("job %s: scale to %d replicas requested (now %s)", job.id, replicas, job.replicas)
            return self.records.job(job.id)

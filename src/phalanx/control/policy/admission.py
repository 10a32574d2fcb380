"""Admission: which jobs the controller accepts (`submit`), finds, cancels and describes, for the API.
A refusal is a `JobRequestError` carrying the HTTP status the API answers with; nothing is started.

Part of `JobScheduler` (a mixin over its store and records). Must not know: heartbeats, faults, processes.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

from phalanx import protocol
from phalanx.control.policy.stragglers import StragglerSettings
from phalanx.control.state.jobs import ACTIVE, FINAL, Job, JobState
from phalanx.control.state.store import ClusterStatus, NodeState
from phalanx.observability.events import EventKind as E
from phalanx.observability.run_events import job_run_dir

log = logging.getLogger("phalanx.scheduler")
TIME_LIMIT_DEDUP_S = 60.0  # Slurm's warnings to the nodes of one allocation, relayed apart: one checkpoint request
J, S = JobState, NodeState


class JobRequestError(ValueError):
    """A job request the controller refuses; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Admission:
    # ---- API: submit, cancel, describe --------------------------------------------------------------
    def submit(self, *, kind: str, nodes: int, name: str | None = None, group: str | None = None,
               argv: list[str] | None = None, config: dict | None = None, checkpoint_dir: str | None = None,
               cwd: str, env: dict | None = None, auto_resume: bool = False, max_retries: int = 0,
               recovery: str = "restart", straggler_factor: float = 2.0, straggler_steps: int = 5,
               straggler_policy: str = "report", priority: int = 0) -> Job:
        status = self.store.cluster()["status"]
        if status not in (ClusterStatus.IN_SERVICE.value, ClusterStatus.DEGRADED.value):
            raise JobRequestError(409, f"cluster {self.spec.name} is {status}; jobs run on a cluster in service")
        g = self._group(group)
        count = self._group_count(g.name)
        if nodes > count:
            raise JobRequestError(422, f"--nodes {nodes} is more than group {g.name} has: {count} worker nodes "
                                       f"(+{g.spares} spares, which stand by to replace faulty nodes and run no "
                                       f"jobs); use --nodes {count} or fewer, or grow the group "
                                       f"(`phalanx cluster scale {g.name} --count N`)")
        if kind == "train":
            if config is None or not checkpoint_dir:
                raise JobRequestError(422, "a train job needs its resolved config and checkpoint_dir")
            argv = [sys.executable, "-m", protocol.TRAIN_WORKER_MODULE]
        elif not argv:
            raise JobRequestError(422, "a command job needs a command (`phalanx job submit --nodes N -- CMD ...`)")
        try:
            straggler = StragglerSettings(straggler_factor, straggler_steps, straggler_policy)
        except ValueError as err:
            raise JobRequestError(422, str(err)) from None
        elastic = None
        if kind == "train" and config is not None and config.get("elastic") is not None:
            from phalanx.control.policy.elastic import admit

            elastic = admit(config, self._group_count(g.name), g.profile.worker_slots)
            recovery = protocol.CHECKPOINTLESS  # a resize is an in-place regroup: the processes are kept
            nodes = elastic["min_replicas"] * elastic["nodes_per_replica"]  # at first; the scheduler fits more
        if recovery == protocol.CHECKPOINTLESS:
            if kind != "train":
                raise JobRequestError(422, "--recovery checkpointless needs a training config: a command's state "
                                           "is unknown to Phalanx (use --auto-resume to rerun it on a fault)")
            auto_resume = True  # recovering in place is resuming; the checkpoint stays the fallback
        jobs_root = str(self.jobs_root)
        if self._nodes_elsewhere() and kind == "train":
            # the job's config and rank logs live beside its checkpoints, not in the controller's cluster directory
            # (a command job's stay there: its nodes' agents ship its rank logs, `Assignment.ship_log`)
            jobs_root = str(job_run_dir(cwd, checkpoint_dir) / ".phalanx" / self.spec.name)
        with self.lock:
            job = self.records.add_job(name=name, kind=kind, group=g.name, nodes=nodes,
                                       workers_per_node=g.profile.worker_slots, argv=argv, cwd=cwd, env=env or {},
                                       config=config, jobs_root=jobs_root, checkpoint_dir=checkpoint_dir,
                                       auto_resume=auto_resume, max_retries=max_retries, recovery=recovery,
                                       straggler=straggler.to_dict(), elastic=elastic, priority=priority)
        (Path(job.job_dir) / "logs").mkdir(parents=True, exist_ok=True)
        if config is not None:
            (Path(job.job_dir) / "config.json").write_text(json.dumps(config, indent=2))
        log.info("job %s (%s) submitted: %d nodes × %d workers", job.id, job.name, nodes, job.workers_per_node)
        return job

    def _nodes_elsewhere(self) -> bool:
        """Whether nodes run on other hosts, which share only the checkpoint directory with the controller."""
        return self.spec.backend in ("hosts", "slurm")

    def _group(self, name: str | None):
        groups = self.spec.instance_groups
        if name is None:
            if len(groups) > 1:
                raise JobRequestError(422, f"cluster has several instance groups ({', '.join(g.name for g in groups)})"
                                           f"; name one with --group")
            return groups[0]
        try:
            return self.spec.group(name)
        except KeyError:
            raise JobRequestError(422, f"no instance group {name!r}; groups: "
                                       f"{', '.join(g.name for g in groups)}") from None

    def _group_count(self, name: str) -> int:
        """The group's member count now (`cluster scale` changes it; the spec keeps the count it was created with)."""
        return next((g["count"] for g in self.store.groups() if g["name"] == name), self.spec.group(name).count)

    def find(self, key: str) -> Job:
        job = self.records.find(key)
        if job is None:
            raise JobRequestError(404, f"no job {key!r} (`phalanx job list` shows the jobs)")
        return job

    def cancel(self, key: str, reason: str = "cancelled by the user") -> Job:
        with self.lock:
            job = self.find(key)
            if job.state in FINAL:
                raise JobRequestError(409, f"job {job.id} is already {job.state.value}")
            self._stop_generation(job, f"job cancelled: {reason}")
            job = self.records.transition(job.id, J.CANCELLED, f"{reason}; its workers are being stopped")
        log.info("job %s cancelled (%s); next: its workers are stopped", job.id, reason)
        return job

    def cancel_all(self, reason: str) -> None:
        for job in self.records.jobs((J.PENDING, *ACTIVE)):
            self.cancel(job.id, reason)

    def describe(self, key: str, *, brief: bool = False) -> dict:
        return self.records.describe(self.find(key), brief=brief)

    def time_limit_warned(self, node: str, warned_at: float) -> None:
        """A node's agent relays Slurm's warning before its allocation's time limit (USR2): the training job on
        the node is asked for a checkpoint now, once (every node of the allocation relays the same warning, in
        every heartbeat: one request per job per `TIME_LIMIT_DEDUP_S`)."""
        with self.lock:
            if self._time_limits.get(node) == warned_at:
                return
            self._time_limits[node] = warned_at
            current = self.store.node(node)
            job = self.records.find(current.job) if current is not None and current.job else None
            if job is None or job.kind != "train" or job.state != J.RUNNING:
                log.info("node %s: Slurm warned of its allocation's time limit; no training job runs there", node)
                return
            if self.clock() - self._asked_at.get(job.id, float("-inf")) < TIME_LIMIT_DEDUP_S:
                return
            self._asked_at[job.id] = self.clock()
            try:
                self.request_checkpoint(job.id, f"Slurm's warning before the time limit of node {node}'s allocation")
            except JobRequestError as err:
                log.warning("node %s: Slurm warned of its allocation's time limit; job %s not asked for a checkpoint "
                            "(%s)", node, job.id, err)

    def request_checkpoint(self, key: str, reason: str = "asked for by the user") -> dict:
        """Ask a running training job's workers for a checkpoint now, between its intervals: the request goes to
        its generation's store key, which every rank's reporter reads; the ranks save after the first step all of
        them have seen it in (`protocol.checkpoint_request_key`). A request a generation ends before serving is
        not carried to the next: the caller asks again (`JobClient.checkpoint` does)."""
        with self.lock:
            job = self.find(key)
            if job.kind != "train":
                raise JobRequestError(422, f"job {job.id} runs a command: Phalanx checkpoints training jobs only "
                                           f"(a command saves its own)")
            if job.state != J.RUNNING:
                raise JobRequestError(409, f"job {job.id} is {job.state.value}; a checkpoint is taken by a running "
                                           f"job (`phalanx job describe {job.id}`)")
            if self.rendezvous is None:
                raise JobRequestError(503, "this controller has no store for its workers; restart it")
            request = int(time.time() * 1000)  # grows across controller restarts (the store starts empty again)
            self.rendezvous.set(protocol.checkpoint_request_key(job.id, job.generation), str(request))
            self.store.record_event(E.CHECKPOINT_REQUESTED, f"checkpoint requested at step {job.last_step} "
                                    f"(generation {job.generation}): {reason}", job=job.id,
                                    generation=job.generation, step=job.last_step, request=request)
        log.info("job %s: checkpoint requested at step %s (%s); next: its ranks save after the step all of them "
                 "have seen the request in", job.id, job.last_step, reason)
        return {"job": job.id, "generation": job.generation, "step": job.last_step, "request": request}


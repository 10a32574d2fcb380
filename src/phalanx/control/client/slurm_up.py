"""`phalanx cluster up --slurm`: a Phalanx cluster inside the Slurm allocation the batch script runs in —
HyperPod's `sbatch --nodes 4 run.slurm` flow. recipes/slurm/run.sbatch:

    #!/bin/bash
    #SBATCH --nodes=3 --exclusive --no-kill --requeue --open-mode=append --output=phalanx-%j.out
    #SBATCH --signal=B:USR2@120
    exec phalanx cluster up --slurm -f cluster.yaml --run train.yaml --nodes 2

    cluster   the spec's instance groups get the allocation's nodes (count + spares ≤ SLURM_JOB_NUM_NODES): the
              controller runs on the batch host, one `srun` step of this job starts an agent on every node;
              refills after a fault are one-node jobs, under the allocation's account and partition unless the
              spec names its own. api.host defaults to the batch host's NodeAddr
    --run     submits the training config with auto-resume, waits for it, deletes the cluster, and exits:
              0   the job succeeded
              3   do not requeue: the job failed for good (an application error, retries spent), or requeues spent
              75  requeued (EX_TEMPFAIL): the job was short of nodes for slurm.spare_timeout_s (no spare came), or
                  the allocation neared its time limit, so Phalanx asked `scontrol requeue` for this job; the next
                  run resumes from the newest checkpoint
    time limit  Slurm's warning before it (USR2; `--signal=B:USR2@120`, and `exec` so that this process is the
              batch shell the signal goes to): the job is asked for a checkpoint now (`phalanx job checkpoint`;
              at most slurm.time_limit_checkpoint_s), cancelled, and this allocation requeued: the next run goes
              on from that step instead of the last interval's
    requeue   a requeued batch script (Slurm requeues it itself when the batch host fails; SLURM_RESTART_COUNT
              counts) finds the cluster its previous run left, removes it and starts again; the training job
              resumes from its checkpoint. After slurm.max_requeues requeues for a failure (a time-limit requeue
              is not one: they are counted in $PHALANX_HOME/clusters/.slurm-requeues/) it exits 3 instead.

Talks to Slurm only through its client commands, and to the cluster through the client API.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from phalanx.control.backends.slurm_commands import SlurmError, slurm
from phalanx.control.client.cluster import ClusterRefused, create_cluster, delete_cluster
from phalanx.control.client.jobs import FINAL_STATES, JobClient, JobError
from phalanx.control.spec import ClusterSpec, load_spec
from phalanx.control.state.paths import ClusterPaths, clusters_root
from phalanx.control.state.store import open_existing

EXIT_OK, EXIT_FATAL, EXIT_REQUEUED = 0, 3, 75


def allocation_spec(spec: ClusterSpec, env: dict) -> ClusterSpec:
    """`spec` as a cluster in the allocation of `env` (SLURM_JOB_ID): backend slurm, slurm.allocation set, the API
    on the batch host's address. ClusterRefused naming the fix when it does not fit."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        raise ClusterRefused("cluster up --slurm runs inside a Slurm allocation (a batch script or salloc): "
                             "SLURM_JOB_ID is not set. Outside one, `phalanx cluster create -f SPEC` with "
                             "`backend: slurm` submits the allocation itself")
    have = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 0)
    wanted = sum(g.count + g.spares for g in spec.instance_groups)
    if wanted > have:
        raise ClusterRefused(f"instance_groups: {wanted} nodes (count + spares over every group) but Slurm job {job} "
                             f"has {have}: submit with `sbatch --nodes {wanted}`, or lower count/spares")
    api = spec.api
    if "host" not in api.model_fields_set:  # the batch host's address, as Slurm reaches it
        here = env.get("SLURMD_NODENAME") or os.uname().nodename
        shown = slurm("scontrol", "show", "node", here, "-o")
        addr = next((w.split("=", 1)[1] for w in shown.split() if w.startswith("NodeAddr=")), None)
        api = api.model_copy(update={"host": addr or here})
    # refills (one-node jobs) are charged as the allocation is, unless the spec says otherwise: under enforced
    # accounting another account may be refused the partition, or bill another project
    inherited = {k: env[v] for k, v in (("account", "SLURM_JOB_ACCOUNT"), ("partition", "SLURM_JOB_PARTITION"))
                 if env.get(v) and getattr(spec.slurm_settings, k) is None}
    settings = spec.slurm_settings.model_copy(update={"allocation": job, **inherited})
    return spec.model_copy(update={"backend": "slurm", "slurm": settings, "api": api})


def cluster_up(spec_path: Path, *, run: Path | None = None, nodes: int | None = None, recovery: str | None = None,
               say: Callable[[str], None] = print, env: dict | None = None, timeout_s: float = 600.0) -> int:
    """Create the cluster in this allocation; with `run`, train it to the end. The process's exit code."""
    env = dict(os.environ if env is None else env)
    spec = allocation_spec(load_spec(spec_path), env)
    job, restarts = spec.slurm.allocation, int(env.get("SLURM_RESTART_COUNT") or 0)
    at_time_limit = TimeLimitRequeues(spec.name, job)
    failures = max(0, restarts - at_time_limit.count())  # the requeues max_requeues caps
    paths = ClusterPaths.for_name(spec.name)
    if paths.root.exists():
        before = _allocation_of(paths)
        if before != job:
            raise ClusterRefused(f"cluster {spec.name!r} already exists at {paths.root} (Slurm job {before or '-'}); "
                                 f"choose another name, or `phalanx cluster delete {spec.name}` first")
        said = f", {restarts - failures} at its time limit" if restarts > failures else ""
        say(f"Slurm job {job} was requeued ({restarts} so far{said}): removing the cluster its previous run left")
        delete_cluster(spec.name, timeout_s=30)
    if failures > spec.slurm.max_requeues:
        say(f"Slurm job {job} has been requeued {failures} times after a failure (slurm.max_requeues="
            f"{spec.slurm.max_requeues}); not starting again: exit {EXIT_FATAL} (do not requeue)")
        at_time_limit.forget()
        return EXIT_FATAL
    warned = threading.Event()  # Slurm's warning before the time limit (the batch script's --signal=B:USR2@T)
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: warned.set())  # (USR2 would end this process)
    try:
        info = create_cluster(spec, timeout_s=timeout_s)
    except BaseException:
        signal.signal(signal.SIGUSR2, previous)
        raise
    say(f"cluster {spec.name} {info['status']} in Slurm job {job}: API {info['controller']['api']}")
    if run is None:
        signal.signal(signal.SIGUSR2, previous)
        return EXIT_OK
    code = EXIT_FATAL
    try:
        code = _train(spec, run, nodes, recovery, say, failures, warned, at_time_limit)
        return code
    finally:
        signal.signal(signal.SIGUSR2, previous)
        if code != EXIT_REQUEUED:
            at_time_limit.forget()
        delete_cluster(spec.name, timeout_s=30)


class TimeLimitRequeues:
    """How many times a Slurm job was requeued at its time limit, kept across its runs (in
    `$PHALANX_HOME/clusters/.slurm-requeues/`; each run's cluster is removed): SLURM_RESTART_COUNT counts every
    requeue, slurm.max_requeues only those after a failure."""

    def __init__(self, cluster: str, job: str):
        self.path = clusters_root() / ".slurm-requeues" / f"{cluster}.{job}"

    def count(self) -> int:
        try:
            return int(self.path.read_text())
        except (OSError, ValueError):
            return 0

    def add(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(str(self.count() + 1))

    def forget(self) -> None:
        self.path.unlink(missing_ok=True)


def _allocation_of(paths: ClusterPaths) -> str | None:
    try:
        store = open_existing(paths.db)
    except Exception:  # a half-created cluster: nothing to tell
        return None
    try:
        return store.spec().slurm_settings.allocation
    finally:
        store.close()


def _train(spec: ClusterSpec, config: Path, nodes: int | None, recovery: str | None, say, restarts: int,
           warned: threading.Event | None = None, at_time_limit: TimeLimitRequeues | None = None) -> int:
    """Submit the training job and follow it to its end: the exit code. `restarts`: the requeues after a
    failure so far; `warned`: set when Slurm warns of the time limit."""
    jobs = JobClient(spec.name)
    group = spec.instance_groups[0]
    submitted = jobs.submit(config, nodes=nodes or group.count, auto_resume=True, recovery=recovery,
                            group=group.name)
    name, short_since, last = submitted["id"], None, None
    say(f"job {name} submitted: {submitted['nodes_requested']} nodes, recovery {submitted['recovery']}")
    while True:
        info = jobs.describe(name)
        if (info["state"], info["generation"]) != last:
            last = (info["state"], info["generation"])
            say(f"job {name}: {info['state']} (generation {info['generation']}, step {info['last_step']})"
                + (f": {info['reason'].splitlines()[0]}" if info.get("reason") else ""))
        if info["state"] in FINAL_STATES:
            return EXIT_OK if info["state"] == "succeeded" else EXIT_FATAL
        if warned is not None and warned.is_set():
            return _at_time_limit(spec, jobs, name, say, at_time_limit)
        short = info["state"] in ("pending", "recovering") and "wait" in (info.get("reason") or "")
        short_since = (short_since or time.monotonic()) if short else None
        if short_since is not None and time.monotonic() - short_since > spec.slurm.spare_timeout_s:
            return _requeue(spec, jobs, name, restarts, say)
        time.sleep(1.0)


def _at_time_limit(spec: ClusterSpec, jobs: JobClient, name: str, say, at_time_limit: TimeLimitRequeues | None) -> int:
    """Slurm's warning before the time limit: a checkpoint now (the job goes on from it after the requeue, not
    from its last interval's), then the job cancelled and this allocation requeued."""
    job, wait_s = spec.slurm.allocation, spec.slurm.time_limit_checkpoint_s
    say(f"Slurm job {job} nears its time limit (USR2): asking job {name} for a checkpoint now (at most {wait_s:g} s), "
        f"then requeueing")
    try:
        saved = jobs.checkpoint(name, timeout_s=wait_s)["saved"] or {}
        say(f"job {name}: checkpoint of step {saved.get('step')} committed")
    except (JobError, TimeoutError) as err:
        say(f"job {name}: no checkpoint after the warning ({err}); the next run resumes from the newest one")
    try:
        jobs.cancel(name, wait=True)
    except JobError:  # it ended meanwhile
        if jobs.describe(name)["state"] == "succeeded":
            say(f"job {name}: succeeded")
            return EXIT_OK
    if at_time_limit is not None:
        at_time_limit.add()
    say(f"requeueing Slurm job {job} at its time limit (not counted against slurm.max_requeues); the next run "
        f"resumes from the newest checkpoint")
    return _ask_requeue(job, say)


def _requeue(spec: ClusterSpec, jobs: JobClient, name: str, restarts: int, say) -> int:
    job = spec.slurm.allocation
    if restarts >= spec.slurm.max_requeues:
        say(f"job {name} short of nodes for {spec.slurm.spare_timeout_s:g} s and Slurm job {job} already requeued "
            f"{restarts} times (slurm.max_requeues): exit {EXIT_FATAL} (do not requeue)")
        return EXIT_FATAL
    say(f"job {name} short of nodes for {spec.slurm.spare_timeout_s:g} s (no spare came): requeueing Slurm job {job}; "
        f"the next run resumes from the newest checkpoint")
    jobs.cancel(name, wait=True)
    return _ask_requeue(job, say)


def _ask_requeue(job: str, say) -> int:
    """`scontrol requeue` this allocation (Slurm then ends this script); EXIT_REQUEUED either way."""
    try:
        slurm("scontrol", "requeue", job)
    except SlurmError as err:
        say(f"scontrol requeue {job} failed: {err}; exit {EXIT_REQUEUED} (a RequeueExit={EXIT_REQUEUED} in slurm.conf "
            f"requeues it)")
    return EXIT_REQUEUED

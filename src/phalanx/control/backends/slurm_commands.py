"""Slurm's client commands, as the slurm backend uses them: run one (`slurm`), the sbatch options of an
allocation, the preflight before a cluster is created, and the poller that reads squeue and sinfo once a second
for the backend (so the reconciler never waits on slurmctld).

Standard library only; knows the spec's slurm section, nothing of nodes, the reconciler or HTTP.
"""

from __future__ import annotations

import getpass
import logging
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

from phalanx.control.spec import ClusterSpec

log = logging.getLogger("phalanx.slurm")

COMMANDS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel")
COMMAND_TIMEOUT_S = 30.0
POLL_S = 1.0
LIVE_JOB_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")
SLURM_STATES_TAKEN = ("drain", "down", "fail", "maint", "reboot")  # sinfo %T words that take a node from a job


class SlurmError(RuntimeError):
    """Slurm refused or could not be reached; the message says what it answered."""


def slurm(*argv: str, timeout: float = COMMAND_TIMEOUT_S, env: dict | None = None) -> str:
    """Run a Slurm client command; its stdout. SlurmError with its stderr when it fails or hangs."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        raise SlurmError(f"`{argv[0]}` is not on PATH: run Phalanx on a host with Slurm's client commands "
                         f"(Debian: slurm-client) and SLURM_CONF pointing at the cluster's slurm.conf") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(argv[:3])} ...` did not answer within {timeout:g} s (is slurmctld "
                         f"reachable?)") from None
    if done.returncode != 0:
        said = "; ".join(line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip())
        said = said or f"exit {done.returncode}"
        raise SlurmError(said if said.startswith(argv[0]) else f"{argv[0]}: {said}")
    return done.stdout


def allocation_options(spec: ClusterSpec, group: str, nodes: int) -> list[str]:
    """sbatch options for `nodes` nodes of `group` (what `preflight` tests and `flush` submits)."""
    s = spec.slurm_settings
    opts = ["--job-name", f"phalanx-{spec.name}", "--nodes", str(nodes), "--ntasks-per-node=1", "--no-kill",
            "--requeue", "--exclusive", "--open-mode=append", "--signal=B:USR2@120",
            f"--comment=phalanx cluster {spec.name} group {group}"]
    if s.partition:
        opts.append(f"--partition={s.partition}")
    if s.account:
        opts.append(f"--account={s.account}")
    gres = gpu_request(spec, group)
    return opts + ([gres] if gres else []) + list(s.sbatch_options)


def gpu_request(spec: ClusterSpec, group: str) -> str | None:
    """`--gres=gpu:N` for a group whose instance type has N GPUs (one per worker), unless slurm.sbatch_options
    already ask for GPUs their own way (`--gres`, `--gpus...`, `-G`). The agents' `srun` step then holds the
    node's GPUs and Slurm sets CUDA_VISIBLE_DEVICES for it; each worker takes `cuda:LOCAL_RANK` among them."""
    gpus = spec.group(group).profile.gpus
    own = any(o.startswith(("--gres", "--gpus", "-G")) for o in spec.slurm_settings.sbatch_options)
    return f"--gres=gpu:{gpus}" if gpus and not own else None


def preflight(spec: ClusterSpec) -> None:
    """Before anything starts: Slurm's client commands are here, slurmctld answers, and Slurm would accept
    each group's allocation (`sbatch --test-only`: partition, account, node count). SlurmError saying which."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise SlurmError(f"backend slurm: {', '.join(missing)} not on PATH; run `phalanx cluster create` on a host "
                         f"with Slurm's client commands (Debian: slurm-client) and SLURM_CONF set")
    try:
        slurm("scontrol", "ping", timeout=15)
    except SlurmError as err:
        raise SlurmError(f"backend slurm: slurmctld is not reachable ({err}); start it or point SLURM_CONF at "
                         f"the right slurm.conf") from None
    for g in spec.instance_groups:
        n = g.count + g.spares
        try:
            slurm("sbatch", "--test-only", *allocation_options(spec, g.name, n), "--wrap", "true", timeout=15)
        except SlurmError as err:
            gres = gpu_request(spec, g.name)
            where = ", ".join(f"{k} {v}" for k, v in (("partition", spec.slurm_settings.partition),
                                                         ("account", spec.slurm_settings.account),
                                                         ("GPUs per node", gres and f"{g.profile.gpus} ({gres})"))
                              if v)
            gpus = (f", or an instance_type whose GPU count ({g.profile.gpus} for {g.instance_type}) the "
                    f"partition's nodes have (their Gres=gpu:N in slurm.conf)") if gres else ""
            nodes = f"{n} node{'s' if n != 1 else ''}"
            fix = what_to_fix(spec, str(err)) or (f"slurm.partition, slurm.account, slurm.sbatch_options or the "
                                                  f"group's count/spares{gpus}")
            raise SlurmError(f"backend slurm: Slurm refuses the allocation for instance group {g.name} ({nodes}: "
                             f"count {g.count} + spares {g.spares}{', ' + where if where else ''}): {err}. Fix "
                             f"{fix}") from None


def what_to_fix(spec: ClusterSpec, refusal: str) -> str | None:
    """The spec field Slurm's refusal names, with what Slurm would take instead: its partitions for an unknown
    partition; for an account it refuses (accounting enforced: this user has no association with it, or not in
    that partition) the accounts this user has. None: the refusal names no one field."""
    s, said = spec.slurm_settings, refusal.lower()
    if "invalid partition" in said:
        partitions = _listed("sinfo", "-h", "-o", "%R")
        known = f"; its partitions: {partitions}" if partitions else ""
        return f"slurm.partition ({s.partition!r}: no such partition{known})"
    if "invalid account" in said:
        user = getpass.getuser()
        mine = _listed("sacctmgr", "-n", "-P", "show", "associations", f"user={user}", "format=account")
        which = (f"{s.account!r}: user {user} has no association with it"
                 f"{f' in partition {s.partition}' if s.partition else ''}" if s.account else
                 f"unset: user {user} has no default account Slurm accepts")
        may = (f"; user {user} may submit under: {mine} (`sacctmgr show associations user={user}`)" if mine else
               f"; user {user} has no account in Slurm's accounting: ask its administrator for one (`sacctmgr add "
               f"user {user} account=...`)")
        return f"slurm.account ({which}{may})"
    return None


def _listed(*argv: str) -> str:
    """A Slurm listing's distinct lines, comma-separated; "" when it cannot be had (a hint, never the error)."""
    try:
        lines = slurm(*argv, timeout=10).splitlines()
    except SlurmError:
        return ""
    return ", ".join(sorted({line.strip().rstrip("*") for line in lines if line.strip()}))


@dataclass(frozen=True)
class SlurmJob:
    id: str
    state: str
    reason: str
    nodes: str


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str
    reason: str


@dataclass(frozen=True)
class SlurmView:
    at: float
    jobs: dict[str, SlurmJob]
    nodes: dict[str, SlurmNode]


class SlurmPoller:
    """What Slurm says about the cluster's jobs and every node, refreshed once a second by one thread."""

    def __init__(self, job_name: str, allocation: str | None = None, on_view=None):
        self.job_name = job_name
        self.allocation = allocation  # the job `cluster up --slurm` runs in (named as its user chose)
        self.on_view = on_view  # called with each fresh view, from the poller's thread
        self.view: SlurmView | None = None  # None until Slurm answered once
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._failing = False

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="slurm-poller", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def poll(self) -> SlurmView:
        jobs = {}
        lines = slurm("squeue", "-h", "--name", self.job_name, "-o", "%i|%T|%r|%N").splitlines()
        if self.allocation:
            lines += slurm("squeue", "-h", "--jobs", self.allocation, "-o", "%i|%T|%r|%N").splitlines()
        for line in lines:
            job_id, state, reason, nodes = (line.split("|") + ["", "", ""])[:4]
            jobs[job_id] = SlurmJob(job_id, state, reason, nodes)
        nodes = {}
        for line in slurm("sinfo", "-h", "-N", "-o", "%N|%T|%E").splitlines():
            name, state, reason = (line.split("|", 2) + ["", ""])[:3]
            nodes[name] = SlurmNode(name, state, reason)
        return SlurmView(time.time(), jobs, nodes)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.view = self.poll()
                if self.on_view is not None:
                    self.on_view(self.view)
                if self._failing:
                    log.info("Slurm answers again")
                self._failing = False
            except SlurmError as err:
                if not self._failing:
                    log.warning("cannot read Slurm's state (%s); next: judging nodes by heartbeats only, retrying",
                                err)
                self._failing = True
            self._stop.wait(POLL_S)

"""The `slurm` backend: Slurm allocates the nodes and starts their agents; Phalanx does the rest.

Slurm owns allocations, job ids, node states and requeue. Phalanx owns the agents, rendezvous, health, fault
classification, spares and the checkpoint/checkpointless policy. A node of this backend is a `hosts` node
(its agent joins the cluster over the API) whose agent Slurm starts:

    launch(node)     queued; `flush()` at the end of the reconciler's tick submits one allocation per group for
                     the nodes queued together: at creation that is every member and spare of the group, later
                     a one-node job per replacement. `sbatch --parsable --no-kill --requeue --open-mode=append
                     --signal=B:USR2@120 --nodes N`, whose batch script runs one long `srun --no-kill
                     --kill-on-bad-exit=0 --ntasks-per-node=1` step: `phalanx agent` on every node, which joins
                     the cluster (`POST /v1/join`) with the handle `slurm:<job id>:<Slurm node>:<pid>`
    taken(node)      Slurm took the node away or will not give it: its allocation pends past
                     `slurm.allocation_timeout_s` (squeue's reason says why), its job ended, or its Slurm node
                     was drained or went down and not by Phalanx. The reconciler replaces it (fault
                     `scheduler`)
    remediate(node)  a faulty node goes back to Slurm through `slurm.remediator`: drain (`scontrol update
                     nodename=X state=drain reason="phalanx: <fault>"`), hyperpod (reason `Action:Replace`),
                     report (an event only)
    forget(node)     when every node of an allocation is gone, the allocation is cancelled (scancel)
    teardown/sweep   scancel every job of the cluster (they are named `phalanx-<cluster>`)

What Slurm says is read by one poller thread (`squeue` and `sinfo`, once a second), so the reconciler never
waits on slurmctld; while Slurm cannot be reached, nodes are judged by their heartbeats alone.
`slurm_commands.preflight(spec)` runs before a cluster is created: the client commands, slurmctld, and
`sbatch --test-only` for each group's allocation (an unknown partition or account is refused before anything
starts).

Implements `base.Backend` (as `hosts.HostsBackend`, plus Slurm). Knows nothing about HTTP or jobs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
import shlex
import subprocess
import sys
import threading
import time

from phalanx.control.agent.join import TOKEN_ENV
from phalanx.control.backends.hosts import HostsBackend
from phalanx.control.backends.slurm_commands import (LIVE_JOB_STATES, POLL_S, SLURM_STATES_TAKEN, SlurmError,
                                                     SlurmPoller, SlurmView, allocation_options, slurm)
from phalanx.control.spec import ClusterSpec
from phalanx.control.state.paths import ClusterPaths
from phalanx.control.state.store import Node
from phalanx.observability.events import EventKind as E

log = logging.getLogger("phalanx.slurm")


class SlurmBackend(HostsBackend):
    def __init__(self, paths: ClusterPaths, spec: ClusterSpec, store=None, links=None):
        super().__init__(paths, spec, store, links)
        self.settings = spec.slurm_settings
        self.job_name = f"phalanx-{spec.name}"
        self.poller = SlurmPoller(self.job_name, self.settings.allocation, on_view=self._annotate)
        self._base: dict[str, str] = {}  # submitted Slurm job → the comment sbatch gave it
        self._comments: dict[str, str] = {}  # Slurm job → the comment last set on it
        self._queued: dict[str, list[Node]] = {}  # group → nodes launch() queued this tick
        self._job_of: dict[str, str] = {}  # node → the Slurm job asked to start its agent
        self._members: dict[str, set[str]] = {}  # Slurm job → its nodes not yet forgotten
        self._submitted: dict[str, float] = {}  # Slurm job → when
        self._steps: dict[tuple, subprocess.Popen] = {}  # (allocation, group) → the srun of its agents (cluster up)
        self._allocation_groups: set[str] = set()  # groups whose first nodes run in the allocation
        self._allocation_used = 0  # its nodes given to groups so far
        self._judged: SlurmView | None = None  # the view `polled` last said was new

    # ---- starting nodes -----------------------------------------------------------------------------
    def launch(self, node: Node) -> None:
        self._queued.setdefault(node.group, []).append(node)
        return None

    def agent_command(self, group: str) -> list[str]:
        cluster = self.store.cluster()
        url = f"http://{cluster['api_host']}:{cluster['api_port']}"
        return [self.settings.python or sys.executable, "-m", "phalanx.control.agent.node_agent", "--join", url,
                "--group", group, "--work-root", self.settings.work_root]

    def agent_env(self, submit: bool = True) -> dict[str, str]:
        """sbatch's and srun's environment (exported to the agents): the token travels in it, so the nodes need
        no filesystem shared with the controller for it (slurmctld keeps a job's environment root-only). For an
        sbatch (`submit`), without the SLURM_* of an allocation this controller may run in (`cluster up`): the
        new job is not part of it."""
        env = {k: v for k, v in os.environ.items()
               if not (submit and k.startswith("SLURM_") and k != "SLURM_CONF")}
        return {**env, TOKEN_ENV: self.paths.read_token()}

    def batch_script(self, group: str, nodes: int) -> str:
        output = self.paths.root / "slurm" / f"%j.{group}.%t.out"
        step = shlex.join([*self.agent_step(nodes, output), *self.agent_command(group)])
        # exec: the step is the batch step's own process, which Slurm signals and ends (a backgrounded srun
        # outlives its killed shell under proctrack/linuxproc); USR2 (--signal=B:USR2@120) reaches the agents
        return (f"#!/bin/bash\n"
                f"# Phalanx cluster {self.spec.name}, instance group {group}: one agent on every node of this\n"
                f"# allocation; each joins the cluster's controller. Written by Phalanx's slurm backend.\n"
                f"exec {step}\n")

    def agent_step(self, nodes: int, output: Path) -> list[str]:
        """The `srun` that starts one agent on each of `nodes` nodes (every resource of the node: its workers run
        under the agent, in the step's cgroup). Each agent's log goes to its own `output` file (a pattern: %t the
        task), written by the step daemon on its node: srun, on the batch host, does not carry it, so an agent
        that outlives that host still logs."""
        return ["srun", "--no-kill", "--kill-on-bad-exit=0", "--ntasks-per-node=1", "--whole", "--nodes", str(nodes),
                f"--output={output}"]

    def _start_in_allocation(self, group: str, nodes: list[Node]) -> str:
        """`cluster up --slurm`: the group's first agents run as a step of the allocation this controller runs in,
        on the allocation's next unused nodes (`--relative`)."""
        job, used = self.settings.allocation, self._allocation_used
        self._allocation_used += len(nodes)
        self._allocation_groups.add(group)
        folder = self.paths.root / "slurm"
        folder.mkdir(exist_ok=True)
        with open(folder / f"{job}.{group}.out", "ab") as out:
            self._steps[(job, group)] = subprocess.Popen(
                [*self.agent_step(len(nodes), folder / f"{job}.{group}.%t.out"), f"--jobid={job}",
                 f"--relative={used}", "--overlap",
                 *self.agent_command(group)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=self.agent_env(submit=False))
        return job

    def flush(self) -> list[tuple[Node, str]]:
        """Submit one allocation per group for the nodes queued this tick; the nodes Slurm refused, and why."""
        failed = []
        queued, self._queued = self._queued, {}
        for group, nodes in queued.items():
            folder = self.paths.root / "slurm"
            folder.mkdir(exist_ok=True)
            if self.settings.allocation and group not in self._allocation_groups:
                job = self._start_in_allocation(group, nodes)  # the first nodes: the allocation we run in
                self._record(job, group, nodes, f"a step of Slurm job {job} (this allocation)")
                continue
            script = folder / f"{group}-{nodes[0].name}.sh"
            script.write_text(self.batch_script(group, len(nodes)))
            # the output beside the cluster's files (a shared PHALANX_HOME); slurm.sbatch_options may name another
            argv = ["sbatch", "--parsable", f"--output={folder}/%j.out",
                    *allocation_options(self.spec, group, len(nodes)), str(script)]
            try:
                job = slurm(*argv, env=self.agent_env()).strip().split(";")[0]
            except SlurmError as err:
                failed.extend((n, f"Slurm refused the allocation: {err}") for n in nodes)
                continue
            self._base[job] = f"phalanx cluster {self.spec.name} group {group}"
            self._record(job, group, nodes, f"Slurm job {job}")
        return failed

    def _record(self, job: str, group: str, nodes: list[Node], what: str) -> None:
        self.poller.start()
        self._submitted[job] = time.time()
        self._members.setdefault(job, set()).update(n.name for n in nodes)
        for n in nodes:
            self._job_of[n.name] = job
        what = f"{what}: {len(nodes)} nodes of group {group} ({', '.join(n.name for n in nodes)})"
        log.info("started %s; next: each node's agent joins once Slurm starts it", what)
        if self.store is not None:
            self.store.record_event(E.WAITING, f"started {what}; output in {self.paths.root / 'slurm'}")

    # ---- what Slurm says ----------------------------------------------------------------------------
    @staticmethod
    def slurm_place(node: Node) -> tuple[str, str] | None:
        """(job id, Slurm node name) of a joined node, from its handle `slurm:<job>:<node>:<pid>`."""
        parts = (node.handle or "").split(":")
        return (parts[1], parts[2]) if len(parts) == 4 and parts[0] == "slurm" else None

    def polled(self) -> bool:
        """Once per fresh view of Slurm (`taken` reads it), and as the hosts backend otherwise."""
        fresh, self._judged = self.poller.view is not self._judged, self.poller.view
        return fresh

    def taken(self, node: Node) -> str | None:
        view = self.poller.view
        if view is None or node.name in self._told:
            return None  # Slurm not heard yet (or unreachable): heartbeats judge the node
        place = self.slurm_place(node)
        if place is None:  # not joined yet: what is its allocation doing?
            job_id = self._job_of.get(node.name)
            submitted = self._submitted.get(job_id or "")
            if job_id is None or submitted is None or view.at < submitted + POLL_S:
                return None
            step = self._steps.get((job_id, node.group))
            if step is not None and step.poll() is not None:
                return (f"the srun step starting the agents in Slurm job {job_id} exited with code {step.returncode} "
                        f"before this node's agent joined; see {self.paths.root / 'slurm'}")
            job = view.jobs.get(job_id)
            if job is None or job.state not in LIVE_JOB_STATES:
                return (f"its Slurm job {job_id} ended ({job.state if job else 'gone from squeue'}) before its agent "
                        f"joined; see {self.paths.root / 'slurm' / f'{job_id}.out'}")
            waited = view.at - submitted
            if job.state == "PENDING" and waited > self.settings.allocation_timeout_s:
                self._cancel(job_id, "pending past slurm.allocation_timeout_s")
                return (f"its Slurm job {job_id} was still pending after {waited:.0f} s (squeue reason: {job.reason}; "
                        f"slurm.allocation_timeout_s={self.settings.allocation_timeout_s:g}); cancelled it")
            return None
        job_id, host = place
        job = view.jobs.get(job_id)
        if job is None or job.state not in LIVE_JOB_STATES:
            return f"its Slurm job {job_id} ended ({job.state if job else 'gone from squeue'})"
        slurm_node = view.nodes.get(host)
        if slurm_node and any(w in slurm_node.state for w in SLURM_STATES_TAKEN) \
                and not slurm_node.reason.startswith(("phalanx", "Action:Replace")):
            return (f"Slurm node {host} is {slurm_node.state} (reason: {slurm_node.reason or 'none given'}): Slurm or "
                    f"an operator took it from the job")
        return None

    def _annotate(self, view: SlurmView) -> None:
        """Keep each submitted Slurm job's comment truthful (squeue %k, scontrol show job): which Phalanx job
        each of its nodes runs. The allocation `cluster up` runs in keeps its user's comment."""
        if self.store is None or not self._base:
            return
        running: dict[str, list[str]] = {}
        for node in self.store.nodes(include_terminated=False):
            place = self.slurm_place(node)
            if place and node.job:
                running.setdefault(place[0], []).append(f"{node.name} runs phalanx job {node.job}")
        for job_id, base in list(self._base.items()):
            if job_id not in view.jobs:
                continue
            comment = base + (f"; {', '.join(sorted(running[job_id]))}" if job_id in running else "")
            if self._comments.get(job_id, base) == comment:  # `base` is what sbatch set
                continue
            try:
                slurm("scontrol", "update", f"jobid={job_id}", f"comment={comment}", timeout=10)
                self._comments[job_id] = comment
            except SlurmError as err:
                log.warning("could not set Slurm job %s's comment: %s", job_id, err)

    def remediate(self, node: Node, reason: str, cause: str) -> None:
        """Hand a faulty node back to Slurm as the spec's remediator says (in a thread: slurmctld may be slow)."""
        place = self.slurm_place(node)
        if place is None or cause == "scheduler":
            return  # never joined (no Slurm node to name), or Slurm took it itself
        host = place[1]
        first = reason.splitlines()[0] if reason else cause
        if self.settings.remediator == "report":
            self._event(f"Slurm node {host} of {node.name} is faulty ({cause}: {first}); remediator report: "
                        f"nothing asked of Slurm", node)
            return
        why = "Action:Replace" if self.settings.remediator == "hyperpod" else f"phalanx: {cause}: {first}"[:200]

        def drain() -> None:
            try:
                slurm("scontrol", "update", f"nodename={host}", "state=drain", f"reason={why}")
                self._event(f"Slurm node {host} of {node.name} drained (reason {why!r}); Slurm keeps it from "
                            f"new jobs until an operator resumes it", node)
            except SlurmError as err:
                self._event(f"could not drain Slurm node {host} of {node.name}: {err}", node)

        threading.Thread(target=drain, name=f"drain-{host}", daemon=True).start()

    def _event(self, line: str, node: Node) -> None:
        log.info("%s", line)
        if self.store is not None:
            self.store.record_event(E.REMEDIATED, line, node=node.name)

    # ---- stopping -----------------------------------------------------------------------------------
    def forget(self, node: Node) -> None:
        super().forget(node)
        place = self.slurm_place(node)
        job_id = place[0] if place else self._job_of.get(node.name)
        self._job_of.pop(node.name, None)
        members = self._members.get(job_id or "")
        if members is not None:
            members.discard(node.name)
            if not members and job_id != self.settings.allocation:  # every node it ran is gone: give it back
                self._members.pop(job_id)
                view = self.poller.view
                if view is None or job_id in view.jobs:  # (a one-node job ends with its agent)
                    self._cancel(job_id, "every node of it has left the cluster")

    def _cancel(self, job_id: str, why: str) -> None:
        try:
            slurm("scancel", job_id, timeout=15)
            log.info("cancelled Slurm job %s: %s", job_id, why)
        except SlurmError as err:
            log.warning("could not cancel Slurm job %s (%s): %s", job_id, why, err)

    def teardown(self, nodes: list[Node], grace_s: float) -> int:
        return len(self.sweep(nodes))

    def start(self) -> None:
        return None  # nothing of its own runs beside the controller

    def close(self) -> None:
        return None  # nothing of its own runs beside the controller

    def sweep(self, nodes: list[Node]) -> list[int]:
        """Cancel every Slurm job of the cluster; [] (no local pids: Slurm ends the processes)."""
        self.poller.stop()
        try:
            slurm("scancel", "--name", self.job_name, timeout=15)
        except SlurmError as err:
            log.warning("could not cancel the Slurm jobs named %s: %s", self.job_name, err)
        return []


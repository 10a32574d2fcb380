"""What an agent running in a Slurm allocation does about Slurm's own news (`backend: slurm`):

  the batch host died   `cluster up --slurm`'s controller runs on the allocation's batch host. Silent for
                        `slurm.controller_lost_s`, that host is taken for dead, and Slurm keeps a job whose batch
                        host failed under --no-kill running without its script: the agents of the allocation's
                        own step ask `scontrol requeue` (the next run resumes from the checkpoint), again every
                        10 s until Slurm accepts (slurmctld busy, the job mid-transition).
  the time limit nears  Slurm's USR2 (`sbatch --signal=B:USR2@120`, passed on by the batch script's `srun`):
                        the agent reports when in its heartbeats (`time_limit_warned_at`) and the controller asks
                        the training job on the node for a checkpoint. srun passes the signal to every process of
                        its step, so what the agent starts there starts with USR2 ignored (`ignoring_usr2`): its
                        default action would end the workers, the worker template, a job's own command.

Must not know: the controller's policy, workers.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time

log = logging.getLogger("phalanx.agent")
ASK_AGAIN_S = 10.0


def ignoring_usr2(argv: list[str]) -> list[str]:
    """In a Slurm step (SLURM_JOB_ID set): `argv` started through `sh` with USR2 ignored (an ignored signal stays
    ignored across exec, and in what a worker template forks); a program that wants the warning installs its own
    handler, which replaces the ignore. Elsewhere `argv` itself."""
    if not os.environ.get("SLURM_JOB_ID"):
        return argv
    return ["/bin/sh", "-c", 'trap "" USR2; exec "$@"', argv[0], *argv]


class SlurmAllocation:
    def __init__(self, requeue: dict | None):
        self.requeue = requeue or {}  # {"job": the allocation's id, "after_s": controller_lost_s}; {}: not asked
        self.next_ask = 0.0  # monotonic time of the next `scontrol requeue`; inf once Slurm accepted
        self.time_limit_warned_at: float | None = None  # epoch seconds of Slurm's USR2

    def warned(self) -> None:
        """Slurm's USR2 (a signal handler calls it): the allocation's time limit is near."""
        self.time_limit_warned_at = time.time()
        log.warning("Slurm sent USR2: the allocation's time limit is near; next: the controller asks the training "
                    "job here for a checkpoint")

    def controller_silent(self, down_s: float) -> None:
        """The controller has not answered for `down_s` seconds: ask for the requeue when it is this agent's to ask."""
        job = self.requeue.get("job")
        if (not job or os.environ.get("SLURM_JOB_ID") != job or down_s < self.requeue["after_s"]
                or time.monotonic() < self.next_ask):
            return  # not an agent of the allocation's own step (a refill job's agent leaves it to those)
        self.next_ask = time.monotonic() + ASK_AGAIN_S
        log.error("controller unreachable for %.0f s (slurm: the batch host is taken for dead); next: scontrol "
                  "requeue %s, the job resumes from its checkpoint", down_s, job)
        try:
            done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as err:
            log.error("scontrol requeue %s failed: %s; next: asking again in %g s", job, err, ASK_AGAIN_S)
            return
        said = (done.stderr or done.stdout).strip()
        if done.returncode == 0:
            self.next_ask = float("inf")
            log.info("scontrol requeue %s: accepted%s", job, f" ({said})" if said else "")
        else:
            log.error("scontrol requeue %s refused (exit %d): %s; next: asking again in %g s", job,
                      done.returncode, said, ASK_AGAIN_S)

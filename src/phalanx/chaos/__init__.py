"""`phalanx chaos`: a seeded soak that injects faults into running training jobs on a local cluster and checks
after each one that the job still ends right — it finished, its losses equal a failure-free run's bit for bit
(fp32), no committed step was lost beyond what the recovery mode allows, no process or port was leaked, and
its story of events is consistent.

    plan.py        the trials: fault kind × phase of a step × recovery mode, seeded; the CI list
    inject.py      landing a trial's faults at the right moment, through the operator's paths
    invariants.py  the checks, pure functions of what a job left behind
    census.py      the cluster's processes and listening ports, from /proc
    soak.py        the cluster, the references, one job per trial, evidence, cleanup
    report.py      the summary and its table

Uses the control plane and the training runtime only through their public APIs; nothing here is imported by
them.
"""

from phalanx.chaos.plan import KINDS, MODES, PHASES, JobShape, Trial, ci_plan, make_plan
from phalanx.chaos.soak import Settings, SoakError, run_soak

__all__ = ["KINDS", "MODES", "PHASES", "JobShape", "Settings", "SoakError", "Trial", "ci_plan", "make_plan",
           "run_soak"]

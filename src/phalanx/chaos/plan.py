"""What a chaos soak does, decided before anything runs: a list of trials drawn from the fault matrix with a
seeded `random.Random`, so one seed always gives the same plan.

A trial is one training job with one fault *kind* landing in one *phase* of a step, under one recovery
*mode*, aimed at one rank:

    kinds   kill-node (SIGKILL the node), kill-worker (SIGKILL one worker), hang-worker (SIGSTOP one worker),
            slow-rank (a rank that sleeps, alive), fail-health (its node fails a health check), agent-death
            (SIGKILL the node's agent only), controller-restart (SIGKILL the controller, `cluster start`),
            two-nodes (two nodes SIGKILLed at once), second-fault (a node SIGKILLed, another one `delay_s`
            later, while the job recovers from the first)
    phases  forward, backward, optimizer (right after the rank's optimizer update), checkpoint (as the
            checkpoint of `step` starts), regroup (while the job recovers from a first fault: a worker
            killed at `step`, rank `first`)
    modes   checkpointless, restart

Knows nothing about clusters or processes: only which faults, where, and what each may cost (the ranks it
takes away, from which the allowed number of lost steps follows).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace

KINDS = ("kill-node", "kill-worker", "hang-worker", "slow-rank", "fail-health", "agent-death",
         "controller-restart", "two-nodes", "second-fault")
PHASES = ("forward", "backward", "optimizer", "checkpoint", "regroup")
MODES = ("checkpointless", "restart")
LAYOUTS = ("hsdp", "fsdp")  # HSDP: 2 replicas × world/2 shards; FSDP: one replica of world shards
HARMLESS = ("slow-rank", "controller-restart")  # the job must go on without a recovery
SECOND_FAULT_DELAYS_S = (0.1, 0.3, 0.6, 1.0)


def layout_dims(layout: str, world: int) -> dict:
    """The `parallel` section of a layout at `world` ranks (one per node)."""
    return {"dp_replicate": 2, "dp_shard": world // 2} if layout == "hsdp" else {"dp_replicate": 1, "dp_shard": world}


@dataclass(frozen=True)
class JobShape:
    """The job every trial runs: its length, checkpoint interval and world size (one rank per node)."""

    steps: int = 40
    interval: int = 10
    world: int = 4

    def __post_init__(self):
        if self.world < 4 or self.world % 2 or self.interval < 1 or self.steps < 2 * self.interval:
            raise ValueError(f"{self}: the world must be even and at least 4 (HSDP needs 2 replicas of 2 shards), "
                             f"and the job at least two checkpoint intervals long")


@dataclass(frozen=True)
class Trial:
    index: int
    kind: str
    phase: str
    mode: str
    rank: int  # the rank the fault is aimed at (held in the phase, killed, stopped, or whose node fails)
    step: int  # the step in whose phase it lands (regroup: the step at which the first fault is injected)
    layout: str = "hsdp"
    other: int | None = None  # two-nodes, second-fault: the second rank
    first: int | None = None  # phase regroup: the rank killed first, to start the recovery the fault lands in
    delay_s: float = 0.0  # second-fault: seconds between the two faults

    def __post_init__(self):
        if self.kind not in KINDS or self.phase not in PHASES or self.mode not in MODES or \
                self.layout not in LAYOUTS:
            raise ValueError(f"not a trial: {self}")
        if (self.kind in ("two-nodes", "second-fault")) != (self.other is not None):
            raise ValueError(f"trial {self.index}: `other` is for two-nodes and second-fault only")
        if (self.phase == "regroup") != (self.first is not None):
            raise ValueError(f"trial {self.index}: `first` is for the regroup phase only")
        ranks = [r for r in (self.rank, self.other, self.first) if r is not None]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"trial {self.index}: its ranks must differ: {ranks}")

    @property
    def faults(self) -> int:
        """Faults this trial injects (a slow rank and a controller restart count as one each)."""
        return 1 + (self.other is not None) + (self.first is not None)

    @property
    def lost_ranks(self) -> set[int]:
        """Ranks whose process (and state) the trial takes away."""
        lost = {self.first} if self.first is not None else set()
        if self.kind not in HARMLESS:
            lost.add(self.rank)
        if self.other is not None:
            lost.add(self.other)
        return lost

    def expected_generations(self) -> tuple[int, int | None]:
        """(at least, at most) generations the job may take: every fault that takes a rank away ends one; a
        slow rank or a controller restart none — except a controller restarted while a checkpointless job
        regroups on its store, which may have to regroup once more (a `stranded` generation), and once more if a
        rank was caught in gloo's group creation of the stranded one: it exits (EXIT_STUCK) `stuck_grace_s`
        later and a fresh process takes its rank (seen once in CI's soak on 2026-11-27, state from peers)."""
        base = 1 + (self.first is not None)
        if self.kind in HARMLESS:
            again = self.kind == "controller-restart" and self.phase == "regroup" and self.mode == "checkpointless"
            return base, base + 2 * again
        return base + 1, None

    def label(self) -> str:
        return f"{self.kind}@{self.phase}/{self.mode}"

    def as_dict(self) -> dict:
        return {**asdict(self), "faults": self.faults}


def steps_allowed(trial: Trial, shape: JobShape) -> int:
    """The most committed steps one recovery may redo: restart mode, or a checkpointless job whose peers no
    longer hold some shard (both replicas, or a rank and its buddy), goes back to the newest checkpoint (up to
    one interval: a fault inside the save of step k·interval leaves step k·interval − interval); with HSDP the
    other replica holds every committed step (0); FSDP's buddy snapshots every step lose at most 2."""
    if trial.mode == "restart" or shard_lost(trial, shape):
        return shape.interval
    return 0 if trial.layout == "hsdp" else 2


def shard_lost(trial: Trial, shape: JobShape) -> bool:
    """Whether the ranks the trial takes away leave some shard's state held by no surviving peer."""
    lost = trial.lost_ranks
    dims = layout_dims(trial.layout, shape.world)
    if dims["dp_replicate"] > 1:  # mesh (replica, shard): rank = replica × dp_shard + shard
        shard = dims["dp_shard"]
        return any(all(r * shard + s in lost for r in range(dims["dp_replicate"])) for s in range(shard))
    return any((r + 1) % shape.world in lost for r in lost)  # a rank and its buddy (the next node's rank)


def _draw(rng: random.Random, index: int, kind: str, phase: str, mode: str, layout: str,
          shape: JobShape) -> Trial:
    ranks = list(range(shape.world))
    rng.shuffle(ranks)
    half = max(shape.interval, shape.steps // 2)
    if phase == "checkpoint":
        step = rng.choice(range(shape.interval, half + 1, shape.interval))
    else:
        step = rng.randint(3, half)
    two = kind in ("two-nodes", "second-fault")
    return Trial(index=index, kind=kind, phase=phase, mode=mode, layout=layout, rank=ranks[0], step=step,
                 other=ranks[1] if two else None, first=ranks[2] if phase == "regroup" else None,
                 delay_s=rng.choice(SECOND_FAULT_DELAYS_S) if kind == "second-fault" else 0.0)


def make_plan(seed: int, trials: int, *, modes=MODES, layouts=("hsdp",), kinds=KINDS, phases=PHASES,
              shape: JobShape = JobShape()) -> list[Trial]:
    """`trials` trials: every pass goes through the whole matrix (kinds × phases × modes × layouts) in a
    fresh seeded order, so any `trials` ≥ the matrix's size covers every cell; targets and steps are drawn
    per trial. Restart mode runs the HSDP layout only (FSDP changes nothing about a restart)."""
    rng = random.Random(seed)
    cells = [(k, p, m, lay) for k in kinds for p in phases for m in modes for lay in layouts
             if m == "checkpointless" or lay == "hsdp" or layouts == ("fsdp",)]
    plan: list[Trial] = []
    while len(plan) < trials:
        order = list(cells)
        rng.shuffle(order)
        for kind, phase, mode, layout in order[: trials - len(plan)]:
            plan.append(_draw(rng, len(plan) + 1, kind, phase, mode, layout, shape))
    return plan


# The CI soak: every fault kind once, both modes, every phase, chosen (not drawn) so that a short run still
# covers the matrix's rows; the targets vary (rank 0, whose process writes the metrics, included).
CI_TRIALS = (
    ("kill-node", "forward", "checkpointless", 1, 12, {}),
    ("kill-worker", "backward", "restart", 2, 7, {}),
    ("hang-worker", "optimizer", "checkpointless", 3, 9, {}),
    ("slow-rank", "checkpoint", "checkpointless", 2, 10, {}),
    ("fail-health", "forward", "restart", 1, 8, {}),
    ("agent-death", "checkpoint", "restart", 0, 10, {}),
    ("controller-restart", "regroup", "checkpointless", 1, 8, {"first": 3}),
    ("two-nodes", "backward", "checkpointless", 1, 11, {"other": 3}),  # both replicas of shard 1: fallback
    ("second-fault", "forward", "checkpointless", 1, 9, {"other": 2, "delay_s": 0.3}),
)


def ci_plan(shape: JobShape = JobShape()) -> list[Trial]:
    plan = []
    for i, (kind, phase, mode, rank, step, extra) in enumerate(CI_TRIALS, start=1):
        step = shape.interval if phase == "checkpoint" else min(step, max(3, shape.steps // 2))
        plan.append(Trial(index=i, kind=kind, phase=phase, mode=mode, rank=rank, step=step, **extra))
    return plan


def renumber(plan: list[Trial]) -> list[Trial]:
    return [replace(t, index=i) for i, t in enumerate(plan, start=1)]

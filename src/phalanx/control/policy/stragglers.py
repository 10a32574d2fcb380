"""The straggler rule: which rank of a running generation is slower than its peers, from the compute seconds
each rank reports for its steps (`protocol.step_time_key`; on a CPU device the rank's own CPU time, which
leaves out the time it waited on a slower peer).

    a rank is slow in a report when  seconds > factor × median(the other ranks' newest seconds)
                                 and seconds − that median ≥ MIN_EXCESS_S (timer noise on tiny steps)
    it is a straggler after `steps` slow reports in a row (a report that is not slow starts the count again)

A *report* is a rank's time for a step the controller has not judged yet: the controller reads the store
at each heartbeat, so it samples the steps (a fast job's ranks are judged on every few steps, not each one).
Nothing is judged until every rank of the generation has reported once. The baseline is the median of the
*others*, not of all ranks: with 2 ranks each is compared with the other one (the median of both would be
their mean, which a rank can never exceed twice over), with 3 or more it is the peers' middle.

A straggler is flagged once per (job, generation, rank); what follows is the job's `straggler_policy`:
`report` (the event only) or `replace-node` (its node is treated as faulty, replaced from the spare pool,
and the job recovers as from a node fault) — the scheduler acts, this module only decides.

Pure: numbers in, verdicts out. Must not know: the store, processes, how the seconds were measured.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field
from statistics import median

POLICIES = ("report", "replace-node")
MIN_EXCESS_S = 0.005


@dataclass(frozen=True)
class StragglerSettings:
    """A job's straggler settings (`phalanx job submit --straggler-factor/--straggler-steps/--straggler-policy`)."""

    factor: float = 2.0  # k: slower than k × the others' median
    steps: int = 5  # m: for this many reports in a row
    policy: str = "report"  # report | replace-node

    def __post_init__(self):
        if not self.factor > 1:
            raise ValueError(f"straggler_factor={self.factor!r}: must be above 1 (a rank slower than this many "
                             f"times its peers' median is a straggler; e.g. 2)")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"straggler_steps={self.steps!r}: must be a whole number >= 1 (slow reports in a row "
                             f"before a rank is flagged; e.g. 5)")
        if self.policy not in POLICIES:
            raise ValueError(f"straggler_policy={self.policy!r}: choose one of {', '.join(POLICIES)}")

    @classmethod
    def of(cls, stored: dict | None) -> StragglerSettings:
        """From a job's stored settings (None: a job submitted before they existed → the defaults)."""
        return cls(**(stored or {}))

    def to_dict(self) -> dict:
        return {"factor": self.factor, "steps": self.steps, "policy": self.policy}


@dataclass(frozen=True)
class Straggler:
    """A flagged rank: its newest compute seconds against the others' median, at `step`."""

    rank: int
    step: int
    seconds: float
    median_s: float
    reports: int  # slow reports in a row when flagged (= the settings' steps)

    @property
    def ratio(self) -> float:
        return self.seconds / self.median_s if self.median_s > 0 else float("inf")


def is_slow(seconds: float, others: list[float], factor: float) -> tuple[bool, float]:
    """(whether `seconds` is slow against `others`, the others' median)."""
    return _judged(seconds, median(others), factor)


def _judged(seconds: float, base: float, factor: float) -> tuple[bool, float]:
    return seconds > factor * base and seconds - base >= MIN_EXCESS_S, base


def median_without(ordered: list[float], value: float) -> float:
    """`statistics.median` of `ordered` (sorted, holding `value`) with one `value` left out, without copying or
    sorting it: a generation's every rank is judged against its peers at each step, and a sort per rank made
    that O(world² log world) per step."""
    at = bisect_left(ordered, value)
    n = len(ordered) - 1  # the others

    def other(i: int) -> float:
        return ordered[i] if i < at else ordered[i + 1]

    return other(n // 2) if n % 2 else (other(n // 2 - 1) + other(n // 2)) / 2


@dataclass
class StragglerWatch:
    """One generation's straggler state: each rank's newest (step, seconds), its slow streak, who is flagged."""

    world_size: int
    settings: StragglerSettings
    newest: dict[int, tuple[int, float]] = field(default_factory=dict)
    streak: dict[int, int] = field(default_factory=dict)
    flagged: dict[int, Straggler] = field(default_factory=dict)
    _new: list[Straggler] = field(default_factory=list)
    _ordered: list[float] = field(default_factory=list)  # every rank's newest seconds, sorted

    def record(self, rank: int, step: int, seconds: float) -> None:
        """A rank's time for `step`; judged when the step is new and every rank has reported."""
        old = self.newest.get(rank)
        if old is not None and old[0] == step:
            return  # read again, not a new report
        self.newest[rank] = (step, seconds)
        if old is not None:
            del self._ordered[bisect_left(self._ordered, old[1])]
        insort(self._ordered, seconds)
        if len(self.newest) < self.world_size or self.world_size < 2 or rank in self.flagged:
            return
        slow, base = _judged(seconds, median_without(self._ordered, seconds), self.settings.factor)
        self.streak[rank] = self.streak.get(rank, 0) + 1 if slow else 0
        if self.streak[rank] >= self.settings.steps:
            found = Straggler(rank, step, seconds, base, self.streak[rank])
            self.flagged[rank] = found
            self._new.append(found)

    def take_new(self) -> list[Straggler]:
        """The stragglers flagged since the last call (each rank once per generation)."""
        new, self._new = self._new, []
        return new

"""Agreeing on where a regrouped job continues from, and who restores what from whom.

After a fault, every rank of the new generation reports what it holds (`Holding`): the shard its new
position needs, its carried live state (a survivor: the state its optimizer reached), and the in-memory
snapshots it kept (its own, and the copy of its buddy's). `choose_plan` — a pure function, run by every
rank on the same gathered list, so all reach the same answer without another round — picks the newest
step at which *every* shard the new layout needs exists somewhere alive (live or snapshot: both are the
state after that step), and for each rank the copy it applies: its own when it has one, else a transfer
from a holder (live state first, the least-loaded sender next, then the lowest rank).

That is the committed step: an update half the ranks applied (a fault inside the step's last reduction)
is kept when every shard has it, and otherwise rolled back to the step all shards have. When no step is
covered — both holders of a shard gone, or nothing held at all (a first start, a restart of every
process) — the plan says `disk`: load the newest checkpoint (or initialise).

Nothing here assumes the world size is fixed: ranks ask for shards by coordinate, so a generation with
more or fewer replicas is planned the same way. Knows nothing about torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

LIVE = "live"


@dataclass(frozen=True)
class Copy:
    """One state a rank holds: `source` is "live", or "own@S"/"peer@S" for snapshots taken at step S."""

    source: str
    coord: tuple
    signature: tuple
    step: int


@dataclass(frozen=True)
class Holding:
    rank: int
    coord: tuple  # the shard this rank's position in the new layout needs
    signature: tuple
    copies: tuple[Copy, ...] = ()


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    source: str  # which of src's copies
    coord: tuple


@dataclass
class Plan:
    kind: str  # "memory" (restore from peers' memory / own copies) or "disk"
    step: int | None
    local: dict[int, str] = field(default_factory=dict)  # rank → the source of its own copy it applies
    transfers: list[Transfer] = field(default_factory=list)
    reason: str = ""

    def sends(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank]

    def receive(self, rank: int) -> Transfer | None:
        return next((t for t in self.transfers if t.dst == rank), None)

    @property
    def from_snapshot(self) -> bool:
        sources = list(self.local.values()) + [t.source for t in self.transfers]
        return any(s != LIVE for s in sources)


def choose_plan(holdings: list[Holding]) -> Plan:
    copies: dict[tuple, list[tuple[int, Copy]]] = {}  # (coord, signature, step) → [(rank, copy)]
    for h in holdings:
        for c in h.copies:
            copies.setdefault((c.coord, c.signature, c.step), []).append((h.rank, c))
    if not copies:
        return Plan("disk", None, reason="no rank holds training state in memory (a first start, or every "
                                         "process restarted)")
    needed = {(h.coord, h.signature) for h in holdings}
    steps = sorted({step for (_, _, step) in copies}, reverse=True)
    for step in steps:
        if all((coord, sig, step) in copies for coord, sig in needed):
            return _assign(holdings, copies, step)
    newest = steps[0]
    missing = sorted(str(coord) for coord, sig in needed if (coord, sig, newest) not in copies)
    return Plan("disk", None, reason=f"no step is held for every shard in memory (at step {newest} nobody "
                                     f"holds shard {missing[0]}: its holders are gone); falling back to the "
                                     f"newest checkpoint")


def _assign(holdings: list[Holding], copies: dict, step: int) -> Plan:
    plan = Plan("memory", step)
    load: dict[int, int] = {}
    for h in sorted(holdings, key=lambda h: h.rank):
        key = (h.coord, h.signature, step)
        mine = [c for c in h.copies if (c.coord, c.signature, c.step) == key]
        if mine:
            plan.local[h.rank] = min(mine, key=lambda c: c.source != LIVE).source
            continue
        src, copy = min(copies[key], key=lambda rc: (rc[1].source != LIVE, load.get(rc[0], 0), rc[0]))
        load[src] = load.get(src, 0) + 1
        plan.transfers.append(Transfer(src, h.rank, copy.source, h.coord))
    return plan

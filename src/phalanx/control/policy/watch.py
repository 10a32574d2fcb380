"""Which nodes a reconciler tick observes (`Reconciler.observe`): every live node when the backend's own checks must
be polled (local: it asks the agent processes); otherwise only the nodes something may have happened to. At 4,096
nodes, observing every healthy node at every tick took a quarter of a core of the controller, and after that the
scans of every node to find the few that changed were most of a tick (benchmarks/control_scale.py).

A node is observed when it is not healthy (bringing up, or judged and waiting to be recovered), its row changed
other than by a beat (`Store.take_touched`), a deadline of it comes due (`wake`: its silence; `remind`: its link's
close, once the grace is over), or it is new. Every node is scanned only after a write that was not a heartbeat's
observation (`Store.version`).

When the silence of nodes past the timeout is not judged yet: `MassSilence` (the counts, no policy of what follows).

Must not know: what observing a node decides, HTTP, processes.
"""

from __future__ import annotations

import heapq

from phalanx.control.state.store import Node, NodeState, Store

MASS_SILENCE_MIN = 8  # nodes silent at once before `health.mass_silence_fraction` may hold their judgment...
MASS_SILENCE_HOLD = 10  # ...for at most this many heartbeat_timeout_s: silent longer, hosts that did die together


class Watch:
    def __init__(self, store: Store):
        self.store = store
        # heap of (when, node, once): when a healthy node is looked at again; `once`: a `remind`, kept whatever
        # else is due sooner (its silence is a single time: `wake`)
        self._due: list[tuple[float, str, bool]] = []
        self._next: dict[str, float] = {}  # node → its earliest time in `_due` (later entries of it are stale)
        self._version: int | None = None  # the store's version `_unsettled` and `_order` were read at
        self._unsettled: set[str] = set()  # the live nodes that were not healthy then
        self._order: dict[str, int] = {}  # node → its position then (nodes are observed in creation order)

    def wake(self, name: str, at: float) -> None:
        """Observe node `name` again at `at` (or sooner, if already due sooner)."""
        if at < self._next.get(name, float("inf")):
            self._next[name] = at
            heapq.heappush(self._due, (at, name, False))

    def remind(self, name: str, at: float) -> None:
        """Observe node `name` at `at` as well, whatever is due sooner: a link's close once its grace is over. As a
        `wake`, a close whose grace ended after a silence check due sooner was found at that check within its grace,
        and forgotten: the killed agent was found only at its next silence check, the heartbeat timeout later
        (tests/test_policy.py)."""
        heapq.heappush(self._due, (at, name, True))

    def pick(self, now: float, *, every: bool) -> list[Node]:
        """The live nodes to observe now; `every`: all of them (the backend is polled, or the store is not the
        owner and keeps no touched rows)."""
        touched, due = self.store.take_touched(), set()
        while self._due and self._due[0][0] <= now:
            at, name, once = heapq.heappop(self._due)
            if once:
                due.add(name)
            elif self._next.get(name) == at:
                del self._next[name]
                due.add(name)
        version = self.store.version
        if every or version is None:
            return self.store.nodes(include_terminated=False)
        names = touched | due | self._unsettled
        if version != self._version:  # a node added, moved on, or changed: scan them all once
            nodes = self.store.nodes(include_terminated=False)
            self._version, self._order = version, {n.name: i for i, n in enumerate(nodes)}
            self._unsettled = {n.name for n in nodes if n.state != NodeState.HEALTHY}
            names |= self._unsettled | {n.name for n in nodes if n.name not in self._next}
        last = len(self._order)
        picked = (self.store.node(name) for name in sorted(names, key=lambda n: self._order.get(n, last)))
        return [n for n in picked if n is not None and n.state != NodeState.TERMINATED]


class MassSilence:
    """Whether the nodes silent past the timeout at a tick wait to be judged. More than `fraction` of the nodes that
    heartbeat (and MASS_SILENCE_MIN) silent at once is the controller's own load or network more likely than that
    many hosts ("mass"). After one, the nodes still silent wait while their count falls, the controller catching up
    ("tail": 188 of 4,096 agents started together, judged the tick the rest were heard, failed a cluster's
    creation), until none came back for a timeout. Never longer than MASS_SILENCE_HOLD timeouts."""

    def __init__(self):
        self._tail: tuple[int, float] | None = None  # since a mass silence: (nodes silent, since when that few)
        self.heard = 0  # how many nodes heartbeat, at the last mass silence

    def holds(self, silent: list[float], count_heard, *, now: float, timeout: float,
              fraction: float | None) -> str | None:
        """`silent`: each silent node's seconds; `count_heard()`: how many nodes heartbeat. "mass", "tail" or None."""
        if not silent or max(silent) >= MASS_SILENCE_HOLD * timeout:
            self._tail = None
            return None
        many = fraction is not None and MASS_SILENCE_MIN <= len(silent)
        if many and len(silent) > fraction * (heard := count_heard()):
            self.heard = heard
            self._tail = (len(silent), now)
            return "mass"
        if self._tail is not None and len(silent) < self._tail[0]:
            self._tail = (len(silent), now)
        if self._tail is not None and now - self._tail[1] < timeout:
            return "tail"
        self._tail = None
        return None

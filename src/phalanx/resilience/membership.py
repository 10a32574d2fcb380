"""A checkpointless worker's view of its job's generations, through the controller's store (the seam), and the
store its process groups rendezvous on.

The controller publishes each generation's layout and then its number (`protocol.publish_generation`). A
worker finds its rank in a layout from its node and local rank, so a survivor keeps its place and a replacement
takes the failed one's. Process groups rendezvous on `PrefixStore(protocol.pg_prefix(job, g))` of that store,
which lives in the controller and outlives any rank; every key goes through `protocol.connect_store`, under the
namespace derived from the cluster token. `arrive()` counts this rank in and waits until every rank of the
generation has arrived before `init_process_group` (which would block, uninterruptibly, on a rank that never
comes); a newer generation interrupts the wait. `watch()` runs a thread that notices a newer generation while
this one trains (a node failed a health check, its workers alive): the loop checks `superseded` between steps.

`RegroupStore` wraps the generation's PrefixStore: every wait bounded, and abandoned when a newer generation is
published. `init_process_group` and every `new_group` after it block in C++ until each peer has written its
address to the store; a peer that dies after arriving never writes it, and a plain TCPStore client would block
for the whole process-group timeout (minutes) while the other survivors, gone on to the next generation, wait
for this rank in vain. Here torch calls back into Python for every store operation (a `dist.Store` subclass),
and a wait polls the real store: between polls it raises `Superseded` when a newer generation exists (which
unwinds the group creation) and `TimeoutError` once `timeout_s` has passed.

The same thread guards the forming of a generation (`forming()` … `watch()`), where not every wait is a store
wait: gloo connecting to a peer that died after writing its address blocks in C++ for the group's timeout. A
rank still forming its generation `stuck_grace_s` after a newer one appeared logs where it is stuck and exits
with `protocol.EXIT_STUCK`: the controller gives its rank to a fresh process, as for a killed one. Likewise a
rank told to leave the generation it trains while it is between two step boundaries (from the trainer's
`on_step_start` — Membership is one of its callbacks — to the run loop's `at_boundary()`: the step, and the
checkpoint save or buddy snapshot after it) that does not reach the boundary within max(`stuck_grace_s`, 3 ×
its longest recent step-to-boundary): it is blocked in a collective with a peer that stopped without dying (a
frozen host keeps its sockets open). When the newer generation lost a node of this one to a fault, the thread
first cuts (after `CUT_GRACE_S`) this process's connections to the generation's peers (`sockets.py`): a
collective waiting on a host that died without closing them fails at once, and the rank leaves with its state.
Before the first step a newer generation is only news: the rank leaves at its first step boundary.

Knows nothing about models or training state; `RegroupStore`'s generation check is a callable.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from phalanx import protocol
from phalanx.resilience.sockets import cut_connections

log = logging.getLogger("phalanx.membership")
POLL_S = 0.01
STORE_POLL_S = 0.002  # a RegroupStore wait's poll: one round trip to the controller's store (~0.1 ms on loopback)
NEWER_EVERY_S = 0.05  # how often a waiting rank asks whether a newer generation exists
STUCK_GRACE_S = 10.0  # the default of `resilience.stuck_grace_s`
CUT_GRACE_S = 1.0  # a newer generation lost a node of this one: cut the peers' connections this long after


class Superseded(RuntimeError):
    """A newer generation was published while this one was forming or training."""

    def __init__(self, generation: int, newer: int):
        super().__init__(f"generation {generation} superseded by generation {newer}")
        self.newer = newer


class NotInGeneration(RuntimeError):
    """This worker's node has no place in the new generation (it was judged faulty)."""


class RankTaken(RuntimeError):
    """Another process already holds this worker's rank in the generation."""


@dataclass(frozen=True)
class Placement:
    generation: int
    rank: int
    world_size: int
    nodes: tuple[str, ...]
    cause: str = "fault"  # why the generation before it ended: "fault", or "resize" (an elastic job)


class Membership:
    def __init__(self, store_addr: str, job_id: str, node: str, local_rank: int, *, timeout_s: float = 30.0,
                 token: str | None = None, stuck_grace_s: float = STUCK_GRACE_S):
        self.host, self.port = protocol.parse_store_addr(store_addr)
        self.store_addr, self.token = store_addr, token
        self.job_id, self.node, self.local_rank = job_id, node, local_rank
        self.timeout = timedelta(seconds=timeout_s)
        self.store = self._connect()
        self.superseded = threading.Event()
        self.left_untold: int | None = None  # a generation this rank left while the store was unreachable
        self.regroup_store: RegroupStore | None = None  # the current generation's (see init_process_group)
        self.identity = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"  # claims ranks (`arrive`)
        self.stuck_grace_s = stuck_grace_s
        self._thread: threading.Thread | None = None  # watches generations (started by `forming` or `watch`)
        self._watching = -1  # the generation this rank trains in (-1: none)
        self._forming: int | None = None  # the generation this rank is forming (joining, restoring), if any
        self._newer_since: float | None = None  # when a generation newer than the forming one was first seen
        self._superseded_at: float | None = None  # when the generation this rank trains was superseded
        self._step_s = 0.0  # the longest recent step-to-boundary (decaying): how long the one in flight may take
        self._step_started: float | None = None  # the step in flight began (monotonic), None at a boundary
        self._lost: set[str] | None = None  # nodes of this generation the newer one lost to a fault (None: cut)
        self._watch_lock = threading.Lock()

    @classmethod
    def from_env(cls, env=None, *, stuck_grace_s: float = STUCK_GRACE_S) -> "Membership":
        env = os.environ if env is None else env
        return cls(env[protocol.STORE_ADDR], env[protocol.JOB_ID], env[protocol.NODE], int(env[protocol.LOCAL_RANK]),
                   token=env.get(protocol.CLUSTER_TOKEN), stuck_grace_s=stuck_grace_s)

    def _connect(self):
        return protocol.connect_store(self.store_addr, self.token, self.timeout)

    # ---- generations ----------------------------------------------------------------------------------
    def latest(self, store=None) -> int:
        store = store or self.store
        key = protocol.generation_key(self.job_id)
        return int(store.get(key)) if store.check([key]) else 0

    def placement(self, generation: int) -> Placement:
        layout = json.loads(self.store.get(protocol.layout_key(self.job_id, generation)))
        nodes = layout["nodes"]
        if self.node not in nodes:
            raise NotInGeneration(f"node {self.node} has no place in generation {generation} (nodes: "
                                  f"{', '.join(nodes)})")
        rank = protocol.rank_of(nodes, self.node, self.local_rank, layout["workers_per_node"])
        return Placement(generation, rank, layout["world_size"], tuple(nodes), layout.get("cause", "fault"))

    def wait_for_newer(self, than: int, timeout_s: float) -> int:
        """Block until a generation newer than `than` is published; return it. TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            g = self._latest_reconnecting()
            if g > than:
                return g
            time.sleep(POLL_S)
        raise TimeoutError(f"no generation after {than} was published within {timeout_s:g} s")

    def _latest_reconnecting(self) -> int:
        try:
            if self.left_untold is not None:  # a restarted controller's store is new: it must hear it now
                self.report_left(self.left_untold)
                log.info("told the controller (its store is back) that this rank left generation %d",
                         self.left_untold)
                self.left_untold = None
            return self.latest()
        except (RuntimeError, OSError):  # the controller restarts: its store comes back on the same port
            time.sleep(0.5)
            try:
                self.store = self._connect()
            except (RuntimeError, OSError):
                pass
            return 0

    # ---- forming a generation ---------------------------------------------------------------------------
    def arrive(self, p: Placement, timeout_s: float) -> None:
        """Claim this rank, count it in, then wait for all `p.world_size` ranks (or a newer generation).

        Exactly one process holds a rank in a generation: the first to claim it. Another process that finds
        the rank taken (a stale standby beside a fresh process, say) raises `RankTaken` before it is counted:
        two processes as one rank would leave another rank missing and every peer waiting for it."""
        claim = f"{protocol.joined_key(self.job_id, p.generation)}/claim/{p.rank}"
        holder = self.store.compare_set(claim, "", self.identity).decode()
        if holder != self.identity:
            raise RankTaken(f"rank {p.rank} of generation {p.generation} is already held by process {holder}; "
                            f"this process ({self.identity}) stays out")
        key = protocol.joined_key(self.job_id, p.generation)
        self.store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while (n := self.store.add(key, 0)) < p.world_size:
            newer = self.latest()
            if newer > p.generation:
                raise Superseded(p.generation, newer)
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {p.generation}: {n} of {p.world_size} ranks arrived within "
                                   f"{timeout_s:g} s")
            time.sleep(POLL_S)

    def init_process_group(self, p: Placement, backend: str, timeout_s: float, regroup_timeout_s: float) -> None:
        """The generation's default group (and, later, every `new_group`) on a `RegroupStore`: a peer that
        dies while the groups form costs at most `regroup_timeout_s`, and a newer generation ends the wait
        at once. `timeout_s` is the collectives' timeout."""
        def newer() -> int:
            latest = self.latest()
            return latest if latest > p.generation else 0

        prefixed = dist.PrefixStore(protocol.pg_prefix(self.job_id, p.generation), self.store)
        # torch keeps only a C++ reference to a Python store: the Python object must outlive the groups, or
        # torch's calls into it fail ("Not implemented")
        self.regroup_store = RegroupStore(prefixed, newer=newer, superseded=lambda g: Superseded(p.generation, g),
                                          timeout_s=regroup_timeout_s)
        dist.init_process_group(backend, store=self.regroup_store, rank=p.rank, world_size=p.world_size,
                                timeout=timedelta(seconds=timeout_s))

    def report_left(self, generation: int) -> None:
        """This rank left `generation` after a failed collective (the controller regroups the job if no
        worker or node fault follows)."""
        self.store.add(protocol.left_key(self.job_id, generation), 1)

    def report_finished(self, step: int) -> None:
        self.store.set(protocol.finished_key(self.job_id), json.dumps({"step": step, "time": time.time()}))

    def report_recovered(self, generation: int, summary: dict) -> None:
        self.store.set(protocol.recovered_key(self.job_id, generation), json.dumps(summary))

    # ---- watching while forming and training ---------------------------------------------------------------
    def forming(self, generation: int) -> None:
        """This rank starts forming `generation`: from here until `watch()` (trained) or `unwatch()` (left),
        a newer generation must make it leave within `stuck_grace_s`, or the process exits (EXIT_STUCK)."""
        with self._watch_lock:
            self._forming, self._newer_since = generation, None
        self._start_thread()

    def watch(self, generation: int) -> None:
        """`generation` formed and trains: set `superseded` as soon as a newer generation is published."""
        self.superseded.clear()
        with self._watch_lock:
            self._watching, self._forming, self._superseded_at, self._step_started = generation, None, None, None
        self._start_thread()

    def unwatch(self) -> None:
        """This rank left its generation: nothing trains, so a newer generation is expected, not news."""
        with self._watch_lock:
            self._forming, self._watching, self._superseded_at, self._step_started = None, -1, None, None

    # the trainer's callbacks (duck-typed: this module imports no training code)
    def on_step_start(self, trainer, step: int) -> None:
        self._step_started = time.monotonic()

    def on_step_end(self, trainer, record: dict) -> None:
        pass  # still busy: a checkpoint save or a buddy snapshot may follow, collectives too

    def at_boundary(self) -> None:
        """The run loop is between steps (where it checks `superseded`): nothing in flight."""
        started, self._step_started = self._step_started, None
        if started is not None:
            self._step_s = max(0.9 * self._step_s, time.monotonic() - started)

    def _start_thread(self) -> None:
        with self._watch_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch_loop, name="phalanx-generation-watch",
                                                daemon=True)
                self._thread.start()

    def _watch_loop(self) -> None:
        store = None
        while True:
            try:
                store = store or self._connect()
                newest = self.latest(store)
            except (RuntimeError, OSError):
                store = None
                time.sleep(0.5)
                continue
            with self._watch_lock:
                current = self._watching
                self._check_forming(newest)
            if current >= 0 and newest > current and not self.superseded.is_set():
                log.warning("generation %d published while generation %d trains; next: leave it at the next step "
                            "boundary and regroup", newest, current)
                lost = self._lost_nodes(store, current, newest)
                with self._watch_lock:
                    self._superseded_at, self._lost = time.monotonic(), lost
                self.superseded.set()
            with self._watch_lock:
                self._check_training(newest)
            time.sleep(0.05)

    def _check_training(self, newest: int) -> None:
        """(Under the lock.) Superseded inside a step: cut the peers' connections if a fault took a node of this
        generation; exit if past its first step and still inside max(stuck_grace_s, 3 × its longest recent one)."""
        if self._superseded_at is None or self._watching < 0 or self._step_started is None:
            return
        waited, grace = time.monotonic() - self._superseded_at, max(self.stuck_grace_s, 3 * self._step_s)
        if self._lost and waited >= CUT_GRACE_S:
            lost, self._lost, cut = self._lost, None, cut_connections(keep=(self.host, self.port))
            log.warning("generation %d lost %s to a fault mid-step: cut %d connections to its peers; next: the step "
                        "fails, this rank leaves with its state", self._watching, ", ".join(sorted(lost)), cut)
        if not self._step_s or waited < grace:
            return
        self._exit_stuck(f"still training generation {self._watching} {waited:.0f} s after generation {newest} was "
                         f"published (a step and what follows it take up to {self._step_s:.1f} s): the main thread "
                         f"is blocked in a collective with a peer that stopped without dying (a frozen host?)")

    def _lost_nodes(self, store, current: int, newest: int) -> set[str]:
        """Nodes of generation `current` that `newest` dropped after a fault (none after a resize)."""
        try:
            old, new = (json.loads(store.get(protocol.layout_key(self.job_id, g))) for g in (current, newest))
        except (RuntimeError, OSError, ValueError):
            return set()
        return set(old["nodes"]) - set(new["nodes"]) if new.get("cause", "fault") == "fault" else set()

    def _exit_stuck(self, what: str) -> None:
        frame = sys._current_frames().get(threading.main_thread().ident)
        where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(unknown)\n"
        log.error("%s, at:\n%snext: exit with code %d (the controller gives this rank to a fresh process)", what,
                  where, protocol.EXIT_STUCK)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(protocol.EXIT_STUCK)

    def _check_forming(self, newest: int) -> None:
        """(Under the lock, so the main thread cannot finish forming in between.) Exit if this rank has been
        forming an older generation for `stuck_grace_s` since a newer one was published."""
        if self._forming is None or newest <= self._forming:
            self._newer_since = None
            return
        now = time.monotonic()
        self._newer_since = self._newer_since or now
        if now - self._newer_since < self.stuck_grace_s:
            return
        self._exit_stuck(f"still forming generation {self._forming} {now - self._newer_since:.0f} s after "
                         f"generation {newest} was published: the main thread is blocked where it cannot notice "
                         f"(a peer that died while the groups formed?)")


# ---- the store a generation's process groups rendezvous on -------------------------------------------------
class RegroupStore(dist.Store):
    """Wraps `inner` (the generation's PrefixStore). `newer()` returns a generation number newer than this
    one, or 0; `superseded(newer)` builds the exception raised when one appears."""

    def __init__(self, inner, *, newer: Callable[[], int], superseded: Callable[[int], Exception],
                 timeout_s: float):
        super().__init__()
        self.inner, self.newer, self.superseded = inner, newer, superseded
        self.timeout_s = timeout_s
        self.abandoned_for: int | None = None  # the newer generation that ended a wait, once one did

    # torch's ProcessGroup constructors call set_timeout with the collective timeout; the waits here keep the
    # regroup's own bound instead (a collective's timeout says nothing about how long peers may take to arrive)
    def set_timeout(self, timeout: timedelta) -> None:
        pass

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    # the rest of the Store API, which torch may call (a method missing here fails as "Not implemented")
    def clone(self) -> "RegroupStore":
        inner = self.inner.clone() if hasattr(self.inner, "clone") else self.inner
        return RegroupStore(inner, newer=self.newer, superseded=self.superseded, timeout_s=self.timeout_s)

    def append(self, key: str, value) -> None:
        self.inner.append(key, value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list) -> None:
        self.inner.multi_set(keys, values)

    def has_extended_api(self) -> bool:
        return True

    def list_keys(self) -> list[str]:
        return self.inner.list_keys()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        bound = self.timeout_s if timeout is None else min(self.timeout_s, timeout.total_seconds())
        start = time.monotonic()
        asked = start
        while not self.inner.check(keys):
            now = time.monotonic()
            if now - asked >= NEWER_EVERY_S:
                asked = now
                newer = self.newer()
                if newer:
                    self.abandoned_for = newer
                    raise self.superseded(newer)
            if now - start > bound:
                raise TimeoutError(f"process-group rendezvous: keys {keys} not written within {bound:g} s "
                                   "(a peer died after it arrived?)")
            time.sleep(STORE_POLL_S)

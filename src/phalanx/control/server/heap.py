"""Keeping the controller's garbage collections short: objects that live as long as the controller are moved out
of the collector's sight (`gc.freeze`).

CPython's full collection walks every object the collector tracks, with the GIL held. In a controller that is
torch's and FastAPI's modules, every node's row, and each agent's connection, link and its tasks: at 1,024 agents
~400k objects, and a full collection every few seconds took 160-260 ms (measured with `gc.callbacks` on
benchmarks/control_scale.py), during which no heartbeat was answered: they were the heartbeats' p99. Frozen, an
object is never walked again, so a full collection costs what the young objects cost.

- `gc.freeze()` once the controller is built (its modules, its app);
- again right after a full collection that took longer than SLOW_S, from a thread of its own: what survived it is
  long-lived (the agents' links, opened while a cluster is created, are most of it). Not at the reconciler's next
  tick: a tick that brings 4,096 nodes into service lasted 47 s, and the full collections meanwhile grew from 0.1
  to 1 s each, every ~3 s, until heartbeats went unanswered past the timeout;
- every REFREEZE_S, `gc.unfreeze()` then one full collection and `gc.freeze()`: a frozen object that became
  garbage in a reference cycle (a closed connection's objects) is freed then, not never.

Must not know: anything of the controller's state; it only decides when the collector runs over what.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger("phalanx.controller")
SLOW_S = 0.02  # a full collection that took longer: its survivors are frozen right after it
REFREEZE_S = 600.0  # unfreeze, collect everything, freeze again at most this often


class LongLived:
    """`freeze()` at start; `tick()` from the reconciler's thread after each tick (never from a collection)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._started: float | None = None
        self._slow = threading.Event()  # a full collection took longer than SLOW_S since the last freeze
        self._lock = threading.Lock()  # (a freeze, the refreeze)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._refrozen_at = clock()
        self.freezes = 0

    def freeze(self) -> None:
        with self._lock:
            self._freeze_locked()
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._freezer, name="heap-freeze", daemon=True)
            self._thread.start()

    def _note(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            if time.perf_counter() - self._started > SLOW_S:
                self._slow.set()  # (the freezer thread runs it: a collection's callback does not change the heap)
            self._started = None

    def _freezer(self) -> None:
        while self._slow.wait() and not self._closed:
            self._freeze_if_slow()

    def _freeze_if_slow(self) -> None:
        with self._lock:  # (the freezer thread and a tick: one freeze)
            if self._slow.is_set():
                self._freeze_locked()

    def _freeze_locked(self) -> None:
        if self._note not in gc.callbacks:
            gc.callbacks.append(self._note)
        gc.freeze()
        self._slow.clear()
        self.freezes += 1

    def tick(self) -> None:
        now = self.clock()
        if now - self._refrozen_at >= REFREEZE_S:
            started = time.perf_counter()
            with self._lock:
                gc.unfreeze()
                gc.collect()
            self.freeze()
            self._refrozen_at = now
            log.debug("heap: full collection of every object in %.0f ms, %d frozen", 1e3 * (time.perf_counter() -
                      started), gc.get_freeze_count())
        else:
            self._freeze_if_slow()  # (the freezer thread's, if it has not run yet)

    def close(self) -> None:
        self._closed = True
        self._slow.set()  # (the freezer thread ends)
        if self._note in gc.callbacks:
            gc.callbacks.remove(self._note)

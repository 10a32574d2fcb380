"""Keeping the controller's garbage collections short: what lives longer than FREEZE_EVERY_S is moved out of the
collector's sight (`gc.freeze`).

CPython's collections walk every object of the generations they collect, with the GIL held: no heartbeat is answered
meanwhile. A controller's objects mostly live long — torch's and FastAPI's modules, each agent's connection and link,
every node's row — and its new ones too: each heartbeat replaces its node's row and reports, which then live until
the node's next one, seconds later. Since a young generation's size counts allocations *minus* deallocations, a
steady replacement keeps that count low while the young generations fill with hundreds of thousands of live rows:
at 4,096 nodes (benchmarks/control_scale.py, `gc.callbacks` timed) young collections took 130-215 ms and full ones
300-975 ms, every few seconds, and were most of the heartbeats' p99.

- `freeze()` once the controller is built, then every FREEZE_EVERY_S from a thread of its own: `gc.freeze()` moves
  every tracked object into the permanent generation, in constant time, so a collection walks at most what was made
  in the last FREEZE_EVERY_S. A frozen object is still freed when its last reference goes (reference counting);
  only a frozen *cycle* of garbage waits, for:
- every REFREEZE_S (`tick()`, from the reconciler's thread), `gc.unfreeze()`, one full collection and `gc.freeze()`.
  How much that frees was measured, with REFREEZE_S at 30 s on a 4,096-node cluster running a job: 159 objects the
  first time, then none; the full collection itself took 1.1-1.4 s on this 2-core VM, once every REFREEZE_S.

Must not know: anything of the controller's state; it only decides when the collector runs over what.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger("phalanx.controller")
FREEZE_EVERY_S = 0.1  # what lives longer is frozen: a young collection walks at most this long's allocations
REFREEZE_S = 600.0  # unfreeze, collect everything, freeze again at most this often


class LongLived:
    """`freeze()` at start (then a thread freezes every FREEZE_EVERY_S until `close()`); `tick()` from the
    reconciler's thread after each tick."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()  # (a freeze, the refreeze)
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._refrozen_at = clock()
        self.freezes = 0

    def freeze(self) -> None:
        with self._lock:
            gc.freeze()
            self.freezes += 1
        if self._thread is None and not self._closed.is_set():
            self._thread = threading.Thread(target=self._freezer, name="heap-freeze", daemon=True)
            self._thread.start()

    def _freezer(self) -> None:
        while not self._closed.wait(FREEZE_EVERY_S):
            self.freeze()

    def tick(self) -> None:
        now = self.clock()
        if now - self._refrozen_at >= REFREEZE_S:
            started = time.perf_counter()
            with self._lock:
                gc.unfreeze()
                freed = gc.collect()
            self.freeze()
            self._refrozen_at = now
            log.debug("heap: full collection of every object in %.0f ms, %d freed", 1e3 * (time.perf_counter() -
                      started), freed)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

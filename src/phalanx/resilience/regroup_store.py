"""The store a generation's process groups rendezvous on: every wait bounded, and abandoned when a newer
generation is published.

`init_process_group` and every `new_group` after it (the device mesh's groups) block in C++ until each peer
has written its address to the store. A peer that dies after arriving never writes it, and a plain TCPStore
client then blocks for the whole process-group timeout (minutes) — long after the controller has published
the next generation and the other survivors have moved on, which then wait for this rank in vain. Here
torch calls back into Python for every store operation (a `dist.Store` subclass), and a wait polls the
real store instead of blocking on it: between polls it asks whether a newer generation exists (then it
raises `Superseded`, which unwinds the group creation so the rank can leave and join the newer one) and
whether `timeout_s` has passed (then `TimeoutError`).

Knows nothing about models or training state; the generation check is a callable.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

POLL_S = 0.002  # a poll is one round trip to the controller's store (~0.1 ms on loopback)
NEWER_EVERY_S = 0.05  # how often a waiting rank asks whether a newer generation exists


class RegroupStore(dist.Store):
    """Wraps `inner` (the generation's PrefixStore). `newer()` returns a generation number newer than this
    one, or 0; `superseded(newer)` builds the exception raised when one appears."""

    def __init__(self, inner, *, newer: Callable[[], int], superseded: Callable[[int], Exception],
                 timeout_s: float):
        super().__init__()
        self.inner, self.newer, self.superseded = inner, newer, superseded
        self.timeout_s = timeout_s
        self.abandoned_for: int | None = None  # the newer generation that ended a wait, once one did

    # torch's ProcessGroup constructors call set_timeout with the collective timeout; the waits here keep
    # the regroup's own bound instead (a collective's timeout says nothing about how long peers may take
    # to arrive)
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
            time.sleep(POLL_S)

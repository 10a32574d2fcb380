"""Worker side of progress reporting: `ProgressReporter` publishes the last finished step, its compute seconds
(`step_time_key`) and a liveness beat from a background thread (a training step never waits on the store),
survives a store outage (a controller restart recreates the store empty on the same port) by reconnecting and
re-publishing, and moves to a new generation's keys when a checkpointless worker regroups (`switch`). In the same
round trip it reads the controller's checkpoint request (`checkpoint_request_key`): `pending_checkpoint()`.

For the worker's own agent, a second thread writes the same step and a beat of its own to a small file on the
node (`PHALANX_PROGRESS_FILE`, a path its agent chose: `write_local`/`read_local`): the agent's hang rule reads
it there, not through the controller, so it judges whatever the network and the controller do, and a heartbeat
carries no progress. A checkpointless worker between generations — from leaving one (`leave`) or moving into
the next (`switch`) until it reports the step it restored — writes no step there ("-"): it is regrouping, and
its wait for the next generation (a controller restart, a stranded job's grace) is bounded by its own timeouts,
not by the stall rule, which would kill every survivor and lose the state they carry.

Must not know: how the agent judges hangs (`control/agent/hang.py` reads what this writes).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Mapping

from phalanx.protocol.env import (CLUSTER_TOKEN, GENERATION, JOB_ID, PROGRESS_FILE, RANK, STORE_ADDR,
                                  parse_store_addr)
from phalanx.protocol.keys import alive_key, checkpoint_request_key, progress_key, step_time_key
from phalanx.protocol.store import connect_store
from phalanx.protocol.version import PROTOCOL_ENV, check_version

BEAT_S = 0.5  # how often a worker's reporter bumps its liveness counter
EXIT_FLUSH_S = 5.0  # at most this long, at a worker's exit, for the store to take its last step (`flush`)
log = logging.getLogger("phalanx.progress")


def write_local(path: str | os.PathLike, generation: int, step: int | None, beat: int) -> None:
    """The worker's progress for its agent: "<generation> <step or -> <beat>", replaced whole (a reader never
    sees half of it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{generation} {'-' if step is None else step} {beat}\n")
    os.replace(tmp, path)


def read_local(path: str | os.PathLike) -> tuple[int, int | None, int] | None:
    """Agent side: (generation, step or None, beat) a worker wrote (`write_local`); None while it wrote none."""
    try:
        with open(path) as f:
            generation, step, beat = f.read().split()
        return int(generation), None if step == "-" else int(step), int(beat)
    except (OSError, ValueError):  # not written yet, or the worker is gone and its agent removed it
        return None


class ProgressReporter:
    """Worker side: publishes the last finished step, and a liveness beat every `beat_s`.

    `report(step)` only records the number and wakes a daemon thread, which does the store I/O. A failed
    write (the store went away: the controller is restarting) is logged once; the thread reconnects every
    `retry_s` and re-publishes the latest step, while training goes on.
    """

    def __init__(self, store_addr: str, job_id: str, generation: int, rank: int, *, beat_s: float = BEAT_S,
                 retry_s: float = 1.0, timeout_s: float = 2.0, token: str | None = None,
                 local_path: str | os.PathLike | None = None):
        self.host, self.port = parse_store_addr(store_addr)
        self.store_addr, self.token = store_addr, token  # token: keys under the cluster's namespace
        self.job_id = job_id
        self.step_key = progress_key(job_id, generation, rank)
        self.beat_key = alive_key(job_id, generation, rank)
        self.time_key = step_time_key(job_id, generation, rank)
        self.request_key = checkpoint_request_key(job_id, generation)
        self._requested = 0  # the newest checkpoint request read (an id; 0: none)
        self._served = 0  # the newest request a checkpoint was taken for (`checkpoint_served`)
        self._keys_version = 0
        self.beat_s = beat_s
        self.retry_s = retry_s
        self.timeout = timedelta(seconds=timeout_s)
        self._step: int | None = None
        self._local_step: int | None = None  # the step its agent is told: None between generations
        self._seconds: float | None = None  # the compute seconds of `_step` (None: not reported)
        self._published: int | None = None  # the newest step the store has (for `flush`)
        self._published_version = 0  # the keys `_published` went to (for `switch`)
        self._closed = False
        self._generation = generation
        self._cond = threading.Condition()
        threading.Thread(target=self._publish_loop, name="phalanx-progress", daemon=True).start()
        if local_path is not None:  # (its own thread: the agent hears this worker beat whatever the store does)
            threading.Thread(target=self._local_loop, args=(local_path,), name="phalanx-progress-local",
                             daemon=True).start()

    def close(self) -> None:
        """Stop publishing (a worker process simply exits; this is for long-lived callers and tests)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until the newest reported step is in the store: a worker calls it before
        it exits, so the controller knows the last step even when the store came back only moments before (a
        restarted controller). True once published."""
        with self._cond:
            return self._cond.wait_for(lambda: self._published == self._step or self._closed, timeout=timeout_s)

    def switch(self, generation: int, rank: int, wait_s: float = 0.0) -> bool:
        """A checkpointless worker moved into a new generation (perhaps as another rank): publish there, the
        step it carries at once and its beat from now on, so that its agent can tell it frozen while it
        regroups. Waits (at most `wait_s`) until the new keys are in the store; True once they are."""
        with self._cond:
            self.step_key = progress_key(self.job_id, generation, rank)
            self.beat_key = alive_key(self.job_id, generation, rank)
            self.time_key = step_time_key(self.job_id, generation, rank)
            self.request_key = checkpoint_request_key(self.job_id, generation)
            self._generation, self._local_step = generation, None  # regrouping: no step in it yet, for the agent
            self._seconds = None  # a time measured in the old generation is not one of the new
            self._keys_version += 1
            version = self._keys_version
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._published_version == version or self._closed, timeout=wait_s)

    def report(self, step: int, seconds: float | None = None) -> None:
        """`step` finished; `seconds`: the compute seconds it took on this rank (None: not measured, as for the
        step a run starts from)."""
        with self._cond:
            if step != self._step or step != self._local_step:
                self._step, self._local_step, self._seconds = step, step, seconds
                self._cond.notify_all()

    def leave(self) -> None:
        """A checkpointless worker left its generation and waits for the next: its agent sees no step until it
        reports one again (the store keeps the last step: the controller's record of how far it got)."""
        with self._cond:
            self._local_step = None
            self._cond.notify_all()

    def pending_checkpoint(self) -> int:
        """The newest checkpoint request the controller made and no checkpoint was taken for yet (0: none)."""
        with self._cond:
            return self._requested if self._requested > self._served else 0

    def checkpoint_served(self, request: int) -> None:
        """A checkpoint was taken after `request` was read: it, and every request before it, is served."""
        with self._cond:
            self._served = max(self._served, request)

    def _local_loop(self, path: str) -> None:
        """The step at once, a beat every `beat_s`, into `path` (the agent's hang rule reads it)."""
        beat, failing = 0, False
        while True:
            with self._cond:
                if self._closed:
                    return
                step, generation = self._local_step, self._generation
            beat += 1
            try:
                write_local(path, generation, step, beat)
                failing = False
            except OSError as err:  # (its agent judges this worker's silence; said once, not every beat)
                if not failing:
                    log.warning("cannot write progress for this worker's agent to %s: %s", path, err)
                failing = True
            with self._cond:
                self._cond.wait_for(lambda: (self._closed or self._local_step != step
                                             or self._generation != generation), timeout=self.beat_s)

    def _connect(self):
        return connect_store(self.store_addr, self.token, self.timeout)

    def _publish_loop(self) -> None:
        store, published, failing, beat, next_beat, version = None, None, False, 0, 0.0, 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._step != published or self._closed or self._keys_version != version,
                                    timeout=max(0.0, next_beat - time.monotonic()))
                if self._closed:
                    return
                if self._keys_version != version:  # new keys: publish everything there at once
                    version, published, next_beat = self._keys_version, None, 0.0
                step, seconds, step_key, beat_key, time_key, request_key = (
                    self._step, self._seconds, self.step_key, self.beat_key, self.time_key, self.request_key)
            try:
                if store is None:
                    store = self._connect()
                if time.monotonic() >= next_beat:
                    beat += 1
                    store.set(beat_key, str(beat))
                    next_beat = time.monotonic() + self.beat_s
                if step != published and step is not None:
                    if seconds is not None:  # before the step: a reader of the step finds its time there too
                        store.set(time_key, f"{step} {seconds:.6f}")
                    store.set(step_key, str(step))
                # a set() into a dead connection may not fail; this round trip does (and reads the request)
                requested = int(store.get(request_key)) if store.check([request_key]) else 0
            except (RuntimeError, OSError) as err:  # torch's DistStoreError/DistNetworkError are RuntimeErrors
                if not failing:
                    log.warning("progress store %s:%d unreachable (%s); training continues, next: reconnecting "
                                "every %g s and re-publishing step %s", self.host, self.port,
                                str(err).splitlines()[0], self.retry_s, step)
                failing, store, next_beat = True, None, 0.0
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, timeout=self.retry_s)
                continue
            if failing:
                log.info("progress store %s:%d reachable again; published step %s", self.host, self.port, step)
            failing, published = False, step
            with self._cond:
                self._published, self._published_version = step, version
                self._requested = max(self._requested, requested)
                self._cond.notify_all()


def progress_reporter(env: Mapping[str, str] | None = None) -> ProgressReporter | None:
    """The reporter for a worker an agent started (None otherwise: plain `phalanx train`, torchrun)."""
    env = os.environ if env is None else env
    if not env.get(STORE_ADDR) or not env.get(JOB_ID):
        return None
    check_version(env.get(PROTOCOL_ENV), f"the agent that started this worker ({PROTOCOL_ENV})")
    return ProgressReporter(env[STORE_ADDR], env[JOB_ID], int(env[GENERATION]), int(env[RANK]),
                            token=env.get(CLUSTER_TOKEN), local_path=env.get(PROGRESS_FILE) or None)

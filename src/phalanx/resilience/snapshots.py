"""Buddy snapshots: in-memory copies of every rank's state on another node, for jobs without a replica.

With dp_replicate = 1 no peer holds a copy of a rank's shard, so every `interval` steps each rank copies
its state (`ShardState.capture`, host memory) and a background thread sends it to its *buddy* — the same
local rank on the next node, rank (r + workers_per_node) mod world — while receiving the copy of the rank
whose buddy it is. Then the thread joins a one-number all_reduce on the snapshot group: when that
completes anywhere, every exchange of that step has completed everywhere (each rank enters it only after
its own exchange), so every shard's copy of that step exists on two nodes and the older copies are
dropped. Until then the previous complete snapshot is kept, so a failure at any moment leaves one step
that all shards have (`restore.choose_plan` finds it).

The capture is the only part on the training step's path (a host copy of the local shards); the exchange
and the agreement run beside the next steps on their own gloo group. On a GPU even the copy leaves the path:
it is queued on a side stream into pinned memory and runs beside the next step's forward and backward; the
next optimizer update waits for it (an optimizer step pre-hook makes the compute stream wait on the copy's
event), and the exchange thread waits for it before it reads the buffer. A snapshot step whose previous
exchange is still running waits for it — skipping would desynchronise the ranks' exchanges.

`SnapshotShelf` keeps the copies across generations (a survivor's snapshots outlive its process groups);
`freeze()` at a fault stops a lingering exchange thread from changing what the shelf reported. The buffers of
the copies it drops are handed to the next capture and the next receive (`buffer`): a snapshot every step then
writes into memory already mapped instead of faulting in fresh pages for every copy.

Knows nothing about the controller, generations or what a state holds (`ShardState` does); of the trainer
only its step.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.resilience.faults import PeerFault, is_peer_fault
from phalanx.resilience.restore import CapturePlan, Copy, ShardState, exchange

log = logging.getLogger("phalanx.snapshots")
_SPARE_BUFFERS = 4  # a snapshot every step drops an own and a peer copy per step and takes two new ones


class SnapshotShelf:
    """This rank's snapshot copies: its own ("own@S") and its peer's ("peer@S"), at most two steps each."""

    def __init__(self):
        self.lock = threading.Lock()
        self.epoch = 0  # bumped by freeze(): results of older exchanges are discarded
        self.own: dict[int, ShardState] = {}
        self.peer: dict[int, ShardState] = {}
        self._spare: list[tuple[bool, torch.Tensor]] = []  # (pinned, buffer) of dropped copies, for reuse

    def freeze(self) -> None:
        with self.lock:
            self.epoch += 1

    def add_own(self, epoch: int, state: ShardState) -> None:
        with self.lock:
            if epoch == self.epoch:
                self.own[state.step] = state

    def add_peer(self, epoch: int, state: ShardState) -> None:
        with self.lock:
            if epoch == self.epoch:
                self.peer[state.step] = state

    def complete(self, epoch: int, step: int) -> None:
        """Every rank's exchange of `step` finished: drop the older copies (their buffers are reused)."""
        with self.lock:
            if epoch == self.epoch:
                dropped = [v for s, v in [*self.own.items(), *self.peer.items()] if s < step]
                self.own = {s: v for s, v in self.own.items() if s >= step}
                self.peer = {s: v for s, v in self.peer.items() if s >= step}
                # only in the epoch that made them: a copy reported at a fault (`copies` after `freeze`) may still
                # be read by the restore, and is never recycled
                for state in dropped:
                    if state.copied is None and len(self._spare) < _SPARE_BUFFERS:
                        self._spare.append((state.data.is_pinned(), state.data))

    def buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A byte buffer for the next copy: a dropped copy's of that size when there is one, else a new one."""
        with self.lock:
            for i, (was_pinned, data) in enumerate(self._spare):
                if was_pinned == pinned and data.numel() == nbytes:
                    return self._spare.pop(i)[1]
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def copies(self) -> list[tuple[Copy, ShardState]]:
        with self.lock:
            return ([(Copy(f"own@{s}", v.coord, v.signature, s), v) for s, v in sorted(self.own.items())]
                    + [(Copy(f"peer@{s}", v.coord, v.signature, s), v) for s, v in sorted(self.peer.items())])

    def prune_after(self, step: int) -> None:
        """Training went on from `step` (a rollback): copies of later steps belong to an abandoned future."""
        with self.lock:
            self.own = {s: v for s, v in self.own.items() if s <= step}
            self.peer = {s: v for s, v in self.peer.items() if s <= step}

    def clear(self) -> None:
        with self.lock:
            self.epoch += 1
            self.own, self.peer, self._spare = {}, {}, []

    @property
    def nbytes(self) -> int:
        with self.lock:
            return sum(v.nbytes for v in [*self.own.values(), *self.peer.values()])


class BuddySnapshots:
    """Takes and exchanges the snapshots of one generation. Collective to construct (makes a gloo group)."""

    def __init__(self, trainer, shelf: SnapshotShelf, *, interval: int, workers_per_node: int,
                 timeout_s: float = 30.0):
        self.trainer, self.shelf, self.interval = trainer, shelf, interval
        rank, world = dist.get_rank(), dist.get_world_size()
        self.buddy = (rank + workers_per_node) % world
        self.ward = (rank - workers_per_node) % world  # the rank whose buddy this one is
        self.enabled = interval > 0 and self.buddy != rank
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self.enabled else None
        self._thread: threading.Thread | None = None
        self._plan: CapturePlan | None = None  # where each tensor goes in a capture, while the tensors stay
        self.error: BaseException | None = None
        # GPU: the copies run on their own stream; the next update waits for the newest one (`_copying`)
        on_gpu = self.enabled and trainer.device.type == "cuda"
        self._stream = torch.cuda.Stream(trainer.device) if on_gpu else None
        self._copying = None
        self._hook = trainer.optimizer.register_step_pre_hook(self._before_update) if on_gpu else None
        if interval > 0 and not self.enabled:
            log.warning("buddy snapshots off: every rank is on one node (no other node to hold a copy)")

    def after_step(self, *, force: bool = False) -> None:
        """Snapshot every `interval` steps (or now, with `force`: every rank must make the same call)."""
        step = self.trainer.progress.step
        if not self.enabled or (step % self.interval and not force):
            return
        self.wait()
        if self.error is not None:  # a peer's fault found off this thread is raised here as one
            kind = PeerFault if is_peer_fault(self.error) else RuntimeError
            raise kind(f"buddy snapshot exchange failed: {self.error}") from self.error
        epoch = self.shelf.epoch
        self._plan = CapturePlan.of(self.trainer, self._plan)
        state = ShardState.capture(self.trainer, stream=self._stream, buffer=self.shelf.buffer, plan=self._plan)
        self._copying = state.copied
        self.shelf.add_own(epoch, state)
        self._thread = threading.Thread(target=self._exchange, args=(state, epoch), daemon=True,
                                        name=f"phalanx-snapshot-{step}")
        self._thread.start()

    def _exchange(self, state: ShardState, epoch: int) -> None:
        try:
            # the copy is checked when it is used (most never are); it keeps the checksum taken here
            got = exchange([(self.buddy, state)], [self.ward], group=self.group, verify=False,
                           buffer=self.shelf.buffer)
            self.shelf.add_peer(epoch, got[self.ward])
            done = torch.ones(1)
            dist.all_reduce(done, group=self.group)
            self.shelf.complete(epoch, state.step)
        except Exception as err:  # the peer died mid-exchange; the training loop sees the fault itself
            self.error = err

    def _before_update(self, optimizer, args, kwargs) -> None:
        """The optimizer is about to write the tensors the newest capture may still be copying."""
        if self._copying is not None:
            torch.cuda.current_stream().wait_event(self._copying)
            self._copying = None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def release(self) -> None:
        """Drop the group (a fault: don't wait for a thread that may be blocked on a dead peer). A GPU copy in
        flight is waited for (it needs no peer): recovery may write the tensors it reads."""
        if self._copying is not None:
            self._copying.synchronize()
            self._copying = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.group = None
        self._thread = None
        self.trainer = self._plan = None

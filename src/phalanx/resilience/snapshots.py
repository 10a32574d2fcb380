"""Buddy snapshots: in-memory copies of every rank's state on another node, for jobs without a replica.

With dp_replicate = 1 no peer holds a copy of a rank's shard, so every `interval` steps each rank copies
its state (`ShardState.capture`, host memory) and a background thread sends it to its *buddy* — the same
local rank on the next node, rank (r + workers_per_node) mod world — while receiving the copy of the rank
whose buddy it is. Then the thread joins a one-number all_reduce on the snapshot group: when that
completes anywhere, every exchange of that step has completed everywhere (each rank enters it only after
its own exchange), so every shard's copy of that step exists on two nodes and the older copies are
dropped. Until then the previous complete snapshot is kept, so a failure at any moment leaves one step
that all shards have (`restore.choose_plan` finds it).

After the first exchange of a generation (two rounds: the sizes, then the header with its table of contents and
the data) a snapshot travels in one message each way, a *frame* of a size both sides know: the few changing
fields (step, counters, RNG, checksum) pickled into its first `FRAME_HEAD` bytes, the data after them, captured
there directly. The table of contents is the one the receiver kept from the full exchange. A rank whose layout
changed (the optimizer's state appears at the first step) or whose header outgrows the room marks its frame
"full follows", and that direction is exchanged in full again. On a CPU-bound box the second round, the pickled
table of contents and the thread's extra wake-ups (each waits for the GIL) cost about as much CPU as moving the
data (`benchmarks/snapshot_cost.py`).

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
import pickle
import queue
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from phalanx.resilience.faults import PeerFault, is_peer_fault
from phalanx.resilience.restore import CapturePlan, Copy, ShardState, exchange

log = logging.getLogger("phalanx.snapshots")
_SPARE_BUFFERS = 4  # a snapshot every step drops an own and a peer copy per step and takes two new ones
FRAME_HEAD = 32 * 1024  # a frame's room for its header (~13 KB pickled: the RNG states are most of it); aligned
_FULL_FOLLOWS = -1  # a frame's header length saying "no header here: this direction is exchanged in full"


def _whole(data: torch.Tensor) -> torch.Tensor:
    """The whole byte buffer `data` lies in (a frame's data is a view past its header)."""
    n = data.untyped_storage().nbytes()
    return data if data.storage_offset() == 0 and data.numel() == n else data.as_strided((n,), (1,), 0)


class Layout:
    """What a frame's receiver keeps from the last full exchange: where the sender's tensors are in the data."""

    def __init__(self, state: ShardState):
        self.coord, self.signature = state.coord, state.signature
        self.entries, self.nbytes = state.entries, state.nbytes

    def fits(self, plan: CapturePlan) -> bool:
        """A capture by `plan` puts every tensor where this layout says (new tensors in the same places)."""
        return (self.coord, self.signature, self.nbytes, self.entries) == (plan.coord, plan.signature, plan.nbytes,
                                                                          plan.entries)

    @property
    def frame_bytes(self) -> int:
        return FRAME_HEAD + self.nbytes

    def read(self, frame: torch.Tensor, length: int) -> ShardState:
        """The state a frame carries (`length`: its header's, from the frame's first 8 bytes)."""
        h = pickle.loads(frame[8:8 + length].numpy().tobytes())
        for k in h["rng_tensors"]:
            h["extra"]["rng"][k] = torch.frombuffer(bytearray(h["extra"]["rng"][k]), dtype=torch.uint8)
        return ShardState(self.coord, self.signature, h["step"], h["samples_consumed"], h["extra"], self.entries,
                          frame[FRAME_HEAD:FRAME_HEAD + self.nbytes], h["taken_at"], h["checksum"])


def _frame(state: ShardState) -> torch.Tensor | None:
    """Write `state`'s header in front of its data (captured past `FRAME_HEAD`); the frame, or None when the
    header does not fit (the state then goes in full)."""
    # the RNG states that are tensors go as bytes: pickling a tensor costs 3–4 times the rest of the header
    rng = state.extra.get("rng", {})
    tensors = [k for k, v in rng.items() if isinstance(v, torch.Tensor)]
    extra = {**state.extra, "rng": {**rng, **{k: rng[k].numpy().tobytes() for k in tensors}}}
    header = pickle.dumps({"step": state.step, "samples_consumed": state.samples_consumed, "extra": extra,
                           "rng_tensors": tensors, "taken_at": state.taken_at, "checksum": state.seal().checksum})
    if len(header) > FRAME_HEAD - 8:
        if not _frame.warned:
            log.warning("a buddy snapshot's header of %d bytes outgrows its frame's room (%d): snapshots go in two "
                        "rounds", len(header), FRAME_HEAD)
            _frame.warned = True
        return None
    frame = _whole(state.data)
    frame[:8].view(torch.int64)[0] = len(header)
    frame[8:8 + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    return frame


_frame.warned = False


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
                    if state.copied is None:  # the newest few are kept
                        spare = (state.data.is_pinned(), _whole(state.data))
                        self._spare = [*self._spare[-(_SPARE_BUFFERS - 1):], spare]

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
        # one exchange thread for the generation, fed one snapshot at a time: starting a thread per snapshot made
        # the training thread wait until the new one was scheduled (`Thread.start`), on cores the ranks fill
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        self._plan: CapturePlan | None = None  # where each tensor goes in a capture, while the tensors stay
        self.error: BaseException | None = None
        # frames: the layout the buddy holds for this rank (and the plan it came from), the ward's layout
        self._told: Layout | None = None
        self._told_plan: CapturePlan | None = None
        self._ward_layout: Layout | None = None
        self.full_exchanges = 0  # directions sent in full (the first of a generation, a changed layout)
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
        self._plan = plan = CapturePlan.of(self.trainer, self._plan)
        if self._told is not None and plan is not self._told_plan and self._told.fits(plan):
            self._told_plan = plan  # new tensors in the same places (a restore): frames go on
        framed = plan is self._told_plan
        state = ShardState.capture(self.trainer, stream=self._stream, plan=plan,
                                   buffer=self._frame_buffer if framed else self.shelf.buffer)
        self._copying = state.copied
        self.shelf.add_own(epoch, state)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, args=(self._jobs,), daemon=True,
                                            name="phalanx-snapshots")
            self._thread.start()
        self._idle.clear()
        self._jobs.put((state, plan, epoch, framed))

    def _serve(self, jobs: queue.SimpleQueue) -> None:
        while (job := jobs.get()) is not None:
            try:
                self._exchange(*job)
            finally:
                self._idle.set()

    def _frame_buffer(self, nbytes: int, pinned: bool) -> torch.Tensor:
        return self.shelf.buffer(FRAME_HEAD + nbytes, pinned)[FRAME_HEAD:]

    def _swap(self, state: ShardState, plan: CapturePlan, framed: bool, group) -> ShardState:
        """Send `state` to the buddy and receive the ward's: one frame each way, in full where a side must."""
        first = self._told is None  # the generation's first exchange: both ways in full (both layouts are set then)
        full_out = full_in = first
        if not first:
            frame = _frame(state) if framed else None
            if frame is None:  # a frame of the size the buddy expects, saying "in full next"
                frame = self.shelf.buffer(self._told.frame_bytes, False)
                frame[:8].view(torch.int64)[0] = _FULL_FOLLOWS
                full_out = True
            inbox = self.shelf.buffer(self._ward_layout.frame_bytes, False)
            for work in (dist.isend(frame, self.buddy, group=group, tag=4),
                         dist.irecv(inbox, self.ward, group=group, tag=4)):
                work.wait()
            length = int(inbox[:8].view(torch.int64)[0])
            full_in = length == _FULL_FOLLOWS
        got = {}
        if full_out or full_in:
            self.full_exchanges += full_out
            got = exchange([(self.buddy, state)] if full_out else [], [self.ward] if full_in else [],
                           group=group, verify=False, buffer=self.shelf.buffer)
        if full_out:
            self._told, self._told_plan = Layout(state), plan
        if full_in:
            self._ward_layout = Layout(got[self.ward])
            return got[self.ward]
        return self._ward_layout.read(inbox, length)

    def _exchange(self, state: ShardState, plan: CapturePlan, epoch: int, framed: bool) -> None:
        group = self.group  # read once: `release` drops it, and None would mean the job's default group
        try:
            # the copy is checked when it is used (most never are); it keeps the checksum taken where it was captured
            self.shelf.add_peer(epoch, self._swap(state, plan, framed, group))
            done = torch.ones(1)
            dist.all_reduce(done, group=group)
            self.shelf.complete(epoch, state.step)
        except Exception as err:  # the peer died mid-exchange; the training loop sees the fault itself
            self.error = err

    def _before_update(self, optimizer, args, kwargs) -> None:
        """The optimizer is about to write the tensors the newest capture may still be copying."""
        if self._copying is not None:
            torch.cuda.current_stream().wait_event(self._copying)
            self._copying = None

    def wait(self) -> None:
        if self._thread is not None:  # not after `release`: its thread may be blocked on a dead peer
            self._idle.wait()

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
        self._jobs.put(None)  # the thread ends after the exchange it may be in (a dead peer's: at the group's timeout)
        self._thread = None
        self.trainer = self._plan = None

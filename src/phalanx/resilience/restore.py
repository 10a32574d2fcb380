"""Restore from peers: which peer holds each missing shard, and the checksummed transfer from its memory.

Which copy (`choose_plan`). After a fault, every rank of the new generation reports what it holds (`Holding`):
the shard its new position needs, its carried live state (a survivor: the state its optimizer reached), and
the in-memory snapshots it kept (its own, and the copy of its buddy's). `choose_plan` — a pure function, run by
every rank on the same gathered list, so all reach the same answer without another round — picks the newest
step at which *every* shard the new layout needs exists somewhere alive (live or snapshot: both are the
state after that step), and for each rank the copy it applies: its own when it has one, else a transfer
from a holder (live state first, the least-loaded sender next, then the lowest rank).

That is the committed step: an update half the ranks applied (a fault inside the step's last reduction)
is kept when every shard has it, and otherwise rolled back to the step all shards have. When no step is
covered — both holders of a shard gone, or nothing held at all (a first start, a restart of every
process) — the plan says `disk`: load the newest checkpoint (or initialise).

What a copy is (`ShardState`). `ShardState.capture(trainer)` copies the trainer's `TrainState`
(`phalanx.train.state`, the one definition of what training state is; checkpoints save the same) into host
memory: this rank's shard of every parameter and optimizer-state tensor in one flat byte buffer with a table
of contents (key, dtype, shape, offset) and one checksum of the buffer (XXH3-64: the state may sit in a peer's
memory for many steps; a flipped bit is caught before it is trained on), plus the step, samples consumed,
LR-scheduler counters and RNG state. `apply(trainer)` writes it into a trainer built on the same shard layout.
`exchange()` moves states between ranks over a process group (point-to-point, every transfer of a round posted
at once), and the receiver verifies the checksum before anything is used.

`coord` says which shard a state is: this rank's position along every mesh dimension that shards the
model (replicas along "dp_replicate" hold the same shard, so it is left out); `signature` is the layout
(those dimensions and their sizes). A state is only applied where coord and signature match, and ranks ask
for shards by coordinate, so a new generation with a different number of replicas can still be planned and
served, and a resharded one cannot be served wrongly.

Knows nothing about the controller, generations or the training loop; of the trainer only its `state` and
`mesh`. The plan knows nothing about torch (it works on coordinates and step numbers).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import xxhash

LIVE = "live"
REPLICA_DIM = "dp_replicate"
_ALIGN = 64  # bytes: every tensor starts aligned, so a slice of the buffer can be viewed as its dtype


# ---- which copy each rank applies --------------------------------------------------------------------------
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


# ---- a rank's state in host memory, and its transfer -------------------------------------------------------
class IntegrityError(RuntimeError):
    """A received state does not match its checksums or does not fit the receiving trainer."""


def shard_layout(mesh) -> tuple[tuple, tuple]:
    """(coord, signature) of this rank: its index along every dimension that shards the state, and their sizes.

    `mesh` is the trainer's `ParallelMesh` (or a bare DeviceMesh): the data-parallel dims except the replica
    dim, plus tp when present. Expert parallel groups are consecutive dp_shard ranks, so the dp_shard index
    already names which experts a rank holds."""
    meshes = [getattr(mesh, "dp", mesh)]
    if getattr(mesh, "tp", None) is not None:
        meshes.append(mesh.tp)
    coord, signature = [], []
    for m in meshes:
        names = m.mesh_dim_names or tuple(f"dim{i}" for i in range(m.ndim))
        for i, n in enumerate(names):
            if n != REPLICA_DIM:
                coord.append((n, m.get_local_rank(i)))
                signature.append((n, m.size(i)))
    return tuple(coord), tuple(signature)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


@dataclass
class Entry:
    key: str  # "param/<name>" or "optim/<name>/<state key>"
    dtype: str
    shape: tuple
    offset: int
    nbytes: int


@dataclass
class CapturePlan:
    """Where each of a trainer's local tensors goes in a capture's buffer: the table of contents and, per dtype, the
    tensors flattened (views: they read the live values). Working it out costs Python calls per tensor (~1 ms
    for 156 tensors); buddy snapshots keep it and `of(trainer, previous)` reuses it while the trainer's tensors
    are the same storage with the same shapes (the optimizer updates them in place; a restore or a checkpoint
    load that replaces them gives a new plan)."""

    key: tuple
    entries: list[Entry]
    regions: list[tuple[torch.dtype, int, int, list[torch.Tensor], bool]]  # (dtype, start, end, flat views, on host)
    nbytes: int
    on_gpu: bool
    coord: tuple
    signature: tuple

    @classmethod
    def of(cls, trainer, previous: "CapturePlan | None" = None) -> "CapturePlan":
        # a view keeps its storage alive, so a pointer seen again is the same storage, not a reused address
        key = trainer.state.local_key()
        if previous is not None and previous.key == key:
            return previous
        tensors = trainer.state.local_tensors()
        if not all(t.is_contiguous() for _, t in tensors):
            key = None  # flattening copies such a tensor: the plan holds its value now, so it is used once
        groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
        for k, t in tensors:
            groups.setdefault(t.dtype, []).append((k, t))
        entries, regions, offset = [], [], 0
        for dtype, group in groups.items():
            start = offset
            for k, t in group:
                nbytes = t.numel() * t.element_size()
                entries.append(Entry(k, str(dtype), tuple(t.shape), offset, nbytes))
                offset += nbytes
            regions.append((dtype, start, offset, [t.reshape(-1) for _, t in group],
                            all(t.device.type == "cpu" for _, t in group)))
            offset = -(-offset // _ALIGN) * _ALIGN  # the next region starts aligned
        on_gpu = any(t.device.type == "cuda" for _, t in tensors)
        coord, signature = shard_layout(trainer.mesh)
        return cls(key, entries, regions, offset, on_gpu, coord, signature)


@dataclass
class ShardState:
    coord: tuple
    signature: tuple
    step: int
    samples_consumed: int
    extra: dict  # {"scheduler": counters, "param_groups": hyperparameters (lr...), "rng": this rank's RNG}
    entries: list[Entry]
    data: torch.Tensor  # uint8, host memory
    taken_at: float = field(default_factory=time.time)
    checksum: int | None = None  # XXH3-64 of `data`, taken once where the state was captured (`seal`)
    verified: bool = False  # `data` was checked against `checksum` on this rank
    copied: object = field(default=None, repr=False)  # a GPU capture's CUDA event: `data` is valid once it completes

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    # ---- capture and apply ------------------------------------------------------------------------
    @classmethod
    def capture(cls, trainer, stream=None, buffer: Callable[[int, bool], torch.Tensor] | None = None,
                plan: "CapturePlan | None" = None) -> "ShardState":
        """Copy `trainer`'s local state (valid at any step boundary, and after a fault mid-step: see
        `TrainState.local_tensors`). On the training step's path when snapshots are on, so it is kept to one pass:
        the tensors are grouped by dtype and each group is copied into its region of the buffer, viewed as that
        dtype, by one `cat` (on CPU).

        On a GPU the buffer is pinned and the copies are queued on `stream` (a side stream, after what the
        current stream has queued): the call returns at once and the copies run beside the next step's compute.
        `copied` is then the CUDA event that completes with them; the optimizer must not update these tensors
        before it (`BuddySnapshots` makes the update wait on it), and whoever reads `data` calls `ready()` first
        (`seal`, `verify` and `apply` do). Without `stream` the copies complete before the call returns.

        `buffer(nbytes, pinned)` supplies the byte buffer (buddy snapshots hand back the buffer of a copy they
        dropped: a fresh one costs a page fault per 4 KiB on first touch); by default a new one. `plan` is where
        each tensor goes (`CapturePlan.of`); by default it is worked out here."""
        plan = plan or CapturePlan.of(trainer)
        data = (buffer or _new_buffer)(plan.nbytes, plan.on_gpu)
        copied, wait = None, stream is None
        with torch.no_grad():
            if plan.on_gpu:
                stream = stream or torch.cuda.current_stream()
                stream.wait_stream(torch.cuda.current_stream())  # the step's last update is queued before
            for dtype, start, end, flat, on_host in plan.regions:
                region = data[start:end].view(dtype)
                if on_host:
                    torch.cat(flat, out=region)  # one call copies the group
                    continue
                # device → host, tensor by tensor (a cat would need the group's size again on the device)
                for slot, t in zip(region.split([t.numel() for t in flat]), flat):
                    if t.device.type == "cuda":
                        with torch.cuda.stream(stream):
                            slot.copy_(t, non_blocking=True)
                    else:  # a host tensor beside device ones (Adam's step count)
                        slot.copy_(t)
            if plan.on_gpu:
                copied = torch.cuda.Event()
                copied.record(stream)
        state = trainer.state
        captured = cls(plan.coord, plan.signature, state.progress.step, state.progress.samples_consumed,
                       state.counters(), plan.entries, data, copied=copied)
        if wait:
            captured.ready()
        return captured

    def ready(self) -> "ShardState":
        """Wait until `data` holds the captured state (a GPU capture's copies have completed)."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None
        return self

    def apply(self, trainer) -> None:
        """Write this state into `trainer` (built on the same layout). Checks the checksum (a sealed state not yet
        verified here: a snapshot copy is checked when it is used, not when it arrives) and the fit before writing
        anything."""
        self.ready()
        if self.checksum is not None and not self.verified:
            self.verify()
        coord, signature = shard_layout(trainer.mesh)
        if (coord, signature) != (self.coord, self.signature):
            raise IntegrityError(f"state of shard {self.coord} in layout {self.signature} does not fit shard "
                                 f"{coord} in layout {signature}")
        state = trainer.state
        by_key = {e.key: e for e in self.entries}
        for key, (dtype, shape) in state.local_param_layout().items():
            e = by_key.get(key)
            if e is None or e.shape != shape or e.dtype != dtype:
                raise IntegrityError(f"state has no matching entry for parameter {key.removeprefix('param/')} "
                                     f"({'missing' if e is None else f'{e.dtype} {e.shape}'})")
        state.load_local({e.key: _view(self.data, e) for e in self.entries}, self.extra, self.step,
                         self.samples_consumed)

    # ---- integrity --------------------------------------------------------------------------------
    def seal(self) -> "ShardState":
        """Take the checksum of `data` (once: a copy forwarded by a peer keeps the one taken at capture, so its
        final receiver checks it end to end)."""
        self.ready()
        if self.checksum is None:
            self.checksum = _checksum(self.data)
            self.verified = True
        return self

    def verify(self) -> None:
        got = _checksum(self.ready().data)
        if got != self.checksum:
            found = ("no checksum was taken" if self.checksum is None
                     else f"XXH3-64 {got:016x}, expected {self.checksum:016x}")
            raise IntegrityError(f"the state of shard {self.coord} at step {self.step} fails its checksum "
                                 f"({self.nbytes} bytes, {len(self.entries)} tensors: {found})")
        self.verified = True

    def header(self) -> dict:
        return {"coord": self.coord, "signature": self.signature, "step": self.step,
                "samples_consumed": self.samples_consumed, "extra": self.extra,
                "entries": [e.__dict__ for e in self.entries], "nbytes": self.nbytes, "taken_at": self.taken_at,
                "checksum": self.checksum}

    @classmethod
    def from_header(cls, h: dict, data: torch.Tensor) -> "ShardState":
        return cls(h["coord"], h["signature"], h["step"], h["samples_consumed"], h["extra"],
                   [Entry(**e) for e in h["entries"]], data, h["taken_at"], h["checksum"])


def _view(data: torch.Tensor, e: Entry) -> torch.Tensor:
    return data[e.offset:e.offset + e.nbytes].view(_dtype(e.dtype)).view(e.shape)


def _checksum(data: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data.numpy()))  # one pass, ~60 GB/s (zlib.crc32: ~4 GB/s)


def _new_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)


def exchange(sends: list[tuple[int, ShardState]], recvs: list[int], group=None, *, verify: bool = True,
             buffer: Callable[[int, bool], torch.Tensor] | None = None) -> dict[int, ShardState]:
    """Send each (dst, state) and receive one state from each src in `recvs`, all posted at once (so a
    ring of buddies cannot deadlock). Received states are verified (with `verify=False`, when applied:
    buddy snapshots, most of which are never used). Ranks are global ranks of `group`. Returns {src: state}.

    Two rounds: the sizes (header and data), then the header and the data together, received into
    `buffer(nbytes, False)` (default: a new buffer)."""

    def wait(works):
        for w in works:
            w.wait()

    headers = {dst: torch.frombuffer(bytearray(pickle.dumps(s.seal().header())), dtype=torch.uint8)
               for dst, s in sends}
    sizes_out = {dst: torch.tensor([headers[dst].numel(), s.nbytes], dtype=torch.int64) for dst, s in sends}
    sizes_in = {src: torch.zeros(2, dtype=torch.int64) for src in recvs}
    wait([dist.isend(sizes_out[dst], dst, group=group, tag=1) for dst, _ in sends]
         + [dist.irecv(sizes_in[src], src, group=group, tag=1) for src in recvs])
    heads_in = {src: torch.empty(int(sizes_in[src][0]), dtype=torch.uint8) for src in recvs}
    data_in = {src: (buffer or _new_buffer)(int(sizes_in[src][1]), False) for src in recvs}
    wait([dist.isend(headers[dst], dst, group=group, tag=2) for dst, _ in sends]
         + [dist.isend(s.data, dst, group=group, tag=3) for dst, s in sends]
         + [dist.irecv(heads_in[src], src, group=group, tag=2) for src in recvs]
         + [dist.irecv(data_in[src], src, group=group, tag=3) for src in recvs])
    out = {}
    for src in recvs:
        state = ShardState.from_header(pickle.loads(heads_in[src].numpy().tobytes()), data_in[src])
        if verify:
            state.verify()
        out[src] = state
    return out

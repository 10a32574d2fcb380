"""Sharded checkpoints with atomic commit, retention, verification and resume.

Each rank writes its shards with torch.distributed.checkpoint (DCP) into `step-NNNNNNNN.tmp/`; once every
rank is done, rank 0 writes a manifest (file sizes and CRC32s) and renames the directory to
`step-NNNNNNNN/` — a rename is atomic, so a checkpoint is either complete or invisible. The manifest also
carries the caller's `metadata` (the trainer records the model config there, so a resume can refuse a
different model). On start the newest committed checkpoint whose files match its manifest is loaded; a
partial one is skipped, a corrupted one is skipped and moved aside to `step-NNNNNNNN.corrupt` (with a
warning), so it is never loaded and never counted. Retention (`keep`) counts only checkpoints that verify and
never deletes the one just committed. DCP reshards on load, so a checkpoint from 4 ranks resumes on 2. Knows
nothing about the model's architecture or the data.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)

MANIFEST = "phalanx-checkpoint.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: Path, step: int, with_checksums: bool, metadata: dict | None = None) -> None:
    files = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            entry = {"size": path.stat().st_size}
            if with_checksums:
                entry["crc32"] = _crc32(path)
            files[str(path.relative_to(directory))] = entry
    manifest = {"format": "phalanx-dcp-v1", "step": step, "files": files}
    if metadata:
        manifest["metadata"] = metadata
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


def read_metadata(directory: Path) -> dict:
    """The `metadata` recorded in a committed checkpoint's manifest ({} for checkpoints that recorded none)."""
    try:
        manifest = json.loads((Path(directory) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    metadata = manifest.get("metadata") if isinstance(manifest, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def verify(directory: Path, with_checksums: bool) -> str | None:
    """None when the checkpoint matches its manifest; otherwise what is wrong."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (never committed)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        return f"unreadable manifest: {err}"
    for rel, entry in manifest.get("files", {}).items():
        path = directory / rel
        if not path.is_file():
            return f"missing file {rel}"
        size = path.stat().st_size
        if size != entry["size"]:
            return f"{rel} has {size} bytes, manifest says {entry['size']}"
        if with_checksums and "crc32" in entry and _crc32(path) != entry["crc32"]:
            return f"{rel} checksum mismatch"
    return None


def committed_steps(root: Path) -> list[int]:
    """Steps of committed checkpoint directories, newest first (unverified)."""
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(steps, reverse=True)


def move_aside(root: Path, step: int, problem: str) -> Path | None:
    """Rename the unusable committed checkpoint `step` to `step-NNNNNNNN.corrupt` (`.corrupt-2`, ... if taken):
    out of every listing, never loaded, never counted, kept for inspection. Returns the new path."""
    source = step_dir(root, step)
    target = source.with_name(source.name + ".corrupt")
    n = 1
    while target.exists():
        n += 1
        target = source.with_name(f"{source.name}.corrupt-{n}")
    try:
        os.replace(source, target)
    except OSError as err:
        log.warning("checkpoint %s is unusable (%s) and could not be moved aside (%s)", source, problem, err)
        return None
    log.warning("checkpoint %s is unusable (%s); moved it aside to %s", source, problem, target)
    return target


@dataclass
class _Pending:
    step: int
    future: Future | None
    started: float  # perf_counter at save()


class CheckpointManager:
    """Save / commit / prune / find-latest. Collective: every rank calls save() and load()."""

    def __init__(self, root: Path, *, keep: int, async_save: bool, verify_checksums: bool,
                 on_commit: Callable[[int, float], None] | None = None, metadata: dict | None = None):
        self.root = Path(root)
        self.metadata = metadata  # recorded in every manifest this manager writes
        self.on_commit = on_commit  # (step, seconds from save() to the commit), on every rank
        self.keep = keep
        self.async_save = async_save
        self.verify_checksums = verify_checksums
        self.rank = dist.get_rank()
        self._pending: _Pending | None = None
        # Rank 0: steps known to verify (committed by this manager, or checked once): retention counts them
        # without reading their files again.
        self._verified: set[int] = set()
        # Async saves run collectives from a background thread: give them their own group.
        self._async_group = dist.new_group(backend="gloo") if async_save else None
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    # ---- save -----------------------------------------------------------------------------------
    def save(self, step: int, state: dict) -> None:
        """Write `state` (a dict of Stateful objects / tensors) for `step`; commit when all ranks finished."""
        self.wait()  # at most one save in flight
        started = time.perf_counter()
        tmp = self.root / f"step-{step:08d}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_group)
            self._pending = _Pending(step, future, started)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._pending = _Pending(step, None, started)
            self.wait()

    def wait(self) -> int | None:
        """Finish the save in flight (if any): commit it. Returns the committed step."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending.future is not None:
            pending.future.result()
        # DCP's coordinator writes .metadata only after every rank's data is written; the barrier makes
        # every rank see the commit before it moves on.
        if self.rank == 0:
            tmp = self.root / f"step-{pending.step:08d}.tmp"
            write_manifest(tmp, pending.step, self.verify_checksums, self.metadata)
            final = step_dir(self.root, pending.step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._verified.add(pending.step)
            self._prune(committed=pending.step)
        dist.barrier(group=self._async_group) if self._async_group is not None else dist.barrier()
        if self.on_commit is not None:
            self.on_commit(pending.step, time.perf_counter() - pending.started)
        return pending.step

    def _prune(self, committed: int) -> None:
        """Keep `keep` checkpoints that verify: the one just `committed` first (the newest, whatever its step
        number: a higher-numbered one on disk is from an earlier run), then the highest steps. A checkpoint
        that fails verification is moved aside, not counted; checkpoints past the window are deleted (older
        ones unread; a higher-numbered one is verified first, so a corrupt one is moved aside, not lost)."""
        kept = 1
        for step in committed_steps(self.root):
            if step == committed:
                continue
            if (kept < self.keep or step > committed) and step not in self._verified:
                problem = verify(step_dir(self.root, step), self.verify_checksums)
                if problem is not None:
                    move_aside(self.root, step, problem)
                    continue
                self._verified.add(step)
            if kept < self.keep:
                kept += 1
                continue
            shutil.rmtree(step_dir(self.root, step), ignore_errors=True)
            self._verified.discard(step)
        # Called between saves (never while one is in flight): any .tmp left is from a crashed save.
        for stale in self.root.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    # ---- load -----------------------------------------------------------------------------------
    def latest_valid_step(self) -> tuple[int | None, list[tuple[int, str]]]:
        """Rank 0 picks the newest checkpoint that verifies; every rank gets the same answer.

        Returns (step or None, [(skipped step, what is wrong with it), ...]). A committed checkpoint that fails
        verification is moved aside (`move_aside`), so no later start or retention counts it again.
        """
        choice: list = [(None, [])]
        if self.rank == 0:
            skipped = []
            for step in committed_steps(self.root):
                problem = verify(step_dir(self.root, step), self.verify_checksums)
                if problem is None:
                    self._verified.add(step)
                    choice[0] = (step, skipped)
                    break
                log.warning("checkpoint step %d at %s is unusable (%s); falling back to an older one",
                            step, step_dir(self.root, step), problem)
                moved = move_aside(self.root, step, problem)
                skipped.append((step, problem + (f"; moved aside to {moved.name}" if moved else "")))
            else:
                choice[0] = (None, skipped)
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def load(self, step: int, state: dict) -> None:
        dcp.load(state, checkpoint_id=str(step_dir(self.root, step)))

    def metadata_of(self, step: int) -> dict:
        """The metadata recorded with committed checkpoint `step` ({} if none: written before it was recorded)."""
        return read_metadata(step_dir(self.root, step))

    def close(self) -> None:
        self.wait()

    def abandon(self) -> None:
        """A fault ended this process group: forget the save in flight (it is never committed: its .tmp is
        pruned by a later save) and the group it ran on."""
        self._pending = None
        self._async_group = None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


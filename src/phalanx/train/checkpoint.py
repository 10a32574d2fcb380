"""Sharded checkpoints with atomic commit, retention, verification and resume.

Each rank writes its shards with torch.distributed.checkpoint (DCP) into `step-NNNNNNNN.tmp/`; once every
rank is done, rank 0 writes a manifest (file sizes and CRC32s) and renames the directory to
`step-NNNNNNNN/` — a rename is atomic, so a checkpoint is either complete or invisible. On start the newest
committed checkpoint whose files match its manifest is loaded; a partial or corrupted one is skipped with a
warning. DCP reshards on load, so a checkpoint from 4 ranks resumes on 2. Knows nothing about the model's
architecture or the data.
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

import torch
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


def write_manifest(directory: Path, step: int, with_checksums: bool) -> None:
    files = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.name != MANIFEST:
            entry = {"size": path.stat().st_size}
            if with_checksums:
                entry["crc32"] = _crc32(path)
            files[str(path.relative_to(directory))] = entry
    manifest = {"format": "phalanx-dcp-v1", "step": step, "files": files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))


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


@dataclass
class _Pending:
    step: int
    future: Future | None
    started: float  # perf_counter at save()


class CheckpointManager:
    """Save / commit / prune / find-latest. Collective: every rank calls save() and load()."""

    def __init__(self, root: Path, *, keep: int, async_save: bool, verify_checksums: bool,
                 on_commit: Callable[[int, float], None] | None = None):
        self.root = Path(root)
        self.on_commit = on_commit  # (step, seconds from save() to the commit), on every rank
        self.keep = keep
        self.async_save = async_save
        self.verify_checksums = verify_checksums
        self.rank = dist.get_rank()
        self._pending: _Pending | None = None
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
            write_manifest(tmp, pending.step, self.verify_checksums)
            final = step_dir(self.root, pending.step)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier(group=self._async_group) if self._async_group is not None else dist.barrier()
        if self.on_commit is not None:
            self.on_commit(pending.step, time.perf_counter() - pending.started)
        return pending.step

    def _prune(self) -> None:
        for old in committed_steps(self.root)[self.keep :]:
            shutil.rmtree(step_dir(self.root, old), ignore_errors=True)
        # Called between saves (never while one is in flight): any .tmp left is from a crashed save.
        for stale in self.root.glob("step-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    # ---- load -----------------------------------------------------------------------------------
    def latest_valid_step(self) -> tuple[int | None, list[tuple[int, str]]]:
        """Rank 0 picks the newest checkpoint that verifies; every rank gets the same answer.

        Returns (step or None, [(skipped step, what is wrong with it), ...]).
        """
        choice: list = [(None, [])]
        if self.rank == 0:
            skipped = []
            for step in committed_steps(self.root):
                problem = verify(step_dir(self.root, step), self.verify_checksums)
                if problem is None:
                    choice[0] = (step, skipped)
                    break
                log.warning("checkpoint step %d at %s is unusable (%s); falling back to an older one",
                            step, step_dir(self.root, step), problem)
                skipped.append((step, problem))
            else:
                choice[0] = (None, skipped)
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def load(self, step: int, state: dict) -> None:
        dcp.load(state, checkpoint_id=str(step_dir(self.root, step)))

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


def rng_state() -> dict:
    import random

    import numpy as np

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

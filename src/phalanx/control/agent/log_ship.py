"""Rank logs shipped to the controller from a host that does not see its files (`Assignment.ship_log`: a command
job on backend hosts or slurm; a training job's logs live beside its checkpoints, which hosts share).

The supervisor writes such a rank's log in the node's work dir (`<work_dir>/job-logs/<job>/rank{R}.log`, appended
across generations, like any rank log) and `watch`es it; every SHIP_EVERY_S what is new of each is sent, whole
lines, in chunks of at most LOG_CHUNK_BYTES, to `POST /v1/jobs/{job}/logs/{rank}`, which appends it where
`phalanx job logs` reads (`server/rank_logs.py`). A line still unfinished a round later is sent as it is (a
prompt, a progress bar). A worker's last lines and the exit line its agent writes are sent before its exit is
reported (`ship_now`, for up to NOW_TIMEOUT_S), so a `job logs -f` that ends with the job has them. While the
controller is unreachable the logs wait on the node and go once it answers.

The node keeps the logs of its KEEP_JOBS most recent jobs (`JobLogs`): when a new job's dir is made, the dirs of
older jobs none of whose logs is still watched go (the controller holds all of them), their sizes kept in
`job-logs/shipped.json`, so a job that comes back to the node goes on from the offsets the controller holds.

Must not know: the controller's files, how workers are started.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from phalanx.control.http import ApiError, ControllerUnreachable, KeepAlive
from phalanx.protocol.messages import LOG_CHUNK_BYTES, LogChunk, LogReceived

log = logging.getLogger("phalanx.agent.logs")
SHIP_EVERY_S = 1.0
NOW_TIMEOUT_S = 1.0  # a worker's exit waits this for its last lines to reach the controller (+ a request's timeout)
POST_TIMEOUT_S = 2.0
IDLE_FORGET_S = 600.0  # a log sent in full and unchanged this long is no longer looked at (watched again on a start)
KEEP_JOBS = 16  # job dirs of `job-logs/` a node keeps; older ones go once none of their logs is watched
SHIPPED = "shipped.json"  # {job: {rank: bytes}}: the sizes of the logs of job dirs that went


@dataclass
class _Log:
    job: str
    rank: int
    path: Path
    offset: int  # what the controller holds of it (in the node's log of the rank: `base` + the file's bytes)
    changed_at: float  # monotonic
    held_at_size: int = -1  # the file's size when an unfinished line was last held back
    refused: bool = False  # the controller's last answer was an error (said once, not every round)
    base: int = 0  # the bytes of this log in files that went before `path` (`JobLogs.prune`)

    def size(self) -> int:
        return self.base + _size(self.path)


class LogShipper:
    def __init__(self, node: str, token: str, url: Callable[[], str | None],
                 post: Callable[[str, int, LogChunk], int] | None = None):
        self.node, self.token, self.url = node, token, url
        self._post = post or self._http_post  # (job, rank, chunk) → bytes the controller holds
        self._logs: dict[tuple[str, int], _Log] = {}
        self._lock = threading.Lock()  # guards `_logs` (held briefly: the supervisor watches under its own lock)
        self._sending = threading.Lock()  # one sender at a time: the thread's rounds, a worker's `ship_now`
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._session = KeepAlive()  # (used while `_sending` is held only)
        self._down = False  # the last send found the controller unreachable

    def watch(self, job: str, rank: int, path: Path, base: int = 0) -> None:
        """Ship `path` (the rank's log on this node, after `base` bytes that went before it) from its current end:
        what is before it was sent."""
        with self._lock:
            if (job, rank) not in self._logs:
                self._logs[(job, rank)] = _Log(job, rank, path, base + _size(path), time.monotonic(), base=base)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="log-ship", daemon=True)
                self._thread.start()

    def ship_now(self, job: str, rank: int) -> bool:
        """All of the rank's log, an unfinished last line too, now; False when not all of it reached the controller
        within about NOW_TIMEOUT_S (the next rounds send it). At once False while the controller is unreachable."""
        with self._lock:
            entry = self._logs.get((job, rank))
        if entry is None:
            return True
        if self._down or not self._sending.acquire(timeout=NOW_TIMEOUT_S):  # (a round may be sending)
            return False
        try:
            return self._ship(entry, whole=True, deadline=time.monotonic() + NOW_TIMEOUT_S)
        except ControllerUnreachable:
            return False
        finally:
            self._sending.release()

    def watched_jobs(self) -> set[str]:
        with self._lock:
            return {job for job, _ in self._logs}

    def ship_all(self, *, whole: bool = False, timeout_s: float = 5.0) -> bool:
        """One round: what is new of every log (with `whole`, unfinished lines too). True when all of it was sent."""
        deadline, done = time.monotonic() + timeout_s, True
        with self._lock:
            entries = list(self._logs.items())
        with self._sending:
            for key, entry in entries:
                try:
                    done = self._ship(entry, whole=whole, deadline=deadline) and done
                except ControllerUnreachable:
                    return False  # (the rest waits for the next round: each would wait for its timeout)
                if entry.offset >= entry.size() and time.monotonic() - entry.changed_at > IDLE_FORGET_S:
                    with self._lock:
                        self._logs.pop(key, None)
        return done

    def close(self, timeout_s: float = 5.0) -> None:
        """The agent is exiting: one last round, everything of every log."""
        self._stop.set()
        self.ship_all(whole=True, timeout_s=timeout_s)
        with self._sending:
            self._session.close()

    def _run(self) -> None:
        while not self._stop.wait(SHIP_EVERY_S):
            try:
                self.ship_all()
            except Exception:  # a bug here must not end the shipping of every log
                log.exception("shipping rank logs failed; next: retrying in %g s", SHIP_EVERY_S)

    def _ship(self, entry: _Log, *, whole: bool, deadline: float) -> bool:
        """Send what is new of `entry`; True when the controller holds all of it. ControllerUnreachable passes."""
        held_at_size = entry.held_at_size  # (as the last round left it)
        while True:
            size = entry.size()
            if size <= entry.offset:
                return True
            with open(entry.path, "rb") as f:
                f.seek(entry.offset - entry.base)
                data = f.read(LOG_CHUNK_BYTES)
            if not whole and len(data) < LOG_CHUNK_BYTES:
                lines = data[:data.rfind(b"\n") + 1]
                if len(lines) < len(data) and held_at_size != size:  # an unfinished line: it waits a round
                    entry.held_at_size = size
                    if not lines:
                        return False
                    data = lines
            chunk = LogChunk(node=self.node, offset=entry.offset, data=base64.b64encode(data).decode())
            try:
                received = self._post(entry.job, entry.rank, chunk)
            except ControllerUnreachable as err:
                if not self._down:
                    log.warning("cannot ship rank logs to the controller (%s); they wait on this node", err)
                self._down = True
                raise
            except ApiError as err:
                if err.status in (404, 422):  # the job or this node unknown to the controller: nothing to send to
                    log.warning("rank %d of job %s: the controller refuses its log (%s); no longer shipped",
                                entry.rank, entry.job, err)
                    with self._lock:
                        self._logs.pop((entry.job, entry.rank), None)
                    entry.offset = size
                    return True
                if not entry.refused:
                    log.warning("rank %d of job %s: shipping its log failed (%s); next: again every %g s",
                                entry.rank, entry.job, err, SHIP_EVERY_S)
                entry.refused = True
                return False
            if self._down:
                log.info("shipping rank logs to the controller again")
            self._down = entry.refused = False
            moved = received != entry.offset
            entry.offset, entry.changed_at = received, time.monotonic()
            if not moved or time.monotonic() > deadline:
                return entry.size() <= entry.offset

    def _http_post(self, job: str, rank: int, chunk: LogChunk) -> int:
        url = self.url()
        if url is None:
            raise ControllerUnreachable("no controller endpoint known yet")
        reply = self._session.request_json("POST", f"{url}/v1/jobs/{job}/logs/{rank}", self.token, chunk.model_dump(),
                                           timeout=POST_TIMEOUT_S)
        return LogReceived.model_validate(reply).received


class JobLogs:
    """The node's `job-logs/`: one dir per job, one log per rank, and the sizes of the logs of dirs that went."""

    def __init__(self, root: Path, keep_jobs: int = KEEP_JOBS):
        self.root, self.keep_jobs = root, keep_jobs

    def path(self, job: str, rank: int) -> Path:
        return self.root / job / f"rank{rank}.log"

    def base(self, job: str, rank: int) -> int:
        """The bytes of the rank's log on this node in files that went (0 if none did)."""
        return int(self._shipped().get(job, {}).get(str(rank), 0))

    def prune(self, busy: set[str]) -> list[str]:
        """Remove the dirs of the jobs past the `keep_jobs` most recently written, except `busy` ones (a log still
        watched: not all of it at the controller yet); returns the jobs whose dirs went."""
        try:
            dirs = [d for d in self.root.iterdir() if d.is_dir()]
        except FileNotFoundError:
            return []
        dirs.sort(key=_written_at, reverse=True)
        going = [d for d in dirs[self.keep_jobs:] if d.name not in busy]
        if not going:
            return []
        shipped = self._shipped()
        for d in going:
            sizes = shipped.setdefault(d.name, {})
            for log_file in d.glob("rank*.log"):
                rank = log_file.name[len("rank"):-len(".log")]
                sizes[rank] = int(sizes.get(rank, 0)) + _size(log_file)
        tmp = self.root / f".{SHIPPED}.tmp"
        tmp.write_text(json.dumps(shipped))
        os.replace(tmp, self.root / SHIPPED)  # (the sizes first: a dir gone with its sizes unsaved would restart at 0)
        for d in going:
            shutil.rmtree(d, ignore_errors=True)
        log.info("removed the rank logs of %d earlier jobs from this node (all of them at the controller): %s",
                 len(going), ", ".join(d.name for d in going))
        return [d.name for d in going]

    def _shipped(self) -> dict[str, dict[str, int]]:
        try:
            return json.loads((self.root / SHIPPED).read_text())
        except (FileNotFoundError, ValueError):
            return {}


def _written_at(d: Path) -> float:
    """When the last log in `d` was written (the dir's own time if it holds none)."""
    try:
        return max([f.stat().st_mtime for f in d.iterdir() if f.is_file()] or [d.stat().st_mtime])
    except FileNotFoundError:  # (gone meanwhile)
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0

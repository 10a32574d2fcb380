"""A run's event file, `<run dir>/events.jsonl`: every event of the run from every source (the controller,
the node agents, rank 0), one `Event` (`events.py`) per line as `Event.to_json()` writes it. The run dir is
the job's `checkpoint_dir`: the one directory the controller (the job's record), the agents (the
assignment) and the workers (`PHALANX_CHECKPOINT_DIR`, `TrainConfig.checkpoint_dir`) all know.

  JsonlSink        appends one line per event with a single `os.write` on an O_APPEND descriptor, so
                   several processes can append to the same file and no line is ever interleaved
  RunEventFiles    the sink for a writer that serves many jobs (the controller, an agent): each event of a
                   job goes to that job's events.jsonl; a file that cannot be written is logged once per
                   job and dropped, never raised to the writer
  read_events      the run's events, sorted by time; a torn last line is ignored

Must not know: the controller, the training loop, what a job is beyond its id; standard library only.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

from phalanx.observability.events import Event

EVENTS_FILE = "events.jsonl"

log = logging.getLogger("phalanx.events")


def events_path(run_dir: Path | str) -> Path:
    return Path(run_dir) / EVENTS_FILE


def job_run_dir(cwd: str | None, checkpoint_dir: str) -> Path:
    """A job's run dir as every side names it: its checkpoint_dir, against the job's cwd when relative."""
    return Path(cwd or ".", checkpoint_dir)


def job_metrics_dir(kind: str, cwd: str | None, config: dict | None) -> Path | None:
    """Where a job's rank 0 writes metrics.jsonl: a training job's `run_dir` (against its cwd); None for a
    command job (no step records)."""
    run_dir = (config or {}).get("run_dir") if kind == "train" else None
    return Path(cwd or ".", run_dir) if run_dir else None


class JsonlSink:
    """Appends each event to `path` as one JSON line, creating the parent directories. The file is opened for
    each event (events are rare) so a file or directory removed in between is simply made again."""

    FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC

    def __init__(self, path: Path | str):
        self.path = Path(path)

    def __call__(self, event: Event) -> None:
        self.append(event.to_json())

    def append(self, line: str) -> None:
        data = (line + "\n").encode()
        try:
            fd = os.open(self.path, self.FLAGS, 0o644)  # (the controller's and agents' umask 077 makes it 0600)
        except FileNotFoundError:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, self.FLAGS, 0o644)
        try:
            written = os.write(fd, data)  # one write on O_APPEND: the whole line lands at the end, in one piece
        finally:
            os.close(fd)
        if written != len(data):  # (a full disk): the reader drops the torn line if it stays the last
            raise OSError(f"{self.path}: wrote {written} of {len(data)} bytes of an event line")


class RunEventFiles:
    """Sends each event of a job to `<run_dir(job)>/events.jsonl` (`run_dir` returns None: the job has no run
    dir; nothing is written). Events without a job are not a run's. Any failure — the lookup, the directory
    gone or not writable — is a warning, once per job, and the event is dropped from the file only: the
    writer's other sinks (the controller's SQLite) are not affected."""

    def __init__(self, run_dir: Callable[[str], Path | str | None], *, what: str = "events"):
        self.run_dir = run_dir
        self.what = what  # who is writing, for the warning ("the controller's events")
        self._warned: set[str] = set()

    def __call__(self, event: Event) -> None:
        if event.job is None:
            return
        try:
            where = self.run_dir(event.job)
            if where:
                JsonlSink(events_path(where))(event)
        except Exception as err:  # noqa: BLE001 — a run file must never break the writer
            if event.job not in self._warned:
                self._warned.add(event.job)
                log.warning("could not write %s of job %s to its run's %s (%s: %s); they stay in their other "
                            "records only (this warning is given once per job)", self.what, event.job, EVENTS_FILE,
                            type(err).__name__, err)


def read_events(run_dir: Path | str) -> list[Event]:
    """The events in `<run_dir>/events.jsonl`, sorted by time (file order among equal times); [] when there is
    none. A torn last line (no newline: a full disk, a crash mid-write) is ignored; a broken whole line (a torn
    one that later lines were appended to) is skipped with a warning naming it."""
    path = events_path(run_dir)
    try:
        text = path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return []
    *whole, _torn = text.split("\n")  # every whole line ends with "\n": after the last one, "" or a torn line
    events = []
    for number, line in enumerate(whole, 1):
        if not line.strip():
            continue
        try:
            events.append(Event.from_json(line))
        except (ValueError, KeyError, TypeError) as err:
            log.warning("%s:%d: not an event line, skipped (%s): %r", path, number, err, line[:200])
    return sorted(events, key=lambda e: e.time)

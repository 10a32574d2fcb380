"""The controller's view of its jobs' training: one `observability.follow.RunFollower` per job, made on first
use, read by /metrics and the dashboard.

Where a job's files are is its record's (`checkpoint_dir` for events.jsonl, the config's `run_dir` for
metrics.jsonl, both against the job's cwd: the rule the agents and the client use). Followers of active jobs
are kept; of the ended ones only the newest `keep_ended`, so a long-lived controller's memory stays bounded.

Must not know: HTTP, Prometheus' format, processes.
"""

from __future__ import annotations

import threading

from phalanx.control.state.jobs import Job
from phalanx.observability.follow import RunFollower
from phalanx.observability.run_events import job_metrics_dir, job_run_dir


class JobRuns:
    def __init__(self, *, keep_ended: int = 32, derive_every_s: float = 5.0):
        self.keep_ended = keep_ended
        self.derive_every_s = derive_every_s
        self._followers: dict[str, RunFollower] = {}
        self._lock = threading.Lock()

    def follower(self, job: Job, *, poll: bool = True) -> RunFollower:
        """The job's follower, caught up with its files (`poll`)."""
        with self._lock:
            f = self._followers.get(job.id)
            if f is None:
                f = self._followers[job.id] = RunFollower(
                    job.id, job_run_dir(job.cwd, job.checkpoint_dir), job_metrics_dir(job.kind, job.cwd, job.config),
                    derive_every_s=self.derive_every_s)
        if poll:
            f.poll()
        return f

    def followers(self, jobs: list[Job]) -> list[tuple[Job, RunFollower]]:
        """Each job's caught-up follower; followers of jobs no longer listed are dropped, and of the ended
        jobs listed only the newest `keep_ended` are kept (`jobs` in submission order)."""
        ended = [j for j in jobs if j.ended_at is not None]
        keep = [j for j in jobs if j.ended_at is None] + (ended[-self.keep_ended:] if self.keep_ended else [])
        ids = {j.id for j in keep}
        with self._lock:
            for stale in set(self._followers) - ids:
                del self._followers[stale]
        return [(j, self.follower(j)) for j in jobs if j.id in ids]

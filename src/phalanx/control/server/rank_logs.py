"""Rank logs shipped by agents on hosts that do not see the controller's files (`Assignment.ship_log`): each
chunk is appended to `<job_dir>/logs/rank{R}.log`, where `phalanx job logs` reads, as a local agent writes it.

A node's chunks carry their offset in the log its agent writes on its node (one per rank and job, across
generations), so a chunk sent again after a lost answer is not written twice, and one past a gap (a chunk lost
before it) is not written: the answer says what is held, from where the agent sends again. A rank that moved to
another node has one such log per node: their chunks interleave in the rank's file, in whole lines
(`agent/log_ship.py`). What was received is counted in memory: a restarted controller takes a node's next chunk
at its word.

Must not know: HTTP, how agents read their files.
"""

from __future__ import annotations

import threading
from pathlib import Path


class RankLogs:
    def __init__(self):
        self._received: dict[tuple[str, int, str], int] = {}  # (job, rank, node) → bytes of that node's log held
        self._lock = threading.Lock()

    def append(self, job_dir: str, job: str, rank: int, node: str, offset: int, data: bytes) -> int:
        """Append what is new in `data` (it starts at `offset` of `node`'s log of the rank); returns the bytes of
        that log now held: nothing is written when `offset` is past them (the agent sends again from there)."""
        key = (job, rank, node)
        with self._lock:
            have = self._received.get(key, offset)
            if offset > have:
                return have
            new = data[have - offset:]
            if new:
                path = Path(job_dir) / "logs" / f"rank{rank}.log"
                path.parent.mkdir(parents=True, exist_ok=True)
                with open(path, "ab") as out:
                    out.write(new)
            self._received[key] = max(have, offset + len(data))
            return self._received[key]

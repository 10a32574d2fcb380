"""Where a cluster's files live: `$PHALANX_HOME/clusters/<name>/` (PHALANX_HOME defaults to ~/.phalanx).

    spec.json        the validated spec the cluster was created from
    state.db         SQLite (WAL): cluster, groups, nodes, events, jobs — the controller's truth
    token            the cluster's API token, mode 0600
    endpoint.json    where the running controller listens (API and rendezvous store); agents re-read it
    controller.pid   the controller daemon's pid
    controller.log   the controller's log
    nodes/<node>/    one work dir per node: agent.json, agent.log, lifecycle.log
    jobs/<id>/       one dir per job: config.json (training jobs), logs/rank<R>.log (every generation's
                     output of that rank, appended), checkpoints/ (command jobs' PHALANX_CHECKPOINT_DIR)

The dir is private to its user (0700; files 0600): the processes Phalanx starts run with PRIVATE_UMASK.

Knows only file names: nothing about what runs or what the files mean.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path


PRIVATE_UMASK = 0o077  # the token, logs and job configs are this user's only


def phalanx_home() -> Path:
    return Path(os.environ.get("PHALANX_HOME") or Path.home() / ".phalanx").expanduser()


def clusters_root() -> Path:
    return phalanx_home() / "clusters"


@dataclass(frozen=True)
class ClusterPaths:
    root: Path

    @classmethod
    def for_name(cls, name: str) -> ClusterPaths:
        return cls(clusters_root() / name)

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def spec(self) -> Path:
        return self.root / "spec.json"

    @property
    def db(self) -> Path:
        return self.root / "state.db"

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def endpoint(self) -> Path:
        return self.root / "endpoint.json"

    @property
    def pid_file(self) -> Path:
        return self.root / "controller.pid"

    @property
    def controller_log(self) -> Path:
        return self.root / "controller.log"

    @property
    def jobs_dir(self) -> Path:
        return self.root / "jobs"

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    def node_dir(self, node: str) -> Path:
        return self.root / "nodes" / node

    def write_token(self) -> str:
        """Create the cluster token, readable by this user only (mode 0600 from the first byte)."""
        token = secrets.token_urlsafe(32)
        fd = os.open(self.token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token)
        return token

    def read_token(self) -> str:
        return self.token.read_text().strip()

    def write_endpoint(self, info: dict) -> None:
        write_atomic(self.endpoint, json.dumps(info))

    def read_endpoint(self) -> dict | None:
        try:
            return json.loads(self.endpoint.read_text())
        except FileNotFoundError:
            return None


def write_private(path: Path, text: str) -> None:
    """Create `path` (it must not exist) readable by this user only, whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def open_private_log(path: Path):
    """`path` opened for appending (binary), created 0600 if it is new."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def list_clusters() -> list[str]:
    root = clusters_root()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "state.db").exists())

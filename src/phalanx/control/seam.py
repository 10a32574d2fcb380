"""The seam between a node agent and the workers it starts: every env var and store key, and nothing else.

An agent starts each worker with the usual torch variables plus Phalanx's own:

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE   this worker's place in the job
    MASTER_ADDR, MASTER_PORT                         torch's default rendezvous (for programs that use it)
    PHALANX_JOB_ID                                   the job this worker belongs to
    PHALANX_GENERATION                               bumped on every (re)start of the job
    PHALANX_STORE_ADDR                               host:port of the controller's TCPStore
    PHALANX_CHECKPOINT_DIR                           where the job saves and resumes checkpoints
    PHALANX_CLUSTER_TOKEN                            the cluster token (to talk to the controller)

Workers talk back only through keys in the controller's TCPStore, all under the generation's prefix
`{job}/gen{g}/` — the same prefix a worker passes to `PrefixStore` for its process groups, so a new
generation never sees an old one's keys:

    {job}/gen{g}/progress/{rank}   the last training step rank `rank` finished (the agent's hang detector
                                   and the controller's progress view read it)

Imports nothing from torch or the rest of Phalanx: both sides import this module.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
JOB_ID = "PHALANX_JOB_ID"
GENERATION = "PHALANX_GENERATION"
STORE_ADDR = "PHALANX_STORE_ADDR"
CHECKPOINT_DIR = "PHALANX_CHECKPOINT_DIR"
CLUSTER_TOKEN = "PHALANX_CLUSTER_TOKEN"


@dataclass(frozen=True)
class WorkerPlacement:
    """What an agent knows about one worker it must start."""

    job_id: str
    generation: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    store_addr: str  # "host:port"
    checkpoint_dir: str
    cluster_token: str


def worker_env(p: WorkerPlacement, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a worker is started with: `base` (default: the agent's) plus the seam's variables."""
    env = dict(os.environ if base is None else base)
    env.update({
        RANK: str(p.rank), WORLD_SIZE: str(p.world_size), LOCAL_RANK: str(p.local_rank),
        LOCAL_WORLD_SIZE: str(p.local_world_size), MASTER_ADDR: p.master_addr, MASTER_PORT: str(p.master_port),
        JOB_ID: p.job_id, GENERATION: str(p.generation), STORE_ADDR: p.store_addr,
        CHECKPOINT_DIR: p.checkpoint_dir, CLUSTER_TOKEN: p.cluster_token,
    })
    return env


def generation_prefix(job_id: str, generation: int) -> str:
    """Key prefix of one generation of a job; workers build process groups on PrefixStore(this, store)."""
    return f"{job_id}/gen{generation}"


def progress_key(job_id: str, generation: int, rank: int) -> str:
    """Store key holding the last step `rank` finished in this generation (an ASCII integer)."""
    return f"{generation_prefix(job_id, generation)}/progress/{rank}"


def parse_store_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{STORE_ADDR}={addr!r} is not host:port")
    return host, int(port)

"""The environment contract between an agent and the workers it starts: the variable names, a worker's
placement, `worker_env()` that writes them and `rank_of()`, the one rank formula (node order × workers per
node + local rank) that the controller, the agents and the workers all use.

Must not know: how a worker trains, how the controller decides; imports nothing from torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from phalanx.protocol.version import PROTOCOL_ENV, PROTOCOL_VERSION

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
CONFIG = "PHALANX_CONFIG"
NODE = "PHALANX_NODE"
STANDBY_ID = "PHALANX_STANDBY_ID"
RECOVERY = "PHALANX_RECOVERY"
CHECKPOINTLESS = "checkpointless"
TRAIN_WORKER_MODULE = "phalanx.worker"  # what a training job's agents run (`python -m`)
NODE_HANDLE = "PHALANX_NODE_HANDLE"  # set by a backend that names its agents itself; the agent reports it
PROGRESS_FILE = "PHALANX_PROGRESS_FILE"  # set by the agent: where the worker writes its progress for it
ACTIVATED_AT = "PHALANX_ACTIVATED_AT"  # a warm standby's activation time (epoch seconds), for its recovery marks
# A checkpointless worker's exit code when it gave up on a generation it could not leave: a newer one was
# published, yet its main thread stayed blocked in the old one's group creation (gloo connecting to a peer that
# died after writing its address: a C++ wait no Python code can interrupt). Like a killed process, a fault the
# peers recover from in place: a fresh process takes the rank.
EXIT_STUCK = 75


def rank_of(nodes: list[str] | Mapping[str, int], node: str, local_rank: int, workers_per_node: int) -> int:
    """The global rank of slot `local_rank` on `node` in a generation laid out on `nodes` (in order; or a mapping
    of each node to its position, which the controller keeps so that a lookup at thousands of nodes is not a
    scan of the list)."""
    position = nodes[node] if isinstance(nodes, Mapping) else nodes.index(node)
    return position * workers_per_node + local_rank


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
    config_path: str | None = None  # training jobs only
    node: str = ""
    recovery: str = "restart"


def worker_env(p: WorkerPlacement, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a worker is started with: `base` (default: the agent's) plus the seam's variables."""
    env = dict(os.environ if base is None else base)
    env.update({
        RANK: str(p.rank), WORLD_SIZE: str(p.world_size), LOCAL_RANK: str(p.local_rank),
        LOCAL_WORLD_SIZE: str(p.local_world_size), MASTER_ADDR: p.master_addr, MASTER_PORT: str(p.master_port),
        JOB_ID: p.job_id, GENERATION: str(p.generation), STORE_ADDR: p.store_addr,
        CHECKPOINT_DIR: p.checkpoint_dir, CLUSTER_TOKEN: p.cluster_token, NODE: p.node, RECOVERY: p.recovery,
    })
    env[PROTOCOL_ENV] = str(PROTOCOL_VERSION)  # the worker refuses another version (`progress_reporter`)
    if p.config_path is not None:
        env[CONFIG] = p.config_path
    return env


def parse_store_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{STORE_ADDR}={addr!r} is not host:port")
    return host, int(port)

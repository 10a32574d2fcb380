"""The wire messages between an agent and the controller, typed: the heartbeat an agent sends (its phase,
lifecycle and health results, its workers), the controller's reply (what the node must run), an assignment
(one generation of one job on the node), the deep-check part of a reply, and the recovery summary a
checkpointless generation's rank 0 leaves in the store (`keys.recovered_key`).

Both sides validate at the edge: the controller parses every heartbeat with `Heartbeat` (an unknown field is
refused, naming it), the agent every reply with `HeartbeatReply`; both carry `protocol`, and a side that
meets another version refuses with `version.ProtocolMismatch` instead of misreading a field.

Must not know: how the controller decides, how an agent starts processes; pydantic only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from phalanx.protocol.version import PROTOCOL_VERSION


# An agent's link (`POST /v1/nodes/{name}/link?handle=H`, held open while the agent lives: its end tells the
# controller the agent process ended): the controller sends a byte down it this often, so nothing on the way takes
# it for idle, and the agent gives up on a link silent for 3 beats and opens another.
LINK_BEAT_S = 5.0
# What travels on a link (protocol 5): down, LINK_BEAT (the keep-alive above) or LINK_POKE (the controller wrote
# something this node's reply depends on: heartbeat now); up, the request's chunked body, LINK_BEAT each heartbeat
# interval in which the agent sends no full heartbeat (it counts as one: `last_heartbeat`).
LINK_BEAT, LINK_POKE = b".", b"!"
# An agent whose link is open sends a full heartbeat only when its report changed, when poked, while its reply
# asks for heartbeats sooner, and at least this often (jittered down to half of it): what it carries then that a
# beat does not is its free ports (`join.free_ports`), and a reply that a lost poke would have brought sooner.
# Nothing else depends on it since protocol 6: the hang rule reads its workers' progress on the node.
FULL_HEARTBEAT_MAX_S = 20.0
# The most of a rank's log one `LogChunk` carries (before base64).
LOG_CHUNK_BYTES = 256 * 1024


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerReport(_Message):
    """One worker, as its agent reports it in every heartbeat."""

    job: str
    generation: int
    rank: int
    local_rank: int
    pid: int | None
    state: Literal["running", "stopping", "exited"]
    exit_code: int | None
    detail: str | None
    hang: str | None
    frozen: bool = False
    stopped: bool
    started_at: float
    ended_at: float | None
    carried_from: list[int] | None = None  # checkpointless: [generation, rank] this process served before


class Heartbeat(_Message):
    """Agent → controller, every `heartbeat_interval_s`."""

    protocol: int | None = None  # the agent's PROTOCOL_VERSION (None: an agent older than versioning)
    handle: str  # the node's opaque handle: `PHALANX_NODE_HANDLE` from its backend, else the agent's pid
    phase: str
    lifecycle: dict | None = None
    health: dict | None = None
    sent_at: float
    workers: list[WorkerReport] = []
    reply_sent_at: float | None = None  # the last reply the agent acted on
    deep_check: dict | None = None  # the result of the newest deep-check round the node took part in
    standbys: dict[str, str] = {}  # local rank → id of the warm standby worker waiting on that slot
    address: str | None = None  # where this node's workers are reached (MASTER_ADDR when it hosts rank 0)
    ifname: str | None = None  # the interface holding `address` (the workers' GLOO/NCCL_SOCKET_IFNAME)
    free_ports: list[int] = []  # TCP ports free on this node just now (a generation's MASTER_PORT)
    time_limit_warned_at: float | None = None  # when Slurm warned the node's allocation of its time limit (USR2)


class JoinRequest(_Message):
    """Agent → controller, once: an agent started on some host (by a lifecycle script, `srun`, by hand) asks to
    be one of the nodes of `group` that wait for an agent (`phalanx agent --controller URL ...`)."""

    protocol: int | None = None
    group: str
    name: str | None = None  # a particular waiting node (default: the first of the group)
    handle: str  # who this agent is (host and pid); every heartbeat repeats it
    address: str
    ifname: str | None = None
    work_root: str  # on the agent's host: the node's work dir is WORK_ROOT/<cluster>/<node>
    hostname: str


class JoinReply(_Message):
    """Controller → a joining agent: which node it is and how to run it (what `agent.json` holds for an agent the
    local backend starts), with the lifecycle script's text: nothing is read from the controller's disk."""

    protocol: int = PROTOCOL_VERSION
    node: str
    cluster: str
    config: dict  # agent settings: group, instance_type, gpus, worker_slots, heartbeat and health settings
    store_addr: str  # host:port of the controller's rendezvous store
    on_create: str | None = None  # the lifecycle script's text
    on_create_name: str | None = None


class RankSlot(_Message):
    rank: int
    local_rank: int
    standby: str | None = None  # the warm standby the controller told to become this rank
    carry: bool = False  # checkpointless: the survivor on this slot serves the new generation


class Assignment(_Message):
    """One generation of one job on the node. A checkpointless job between generations is `hold`: its
    survivors wait in their processes (no ranks)."""

    job: str
    generation: int
    hold: bool = False
    ranks: list[RankSlot] = []
    recovery: str | None = None
    argv: list[str] | None = None
    cwd: str | None = None
    env: dict[str, str] = {}
    log_dir: str | None = None  # the controller's, where `job logs` reads
    # the node does not see log_dir (a host without the controller's files): the agent writes each rank's log in
    # its own work dir and ships it to the controller (`POST /v1/jobs/{job}/logs/{rank}`, `LogChunk`)
    ship_log: bool = False
    world_size: int | None = None
    local_world_size: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    store_addr: str | None = None
    checkpoint_dir: str | None = None
    config_path: str | None = None


class LogChunk(_Message):
    """Agent → controller: bytes of one rank's log, from `offset` in the log the agent writes on its node."""

    node: str
    offset: int = Field(ge=0)
    data: str = Field(max_length=LOG_CHUNK_BYTES * 4 // 3 + 4)  # base64


class LogReceived(_Message):
    received: int  # how much of the node's log the controller holds (an agent resumes from there)


class DeepCheckPart(_Message):
    id: str
    nodes: list[str]
    node_rank: int
    procs_per_node: int
    master_addr: str
    master_port: int
    size_mb: float
    iters: int
    timeout_s: float
    env: dict[str, str] = {}


class HeartbeatReply(_Message):
    """Controller → agent: run these workers (`action` run), or stop (`terminate`, with the reason)."""

    protocol: int = PROTOCOL_VERSION
    sent_at: float
    controller: float  # the controller process's start time (which controller answered)
    action: Literal["run", "terminate"]
    reason: str | None = None
    state: str | None = None
    workers: list[Assignment] = []
    faults: list[str] = []  # operator-injected faults the node's next health check reports
    standby: int = 0  # warm standby workers to keep
    deep_check: DeepCheckPart | None = None
    # sooner than heartbeat_interval_s: a job on this node is changing generation (a stop to acknowledge, new
    # workers to start), so the next decision reaches the agent in this many seconds instead of an interval
    next_heartbeat_s: float | None = Field(None, gt=0)


class RecoverySummary(BaseModel):
    """What the new rank 0 of a checkpointless generation writes once state is restored (extra fields are
    kept: the events it carries grow with the recovery's phases)."""

    model_config = ConfigDict(extra="allow")
    source: str  # where the state came from: a peer replica, a buddy's snapshot, the checkpoint
    step: int
    bytes: int = Field(ge=0)
    seconds: float = Field(ge=0)
    reason: str | None = None
    events: list[dict] = []  # the recovery's events (fault_detected, pg_rebuilt, resumed), as in metrics.jsonl

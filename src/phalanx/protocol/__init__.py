"""The protocol: the one seam between the control plane and the workers — every env var, store key and wire
message, and nothing else. `control` and the runtime (`train`, `resilience`) both import this package, never
each other.

An agent starts each worker with the usual torch variables plus Phalanx's own:

    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE   this worker's place in the job
    MASTER_ADDR, MASTER_PORT                         torch's env:// rendezvous, fresh for every generation
                                                     (rank 0 hosts it; the controller picked a free port)
    PHALANX_JOB_ID                                   the job this worker belongs to
    PHALANX_GENERATION                               bumped on every (re)start of the job
    PHALANX_STORE_ADDR                               host:port of the controller's TCPStore
    PHALANX_CHECKPOINT_DIR                           where the job saves and resumes checkpoints
    PHALANX_CLUSTER_TOKEN                            the cluster token (to talk to the controller; the
                                                     store's key namespace is derived from it)
    PHALANX_CONFIG                                   training jobs: the resolved config (JSON) that
                                                     `python -m phalanx.worker` runs
    PHALANX_NODE                                     the node this worker runs on
    PHALANX_RECOVERY                                 restart | checkpointless (the job's recovery mode)
    PHALANX_PROGRESS_FILE                            where the worker writes its progress for its agent

Workers talk back only through keys in the controller's TCPStore, all under the generation's prefix
`{job}/gen{g}/` (the prefix a worker would pass to `PrefixStore`), so a new generation never sees an old
one's keys:

    {job}/gen{g}/progress/{rank}   the last training step rank `rank` finished (before its first step: the
                                   step it starts from, i.e. the resumed one)
    {job}/gen{g}/alive/{rank}      a counter the worker bumps every BEAT_S from a background thread: it
                                   keeps going while the main thread waits in a collective (those release
                                   the GIL) and stops when the process is frozen (SIGSTOP, a stalled host)
    {job}/gen{g}/steptime/{rank}   "<step> <seconds>": the compute seconds of the rank's newest step (its own
                                   CPU time on a CPU device, not the time it waited on its peers): what the
                                   controller's straggler rule compares (`control/policy/stragglers.py`)

One key goes the other way: the controller writes `{job}/gen{g}/checkpoint-request` (an id that only grows)
when a checkpoint is asked for (`phalanx job checkpoint`, Slurm's warning before a time limit). Each worker's
reporter reads it in the round trip it makes anyway; the step every rank has seen it in (the flag rides on the
step's loss all-reduce, no collective of its own) ends with a checkpoint.

The controller reads them for the job's step (`job describe`) and the straggler rule. The agent's hang rule
reads the same step and a beat of its own from a file each worker writes on its node (`PHALANX_PROGRESS_FILE`,
set by the agent; "<generation> <step> <beat>"), and tells a frozen worker (no progress, no beat:
the culprit) from one waiting on it (no progress, beat going) without the controller.

Checkpointless jobs (`PHALANX_RECOVERY=checkpointless`) keep their processes across generations, so they
also need to learn of a new generation without being restarted, and to rendezvous on a store that outlives
every worker. The controller publishes, for each generation it starts:

    {job}/gen{g}/layout            JSON {"nodes": [...], "workers_per_node": k, "world_size": n}: a worker
                                   finds its rank from its node and local rank (a survivor keeps its node)
    {job}/generation               the newest generation (ASCII integer), set after its layout
    {job}/gen{g}/pg/...            the generation's process groups rendezvous under this prefix
    {job}/gen{g}/joined            a counter of the ranks that arrived (so nobody blocks in init_process_group
                                   on a rank that will never come; a newer generation interrupts the wait)
    {job}/gen{g}/recovered         JSON written by the new rank 0 once state is restored: source, step,
                                   bytes, seconds — the controller turns it into an event
    {job}/gen{g}/left              a counter of the ranks that left generation g after a failed collective;
                                   when no worker or node fault explains it (a network error broke a
                                   collective, every process is alive), the controller regroups them

Warm standby: an idle node's agent pre-starts `python -m phalanx.worker --standby` per slot (torch
imported, waiting) with a unique PHALANX_STANDBY_ID, and reports the ids in its heartbeats. It watches
`standby/{id}`; when a generation gives that node's slot a rank, the controller writes there the seam env
of that rank (and its log file) at the moment it starts the generation, so the standby starts without
waiting for its agent's next heartbeat; the assignment names the id, and the agent adopts the process. Once
warmed up the standby sets `standby-warm/{id}` (deleted when it is activated): an elastic job grows onto a
node only when its standbys are warm.

Every key above lives under the cluster's namespace, `store_namespace(token)/`: an HMAC of the cluster token
(never the token itself). Both sides open the store through `namespaced()` (controller) or `connect_store()`
(workers), so the names listed here are what the code uses and the namespace is added underneath. A
standby's assignment carries no token and is signed with a key derived from it (`standby_assignment`): a
standby acts only on what the controller wrote. The namespace is no secret from a client that can connect
(TCPStore answers `list_keys`): what keeps strangers out is where the store listens — `serve_store()` binds
one address, never every interface (docs/control-plane.md, "Trust boundary"). Restart-mode generations under
an agent rendezvous the same way: rank 0 serves MASTER_ADDR:MASTER_PORT on that address only, keys namespaced
(`env_rendezvous_store`).

Worker side: `progress_reporter()` returns a `ProgressReporter` when the worker runs under an agent. It
publishes from a background thread (a training step never waits on the store) and outlives a store outage
— a controller restart recreates the store empty on the same port — by reconnecting and re-publishing.

Imports nothing from torch at module level (agents import this module and must start fast); the reporter
and `read_progress` import torch.distributed when used.
"""

# the contract in one flat namespace: `from phalanx import protocol` then `protocol.RANK`, `protocol.rank_of`
from phalanx.protocol.env import (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, JOB_ID,
    GENERATION, STORE_ADDR, CHECKPOINT_DIR, CLUSTER_TOKEN, CONFIG, NODE, STANDBY_ID, RECOVERY, CHECKPOINTLESS,
    TRAIN_WORKER_MODULE, NODE_HANDLE, ACTIVATED_AT, PROGRESS_FILE, EXIT_STUCK, rank_of, WorkerPlacement, worker_env,
    parse_store_addr)
from phalanx.protocol.keys import (generation_prefix, progress_key, alive_key, generation_key, layout_key,
    pg_prefix, joined_key, recovered_key, left_key, finished_key, standby_key, standby_warm_key, publish_generation,
    read_progress, step_time_key, read_step_times, checkpoint_request_key)
from phalanx.protocol.store import (store_namespace, namespaced, listen_socket, serve_store, connect_store,
    env_rendezvous_store, standby_assignment, open_standby_assignment)
from phalanx.protocol.progress import (BEAT_S, EXIT_FLUSH_S, ProgressReporter, progress_reporter, read_local,
    write_local)
from phalanx.protocol.version import (PROTOCOL_VERSION, PROTOCOL_ENV, ProtocolMismatch, check_version)

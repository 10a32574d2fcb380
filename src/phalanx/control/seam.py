"""The seam between a node agent and the workers it starts: every env var and store key, and nothing else.

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
                                                     `python -m phalanx.train.worker` runs
    PHALANX_NODE                                     the node this worker runs on
    PHALANX_RECOVERY                                 restart | checkpointless (the job's recovery mode)

Workers talk back only through keys in the controller's TCPStore, all under the generation's prefix
`{job}/gen{g}/` (the prefix a worker would pass to `PrefixStore`), so a new generation never sees an old
one's keys:

    {job}/gen{g}/progress/{rank}   the last training step rank `rank` finished (before its first step: the
                                   step it starts from, i.e. the resumed one)
    {job}/gen{g}/alive/{rank}      a counter the worker bumps every BEAT_S from a background thread: it
                                   keeps going while the main thread waits in a collective (those release
                                   the GIL) and stops when the process is frozen (SIGSTOP, a stalled host)

The controller reads both and relays them to the agents' hang detectors, which tell a frozen worker (no
progress, no beat: the culprit) from one waiting on it (no progress, beat going); `job describe` shows the
step.

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

Warm standby: an idle node's agent pre-starts `python -m phalanx.train.worker --standby` per slot (torch
imported, waiting) with a unique PHALANX_STANDBY_ID, and reports the ids in its heartbeats. It watches
`standby/{id}`; when a generation gives that node's slot a rank, the controller writes there the seam env
of that rank (and its log file) at the moment it starts the generation, so the standby starts without
waiting for its agent's next heartbeat; the assignment names the id, and the agent adopts the process.

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

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
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
CONFIG = "PHALANX_CONFIG"
NODE = "PHALANX_NODE"
STANDBY_ID = "PHALANX_STANDBY_ID"
RECOVERY = "PHALANX_RECOVERY"
CHECKPOINTLESS = "checkpointless"
TRAIN_WORKER_MODULE = "phalanx.train.worker"  # what a training job's agents run (`python -m`)
BEAT_S = 0.5  # how often a worker's reporter bumps its liveness counter
log = logging.getLogger("phalanx.seam")


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
    if p.config_path is not None:
        env[CONFIG] = p.config_path
    return env


def generation_prefix(job_id: str, generation: int) -> str:
    """Key prefix of one generation of a job; workers build process groups on PrefixStore(this, store)."""
    return f"{job_id}/gen{generation}"


def progress_key(job_id: str, generation: int, rank: int) -> str:
    """Store key holding the last step `rank` finished in this generation (an ASCII integer)."""
    return f"{generation_prefix(job_id, generation)}/progress/{rank}"


def alive_key(job_id: str, generation: int, rank: int) -> str:
    """Store key of the liveness counter rank `rank` bumps every BEAT_S (an ASCII integer)."""
    return f"{generation_prefix(job_id, generation)}/alive/{rank}"


def generation_key(job_id: str) -> str:
    """Store key holding the newest generation of a job (checkpointless jobs watch it)."""
    return f"{job_id}/generation"


def layout_key(job_id: str, generation: int) -> str:
    return f"{generation_prefix(job_id, generation)}/layout"


def pg_prefix(job_id: str, generation: int) -> str:
    """The PrefixStore prefix a checkpointless generation's process groups rendezvous under."""
    return f"{generation_prefix(job_id, generation)}/pg"


def joined_key(job_id: str, generation: int) -> str:
    return f"{generation_prefix(job_id, generation)}/joined"


def recovered_key(job_id: str, generation: int) -> str:
    return f"{generation_prefix(job_id, generation)}/recovered"


def left_key(job_id: str, generation: int) -> str:
    return f"{generation_prefix(job_id, generation)}/left"


def finished_key(job_id: str) -> str:
    """Checkpointless: set by rank 0 once every rank has completed the last step and its final checkpoint —
    an exit after that (however it ends) loses nothing, and the controller ends the job instead of recovering."""
    return f"{job_id}/finished"


def standby_key(standby_id: str) -> str:
    """Where the warm standby worker `standby_id` waits for the env of the rank it must become. Ids are
    unique (node, slot, sequence): a key is only ever read by the process it was written for."""
    return f"standby/{standby_id}"


def publish_generation(store, job_id: str, generation: int, nodes: list[str], workers_per_node: int) -> None:
    """Controller side: the layout first, then the generation number (a watcher that sees the number can
    read the layout)."""
    layout = {"nodes": list(nodes), "workers_per_node": workers_per_node,
              "world_size": len(nodes) * workers_per_node}
    store.set(layout_key(job_id, generation), json.dumps(layout))
    store.set(generation_key(job_id), str(generation))


def _derive(token: str, purpose: str) -> bytes:
    return hmac.new(token.encode(), f"phalanx/{purpose}/v1".encode(), hashlib.sha256).digest()


def store_namespace(token: str) -> str:
    """The prefix every key of a cluster's stores lives under: derived from the cluster token by an HMAC, so
    the token never appears in a store. Not secret from a client that can connect: see the module doc."""
    return "phx-" + _derive(token, "store-namespace").hex()[:32]


def namespaced(store, token: str | None):
    """`store` with every key under the cluster's namespace (no token: `store` itself — torchrun, tests)."""
    import torch.distributed as dist

    return dist.PrefixStore(store_namespace(token), store) if token else store


def serve_store(host: str, port: int, timeout: timedelta | None = None):
    """A TCPStore server listening on `host` only. torch's own (`TCPStore(is_master=True)`, and env://'s
    rank 0) listens on every interface whatever `host` says (checked: torch 2.13, both backends); handing it
    a socket bound here (`master_listen_fd`, which the store then owns) is the only way to choose.
    OSError when `host:port` cannot be bound (port taken, address not on this machine)."""
    import socket

    import torch.distributed as dist

    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    extra = {} if timeout is None else {"timeout": timeout}
    return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                         **extra)


def connect_store(addr: str, token: str | None, timeout: timedelta):
    """Worker side: a client of the controller's store at `addr` ("host:port"), under the cluster's namespace."""
    import torch.distributed as dist

    host, port = parse_store_addr(addr)
    return namespaced(dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout), token)


def env_rendezvous_store(env: Mapping[str, str], timeout: timedelta):
    """The store a restart-mode generation's default process group rendezvouses on, instead of env://'s
    (whose rank 0 listens on every interface): rank 0 serves MASTER_ADDR:MASTER_PORT bound to MASTER_ADDR
    only, the other ranks connect; keys under the cluster's namespace. Applies under a node agent (the
    controller picked MASTER_ADDR, the node's address, and a port free there) and to a loopback MASTER_ADDR
    (`phalanx train`); None otherwise (srun, torchrun: MASTER_ADDR may be a name this host does not bind):
    torch's env:// as usual."""
    import ipaddress

    import torch.distributed as dist

    host = env.get(MASTER_ADDR, "")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not host or not env.get(MASTER_PORT) or not (env.get(JOB_ID) or loopback):
        return None
    port = int(env[MASTER_PORT])
    if int(env.get(RANK, "0")) == 0:
        store = serve_store(host, port, timeout)
    else:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    return namespaced(store, env.get(CLUSTER_TOKEN))


def standby_assignment(token: str, standby_id: str, env: Mapping[str, str], log_path: str) -> str:
    """Controller side: the value of `standby_key(standby_id)` — the rank's env without the cluster token (the
    standby has it from its agent; no store holds it) and its log file, signed for this standby with a key
    derived from the token."""
    body = json.dumps({"env": {k: v for k, v in env.items() if k != CLUSTER_TOKEN}, "log": log_path})
    return json.dumps({"body": body, "mac": _assignment_mac(token, standby_id, body)})


def open_standby_assignment(token: str, standby_id: str, raw: bytes | str) -> dict:
    """Worker side: {"env", "log"} of a `standby_assignment`; ValueError unless the controller of this cluster
    signed it for this standby (anyone who reaches the store can write the key)."""
    try:
        sealed = json.loads(raw)
        body, mac = sealed["body"], sealed["mac"]
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"malformed standby assignment ({err})") from None
    if not isinstance(body, str) or not isinstance(mac, str) or not hmac.compare_digest(
            mac, _assignment_mac(token, standby_id, body)):
        raise ValueError("standby assignment not signed with this cluster's token")
    return json.loads(body)


def _assignment_mac(token: str, standby_id: str, body: str) -> str:
    return hmac.new(_derive(token, "standby-assignment"), f"{standby_key(standby_id)}\n{body}".encode(),
                    hashlib.sha256).hexdigest()


def parse_store_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{STORE_ADDR}={addr!r} is not host:port")
    return host, int(port)


def read_progress(store, job_id: str, generation: int, ranks: list[int]) -> dict[int, dict]:
    """Controller side: rank → {"step": last reported step, "beat": liveness counter} (None before the first
    report). `store`: a TCPStore."""
    out: dict[int, dict] = {}
    for rank in ranks:
        keys = {"step": progress_key(job_id, generation, rank), "beat": alive_key(job_id, generation, rank)}
        # get() would block on a missing key: check first
        out[rank] = {name: int(store.get(key)) if store.check([key]) else None for name, key in keys.items()}
    return out


class ProgressReporter:
    """Worker side: publishes the last finished step, and a liveness beat every `beat_s`.

    `report(step)` only records the number and wakes a daemon thread, which does the store I/O. A failed
    write (the store went away: the controller is restarting) is logged once; the thread reconnects every
    `retry_s` and re-publishes the latest step, while training goes on.
    """

    def __init__(self, store_addr: str, job_id: str, generation: int, rank: int, *, beat_s: float = BEAT_S,
                 retry_s: float = 1.0, timeout_s: float = 2.0, token: str | None = None):
        self.host, self.port = parse_store_addr(store_addr)
        self.store_addr, self.token = store_addr, token  # token: keys under the cluster's namespace
        self.job_id = job_id
        self.step_key = progress_key(job_id, generation, rank)
        self.beat_key = alive_key(job_id, generation, rank)
        self._keys_version = 0
        self.beat_s = beat_s
        self.retry_s = retry_s
        self.timeout = timedelta(seconds=timeout_s)
        self._step: int | None = None
        self._published: int | None = None  # the newest step the store has (for `flush`)
        self._published_version = 0  # the keys `_published` went to (for `switch`)
        self._closed = False
        self._cond = threading.Condition()
        threading.Thread(target=self._publish_loop, name="phalanx-progress", daemon=True).start()

    def close(self) -> None:
        """Stop publishing (a worker process simply exits; this is for long-lived callers and tests)."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most `timeout_s`) until the newest reported step is in the store: a worker calls it before
        it exits, so the controller knows the last step even when the store came back only moments before (a
        restarted controller). True once published."""
        with self._cond:
            return self._cond.wait_for(lambda: self._published == self._step or self._closed, timeout=timeout_s)

    def switch(self, generation: int, rank: int, wait_s: float = 0.0) -> bool:
        """A checkpointless worker moved into a new generation (perhaps as another rank): publish there, the
        step it carries at once and its beat from now on, so that its agent can tell it frozen while it
        regroups. Waits (at most `wait_s`) until the new keys are in the store; True once they are."""
        with self._cond:
            self.step_key = progress_key(self.job_id, generation, rank)
            self.beat_key = alive_key(self.job_id, generation, rank)
            self._keys_version += 1
            version = self._keys_version
            self._cond.notify()
            return self._cond.wait_for(lambda: self._published_version == version or self._closed, timeout=wait_s)

    def report(self, step: int) -> None:
        with self._cond:
            if step != self._step:
                self._step = step
                self._cond.notify()

    def _connect(self):
        return connect_store(self.store_addr, self.token, self.timeout)

    def _publish_loop(self) -> None:
        store, published, failing, beat, next_beat, version = None, None, False, 0, 0.0, 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._step != published or self._closed or self._keys_version != version,
                                    timeout=max(0.0, next_beat - time.monotonic()))
                if self._closed:
                    return
                if self._keys_version != version:  # new keys: publish everything there at once
                    version, published, next_beat = self._keys_version, None, 0.0
                step, step_key, beat_key = self._step, self.step_key, self.beat_key
            try:
                if store is None:
                    store = self._connect()
                if time.monotonic() >= next_beat:
                    beat += 1
                    store.set(beat_key, str(beat))
                    next_beat = time.monotonic() + self.beat_s
                if step != published and step is not None:
                    store.set(step_key, str(step))
                store.check([beat_key])  # a set() into a dead connection may not fail; this round trip does
            except (RuntimeError, OSError) as err:  # torch's DistStoreError/DistNetworkError are RuntimeErrors
                if not failing:
                    log.warning("progress store %s:%d unreachable (%s); training continues, next: reconnecting "
                                "every %g s and re-publishing step %s", self.host, self.port,
                                str(err).splitlines()[0], self.retry_s, step)
                failing, store, next_beat = True, None, 0.0
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, timeout=self.retry_s)
                continue
            if failing:
                log.info("progress store %s:%d reachable again; published step %s", self.host, self.port, step)
            failing, published = False, step
            with self._cond:
                self._published, self._published_version = step, version
                self._cond.notify_all()


def progress_reporter(env: Mapping[str, str] | None = None) -> ProgressReporter | None:
    """The reporter for a worker an agent started (None otherwise: plain `phalanx train`, torchrun)."""
    env = os.environ if env is None else env
    if not env.get(STORE_ADDR) or not env.get(JOB_ID):
        return None
    return ProgressReporter(env[STORE_ADDR], env[JOB_ID], int(env[GENERATION]), int(env[RANK]),
                            token=env.get(CLUSTER_TOKEN))

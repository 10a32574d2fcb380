"""The controller's HTTP API (FastAPI). Every route requires the cluster token (`Authorization: Bearer`);
anything else gets 401.

    GET    /v1/cluster                  describe: status, groups (counts, spares), controller, store address
    GET    /v1/nodes                    every node (terminated ones too): state, health, heartbeat, handle, ...
    GET    /v1/nodes/{name}             one node
    GET    /v1/events?since_id=&node=&limit=
    POST   /v1/join                     an agent on another host (backend hosts) claims a node waiting for one:
                                        the reply names the node and carries its settings and lifecycle script
    POST   /v1/nodes/{name}/heartbeat   agent → controller: phase, lifecycle result, health, its workers
                                        (state, exit code, hang); the reply says run or terminate, lists the
                                        workers to run, hands over injected faults
                                        (heartbeat_route.py: a plain ASGI layer ahead of FastAPI's router)
    POST   /v1/nodes/{name}/faults      {"kind": "kill-node" | "fail-health" | "freeze-node" | "kill-worker"
                                        | "hang-worker", "rank": R (optional, worker faults)}
    POST   /v1/jobs                     submit (kind train: resolved config; kind command: argv) → 201
    GET    /v1/jobs                     every job (like squeue)
    GET    /v1/jobs/{id}                describe: state, reason, generations, workers, events
    POST   /v1/jobs/{id}/cancel         cancel: its workers are stopped
    POST   /v1/jobs/{id}/logs/{rank}    agent → controller: a chunk of a rank's log (`LogChunk`), from a host that
                                        does not see the controller's files (rank_logs.py)
    POST   /v1/controller/stop          stop the controller only (nodes keep running)
    DELETE /v1/cluster                  stop every node, then the controller
    GET    /metrics                     Prometheus text format (server/metrics.py; docs/observability.md)
    GET    /dashboard                   the live web dashboard (dashboard.py): the page needs no token, its
                                        data (/v1/dashboard, /v1/jobs/{id}/dashboard) does

Routes only record observations and requests; the reconciler and the job scheduler decide. Knows nothing
about processes beyond the backend's fault methods.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import signal
from typing import Literal

from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator

from phalanx.control.server.dashboard import PUBLIC_PATHS, add_dashboard_routes
from phalanx.control.server.heartbeat_route import HeartbeatRoute
from phalanx.control.server.job_runs import JobRuns
from phalanx.control.server.metrics import ClusterCollector
from phalanx.control.server.rank_logs import RankLogs
from phalanx.protocol import ProtocolMismatch, check_version
from phalanx.protocol.messages import JoinReply, JoinRequest, LogChunk, LogReceived
from phalanx.control.spec import agent_settings
from phalanx.control.policy.admission import JobRequestError
from phalanx.control.state.describe import describe
from phalanx.control.state.store import ClusterStatus, NodeState, Store
from phalanx.observability.events import EventKind as E

S = NodeState
FAULT_KINDS = ("kill-node", "fail-health", "freeze-node", "kill-worker", "hang-worker")


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["kill-node", "fail-health", "freeze-node", "kill-worker", "hang-worker", "gpu-xid"]
    rank: int | None = None  # worker faults: which rank on the node (default: its lowest running rank)
    xid: int | None = Field(None, ge=1, description="gpu-xid: the XID the node's GPU check reports")

    @model_validator(mode="after")
    def _xid_for_gpu_xid(self) -> "FaultRequest":
        if (self.kind == "gpu-xid") != (self.xid is not None):
            raise ValueError("xid is required with kind gpu-xid (e.g. 13: restart the job, 79: replace the node) "
                             "and only with it")
        return self


class JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["train", "command"]
    nodes: int = Field(..., ge=1)
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
    group: str | None = None
    argv: list[str] | None = None
    config: dict | None = None
    checkpoint_dir: str | None = None
    cwd: str
    env: dict[str, str] = {}
    auto_resume: bool = False
    max_retries: int = Field(0, ge=0)
    recovery: Literal["restart", "checkpointless"] = "restart"
    straggler_factor: float = Field(2.0, gt=1, description="a rank slower than this × its peers' median …")
    straggler_steps: int = Field(5, ge=1, description="… for this many reports in a row is a straggler")
    straggler_policy: Literal["report", "replace-node"] = "report"
    priority: int = Field(0, description="a pending job takes nodes from running elastic jobs of lower priority")


class ScaleJobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: int = Field(..., ge=1)


class ScaleGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: int = Field(..., ge=0)


class RequireToken:
    """Before routing and validation: without the token, every path (even an unknown one) is a 401 — but the
    dashboard's page and assets (`dashboard.PUBLIC_PATHS`: no data in them, only a sign-in). A plain ASGI
    middleware: Starlette's `BaseHTTPMiddleware` (`@app.middleware("http")`) costs ~0.5 ms of CPU per request,
    more than a heartbeat's own handling (benchmarks/control_scale.py)."""

    def __init__(self, app, token: bytes):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not (scope["method"] == "GET" and scope["path"] in PUBLIC_PATHS):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, value = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(value.strip(), self.token):
                response = JSONResponse({"detail": "missing or wrong cluster token (Authorization: Bearer <token>)"},
                                        status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(ctl):
    """The controller's ASGI app. `ctl`: the running controller (store, backend, token, request_exit, jobs, runs)."""
    store: Store = ctl.store
    token = ctl.token.encode()

    app = FastAPI(title="phalanx controller", docs_url=None, redoc_url=None, openapi_url=None)


    registry = CollectorRegistry(auto_describe=False)
    runs = getattr(ctl, "runs", None) or JobRuns()  # one follower of each job's run files: /metrics and the dashboard
    collector = ClusterCollector(store, runs, ctl.jobs.records if ctl.jobs is not None else None,
                                 getattr(ctl, "links", None), render_ages=True)
    registry.register(collector)

    def node_or_404(name: str):
        node = store.node(name)
        if node is None:
            raise HTTPException(404, f"no node named {name!r}")
        return node

    @app.get("/v1/cluster")
    def get_cluster() -> dict:
        return describe(store)

    @app.get("/v1/nodes")
    def get_nodes() -> list[dict]:
        return [n.public() for n in store.nodes()]

    @app.get("/v1/nodes/{name}")
    def get_node(name: str) -> dict:
        return node_or_404(name).public()

    @app.get("/v1/events")
    def get_events(since_id: int = 0, node: str | None = None, limit: int | None = None) -> list[dict]:
        return store.events(since_id=since_id, node=node, limit=limit)

    @app.post("/v1/join")
    def join(req: JoinRequest) -> dict:
        try:
            check_version(req.protocol, f"the agent joining from {req.hostname}")
        except ProtocolMismatch as err:
            raise HTTPException(409, str(err)) from None
        spec = ctl.spec
        groups = [g.name for g in spec.instance_groups]
        if req.group not in groups:
            raise HTTPException(404, f"no instance group {req.group!r} in cluster {spec.name}; groups: "
                                     f"{', '.join(groups)} (--group)")
        status = store.cluster()["status"]
        if status in (ClusterStatus.DELETING.value, ClusterStatus.DELETED.value, ClusterStatus.FAILED.value):
            raise HTTPException(409, f"cluster {spec.name} is {status}; nothing to join")
        node = store.claim_node(req.group, req.handle, req.work_root, req.name)
        if node is None and status == ClusterStatus.CREATING.value and not req.name:
            # agents started with the cluster (an srun on every host) may come before their rows are provisioned
            raise HTTPException(503, f"cluster {spec.name} is being created and has no node of group {req.group} "
                                     f"waiting yet; retry in a moment")
        if node is None:
            which = f"node {req.name!r} of group {req.group}" if req.name else f"no node of group {req.group}"
            why = ("the local backend starts its own agents (backends hosts and slurm take joining agents)"
                   if spec.backend == "local" else
                   "every member and spare has its agent; a node waits for one when the group grows or a "
                   "faulty node is replaced")
            raise HTTPException(409, f"{which} waits for an agent: {why}")
        what = f"agent {req.handle} on {req.hostname} ({req.address}) joined as node {node.name}"
        store.record_event(E.JOINED, what, node=node.name)
        ctl.log.info(what)
        g = spec.group(req.group)
        script = g.on_create
        return JoinReply(node=node.name, cluster=spec.name, config=agent_settings(spec, req.group),
                         store_addr=ctl.store_addr, on_create=script.read_text() if script else None,
                         on_create_name=script.name if script else None).model_dump()

    @app.post("/v1/nodes/{name}/faults", status_code=202)
    def inject_fault(name: str, req: FaultRequest) -> dict:
        node = node_or_404(name)
        if not node.live:
            raise HTTPException(409, f"node {name} is {node.state.value}; faults go to live nodes only")
        at = store.clock()  # its event's time: before the signal (the fault it causes may be recorded first)
        if getattr(ctl.backend, "faults_through_agent", False) and req.kind in (
                "kill-node", "freeze-node", "kill-worker", "hang-worker"):
            what = _fault_through_agent(node, req)
        elif req.kind in ("kill-worker", "hang-worker"):
            what = _signal_worker(node, req)
        elif req.kind == "fail-health":
            store.add_directive(name, "fail-health")
            what = "the agent reports a failing health check after its next heartbeat"
        elif req.kind == "gpu-xid":
            store.add_directive(name, f"xid:{req.xid}")
            what = f"the agent's GPU check reports XID {req.xid} after its next heartbeat"
        elif req.kind == "kill-node":
            pids = ctl.backend.kill(node)
            what = f"SIGKILL sent to the node's processes {pids}"
        else:
            ctl.backend.freeze(node)
            what = f"SIGSTOP sent to the agent ({node.handle}): it stays alive but stops heartbeating"
        reason = f"fault injected by operator: {req.kind}; {what}"
        store.record_event(E.FAULT_INJECTED, reason, node=name, at=at)
        ctl.log.warning("node %s: %s", name, reason)
        return {"node": name, "kind": req.kind, "detail": what}

    def _running_worker(node, req: FaultRequest):
        running = [w for w in ctl.jobs.records.workers(node=node.name) if w.state == "running" and w.pid]
        if req.rank is not None:
            running = [w for w in running if w.rank == req.rank]
        if not running:
            which = f" of rank {req.rank}" if req.rank is not None else ""
            raise HTTPException(409, f"node {node.name} runs no job worker{which}; {req.kind} needs a running job")
        return running[0]

    def _fault_through_agent(node, req: FaultRequest) -> str:
        """A node on another host: its agent acts on its next heartbeat reply."""
        if req.kind in ("kill-node", "freeze-node"):
            store.add_directive(node.name, req.kind)
            return ("the agent SIGKILLs its workers and itself on its next heartbeat" if req.kind == "kill-node"
                    else "the agent SIGSTOPs itself on its next heartbeat: alive but silent")
        w = _running_worker(node, req)
        sig = signal.SIGKILL if req.kind == "kill-worker" else signal.SIGSTOP
        store.add_directive(node.name, f"signal:{w.pid}:{int(sig)}")
        return f"the agent sends {sig.name} to worker rank {w.rank} of job {w.job} (pid {w.pid}) on its next heartbeat"

    def _signal_worker(node, req: FaultRequest) -> str:
        w = _running_worker(node, req)
        sig = signal.SIGKILL if req.kind == "kill-worker" else signal.SIGSTOP
        try:
            ctl.backend.signal_worker(node, w.pid, sig)
        except ProcessLookupError as err:
            raise HTTPException(409, str(err)) from None
        if req.kind == "kill-worker":
            return f"SIGKILL sent to worker rank {w.rank} of job {w.job} (pid {w.pid}): its agent reports the exit"
        return (f"SIGSTOP sent to worker rank {w.rank} of job {w.job} (pid {w.pid}): it makes no more progress; "
                f"the agent's hang detector (hang_timeout_s={ctl.spec.health.hang_timeout_s:g}) takes it from there")

    @app.post("/v1/jobs", status_code=201)
    def submit_job(req: JobRequest) -> dict:
        try:
            return ctl.jobs.submit(**req.model_dump()).public()
        except JobRequestError as err:
            raise HTTPException(err.status, str(err)) from None

    @app.get("/v1/jobs")
    def list_jobs() -> list[dict]:
        return [j.public() for j in ctl.jobs.records.jobs()]

    @app.get("/v1/jobs/{key}")
    def describe_job(key: str, brief: bool = False) -> dict:
        """`?brief=true`: without the workers and events (`JobRecords.describe`), for a poll of the state."""
        try:
            info = ctl.jobs.describe(key, brief=brief)
            job = ctl.jobs.find(key)
        except JobRequestError as err:
            raise HTTPException(err.status, str(err)) from None
        follower = runs.follower(job) if job.kind == "train" else None
        info["last_checkpoint"] = follower.last_checkpoint if follower else None
        info["requested_checkpoint"] = follower.requested_checkpoint if follower else None  # `job checkpoint`'s
        return info

    @app.post("/v1/jobs/{key}/checkpoint", status_code=202)
    def checkpoint_job(key: str) -> dict:
        try:
            return ctl.jobs.request_checkpoint(key)
        except JobRequestError as err:
            raise HTTPException(err.status, str(err)) from None

    @app.post("/v1/jobs/{key}/cancel", status_code=202)
    def cancel_job(key: str) -> dict:
        try:
            return ctl.jobs.cancel(key).public()
        except JobRequestError as err:
            raise HTTPException(err.status, str(err)) from None

    rank_logs = RankLogs()

    @app.post("/v1/jobs/{key}/logs/{rank}")
    def ship_log(key: str, rank: int, chunk: LogChunk) -> dict:
        try:
            job = ctl.jobs.find(key)
        except JobRequestError as err:
            raise HTTPException(err.status, str(err)) from None
        if not 0 <= rank < job.world_size:
            raise HTTPException(422, f"rank: job {job.id} has ranks 0-{job.world_size - 1}, not {rank}")
        node_or_404(chunk.node)
        try:
            data = base64.b64decode(chunk.data, validate=True)
        except binascii.Error as err:
            raise HTTPException(422, f"data: not base64 ({err})") from None
        try:
            held = rank_logs.append(job.job_dir, job.id, rank, chunk.node, chunk.offset, data)
        except OSError as err:
            raise HTTPException(507, f"cannot write job {job.id}'s logs in {job.job_dir}: {err}") from None
        return LogReceived(received=held).model_dump()

    @app.post("/v1/jobs/{key}/scale", status_code=202)
    def scale_job(key: str, req: ScaleJobRequest) -> dict:
        try:
            return ctl.jobs.scale(key, req.replicas).public()
        except JobRequestError as err:
            raise HTTPException(err.status, str(err)) from None

    @app.post("/v1/groups/{name}/scale", status_code=202)
    def scale_group(name: str, req: ScaleGroupRequest) -> dict:
        groups = {g["name"]: g for g in store.groups()}
        if name not in groups:
            raise HTTPException(404, f"no instance group {name!r}; groups: {', '.join(groups)}")
        before = groups[name]["count"]
        store.update_group(name, count=req.count)
        what = f"group {name} scaled from {before} to {req.count} members by the operator"
        store.record_event(E.CLUSTER, what)
        ctl.log.info(what)
        return {"group": name, "count": req.count, "before": before,
                "detail": "new members are provisioned" if req.count > before else
                          "idle members beyond the count are retired; members running a job stay until it ends"
                          if req.count < before else "unchanged"}

    @app.post("/v1/controller/stop", status_code=202)
    def stop_controller() -> dict:
        ctl.request_exit(None)
        return {"detail": "controller stopping; nodes keep running (`phalanx cluster start` brings it back)"}

    @app.delete("/v1/cluster", status_code=202)
    def delete_cluster() -> dict:
        store.set_status(ClusterStatus.DELETING, "cluster delete requested")
        ctl.request_exit("cluster deleted")
        return {"detail": "deleting: stopping every node, then the controller"}

    add_dashboard_routes(app, store, ctl.jobs.records, runs)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry) + collector.heartbeat_ages(), media_type="text/plain; version=0.0.4")

    # The token first, then heartbeats (POST /v1/nodes/{name}/heartbeat, `heartbeat_route.py`) answered before
    # FastAPI and its middleware stack; everything else on to FastAPI.
    return RequireToken(HeartbeatRoute(app, ctl), token)

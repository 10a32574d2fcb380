"""The controller's HTTP API (FastAPI). Every route requires the cluster token (`Authorization: Bearer`);
anything else gets 401.

    GET    /v1/cluster                  describe: status, groups (counts, spares), controller, store address
    GET    /v1/nodes                    every node (terminated ones too): state, health, heartbeat, pid, ...
    GET    /v1/nodes/{name}             one node
    GET    /v1/events?since_id=&node=&limit=
    POST   /v1/nodes/{name}/heartbeat   agent → controller: phase, lifecycle result, health; the reply says
                                        run or terminate, and hands over injected faults
    POST   /v1/nodes/{name}/faults      {"kind": "kill-node" | "fail-health" | "freeze-node"}
    POST   /v1/controller/stop          stop the controller only (nodes keep running)
    DELETE /v1/cluster                  stop every node, then the controller
    GET    /metrics                     Prometheus text format

Routes only record observations and requests; the reconciler decides. Knows nothing about processes
beyond the backend's fault methods.
"""

from __future__ import annotations

import hmac
import time
from typing import Literal

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict

from phalanx.control.store import ClusterStatus, NodeState, Store

S = NodeState
FAULT_KINDS = ("kill-node", "fail-health", "freeze-node")
LATER_FAULT_KINDS = ("kill-worker", "hang-worker")


class Heartbeat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pid: int
    phase: str
    lifecycle: dict | None = None
    health: dict | None = None
    sent_at: float


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["kill-node", "fail-health", "freeze-node", "kill-worker", "hang-worker"]


class _StoreCollector:
    """Prometheus metrics computed from SQLite at scrape time (nothing to keep in sync)."""

    def __init__(self, store: Store):
        self.store = store

    def collect(self):
        nodes = self.store.nodes()
        by_state = GaugeMetricFamily("phalanx_nodes", "Nodes by group, state and role",
                                     labels=["group", "state", "role"])
        counts: dict[tuple, int] = {}
        for n in nodes:
            key = (n.group, n.state.value, "spare" if n.is_spare else "member")
            counts[key] = counts.get(key, 0) + 1
        for key, v in sorted(counts.items()):
            by_state.add_metric(list(key), v)
        yield by_state
        age = GaugeMetricFamily("phalanx_node_heartbeat_age_seconds", "Seconds since the last heartbeat",
                                labels=["node"])
        now = time.time()
        for n in nodes:
            if n.live and n.last_heartbeat:
                age.add_metric([n.name], now - n.last_heartbeat)
        yield age
        events = self.store.events()
        faults = CounterMetricFamily("phalanx_node_faults", "Node transitions to faulty")
        faults.add_metric([], sum(e["to_state"] == S.FAULTY.value for e in events))
        yield faults
        promoted = CounterMetricFamily("phalanx_spares_promoted", "Spares promoted to replace a faulty member")
        promoted.add_metric([], sum(e["kind"] == "promoted" for e in events))
        yield promoted


def build_app(ctl) -> FastAPI:
    """`ctl`: the running controller (store, backend, token, request_exit)."""
    store: Store = ctl.store
    token = ctl.token.encode()

    app = FastAPI(title="phalanx controller", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def require_token(request: Request, call_next):
        """Before routing and validation: without the token, every path (even an unknown one) is a 401."""
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token):
            return JSONResponse({"detail": "missing or wrong cluster token (Authorization: Bearer <token>)"},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StoreCollector(store))

    def node_or_404(name: str):
        node = store.node(name)
        if node is None:
            raise HTTPException(404, f"no node named {name!r}")
        return node

    @app.get("/v1/cluster")
    def get_cluster() -> dict:
        return store.describe()

    @app.get("/v1/nodes")
    def get_nodes() -> list[dict]:
        return [n.public() for n in store.nodes()]

    @app.get("/v1/nodes/{name}")
    def get_node(name: str) -> dict:
        return node_or_404(name).public()

    @app.get("/v1/events")
    def get_events(since_id: int = 0, node: str | None = None, limit: int | None = None) -> list[dict]:
        return store.events(since_id=since_id, node=node, limit=limit)

    @app.post("/v1/nodes/{name}/heartbeat")
    def heartbeat(name: str, hb: Heartbeat) -> dict:
        node = node_or_404(name)
        if node.state == S.TERMINATED:
            raise HTTPException(410, f"node {name} is terminated ({node.reason})")
        if node.pid is not None and hb.pid != node.pid:
            raise HTTPException(410, f"node {name} is run by agent pid {node.pid}, not {hb.pid}")
        store.update_node(name, last_heartbeat=time.time(), pid=hb.pid, health=hb.health,
                          report={"phase": hb.phase, "lifecycle": hb.lifecycle})
        status = store.cluster()["status"]
        if node.state == S.REPLACING:
            return {"action": "terminate", "reason": node.reason, "faults": []}
        if status in (ClusterStatus.DELETING.value, ClusterStatus.FAILED.value, ClusterStatus.DELETED.value):
            return {"action": "terminate", "reason": f"cluster is {status}", "faults": []}
        return {"action": "run", "state": node.state.value, "faults": store.take_directives(name)}

    @app.post("/v1/nodes/{name}/faults", status_code=202)
    def inject_fault(name: str, req: FaultRequest) -> dict:
        node = node_or_404(name)
        if req.kind in LATER_FAULT_KINDS:
            raise HTTPException(422, f"fault {req.kind!r} needs a running job; it arrives with jobs (next milestone)")
        if not node.live:
            raise HTTPException(409, f"node {name} is {node.state.value}; faults go to live nodes only")
        if req.kind == "fail-health":
            store.add_directive(name, "fail-health")
            what = "the agent reports a failing health check after its next heartbeat"
        elif req.kind == "kill-node":
            pids = ctl.backend.kill(node)
            what = f"SIGKILL sent to the node's processes {pids}"
        else:
            ctl.backend.freeze(node)
            what = f"SIGSTOP sent to agent pid {node.pid}: it stays alive but stops heartbeating"
        reason = f"fault injected by operator: {req.kind}; {what}"
        store.record_event("fault-injected", reason, node=name)
        ctl.log.warning("node %s: %s", name, reason)
        return {"node": name, "kind": req.kind, "detail": what}

    @app.post("/v1/controller/stop", status_code=202)
    def stop_controller() -> dict:
        ctl.request_exit(None)
        return {"detail": "controller stopping; nodes keep running (`phalanx cluster start` brings it back)"}

    @app.delete("/v1/cluster", status_code=202)
    def delete_cluster() -> dict:
        store.set_status(ClusterStatus.DELETING, "cluster delete requested")
        ctl.request_exit("cluster deleted")
        return {"detail": "deleting: stopping every node, then the controller"}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return app

"""The controller's live web dashboard: the page and its assets, and the two JSON routes it polls.

    GET /dashboard                 the page (static/dashboard.html); no token: it holds no data, only a sign-in
    GET /dashboard/<asset>         its script and style sheet (static/), shipped in the package: no CDN
    GET /v1/dashboard              token: the cluster (status), the node grid (state, health, role, group,
                                   heartbeat age), the jobs (state, step, generation, goodput ratio)
    GET /v1/jobs/{id}/dashboard    token: one job's loss and tokens/s series, goodput seconds by category, and
                                   its timeline (generations, and each recovery's fault, detect, regroup,
                                   restore and first step with their durations)

The page signs in with the cluster token and polls these routes every second (static/dashboard.js); the
charts are SVG drawn by that script. The token check is api.py's middleware; only `PUBLIC_PATHS` pass it.

Must not know: how nodes are started, what a worker does; reads the store, the job records and the
followers of the jobs' run files (`job_runs.JobRuns`).
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import Response

from phalanx.control.server.job_runs import JobRuns
from phalanx.control.state.jobs import Generation, Job, JobRecords
from phalanx.control.state.store import Node, Store
from phalanx.observability.events import Event, EventKind as K

STATIC = Path(__file__).parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
PUBLIC_PATHS = frozenset({"/dashboard", *(f"/dashboard/{name}" for name in ASSETS)})  # GET, without the token
PHASES = ("detect", "regroup", "restore", "first_step")
FAULTLESS = (None, "succeeded", "cancelled")  # generation outcomes no recovery follows
RECENT_EVENTS = 40  # the job's newest events shown under its timeline


def add_dashboard_routes(app: FastAPI, store: Store, records: JobRecords, job_runs: JobRuns) -> None:
    def asset(name: str, media_type: str) -> Response:
        return Response((STATIC / name).read_bytes(), media_type=media_type, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard")
    def dashboard_page() -> Response:
        return asset("dashboard.html", "text/html; charset=utf-8")

    @app.get("/dashboard/{name}")
    def dashboard_asset(name: str) -> Response:
        if name not in ASSETS:
            raise HTTPException(404, f"no dashboard asset {name!r}")
        return asset(name, ASSETS[name] + "; charset=utf-8")

    @app.get("/v1/dashboard")
    def dashboard_overview() -> dict:
        now = time.time()
        jobs = records.jobs()
        followed = dict((j.id, f) for j, f in job_runs.followers(jobs))
        straggling = {e.node for j in jobs if j.ended_at is None and j.id in followed
                      for e in followed[j.id].stragglers() if e.fields.get("generation") == j.generation}
        cluster = store.cluster()
        return {
            "cluster": {"name": cluster["name"], "status": cluster["status"], "reason": cluster["status_reason"]},
            "now": now,
            "nodes": [node_view(n, now, n.name in straggling) for n in store.nodes()],
            "jobs": [job_summary(j, followed.get(j.id)) for j in jobs],
        }

    @app.get("/v1/jobs/{key}/dashboard")
    def job_dashboard(key: str) -> dict:
        job = records.find(key)
        if job is None:
            raise HTTPException(404, f"no job with id or name {key!r}")
        follower = job_runs.follower(job)
        derived = follower.derived()
        ledger = derived.ledger
        gens = records.generations(job.id)
        step, t, loss, tps = (list(c) for c in zip(*follower.series)) if follower.series else ([], [], [], [])
        return {
            "job": job_summary(job, follower),
            "now": time.time(),
            "series": {"step": step, "time": t, "loss": loss, "tokens_per_s": tps},
            "goodput": ledger.to_dict() if ledger else None,
            "timeline": timeline(job, gens, follower.events, follower.steps, derived.recoveries),
            "events": [e.to_dict() for e in follower.events[-RECENT_EVENTS:]],
        }


def node_view(n: Node, now: float, straggler: bool = False) -> dict:
    """One tile of the node grid; `straggler`: a rank on it is flagged in its job's current generation."""
    failed = [c.get("name") for c in (n.health or {}).get("checks", []) if c.get("status") == "fail"]
    return {
        "name": n.name, "group": n.group, "state": n.state.value, "role": "spare" if n.is_spare else "member",
        "health": None if not n.health or not n.live else ("fail: " + ", ".join(map(str, failed)) if failed else "ok"),
        "heartbeat_age_s": None if n.last_heartbeat is None else max(0.0, now - n.last_heartbeat),
        "job": n.job, "reason": n.reason, "since": n.state_since, "live": n.live, "straggler": straggler,
    }


def job_summary(job: Job, follower) -> dict:
    """A row of the jobs table: the record's state and step, the goodput ratio and the newest step's figures."""
    ledger = follower.derived().ledger if follower is not None else None
    last = (follower.last if follower is not None else None) or {}
    return {
        "id": job.id, "name": job.name, "state": job.state.value, "kind": job.kind, "recovery": job.recovery,
        "nodes": job.nodes, "world_size": job.world_size, "generation": job.generation,
        "step": job.last_step, "node_faults": job.node_faults, "retries": job.retries,
        "created_at": job.created_at, "ended_at": job.ended_at, "reason": job.reason,
        "goodput": round(ledger.goodput, 6) if ledger else None, "loss": last.get("loss"),
        "tokens_per_s": last.get("tokens_per_s"),
        "stragglers": len(follower.stragglers()) if follower is not None else 0,
    }


def timeline(job: Job, gens: list[Generation], events: list[Event], steps: list[dict],
             recoveries: list[dict]) -> dict:
    """The job's generations (start, end, outcome) and, for each generation a fault ended, the recovery: the
    fault's moment, then detect, regroup, restore and first step as intervals with their durations.

    Durations are the follower's (`observability.follow.recovery_phases`; recomputed every few seconds, so a
    phase appears shortly after it ends). Where each interval sits: detect ends when the controller first knew
    (a `recovery`/`hang` event, the job to `recovering`, else the generation's stop), the fault is its start;
    regroup starts at the fault (checkpointless: measured from it) or when the controller knew (restart);
    restore ends at rank 0's `state_restored`/`resumed`; first step is the new generation's first step record."""
    end = job.ended_at or time.time()
    out_gens = [{"generation": g.generation, "start": g.started_at, "end": g.ended_at, "stop_at": g.stop_at,
                 "outcome": g.outcome, "reason": _first_line(g.end_reason), "nodes": g.nodes,
                 "first_step_at": g.first_step_at} for g in gens]
    entries = []
    for i, g in enumerate(gens):
        nxt = gens[i + 1] if i + 1 < len(gens) else None
        until = nxt.started_at if nxt else end
        word = next((e.time for e in events if e.source == "controller" and g.started_at <= e.time <= until
                     and (e.kind in (K.RECOVERY, K.HANG) or e.kind == K.JOB
                          and e.fields.get("to_state") in ("recovering", "failed"))), None)
        if nxt is None and g.outcome in FAULTLESS and word is None:
            continue  # running (no fault known yet), or ended without a fault
        knew = word or g.stop_at or g.ended_at or until
        phases = recoveries[i] if i < len(recoveries) else {}
        fault_at = knew - phases["detect"] if "detect" in phases else knew
        rec = {"generation": nxt.generation if nxt else None, "after": g.generation}
        entries.append({**rec, "kind": "fault", "start": fault_at, "seconds": 0.0,
                        "detail": _first_line(g.end_reason) or g.outcome or "fault"})
        if "detect" in phases:
            entries.append({**rec, "kind": "detect", "start": fault_at, "seconds": phases["detect"],
                            "detail": "the fault → the controller knew"})
        if nxt is None:
            continue
        later = gens[i + 2].started_at if i + 2 < len(gens) else float("inf")
        rank0 = [e for e in events if e.source.startswith("rank:") and nxt.started_at <= e.time < later]
        loaded = next((e for e in rank0 if e.kind in (K.STATE_RESTORED, K.RESUMED)), None)
        cursor = knew
        if "regroup" in phases:
            start = fault_at if job.recovery == "checkpointless" else knew
            entries.append({**rec, "kind": "regroup", "start": start, "seconds": phases["regroup"],
                            "detail": "new process groups" if job.recovery == "checkpointless"
                            else "stop, relaunch, build"})
            cursor = start + phases["regroup"]
        if "restore" in phases:
            start = loaded.time - phases["restore"] if loaded else cursor
            source = (loaded.fields.get("source") if loaded and loaded.kind == K.STATE_RESTORED else "checkpoint")
            entries.append({**rec, "kind": "restore", "start": start, "seconds": phases["restore"],
                            "detail": f"from {source or 'peers'}"
                                      + (f", step {loaded.fields['step']}" if loaded and "step" in loaded.fields else "")})
        if "first_step" in phases:
            first = next((s for s in steps if nxt.started_at < s["time"] < later), None)
            start = first["time"] - first["step_time_s"] if first else cursor
            entries.append({**rec, "kind": "first_step", "start": start, "seconds": phases["first_step"],
                            "detail": f"step {first['step']}" if first else "first step"})
    marks = [{"kind": "straggler", "start": e.time, "seconds": 0.0, "generation": e.fields.get("generation"),
              "detail": _first_line(e.message)} for e in events if e.source == "controller" and e.kind == K.STRAGGLER]
    return {"start": job.created_at, "end": end, "generations": out_gens, "entries": entries, "marks": marks}


def _first_line(text: str | None) -> str | None:
    return text.partition("\n")[0][:200] if text else None

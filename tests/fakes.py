"""Fakes that let the control plane's policy run without processes, sockets or sleeps (tests/test_policy.py).

    FakeClock     the one clock the store, the reconciler and the scheduler read; it moves only when told
    FakeStore     the controller's rendezvous store (a TCPStore's set/get/add/check) in a dict
    FakeBackend   `backends.base.Backend` in memory: `launch` hands out increasing handles, `gone` is None until
                  the node is ended (by the test, `terminate` or `kill`), every call is recorded
    FakeAgent     one node's agent as the controller sees it: it registers, runs its lifecycle script and its
                  health checks (one bring-up phase per heartbeat), reports its workers, and acts on each
                  heartbeat reply the way `agent/node_agent.py` and `agent/supervisor.py` do (start, stop,
                  carry, adopt workers; keep warm standbys; take injected faults; run deep-check rounds)
    FakeCluster   the controller's policy — `Store` (real SQLite in a tmp dir), `JobScheduler`, `Reconciler`,
                  `DeepCheckCoordinator`, wired as `server/daemon.py` wires them — over those fakes. `step()` is
                  one heartbeat interval: every live agent heartbeats, handled the way `server/api.py`'s
                  heartbeat route handles it, then `Reconciler.tick()` runs, then the clock moves on.
                  `inject_fault` does what the API's fault route does.

Time: the store stamps rows and events with the same fake clock the policy decides by, so a timeout is
reached by `clock.advance(...)` (or by steps), never by waiting.
"""

from __future__ import annotations

import itertools
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from phalanx import protocol
from phalanx.control.agent import health as H
from phalanx.control.agent.worker import describe_exit
from phalanx.control.policy.deep_check import DeepCheckCoordinator
from phalanx.control.policy.reconciler import Reconciler
from phalanx.control.policy.scheduler import JobScheduler
from phalanx.control.spec import spec_from_dict
from phalanx.control.state.paths import ClusterPaths
from phalanx.control.server.heartbeat import answer_heartbeat
from phalanx.control.state.store import Node, NodeState, Store
from phalanx.observability.events import EventKind as E
from phalanx.protocol.messages import Heartbeat

S = NodeState


# ---- time and the rendezvous store ------------------------------------------------------------------------
class FakeClock:
    """Starts at the real time (so stamps read as plausible dates) and moves only when told."""

    def __init__(self, start: float | None = None):
        self.t = time.time() if start is None else start

    def __call__(self) -> float:
        return self.t

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        assert seconds >= 0, "time only moves forward"
        self.t += seconds
        return self.t


class FakeStore:
    """The controller's TCPStore, as the scheduler uses it (values are bytes, as torch returns them)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        if key not in self.data:
            raise RuntimeError(f"key {key!r} is not set (a TCPStore get would time out)")
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]


# ---- the backend ----------------------------------------------------------------------------------------------
class FakeBackend:
    """Every method of `Backend`, in memory. A node's agent "runs" from `launch` until `end` (the test), a
    `terminate` (obeyed at once, like an agent that stops on SIGTERM, unless its name is in `stubborn`) or a
    `kill`. `calls` records (method, node name) in order; `signals` the worker signals sent."""

    def __init__(self, root: Path, on_signal: Callable[[str, int, signal.Signals], None] | None = None):
        self.root = Path(root)
        self.on_signal = on_signal  # delivers a worker signal to the node's (fake) agent
        self.calls: list[tuple[str, str]] = []
        self.signals: list[tuple[str, int, signal.Signals]] = []
        self.handles: dict[str, int] = {}  # node name → handle, for every node ever launched
        self.running: set[str] = set()
        self.ended: dict[str, str] = {}  # node name → how its agent ended
        self.frozen: set[str] = set()
        self.stubborn: set[str] = set()  # agents that ignore SIGTERM (only a kill ends them)
        self.launch_error: str | None = None  # launch raises OSError with this while set
        self.taken_by: dict[str, str] = {}  # node name → why its scheduler took it (what `taken` says)
        self.remediated: list[tuple[str, str]] = []  # (node name, fault cause) handed back to the scheduler
        self.polls = True  # `polled`: as the local backend. False: as hosts, whose `gone` knows only the agents
        self.told: set[str] = set()  # it told to terminate (an agent's end is otherwise heard only as silence)
        self._handles = itertools.count(1000)
        self._ports = itertools.count(29500)

    # (test side)
    def end(self, name: str, how: str) -> None:
        """The node's agent is gone, `how` being what `gone` says."""
        self.running.discard(name)
        self.frozen.discard(name)
        self.ended[name] = how

    def launched(self) -> list[str]:
        return [name for method, name in self.calls if method == "launch"]

    # (Backend)
    def launch(self, node: Node) -> int:
        self.calls.append(("launch", node.name))
        if self.launch_error is not None:
            raise OSError(self.launch_error)
        handle = str(next(self._handles))  # opaque to policy, like every backend's
        self.handles[node.name] = handle
        self.running.add(node.name)
        return handle

    def gone(self, node: Node) -> str | None:
        if node.name in self.running or not (self.polls or node.name in self.told):
            return None
        return self.ended.get(node.name, f"agent process {node.handle} is no longer running")

    def terminate(self, node: Node) -> None:
        self.calls.append(("terminate", node.name))
        self.told.add(node.name)
        if node.name in self.running and node.name not in self.stubborn:
            self.end(node.name, f"agent process {node.handle} {describe_exit(0)}")

    def kill(self, node: Node) -> list[int]:
        self.calls.append(("kill", node.name))
        if node.name not in self.running:
            return []
        self.end(node.name, f"agent process {node.handle} {describe_exit(-signal.SIGKILL)}")
        return [int(self.handles[node.name])]

    def freeze(self, node: Node) -> None:
        self.calls.append(("freeze", node.name))
        if node.name not in self.running:
            raise ProcessLookupError(f"node {node.name}: agent process {node.handle} is not running")
        self.frozen.add(node.name)

    def signal_worker(self, node: Node, pid: int, sig: signal.Signals) -> None:
        self.calls.append(("signal_worker", node.name))
        if node.name not in self.running:
            raise ProcessLookupError(f"process {pid} is not a running worker of node {node.name}")
        self.signals.append((node.name, pid, sig))
        if self.on_signal is not None:
            self.on_signal(node.name, pid, sig)

    def forget(self, node: Node) -> None:
        self.calls.append(("forget", node.name))

    def node_host(self, node: Node) -> str:
        return f"{node.name}.fake"

    def free_port(self, node: Node) -> int:
        return next(self._ports)

    def work_root(self) -> Path:
        return self.root / "nodes"

    def worker_env(self, node: Node | None = None) -> dict[str, str]:
        return {}

    def teardown(self, nodes: list[Node], grace_s: float) -> int:
        running = [n for n in nodes if n.name in self.running]
        for n in running:
            self.terminate(n)
            self.kill(n)
        return len(running)

    def flush(self) -> list[tuple[Node, str]]:
        return []

    def polled(self) -> bool:
        return self.polls

    def taken(self, node: Node) -> str | None:
        return self.taken_by.get(node.name)

    def remediate(self, node: Node, reason: str, cause: str) -> None:
        self.calls.append(("remediate", node.name))
        self.remediated.append((node.name, cause))

    def sweep(self, nodes: list[Node]) -> list[int]:
        return []

    def start(self) -> None:
        self.calls.append(("start", None))

    def close(self) -> None:
        self.calls.append(("close", None))


# ---- an agent -------------------------------------------------------------------------------------------------
@dataclass
class FakeWorker:
    job: str
    generation: int
    rank: int
    local_rank: int
    pid: int
    started_at: float
    state: str = "running"  # running | exited
    exit_code: int | None = None
    detail: str | None = None
    hang: str | None = None
    frozen: bool = False
    stopped: bool = False
    ended_at: float | None = None
    carried_from: list[int] | None = None
    standby: str | None = None  # the warm standby this process was, when one was adopted
    sigstopped_at: float | None = None  # SIGSTOP'd: no progress, no beat since then
    reported_exit: bool = False

    def as_report(self) -> dict:
        """What the agent's heartbeat says about it (`worker.Worker.as_report`)."""
        return {"job": self.job, "generation": self.generation, "rank": self.rank, "local_rank": self.local_rank,
                "pid": self.pid, "state": self.state, "exit_code": self.exit_code, "detail": self.detail,
                "hang": self.hang, "frozen": self.frozen, "stopped": self.stopped, "started_at": self.started_at,
                "ended_at": self.ended_at, "carried_from": self.carried_from}


class FakeAgent:
    """One node's agent. Bring-up takes one phase per heartbeat (registered → lifecycle result → health
    checked), as a real agent's first heartbeats report it. Behaviour:

        register=False         never heartbeats (its agent never reaches the controller)
        lifecycle_code=N       the lifecycle script exits N (non-zero: phase failed, with `lifecycle_tail`)
        health_ok=False        its first health check fails (a replace-node check)
        busbw=G                the bus bandwidth its deep-check probes measure (GB/s)
    """

    def __init__(self, cluster: FakeCluster, name: str, handle: str, *, register: bool = True,
                 lifecycle_code: int = 0, lifecycle_tail: str = "", health_ok: bool = True, busbw: float = 1.0):
        self.cluster, self.name, self.handle = cluster, name, handle
        self.register, self.lifecycle_code, self.lifecycle_tail = register, lifecycle_code, lifecycle_tail
        self.health_ok, self.busbw = health_ok, busbw
        self.beats = 0
        self.phase = "configuring"
        self.lifecycle: dict | None = None
        self.health: dict | None = None
        self.checked_at: float | None = None
        self.injected: list[str] = []
        self.injected_xids: list[int] = []
        self.workers: dict[tuple[str, int, int], FakeWorker] = {}
        self.desired: set[tuple[str, int]] = set()
        self.held: set[str] = set()
        self.assigned: dict[tuple[str, int], dict] = {}  # (job, generation) → the assignment last received
        self.standbys: dict[int, str] = {}  # local rank → warm standby id
        self.deep_result: dict | None = None
        self.time_limit_warned_at: float | None = None  # Slurm's USR2 reached this agent (`node_agent`)
        self.reply_sent_at: float | None = None
        self.replies: list[dict] = []
        self.exited = False
        self._standby_seq = itertools.count()

    @property
    def clock(self) -> FakeClock:
        return self.cluster.clock

    # ---- bring-up and health --------------------------------------------------------------------------------
    def bring_up(self) -> None:
        """Called before each heartbeat: the next phase (registered; lifecycle done; health checked; ready)."""
        if self.phase == "configuring" and self.beats == 1:
            code = self.lifecycle_code
            script = "on_create.sh"
            detail = f"lifecycle script {script} " + ("succeeded in 0.01 s" if code == 0 else describe_exit(code))
            self.lifecycle = {"ok": code == 0, "exit_code": code, "duration_s": 0.01, "tail": self.lifecycle_tail,
                              "log": None, "detail": detail}
            self.phase = "health-checking" if code == 0 else "failed"
        elif self.phase == "health-checking" and self.beats >= 2:
            self.run_checks()
            self.phase = "ready"
        elif self.phase == "ready" and self.clock() - self.checked_at >= self.cluster.spec.health.check_interval_s:
            self.run_checks()

    def run_checks(self) -> None:
        """`node_agent.run_checks`: injected faults keep failing; injected XIDs are reported once."""
        checks = [H.Check("host.disk", "pass", "fake disk"), H.Check("host.memory", "pass", "fake memory")]
        if not self.health_ok:
            checks.append(H.Check("host.disk", "fail", "fake: work dir full", H.REPLACE_NODE))
        checks += [H.injected_failure(kind) for kind in self.injected]
        if self.injected_xids:
            checks.append(H.xid_check(self.injected_xids, " (injected)"))
            self.injected_xids = []
        self.health = H.report(checks)
        self.health["checked_at"] = self.checked_at = self.clock()

    # ---- heartbeats -----------------------------------------------------------------------------------------
    def body(self) -> dict:
        return {"protocol": protocol.PROTOCOL_VERSION, "handle": self.handle, "phase": self.phase,
                "lifecycle": self.lifecycle, "health": self.health,
                "sent_at": self.clock(), "workers": [w.as_report() for w in self.workers.values()],
                "reply_sent_at": self.reply_sent_at, "deep_check": self.deep_result,
                "standbys": {str(k): v for k, v in self.standbys.items()},
                **({"time_limit_warned_at": self.time_limit_warned_at} if self.time_limit_warned_at else {})}

    def handle_reply(self, reply: dict | None, body: dict) -> None:
        """`node_agent.handle_reply`. None: the controller answered 410 (terminated, or another agent's node)."""
        if reply is None:
            return self.exit("the controller refused its heartbeat (410)")
        self.replies.append(reply)
        if reply["action"] != "terminate":
            self.apply(reply["workers"], reply["standby"])
            self.run_deep_check(reply["deep_check"])
        self.acknowledged(body["workers"])
        self.reply_sent_at = reply["sent_at"]
        if reply["faults"]:
            for fault in reply["faults"]:
                if fault.startswith("xid:"):
                    self.injected_xids.append(int(fault[4:]))
                else:
                    self.injected.append(fault)
            self.run_checks()  # the real agent wakes its checks: the result goes out with the next heartbeat
        if reply["action"] == "terminate":
            self.exit(f"controller asked this node to terminate: {reply.get('reason', '')}")

    def exit(self, why: str) -> None:
        for w in self.workers.values():
            if w.state == "running":
                self._stop(w)
        self.exited = True
        if self.name in self.cluster.backend.running:
            self.cluster.backend.end(self.name, f"agent process {self.handle} {describe_exit(0)} ({why})")

    # ---- workers (`supervisor.WorkerSupervisor`) ------------------------------------------------------------
    def apply(self, assignments: list[dict], standby: int) -> None:
        self.held = {a["job"] for a in assignments if a.get("hold")}
        runs = [a for a in assignments if not a.get("hold")]
        self.desired = {(a["job"], a["generation"]) for a in runs}
        for a in runs:
            self.assigned[(a["job"], a["generation"])] = a
            for r in a["ranks"]:
                key = (a["job"], a["generation"], r["rank"])
                if key in self.workers:
                    continue
                w = self._carry(a, r) if a.get("recovery") == protocol.CHECKPOINTLESS else None
                self.workers[key] = w or self._start(a, r)
        for w in self.workers.values():
            if (w.job, w.generation) not in self.desired and w.job not in self.held and w.state == "running":
                self._stop(w)
        self._keep_standbys(standby, stop_extra=not self.held)

    def _carry(self, a: dict, r: dict) -> FakeWorker | None:
        def serves(w: FakeWorker) -> bool:
            return w.state == "running" or (bool(r.get("carry")) and w.state == "exited" and not w.stopped)

        old = next((w for w in self.workers.values() if w.job == a["job"] and w.local_rank == r["local_rank"]
                    and w.generation < a["generation"] and serves(w)), None)
        if old is None:
            return None
        del self.workers[(old.job, old.generation, old.rank)]
        old.carried_from = [old.generation, old.rank]
        old.generation, old.rank = a["generation"], r["rank"]
        if old.state == "exited":
            old.reported_exit = False  # its death is the new generation's fault
        return old

    def _start(self, a: dict, r: dict) -> FakeWorker:
        sid = r.get("standby")
        local = next((k for k, v in self.standbys.items() if v == sid), None) if sid else None
        if local is not None:  # adopt the warm standby the controller named (it already runs)
            del self.standbys[local]
            pid = self.cluster.standby_pids[sid]
        else:
            sid, pid = None, self.cluster.next_pid()
        return FakeWorker(a["job"], a["generation"], r["rank"], r["local_rank"], pid=pid, started_at=self.clock(),
                          standby=sid)

    def _stop(self, w: FakeWorker) -> None:
        """SIGTERM to a worker no longer assigned; it exits before the next heartbeat."""
        w.state, w.stopped, w.exit_code, w.ended_at = "exited", True, -signal.SIGTERM, self.clock()
        w.detail = describe_exit(-signal.SIGTERM)

    def _keep_standbys(self, wanted: int, stop_extra: bool) -> None:
        for local in range(wanted):
            if local not in self.standbys:
                sid = f"{self.name}-{local}-{next(self._standby_seq)}"
                self.standbys[local] = sid
                self.cluster.standby_pids[sid] = self.cluster.next_pid()
        if stop_extra:
            for local in [k for k in self.standbys if k >= wanted]:
                del self.standbys[local]

    def acknowledged(self, reported: list[dict]) -> None:
        for r in reported:
            w = self.workers.get((r["job"], r["generation"], r["rank"]))
            if w is not None and r["state"] == "exited":
                w.reported_exit = True
        for key in [k for k, w in self.workers.items() if w.state == "exited" and w.reported_exit
                    and (w.job, w.generation) not in self.desired and w.job not in self.held]:
            del self.workers[key]

    def judge_hangs(self) -> None:
        """The agent's hang rule for SIGSTOP'd workers: no progress and no beat for hang_timeout_s → frozen,
        SIGKILL. (The rule itself is tested with real processes in test_jobs.py.)"""
        timeout = self.cluster.spec.health.hang_timeout_s
        for w in self.workers.values():
            if w.state == "running" and w.sigstopped_at is not None and self.clock() - w.sigstopped_at >= timeout:
                self.hang(w, frozen=True)

    # ---- what happens to a worker (test side) ---------------------------------------------------------------
    def running(self, job: str | None = None) -> list[FakeWorker]:
        return [w for w in self.workers.values() if w.state == "running" and (job is None or w.job == job)]

    def exit_worker(self, w: FakeWorker, code: int) -> None:
        w.state, w.exit_code, w.ended_at, w.detail = "exited", code, self.clock(), describe_exit(code)

    def hang(self, w: FakeWorker, *, frozen: bool, step: int = 5) -> None:
        """The hang rule's verdict on `w` (frozen: no progress and no beat; stalled: beat alive, no progress),
        then its SIGKILL."""
        silent = self.cluster.spec.health.hang_timeout_s
        w.hang = (f"frozen: no progress for {silent:.1f} s after step {step}, liveness beat stopped" if frozen
                  else f"stalled: no progress for {2 * silent:.1f} s after step {step}, liveness beat alive")
        w.frozen = frozen
        self.exit_worker(w, -signal.SIGKILL)

    def deliver(self, pid: int, sig: signal.Signals) -> None:
        w = next(w for w in self.workers.values() if w.pid == pid and w.state == "running")
        if sig == signal.SIGKILL:
            self.exit_worker(w, -signal.SIGKILL)
        elif sig == signal.SIGSTOP:
            w.sigstopped_at = self.clock()

    # ---- deep check (`agent.deep_check.DeepCheckRunner`) ---------------------------------------------------
    def run_deep_check(self, a: dict | None) -> None:
        if a is None or (self.deep_result is not None and self.deep_result["id"] == a["id"]):
            return
        per, world = a["procs_per_node"], a["procs_per_node"] * len(a["nodes"])
        ranks = [{"rank": a["node_rank"] * per + i, "correct": True,
                  "busbw_gbps": None if world == 1 else self.busbw} for i in range(per)]
        self.deep_result = {"id": a["id"], "ranks": ranks, "problems": []}


# ---- the controller's policy over the fakes -------------------------------------------------------------------
class FakeCluster:
    """A cluster dir with a real SQLite store and the controller's policy objects, driven by `step()`.

    `spares`, `count`, `node_recovery`, `warm_standby` and `health` (overrides of the spec's health section)
    shape the spec. `plan(name, **behaviour)` sets how the agent of a node not yet launched behaves
    (FakeAgent's keywords)."""

    def __init__(self, root: Path, *, count: int = 2, spares: int = 1, node_recovery: str = "automatic",
                 warm_standby: bool = False, instance_type: str = "local.cpu-1", health: dict | None = None,
                 name: str = "c1", backend: str = "local"):
        """`backend`: the spec's (its policy settings and limits; the backend itself is always `FakeBackend`)."""
        self.clock = FakeClock()
        self.paths = ClusterPaths(Path(root) / name)
        self.paths.root.mkdir(parents=True, mode=0o700)
        group = {"name": "workers", "instance_type": instance_type, "count": count, "spares": spares,
                 "warm_standby": warm_standby}
        self.spec = spec_from_dict({"name": name, "backend": backend, "node_recovery": node_recovery,
                                    "instance_groups": [group], "health": health or {}})
        self.paths.write_token()
        self.store = Store(self.paths.db, clock=self.clock, owner=True)  # as the controller opens it
        self.store.initialize(self.spec)
        self.backend = FakeBackend(self.paths.root, on_signal=self._deliver)
        self.rendezvous = FakeStore()
        self.agents: dict[str, FakeAgent] = {}
        self.plans: dict[str, dict] = {}
        self.standby_pids: dict[str, int] = {}
        self.exit_requests: list[str] = []  # what the reconciler asked the controller (stop everything: why)
        self._pids = itertools.count(50000)
        self.start_controller()

    def start_controller(self) -> None:
        """The controller's policy objects, as `daemon.Controller.run` builds them. Called again, it is a
        controller restart: nothing carries over but the store, the backend and the rendezvous store."""
        restart = hasattr(self, "jobs")
        if restart:  # (as the daemon does on a restart)
            for g in self.store.groups():
                self.store.update_group(g["name"], provision_failures=0)
        self.started_at = self.clock()
        self.jobs = JobScheduler(
            self.store, self.backend, jobs_root=self.paths.jobs_dir, store_addr=lambda: "controller.fake:29400",
            read_progress=lambda job, gen, ranks, **how: protocol.read_progress(self.rendezvous, job, gen, ranks,
                                                                                 beats=False, **how),
            rendezvous=self.rendezvous, clock=self.clock)
        self.jobs.token = self.paths.read_token()
        self.deep = DeepCheckCoordinator(self.spec, self.backend)
        self.reconciler = Reconciler(self.store, self.backend, started_at=self.started_at,
                                     request_exit=self.exit_requests.append, jobs=self.jobs, deep_checks=self.deep,
                                     clock=self.clock)
        if restart:
            self.jobs.republish()  # checkpointless workers watch their job's generation key

    def close(self) -> None:
        self.store.close()

    def next_pid(self) -> int:
        return next(self._pids)

    def plan(self, name: str, **behaviour) -> None:
        self.plans[name] = behaviour

    # ---- driving ----------------------------------------------------------------------------------------------
    @property
    def interval(self) -> float:
        return self.spec.health.heartbeat_interval_s

    def step(self, seconds: float | None = None) -> None:
        """One heartbeat interval: every live agent heartbeats, the reconciler ticks, the clock moves on."""
        for name, handle in self.backend.handles.items():
            if name not in self.agents:
                self.agents[name] = FakeAgent(self, name, handle, **self.plans.pop(name, {}))
        for agent in list(self.agents.values()):
            if self.alive(agent):
                self.heartbeat(agent)
        self.reconciler.tick()
        self.clock.advance(self.interval if seconds is None else seconds)

    def alive(self, agent: FakeAgent) -> bool:
        """Heartbeating: registered, running, not frozen, not exited."""
        return (agent.register and not agent.exited and agent.name in self.backend.running
                and agent.name not in self.backend.frozen)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def run_until(self, predicate: Callable[[], object], what: str, max_steps: int = 40):
        for _ in range(max_steps):
            if value := predicate():
                return value
            self.step()
        raise AssertionError(f"not reached within {max_steps} steps: {what}")

    def create(self) -> FakeCluster:
        """Bring the cluster up (status in-service; failed raises)."""
        status = self.run_until(lambda: self.status() in ("in-service", "failed") and self.status(),
                                "cluster creation to end")
        assert status == "in-service", self.store.cluster()["status_reason"]
        return self

    def heartbeat(self, agent: FakeAgent) -> dict | None:
        """POST /v1/nodes/{name}/heartbeat: `server/api.py`'s refusals, then the same `answer_heartbeat`; and the
        agent's handling of the reply."""
        agent.bring_up()
        agent.judge_hangs()
        body = agent.body()
        agent.beats += 1
        store, name = self.store, agent.name
        node = store.node(name)
        if node is None or node.state == S.TERMINATED or (node.handle is not None and body["handle"] != node.handle):
            agent.handle_reply(None, body)
            return None
        reply = answer_heartbeat(store, self.jobs, self.deep, self.started_at, node, Heartbeat.model_validate(body),
                                 self.clock())
        agent.handle_reply(reply, body)
        return reply

    def inject_fault(self, name: str, kind: str, *, rank: int | None = None, xid: int | None = None) -> None:
        """POST /v1/nodes/{name}/faults, as `server/api.py` handles it."""
        node = self.store.node(name)
        assert node is not None and node.live, f"node {name} is not live"
        if kind in ("kill-worker", "hang-worker"):
            running = [w for w in self.jobs.records.workers(node=name) if w.state == "running" and w.pid
                       and (rank is None or w.rank == rank)]
            assert running, f"node {name} runs no job worker"
            self.backend.signal_worker(node, running[0].pid,
                                       signal.SIGKILL if kind == "kill-worker" else signal.SIGSTOP)
        elif kind == "fail-health":
            self.store.add_directive(name, "fail-health")
        elif kind == "gpu-xid":
            self.store.add_directive(name, f"xid:{xid}")
        elif kind == "kill-node":
            self.backend.kill(node)
        elif kind == "freeze-node":
            self.backend.freeze(node)
        else:
            raise ValueError(kind)
        self.store.record_event(E.FAULT_INJECTED, f"fault injected by operator: {kind}", node=name)

    def _deliver(self, name: str, pid: int, sig: signal.Signals) -> None:
        self.agents[name].deliver(pid, sig)

    # ---- jobs -------------------------------------------------------------------------------------------------
    def submit(self, *, nodes: int = 2, recovery: str = "restart", **kw):
        """A command job (or, with recovery=checkpointless, a train job) submitted through `JobScheduler.submit`."""
        if recovery == protocol.CHECKPOINTLESS:
            kw = {"kind": "train", "config": {"model": "fake"}, "checkpoint_dir": str(self.paths.root / "ckpt"),
                  **kw}
        kw.setdefault("kind", "command")
        kw.setdefault("argv", ["train.sh"] if kw["kind"] == "command" else None)
        return self.jobs.submit(nodes=nodes, cwd=str(self.paths.root), recovery=recovery, **kw)

    def workers(self, job: str, generation: int | None = None) -> dict[int, tuple[FakeAgent, FakeWorker]]:
        """rank → (agent, worker) of the job's running workers (of `generation`, default: the newest)."""
        found = {}
        for agent in self.agents.values():
            if agent.exited:
                continue
            for w in agent.running(job):
                if generation is None or w.generation == generation:
                    found[(w.generation, w.rank)] = (agent, w)
        if not found:
            return {}
        g = generation or max(g for g, _ in found)
        return {r: aw for (gg, r), aw in found.items() if gg == g}

    def report_step(self, job: str, generation: int, rank: int, step: int) -> None:
        """A worker publishes its progress to the rendezvous store."""
        self.rendezvous.set(protocol.progress_key(job, generation, rank), str(step))

    # ---- reading the state --------------------------------------------------------------------------------------
    def status(self) -> str:
        return self.store.cluster()["status"]

    def node(self, name: str) -> Node:
        return self.store.node(name)

    def states(self) -> dict[str, str]:
        """node name → state (every node, terminated too)."""
        return {n.name: n.state.value for n in self.store.nodes()}

    def live(self) -> dict[str, Node]:
        return {n.name: n for n in self.store.nodes() if n.live}

    def transitions(self, name: str) -> list[str]:
        return [e["to_state"] for e in self.store.events(node=name) if e["kind"] == "transition"]

    def events(self, **kw) -> list[dict]:
        return self.store.events(**kw)

    def job(self, key: str):
        return self.jobs.records.find(key)

    def generations(self, job: str):
        return self.jobs.records.generations(job)

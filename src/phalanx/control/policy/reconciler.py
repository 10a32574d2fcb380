"""The level-triggered reconciler: every tick (~0.2 s) it compares what the spec wants with what the
store and the backend observe, and takes the next step. Nothing is remembered between ticks that is not
in SQLite, so a restarted controller picks up exactly where the last one stopped.

Each tick:
  observe   advance nodes from the agents' reports (registered → configuring → health-checking → healthy) or
            mark them faulty: agent process gone, taken by its scheduler (Slurm), no heartbeat within
            heartbeat_timeout_s (from the later of the last heartbeat and this controller's start; not when too
            many fall silent at once: `_judge_silence`), lifecycle script or health check failed, not registered
            within provision_timeout_s. A healthy node is observed only when something of it may have changed
            (`_to_observe`), unless the backend's own checks must be polled (local: every node, every tick)
  creation  while `creating`: any faulty node fails the creation (everything is stopped); all healthy → in service
  jobs      `JobScheduler.observe`: finish, stop or classify job generations (a hang marks its node faulty)
  recover   node_recovery=automatic: a faulty member is replaced by a healthy spare of its group (the spare
            becomes a member), or, in a group without spares, by a freshly provisioned node; a faulty spare
            is retired. node_recovery=none: faulty nodes stay for the operator
  jobs      `JobScheduler.advance`: start the next generation of pending/recovering jobs on healthy nodes
  retire    replacing nodes: SIGTERM, SIGKILL after a grace period, then terminated
  refill    provision nodes until every group has `count` members and `spares` spares (`flush`: Slurm gets one
            allocation for a tick's nodes); spares wait while a job relaunched after a fault has not made its
            first step (at most REFILL_HOLD_S)
Recover, status, retire and refill are skipped while nothing was written since a tick that left them nothing to do.

One log line per fault says what happened and what happens next. Knows nothing about HTTP; reaches
processes only through the backend.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from phalanx.control.agent.health import REPLACE_NODE, summarize_failure
from phalanx.control.policy.watch import MASS_SILENCE_HOLD, MASS_SILENCE_MIN, MassSilence, Watch  # noqa: F401
from phalanx.control.state.store import BRINGUP_STATES, FAULT_CAUSES, FLUSH_S, ClusterStatus, Node, NodeState, Store
from phalanx.observability.events import EventKind as E

log = logging.getLogger("phalanx.reconciler")
S = NodeState
TERMINATE_GRACE_S = 5.0
# A spare refill waits (at most this long) while a job relaunched after a fault has not made its first step: locally the
# new node's agent, template and standby take the recovering ranks' cores (elsewhere a refill takes longer anyway).
REFILL_HOLD_S = 10.0
MAX_PROVISION_FAILURES = 3


class Reconciler:
    def __init__(self, store: Store, backend, *, started_at: float, request_exit: Callable[[str], None],
                 jobs=None, deep_checks=None, links=None, clock: Callable[[], float] = time.time):
        self.store = store
        self.clock = clock  # the time policy decides by (tests drive a fake one)
        self.backend = backend
        self.jobs = jobs  # the JobScheduler, or None (no jobs)
        self.deep = deep_checks  # the DeepCheckCoordinator (used when the spec asks for the deep check)
        self.links = links  # the agents' links (`server/links.py`), or None
        self.spec = store.spec()
        self.started_at = started_at
        self.request_exit = request_exit  # stop every node and exit the controller, with a reason
        self._said: set[str] = set()  # "waiting" lines already logged (log once, not every tick)
        self._heard: float | None = None  # until when the server's loop had read agents' messages (`tick`)
        self.watch = Watch(store)  # which nodes a tick observes
        self._calm_at: int | None = None  # `Store.version` at a tick that left nothing to recover, retire or refill
        self._silent: list[tuple[Node, float]] = []  # (node, seconds) silent past the timeout at this tick
        self._mass = MassSilence()  # when silence waits to be judged

    def tick(self) -> None:
        # what the server's loop had read when the tick began: every beat read by then is folded next, and silence
        # is judged up to this time, not to when `observe` runs — the loop may read a paused controller's backlog
        # meanwhile, and stamp that it runs, with those beats not folded yet
        self._heard = self.links.heard_until(time.time()) if self.links is not None else None
        self._fold_beats()
        self.store.flush_observed(every_s=FLUSH_S)  # the heartbeats' batched observations, into SQLite
        status = ClusterStatus(self.store.cluster()["status"])
        if status not in (ClusterStatus.CREATING, ClusterStatus.IN_SERVICE, ClusterStatus.DEGRADED):
            return
        now = self.clock()
        timeout_s = self.spec.health.heartbeat_timeout_s
        for node in self._to_observe(now):
            if node.state not in (S.FAULTY, S.REPLACING):  # already judged; recover/retire take them on
                self.observe(node, now)
                self.watch.wake(node.name, max(node.last_heartbeat or 0.0, self.started_at) + timeout_s)  # silence
        self._judge_silence()
        if self.deep is not None and self.deep.enabled:
            self.judge_deep_checks(now)
        if status == ClusterStatus.CREATING:
            if not self.check_creation():
                return
        elif self.jobs is not None:
            self.jobs.observe(now, self.fault)
        version, calm = self.store.version, self._calm_at is not None and self._calm_at == self.store.version
        if status != ClusterStatus.CREATING and not calm:
            self.recover()
        if status != ClusterStatus.CREATING and self.jobs is not None:
            self.jobs.advance(now)
        if not calm or version != self.store.version:  # (nothing written since a calm tick: the scans find the same)
            self._settle(status, now, version)
        for node, why in self.backend.flush():  # Slurm: one allocation for the nodes provisioned this tick
            self.fault(self.store.node(node.name) or node, f"could not start the agent: {why}", "agent-start-failed")

    def _to_observe(self, now: float) -> list[Node]:
        """The live nodes to observe now (`watch.py`): all of them when the backend's `gone`/`taken` must be polled,
        else the ones something may have happened to; a link's close 1 ms past `link_grace_s` (past its rounding)."""
        grace = self.spec.health.link_grace_s
        for name, at in self.links.take_closes() if self.links is not None else ():
            if grace is not None:
                self.watch.remind(name, at + grace + 1e-3)
        return self.watch.pick(now, every=self.backend.polled() or not self.store.owner)

    def _settle(self, status: ClusterStatus, now: float, version: int | None) -> None:
        """The status, retirement and refill; then calm (`_calm_at`) when nothing was written meanwhile and no node is
        faulty, replacing or missing from its group: until the next write their scans of every node would find the
        same (at 4,096 idle nodes they were most of the reconciler's time, benchmarks/control_scale.py)."""
        if status != ClusterStatus.CREATING:
            self.update_status()
        self.retire(now)
        self.refill(creating=status == ClusterStatus.CREATING)
        if version is None or version != self.store.version:
            return
        nodes = self.store.nodes(include_terminated=False)
        full = all(sum(not n.is_spare for n in nodes if n.group == g["name"]) == g["count"] and
                   sum(n.is_spare for n in nodes if n.group == g["name"]) >= g["spares"] for g in self.store.groups())
        if full and not any(n.state in (S.FAULTY, S.REPLACING) for n in nodes):
            self._calm_at = version

    def _fold_beats(self) -> None:
        """The beats agents send on their links (`server/links.py`) are heartbeats with nothing new: each agent's
        newest is its node's `last_heartbeat` (not an agent's the node is no longer run by, nor before its first)."""
        folded, beats = {}, self.links.take_beats() if self.links is not None else {}
        with self.store.lock:  # (one hold, not one per beat: a heartbeat waiting for it gets it once, not 2,000 times)
            rows = self.store.node_map()  # (one lookup per beat, not a call: at 4,096 nodes, thousands a tick)
            for (name, handle), at in beats.items():
                node = rows.get(name)
                if node is not None and node.handle == handle and node.last_heartbeat is not None \
                        and at > node.last_heartbeat and node.state != S.TERMINATED:
                    folded[name] = at
            self.store.observe_beats(folded)

    # ---- observe ------------------------------------------------------------------------------------
    def observe(self, node: Node, now: float) -> None:
        h = self.spec.health
        gone = self.backend.gone(node) if node.handle else None
        if gone:
            return self.fault(node, gone, "agent-gone")
        taken = self.backend.taken(node)  # Slurm drained it, ended its job, or never started it
        if taken:
            return self.fault(node, taken, "scheduler")
        state, report = node.state, node.report or {}
        if state == S.PROVISIONING:
            if node.last_heartbeat is None:
                if not node.handle:  # hosts, slurm: the node waits for an agent to join it (slurm: `taken` times out)
                    how = (f"on a host, `phalanx agent --controller URL --token-file F --group {node.group}`"
                           if self.spec.backend == "hosts" else "Slurm starts it")
                    self._say_once(f"join:{node.name}", f"node {node.name} waits for an agent to join group "
                                   f"{node.group}: {how}")
                    return
                if now - node.state_since > h.provision_timeout_s:
                    self.fault(node, f"agent did not register within provision_timeout_s={h.provision_timeout_s:g}",
                               "provision-timeout")
                return
            script = self.spec.group(node.group).on_create
            node = self.store.transition(node.name, S.CONFIGURING, f"agent registered (handle {node.handle}); "
                                         f"running lifecycle script {script}" if script else
                                         f"agent registered (handle {node.handle}); no lifecycle script")
            state = node.state
        closed = (self.links.lost(node.name, node.handle, node.last_heartbeat, now, h.link_grace_s)
                  if self.links is not None else None)
        if closed is not None:
            return self.fault(node, f"its agent's link to the controller closed {closed:.1f} s ago, and no heartbeat "
                              f"or new link came (the agent process ended)", "agent-gone")
        heard = now if self._heard is None else min(now, self._heard)  # (not the controller's own stall)
        silent = heard - max(node.last_heartbeat, self.started_at)
        if silent > h.heartbeat_timeout_s:
            return self._silent.append((node, silent))  # judged once every node is observed (`_judge_silence`)
        lifecycle = report.get("lifecycle")
        if report.get("phase") == "failed":  # the lifecycle script failed, or the agent hit an error
            detail = (lifecycle or {}).get("detail") or "agent reported its bring-up failed"
            return self.fault(node, f"{detail}; output tail:\n{(lifecycle or {}).get('tail', '')}", "bringup-failed")
        if state == S.CONFIGURING and lifecycle and lifecycle["ok"]:
            node = self.store.transition(node.name, S.HEALTH_CHECKING, lifecycle.get("detail") or
                                         f"lifecycle script succeeded in {lifecycle['duration_s']:.2f} s")
            state = node.state
        health = node.health
        if state == S.HEALTH_CHECKING and report.get("phase") == "ready" and health:
            if not health["ok"]:
                self._count_failed_checks(health)
                return self.fault(node, f"health check failed during bring-up: {summarize_failure(health)}",
                                  "health-check")
            if self.deep is not None and self.deep.enabled:
                self.deep.ready(node.name)  # healthy only once its deep check passes (judge_deep_checks)
                return
            self.become_healthy(node, "")
        elif state == S.HEALTHY and health and not health["ok"]:
            self._count_failed_checks(health)
            self.fault(node, f"health check failed: {summarize_failure(health)}", "health-check")

    def _judge_silence(self) -> None:
        """The nodes silent past heartbeat_timeout_s at this tick are faulty, unless `MassSilence` holds them (many at
        once, or the ones left as the controller catches up: `watch.py`); as Kubernetes' node controller holds
        evictions in a full disruption."""
        silent, self._silent, h = self._silent, [], self.spec.health
        hold = MASS_SILENCE_HOLD * h.heartbeat_timeout_s
        live = lambda: sum(1 for n in self.store.nodes(include_terminated=False)  # noqa: E731
                           if n.last_heartbeat is not None and n.state not in (S.FAULTY, S.REPLACING))
        held = self._mass.holds([s for _, s in silent], live, now=self.clock(), timeout=h.heartbeat_timeout_s,
                                fraction=h.mass_silence_fraction)
        if held == "mass":
            return self._say_once("mass-silence", f"{len(silent)} of {self._mass.heard} nodes silent past heartbeat_"
                                  f"timeout_s={h.heartbeat_timeout_s:g} at once: the controller's own load or network "
                                  f"more likely than that many hosts; none is judged faulty (health.mass_silence_"
                                  f"fraction={h.mass_silence_fraction:g}); next: judged once their count stops "
                                  f"falling for heartbeat_timeout_s, or when silent {hold:g} s")
        if held == "tail":
            return
        if "mass-silence" in self._said:
            self._said.discard("mass-silence")
            log.warning("mass silence over; %d nodes still silent past heartbeat_timeout_s are judged", len(silent))
        for node, seconds in silent:
            self.fault(node, f"no heartbeat for {seconds:.1f} s (heartbeat_timeout_s={h.heartbeat_timeout_s:g})",
                       "heartbeat-timeout")

    def _count_failed_checks(self, health: dict) -> None:  # once per check that failed the node (it is faulty now)
        for c in health["checks"]:
            if c["status"] == "fail" and c.get("action") == REPLACE_NODE:
                self.store.count("health_check_failures", c["name"])

    def become_healthy(self, node: Node, extra: str) -> None:
        passed = ", ".join(f"{c['name']} {c['status']}" for c in node.health["checks"])
        for c in node.health["checks"]:  # every check a node runs is a series of /metrics from 0 on
            self.store.count("health_check_failures", c["name"], 0)
        self.store.transition(node.name, S.HEALTHY, f"health checks: {passed}{extra}")
        self._reset_failures(node.group)
        log.info("node %s healthy (%s)%s", node.name, "spare" if node.is_spare else "member", extra)

    def judge_deep_checks(self, now: float) -> None:
        for name, passed, detail in self.deep.tick(now, self.store.nodes(include_terminated=False)):
            node = self.store.node(name)
            if node is None or node.state != S.HEALTH_CHECKING:
                continue  # judged otherwise meanwhile (its agent died, a basic check failed)
            if passed:
                self.become_healthy(node, f"; {detail}")
            else:
                self.store.count("health_check_failures", "deep-check")
                self.fault(node, detail, "deep-check")

    def fault(self, node: Node, reason: str, cause: str) -> None:
        """Mark the node faulty; `cause`: one of store.FAULT_CAUSES (the job scheduler's is a hang)."""
        assert cause in FAULT_CAUSES, cause
        self.store.transition(node.name, S.FAULTY, reason, fault_cause=cause)
        self.store.count("node_faults", cause)
        self.backend.remediate(node, reason, cause)  # Slurm: drain it
        if node.state in BRINGUP_STATES:
            g = next(g for g in self.store.groups() if g["name"] == node.group)
            self.store.update_group(node.group, provision_failures=g["provision_failures"] + 1)
        log.error("node %s faulty: %s; next: %s", node.name, reason.splitlines()[0], self._next_step(node))

    def _next_step(self, node: Node) -> str:
        if ClusterStatus(self.store.cluster()["status"]) == ClusterStatus.CREATING:
            return "cluster creation fails and every node is stopped"
        return ("retire it and provision a fresh spare" if node.is_spare else
                "node_recovery=none, leaving it for the operator" if self.spec.node_recovery == "none" else
                "replace it with a freshly provisioned node (group has no spares)"
                if self.spec.group(node.group).spares == 0 else "replace it with a healthy spare")

    def _reset_failures(self, group: str) -> None:
        self.store.update_group(group, provision_failures=0)
        self._said.discard(f"stuck:{group}")

    # ---- creation -----------------------------------------------------------------------------------
    def check_creation(self) -> bool:
        """False when creation failed (the controller is asked to stop everything and exit)."""
        nodes = self.store.nodes(include_terminated=False)
        faulty = [n for n in nodes if n.state == S.FAULTY]
        if faulty:
            n = faulty[0]
            reason = f"node {n.name} failed during creation: {n.reason}"
            self.store.set_status(ClusterStatus.FAILED, reason)
            log.error("cluster creation failed (%s); next: stopping every node and the controller",
                      reason.splitlines()[0])
            self.request_exit(reason)
            return False
        wanted = sum(g.count + g.spares for g in self.spec.instance_groups)
        healthy = [n for n in nodes if n.state == S.HEALTHY]
        if len(healthy) == wanted == len(nodes):
            self.store.set_status(ClusterStatus.IN_SERVICE, f"all {wanted} nodes healthy")
            log.info("cluster %s in service: all %d nodes healthy", self.spec.name, wanted)
        return True

    def update_status(self) -> None:
        nodes = self.store.nodes(include_terminated=False)
        members = [n for n in nodes if n.live and not n.is_spare]
        unhealthy = [n for n in members if n.state != S.HEALTHY]
        short = [g["name"] for g in self.store.groups()
                 if sum(1 for n in members if n.group == g["name"]) < g["count"]]
        if unhealthy or short:
            what = ", ".join(f"{n.name} {n.state.value}" for n in unhealthy) or f"groups short of members: {short}"
            self.store.set_status(ClusterStatus.DEGRADED, f"members not healthy: {what}")
        else:
            self.store.set_status(ClusterStatus.IN_SERVICE, "every member node healthy")

    # ---- recover ------------------------------------------------------------------------------------
    def recover(self) -> None:
        nodes = self.store.nodes(include_terminated=False)
        for node in (n for n in nodes if n.state == S.FAULTY):
            if node.is_spare:
                self.start_retiring(node, "faulty spare retired; the spare pool is refilled")
            elif self.spec.node_recovery == "none":
                self._say_once(f"none:{node.name}", f"node {node.name} stays faulty: node_recovery=none")
            elif self.spec.group(node.group).spares == 0:
                self.store.count("node_replacements", node.fault_cause or "unknown")
                self.start_retiring(node, "replaced by a freshly provisioned node (group has no spares)")
            else:
                spare = next((n for n in nodes if n.group == node.group and n.is_spare and n.state == S.HEALTHY
                              and n.live), None)
                if spare is None:
                    self._say_once(f"wait:{node.name}", f"node {node.name} faulty; waiting for a healthy spare "
                                                        f"in group {node.group}")
                    continue
                self.store.update_node(spare.name, is_spare=0)
                self.store.record_event(E.PROMOTED, f"spare promoted to member of group {node.group}, "
                                                    f"replacing {node.name}", node=spare.name)
                nodes = [n for n in nodes if n.name != spare.name]
                self.store.count("node_replacements", node.fault_cause or "unknown")
                self.start_retiring(node, f"replaced by spare {spare.name}")
                log.info("spare %s promoted to member in place of %s", spare.name, node.name)

    def start_retiring(self, node: Node, reason: str) -> None:
        node = self.store.transition(node.name, S.REPLACING, f"{reason}; terminating its agent")
        self.backend.terminate(node)

    def _say_once(self, key: str, line: str) -> None:
        if key not in self._said:
            self._said.add(key)
            log.warning(line)
            self.store.record_event(E.WAITING, line)

    # ---- retire and refill --------------------------------------------------------------------------
    def retire(self, now: float) -> None:
        for node in self.store.nodes(include_terminated=False):
            if node.state != S.REPLACING:
                continue
            gone = self.backend.gone(node) if node.handle else "never started"
            if gone:
                leftovers = self.backend.kill(node)  # whatever the agent left in its process group
                self.backend.forget(node)
                extra = f"; killed {len(leftovers)} leftover processes" if leftovers else ""
                self.store.transition(node.name, S.TERMINATED, f"{gone}{extra}")
                if self.links is not None:
                    self.links.forget(node.name)
                log.info("node %s terminated: %s%s", node.name, gone, extra)
            elif now - node.state_since > TERMINATE_GRACE_S:
                log.warning("node %s did not stop within %.0f s of SIGTERM; next: SIGKILL", node.name,
                            TERMINATE_GRACE_S)
                self.backend.kill(node)

    def refill(self, *, creating: bool) -> None:
        nodes = self.store.nodes(include_terminated=False)
        for g in self.store.groups():
            live = [n for n in nodes if n.group == g["name"] and n.live]
            members = sum(1 for n in live if not n.is_spare)
            spares = sum(1 for n in live if n.is_spare)
            if members > g["count"]:  # `cluster scale` lowered the count: retire idle members, newest first
                idle = [n for n in live if not n.is_spare and not n.job and n.state in (S.HEALTHY, *BRINGUP_STATES)]
                for node in sorted(idle, key=lambda n: n.created_at, reverse=True)[:members - g["count"]]:
                    self.start_retiring(node, f"group {g['name']} scaled down to {g['count']} members")
            if members >= g["count"] and spares >= g["spares"]:
                continue
            if g["provision_failures"] >= MAX_PROVISION_FAILURES:
                last = next((n.reason for n in reversed(nodes) if n.group == g["name"] and n.state == S.FAULTY), "")
                self._say_once(f"stuck:{g['name']}", f"group {g['name']}: {g['provision_failures']} nodes in a "
                               f"row failed to come up (last: {(last or '').splitlines()[0] if last else '?'}); "
                               f"not provisioning more until the controller restarts (`phalanx cluster stop` "
                               f"then `phalanx cluster start` once the cause is fixed)")
                continue
            wanted = [(False, f"group {g['name']}: " + (f"initial member {i + 1}/{g['count']}" if creating else
                                                        f"member {i + 1}/{g['count']} missing"))
                      for i in range(members, g["count"])]
            if not (spares < g["spares"] and not creating and self._refill_held()):
                wanted += [(True, f"group {g['name']}: " + (f"initial spare {i + 1}/{g['spares']}" if creating else
                                                           f"refilling spare pool ({i + 1}/{g['spares']})"))
                           for i in range(spares, g["spares"])]
            self.provision(g["name"], wanted)

    def _refill_held(self) -> bool:
        since = self.jobs.relaunched_since() if self.jobs is not None else None
        return since is not None and self.clock() - since < REFILL_HOLD_S

    def provision(self, group: str, wanted: list[tuple[bool, str]]) -> None:
        """New nodes for `group`, one per (is_spare, reason), their rows in one transaction; then each agent started."""
        for node in self.store.add_nodes(group, wanted, work_root=self.backend.work_root()) if wanted else ():
            try:
                handle = self.backend.launch(node)
            except OSError as err:
                self.fault(node, f"could not start the agent: {err}", "agent-start-failed")
                continue
            if handle is not None:  # None: an agent joins (hosts, Slurm) and may have claimed the row already
                self.store.update_node(node.name, handle=handle)
            log.info("provisioning %s (%s, %s): %s", node.name, "spare" if node.is_spare else "member",
                     f"agent {handle}" if handle else "waiting for an agent to join", node.reason)

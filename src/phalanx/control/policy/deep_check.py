"""Controller side of the deep health check (the agent side, which runs the probes, is
`phalanx.control.agent.deep_check`): a timed all_reduce across a new node and a healthy peer, run while the
node is health-checking, failing it below a bus-bandwidth threshold (`health.deep_check_min_busbw_gbps`).

`DeepCheckCoordinator` (called by the reconciler each tick) forms *rounds*: each node that passed its basic
checks is paired with one healthy node of its group (a spare first, then a member without a job). A group with
no healthy node yet — cluster creation — is checked as one round of all its nodes once every one of them is
ready. A round gets its own id and MASTER_ADDR/PORT; heartbeat replies carry each node's part (`assignment`).
When every node of the round reported, or `deep_check_timeout_s` passed, the candidates get a verdict: pass
when every rank summed correctly and the slowest rank's bus bandwidth reached the threshold; otherwise fail
with the figure. A round whose peer stopped being healthy meanwhile is dropped without a verdict and the
candidates are paired again; so is a round one of whose candidates failed otherwise. Rounds live in memory:
a restarted controller simply runs the check again for nodes still health-checking.

Standard library only. Must not know: processes (the agents run the probes).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

log = logging.getLogger("phalanx.deep_check")


@dataclass
class Round:
    id: str
    nodes: list[str]  # in rank order
    candidates: list[str]  # the nodes being judged (the others are healthy peers)
    master_addr: str
    master_port: int
    started_at: float
    env: dict = field(default_factory=dict)


class DeepCheckCoordinator:
    def __init__(self, spec, backend, changed=None):
        self.spec = spec
        self.backend = backend
        self.changed = changed  # told the nodes of a round it starts (`Store.changed`: their agents are poked)
        self.rounds: dict[str, Round] = {}
        self._ready: set[str] = set()  # candidates that passed their basic checks, seen this tick

    @property
    def enabled(self) -> bool:
        return self.spec.health.deep_health_check

    def ready(self, node_name: str) -> None:
        """`node_name` passed its basic checks and waits for its deep check (called from the tick's observe)."""
        self._ready.add(node_name)

    def assignment(self, node) -> dict | None:
        """This node's part of the round it is in (for its heartbeat reply), or None."""
        for r in list(self.rounds.values()):
            if node.name in r.nodes:
                h = self.spec.health
                return {"id": r.id, "nodes": r.nodes, "node_rank": r.nodes.index(node.name),
                        "procs_per_node": self.spec.group(node.group).profile.worker_slots,
                        "master_addr": r.master_addr,
                        "master_port": r.master_port, "size_mb": h.deep_check_size_mb, "iters": h.deep_check_iters,
                        "timeout_s": h.deep_check_timeout_s, "env": r.env}
        return None

    def tick(self, now: float, nodes: list) -> list[tuple[str, bool, str]]:
        """Form new rounds and judge finished ones. Returns (candidate, passed, detail) verdicts."""
        ready, self._ready = self._ready, set()
        by_name = {n.name: n for n in nodes}
        verdicts = []
        for r in list(self.rounds.values()):
            verdicts += self._judge(r, now, by_name)
        # (a candidate judged just now was still "ready" when this tick observed it)
        busy = {name for r in self.rounds.values() for name in r.nodes} | {name for name, _, _ in verdicts}
        for g in self.spec.instance_groups:
            waiting = sorted((n for n in ready if n not in busy and by_name[n].group == g.name),
                             key=lambda n: by_name[n].name)
            if not waiting:
                continue
            live = [n for n in nodes if n.group == g.name and n.live]
            peers = [n for n in live if n.state.value == "healthy" and n.name not in busy]
            peers.sort(key=lambda n: (not n.is_spare, n.job is not None, n.name))
            if any(n.state.value == "healthy" for n in live):
                for cand, peer in zip(waiting, peers):  # one round per candidate: a slow link names its node
                    self._start([peer, by_name[cand]], [cand], now)
            elif all(n.name in ready for n in live):  # creation: every node of the group is ready
                group = sorted(live, key=lambda n: n.name)
                self._start(group, [n.name for n in group], now)
        return verdicts

    def _start(self, nodes: list, candidates: list[str], now: float) -> None:
        names, first = [n.name for n in nodes], nodes[0]
        r = Round(id=uuid.uuid4().hex[:8], nodes=names, candidates=candidates,
                  master_addr=self.backend.node_host(first), master_port=self.backend.free_port(first),
                  started_at=now, env={k: v for k, v in self.backend.worker_env().items() if k == "GLOO_SOCKET_IFNAME"})
        self.rounds[r.id] = r
        if self.changed is not None:
            self.changed(tuple(names))
        log.info("deep health check round %s for %s across %s (MASTER_PORT %d)", r.id, ", ".join(candidates),
                 ", ".join(names), r.master_port)

    def _judge(self, r: Round, now: float, by_name: dict) -> list[tuple[str, bool, str]]:
        results = {}
        for name in r.nodes:
            node = by_name.get(name)
            res = ((node.report or {}).get("deep_check") if node is not None else None) or {}
            if res.get("id") == r.id:
                results[name] = res
        gone = [n for n in r.nodes if by_name.get(n) is None
                or by_name[n].state.value != ("health-checking" if n in r.candidates else "healthy")]
        if gone:  # a verdict would blame the others for it
            del self.rounds[r.id]
            log.warning("deep health check round %s dropped: %s left it (no longer %s); next: checking %s again",
                        r.id, ", ".join(gone), "healthy or health-checking", ", ".join(r.candidates))
            return []
        timeout = self.spec.health.deep_check_timeout_s + 30  # + process start-up (a torch import)
        if len(results) < len(r.nodes) and now - r.started_at < timeout:
            return []
        del self.rounds[r.id]
        ok, detail = self.verdict(r, results)
        return [(c, ok, detail) for c in r.candidates if c in by_name]

    def verdict(self, r: Round, results: dict[str, dict]) -> tuple[bool, str]:
        h = self.spec.health
        missing = [n for n in r.nodes if n not in results]
        problems = [p for res in results.values() for p in res.get("problems", [])]
        ranks = [x for res in results.values() for x in res.get("ranks", [])]
        across = f"all_reduce of {h.deep_check_size_mb:g} MiB across {', '.join(r.nodes)}"
        if missing:
            return False, f"deep health check: no result from {', '.join(missing)} within " \
                          f"{h.deep_check_timeout_s:g} s ({across})"
        if problems:
            return False, f"deep health check failed: {problems[0]} ({across})"
        wrong = [x["rank"] for x in ranks if not x["correct"]]
        if wrong:
            return False, f"deep health check: all_reduce result wrong on ranks {wrong} ({across})"
        bws = [x["busbw_gbps"] for x in ranks if x["busbw_gbps"] is not None]
        if not bws:
            return True, f"deep health check: {across} is a single process, no bandwidth to measure"
        slowest = min(bws)
        figure = f"bus bandwidth {slowest:.3f} GB/s ({across}, {len(ranks)} processes)"
        if slowest < h.deep_check_min_busbw_gbps:
            return False, f"deep health check: {figure} below deep_check_min_busbw_gbps=" \
                          f"{h.deep_check_min_busbw_gbps:g}"
        return True, f"deep health check: {figure} ≥ {h.deep_check_min_busbw_gbps:g} GB/s"

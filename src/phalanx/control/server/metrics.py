"""The controller's Prometheus metrics (`GET /metrics`): a custom prometheus_client collector computed at
scrape time from bounded state, so nothing has to be kept in sync and a scrape's cost does not grow with the
cluster's history:

  - SQLite: GROUP BY counts over the nodes and jobs tables, the `counters` table (faults, replacements and
    failed health checks, counted by the reconciler as they happen), and the generations of the jobs shown
    (their primary key). Never the events table: it grows with every heartbeat-era transition.
  - `JobRuns`: one `RunFollower` per job shown (every job not ended and the newest `keep_ended` ended), which
    reads only the bytes appended to the run's metrics.jsonl / events.jsonl since the last scrape and
    recomputes the goodput ledger at most every few seconds.

Names follow Prometheus' conventions: base units (`_seconds`, `_ratio`), `_total` on counters, labels from
bounded sets (node names: the cluster's size; job ids: the jobs shown; causes, checks, phases, categories:
fixed vocabularies). Every metric is listed in docs/observability.md ("Prometheus").

Must not know: HTTP, processes, policy.
"""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from phalanx.control.server.job_runs import JobRuns
from phalanx.control.state.jobs import Job, JobRecords, JobState, Outcome
from phalanx.control.state.store import FAULT_CAUSES, NodeState, Store
from phalanx.observability.follow import PHASE_BUCKETS, PHASES, Histogram, RunFollower
from phalanx.observability.goodput import CATEGORIES

# A generation that ended with one of these and was followed by another is a restart, labelled by its cause.
RESTART_CAUSES = tuple(o.value for o in Outcome if o not in (Outcome.SUCCEEDED, Outcome.CANCELLED))
RETIRED = (NodeState.REPLACING.value, NodeState.TERMINATED.value)
AGE, AGE_DOC = ("phalanx_node_heartbeat_age_seconds",
                "Seconds since the node's last heartbeat (live nodes: not replacing or terminated)")


def _escape(value: str) -> str:  # a label value in the text format
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _histogram(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _add(family: HistogramMetricFamily, values: list[str], h: Histogram) -> None:
    family.add_metric(values, h.cumulative(), sum_value=h.total)


class ClusterCollector:
    """`collect()` is called once per scrape (prometheus_client's custom-collector protocol)."""

    def __init__(self, store: Store, runs: JobRuns, records: JobRecords | None = None, links=None, *,
                 render_ages: bool = False, clock=time.time):
        self.store = store
        self.runs = runs
        self.records = records or JobRecords(store)
        self.links = links  # the agents' links (`links.AgentLinks`): what the agents sent, and the pokes
        self.render_ages = render_ages  # the per-node family is left to `heartbeat_ages()` (the controller's route)
        self.clock = clock

    def collect(self):
        yield from self.nodes()
        yield from self.jobs()
        if self.links is not None:
            sent = CounterMetricFamily("phalanx_agent_messages", "Agents' messages to the controller since it started: "
                                       "full heartbeats, and beats on their links (a heartbeat with nothing new)",
                                       labels=["kind"])
            sent.add_metric(["heartbeat"], self.links.heartbeats)
            sent.add_metric(["beat"], self.links.beats)
            yield sent
            yield CounterMetricFamily("phalanx_link_pokes", "Pokes sent down agents' links (news for the node: "
                                      "heartbeat now)", value=self.links.pokes)

    # ---- nodes -----------------------------------------------------------------------------------------
    def nodes(self):
        nodes = GaugeMetricFamily("phalanx_nodes", "Nodes by group, state and role (member or spare)",
                                  labels=["group", "state", "role"])
        rows = self.store.execute("SELECT group_name, state, is_spare, COUNT(*) AS n FROM nodes "
                                  "GROUP BY group_name, state, is_spare")
        for r in rows:
            nodes.add_metric([r["group_name"], r["state"], "spare" if r["is_spare"] else "member"], r["n"])
        yield nodes
        if not self.render_ages:
            age = GaugeMetricFamily(AGE, AGE_DOC, labels=["node", "group", "role"])
            for name, group, role, seconds in self._ages():
                age.add_metric([name, group, role], seconds)
            yield age
        for name, doc, label, known in (
                ("health_check_failures", "Health checks that failed a node, by check (every check a healthy "
                                          "node ran starts at 0)", "check", ()),
                ("node_faults", "Nodes marked faulty, by cause", "cause", FAULT_CAUSES),
                ("node_replacements", "Faulty member nodes replaced (by a spare or a fresh node), by the fault's "
                                      "cause", "reason", FAULT_CAUSES)):
            family = CounterMetricFamily(f"phalanx_{name}", doc, labels=[label])
            for value, n in sorted({**dict.fromkeys(known, 0), **self.store.counters(name)}.items()):
                family.add_metric([value], n)
            yield family

    def _ages(self):
        now = self.clock()
        for n in self.store.nodes(include_terminated=False):  # (the controller's view: heartbeats are batched
            if n.state.value not in RETIRED and n.last_heartbeat is not None:  # into SQLite, store.observe_node)
                yield n.name, n.group, "spare" if n.is_spare else "member", max(0.0, now - n.last_heartbeat)

    def heartbeat_ages(self) -> bytes:
        """The per-node family in the text format, rendered here: prometheus_client's exposition took ~20 µs a
        sample (each label name validated, each value escaped) with the GIL held, while heartbeats waited. The same
        text (tests/test_metrics.py); a 4,096-node scrape 30 ms, not 85 (`benchmarks/scrape.py --nodes 4096`)."""
        lines = [f"# HELP {AGE} {AGE_DOC}", f"# TYPE {AGE} gauge"]
        for name, group, role, seconds in self._ages():
            lines.append(f'{AGE}{{group="{_escape(group)}",node="{_escape(name)}",role="{role}"}} '
                         f'{floatToGoString(seconds)}')
        return ("\n".join(lines) + "\n").encode()

    # ---- jobs ------------------------------------------------------------------------------------------
    def jobs(self):
        by_state = GaugeMetricFamily("phalanx_jobs", "Jobs by state", labels=["state"])
        found = {r["state"]: r["n"] for r in self.store.execute("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")}
        for state in JobState:
            by_state.add_metric([state.value], found.get(state.value, 0))
        yield by_state

        shown = self.runs.followers(self.records.recent_jobs(self.runs.keep_ended))
        f = _JobFamilies()
        for job, follower in shown:
            f.add(job, follower)
        restarts = CounterMetricFamily("phalanx_job_restarts", "Generations ended by a fault and followed by "
                                       "another, by cause (the generation's outcome)", labels=["job", "cause"])
        counts = self._restarts([j.id for j, _ in shown])
        for job, _ in shown:
            for cause in RESTART_CAUSES:
                restarts.add_metric([job.id, cause], counts.get((job.id, cause), 0))
        yield from f.families()
        yield restarts

    def _restarts(self, ids: list[str]) -> dict[tuple[str, str], int]:
        if not ids:
            return {}
        marks = ",".join("?" * len(ids))
        rows = self.store.execute(
            f"SELECT g.job, g.outcome, COUNT(*) AS n FROM generations g JOIN jobs j ON j.id = g.job "
            f"WHERE g.job IN ({marks}) AND g.generation < j.generation AND g.outcome IS NOT NULL "
            f"GROUP BY g.job, g.outcome", tuple(ids))
        return {(r["job"], r["outcome"]): r["n"] for r in rows}


class _JobFamilies:
    """The per-job families of one scrape, filled job by job."""

    def __init__(self):
        g, c = GaugeMetricFamily, CounterMetricFamily
        job = ["job"]
        self.info = g("phalanx_job_info", "1 for each job shown; its name, kind and state as labels",
                      labels=["job", "name", "kind", "state"])
        self.step = g("phalanx_job_step", "The newest step trained (rank 0's record, else the workers' report)", labels=job)
        self.last_step = g("phalanx_job_last_step_timestamp_seconds", "When the newest step record was written "
                           "(epoch seconds)", labels=job)
        self.tokens = c("phalanx_job_tokens", "Tokens processed by every step executed (replayed ones too)", labels=job)
        self.loss = g("phalanx_job_loss", "Training loss of the newest step", labels=job)
        self.grad_norm = g("phalanx_job_grad_norm", "Gradient norm of the newest step", labels=job)
        self.tps = g("phalanx_job_tokens_per_second", "Tokens per second of the newest step", labels=job)
        self.mfu = g("phalanx_job_mfu_ratio", "Model FLOPs utilisation of the newest step (0-1; only where the "
                     "device's peak is known)", labels=job)
        self.step_seconds = _histogram("phalanx_job_step_duration_seconds", "Step durations (rank 0)", job)
        self.phases = _histogram("phalanx_job_recovery_phase_seconds", "Recovery phase durations, one observation "
                                 "per recovery: detect, regroup, restore, first_step", ["job", "phase"])
        self.saves = _histogram("phalanx_job_checkpoint_save_seconds", "Checkpoint saves, start to commit (rank 0)", job)
        self.goodput = g("phalanx_job_goodput_seconds", "Wall time since submission by goodput category (the "
                         "ledger; recomputed every few seconds)", labels=["job", "category"])
        self.ratio = g("phalanx_job_goodput_ratio", "Productive time / wall time since submission", labels=job)
        self.stragglers = c("phalanx_job_stragglers", "Ranks flagged as stragglers (one per job, generation and "
                            "rank; docs/observability.md, Stragglers)", labels=job)

    def add(self, job: Job, f: RunFollower) -> None:
        j = [job.id]
        self.info.add_metric([job.id, job.name, job.kind, job.state.value], 1)
        last = f.last or {}
        step = last.get("step", job.last_step)
        if step is not None:
            self.step.add_metric(j, step)
        for family, key in ((self.last_step, "time"), (self.loss, "loss"), (self.grad_norm, "grad_norm"),
                            (self.tps, "tokens_per_s"), (self.mfu, "mfu")):
            value = last.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                family.add_metric(j, value)
        if job.kind == "train":
            self.tokens.add_metric(j, f.tokens)
            _add(self.step_seconds, j, f.step_seconds)
            _add(self.saves, j, f.checkpoint_seconds)
        self.stragglers.add_metric(j, len(f.stragglers()))
        derived = f.derived()
        for phase in PHASES:
            _add(self.phases, [job.id, phase],
                 Histogram.of(PHASE_BUCKETS, [r[phase] for r in derived.recoveries if phase in r]))
        if derived.ledger is not None:
            for category in CATEGORIES:
                self.goodput.add_metric([job.id, category], derived.ledger.seconds.get(category, 0.0))
            self.ratio.add_metric(j, derived.ledger.goodput)

    def families(self):
        yield from (self.info, self.step, self.last_step, self.tokens, self.loss, self.grad_norm, self.tps, self.mfu,
                    self.step_seconds, self.phases, self.saves, self.goodput, self.ratio, self.stragglers)

"""Running a chaos soak: one local cluster (N worker nodes + spares of `local.cpu-1`, short heartbeat and hang
timeouts so that every fault is detected in seconds), the failure-free reference run of each (mode, layout)
the plan needs (the modes' references must agree bit for bit before any trial relies on them), then one job
per trial, one after another, each with its faults injected (`inject.Injector`) and every invariant checked
once it ended (`invariants`). A trial that breaks one keeps its evidence (run dir, the controller's
description and events, every rank's log, the controller's and agents' logs) under its run dir. At the end
the cluster is deleted and the soak proves nothing of it is left running.

Knows the control plane through its public API (`ClusterClient`, `JobClient`, the documented files); how a
fault is delivered and what an invariant checks are the other modules' business.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from phalanx.chaos import invariants as inv
from phalanx.chaos.census import agent_pid, take_census
from phalanx.chaos.inject import InjectionError, Injector, drill_for
from phalanx.chaos.plan import JobShape, Trial, layout_dims, steps_allowed
from phalanx.control.backends.local import cmdline, process_running, processes_mentioning, session_members
from phalanx.control.client.cluster import ClusterClient, controller_pid, create_cluster, delete_cluster, start_controller
from phalanx.control.client.jobs import FINAL_STATES, JobClient
from phalanx.resilience.drill import ENV_VAR

CLUSTER = "chaos"


class SoakError(RuntimeError):
    """The soak cannot go on (the cluster would not come up, the references disagree)."""


@dataclass
class Settings:
    nodes: int = 4
    spares: int = 2
    shape: JobShape = field(default_factory=JobShape)
    hold_s: float = 2.0  # how long the drill holds the target rank in its phase while the fault is injected
    slow_s: float = 3.0  # a slow rank's sleep
    heartbeat_timeout_s: float = 3.0
    hang_timeout_s: float = 4.0
    pg_timeout_s: float = 30.0
    recovery_timeout_s: float = 60.0
    trial_timeout_s: float = 180.0
    max_retries: int = 4
    drill_in_restart: bool = False  # restart-mode workers install the drill (they do not today)


def job_tree(run_dir: Path, data: Path, mode: str, layout: str, s: Settings) -> dict:
    """The tiny model, fp32, one rank per node, 2 samples per rank per step; the same for every trial and its
    reference."""
    shape = s.shape
    return {"run_dir": str(run_dir), "seed": 7, "precision": "fp32", "pg_timeout_s": s.pg_timeout_s,
            "model": {"preset": "tiny", "overrides": {"vocab_size": 512, "n_layers": 2}},
            "data": {"path": str(data)}, "parallel": layout_dims(layout, shape.world),
            "training": {"global_batch_size": 2 * shape.world, "micro_batch_size": 2, "max_steps": shape.steps,
                         "log_interval": shape.steps},
            "optimizer": {"lr": 3e-3}, "lr_schedule": {"warmup_steps": 3, "total_steps": shape.steps},
            "checkpoint": {"interval": shape.interval, "keep": 3},
            "resilience": {"recovery": mode, "regroup_timeout_s": 60.0,
                           "recovery_timeout_s": s.recovery_timeout_s}}


def read_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_span_s(records: list[dict]) -> float | None:
    steps = inv.step_records(records)
    return steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else None


def time_lost_s(records: list[dict], max_steps: int) -> float | None:
    """Wall time the faults cost: from the first step record to the last, minus the time the run's own median
    step takes for the steps a failure-free run has (so detection, recovery and redone steps all count, and a
    machine busier during this job than during the reference does not)."""
    steps = inv.step_records(records)
    gaps = sorted(b["time"] - a["time"] for a, b in zip(steps, steps[1:]))
    if not gaps:
        return None
    return steps[-1]["time"] - steps[0]["time"] - (max_steps - 1) * gaps[len(gaps) // 2]


class Soak:
    def __init__(self, root: Path, settings: Settings, *, say: Callable[[str], None] = print):
        self.root, self.s, self.say = Path(root).resolve(), settings, say
        self.root.mkdir(parents=True, exist_ok=True)
        self.references: dict[str, dict] = {}  # layout → {"losses", "span_s", "verified"}
        self.node_pids: set[int] = set()
        self.worker_pids: set[int] = set()
        self.client: ClusterClient | None = None

    # ---- the cluster ----------------------------------------------------------------------------------
    def start(self) -> None:
        from phalanx.data import prepare, write_demo_corpus

        data = self.root / "data"
        if not (data / "tokens" / "train.bin").exists():
            corpus = write_demo_corpus(data / "corpus.jsonl")
            prepare([corpus], data / "tokens", block_size=64, vocab_size=512, val_percent=0.0, progress=False)
        self.data = data / "tokens"
        spec = self.root / "cluster.json"
        spec.write_text(json.dumps({
            "name": CLUSTER, "backend": "local", "node_recovery": "automatic",
            "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": self.s.nodes,
                                 "spares": self.s.spares, "warm_standby": True}],
            "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": self.s.heartbeat_timeout_s,
                       "hang_timeout_s": self.s.hang_timeout_s}}))
        create_cluster(spec, timeout_s=180)
        self.client, self.jobs = ClusterClient(CLUSTER), JobClient(CLUSTER)

    def close(self, keep_files: bool) -> list[str]:
        """Delete the cluster (its files kept when a trial failed) and return what is still running of it."""
        if self.client is None:
            return []
        self._remember_pids()
        home = str(self.client.paths.root)
        delete_cluster(CLUSTER, keep_files=keep_files, timeout_s=30)
        deadline, left = time.monotonic() + 10, []
        while time.monotonic() < deadline:
            left = sorted({p for pid in self.node_pids for p in session_members(pid)}
                          | {p for p in self.worker_pids if process_running(p, "phalanx")}
                          | set(processes_mentioning(home)))
            if not left:
                break
            time.sleep(0.2)
        return [f"{p}: {cmdline(p)[:120]}" for p in left]

    def _remember_pids(self) -> None:
        try:
            self.node_pids.update(agent_pid(n) for n in self.client.nodes() if n.get("handle"))
        except Exception:  # noqa: BLE001 - best effort: the controller may be the thing that broke
            pass

    def _standby_warm(self, node: dict) -> bool:
        ids = ((node.get("report") or {}).get("standbys")) or {}
        if not ids:
            return False
        for slot, sid in ids.items():
            log = Path(node["work_dir"]) / f"standby-{slot}.log"
            try:
                if f"standby/{sid}: warm" not in log.read_text(errors="replace"):
                    return False
            except FileNotFoundError:
                return False
        return True

    def wait_ready(self, timeout_s: float = 180.0, warm: bool = False) -> list[dict]:
        """Every member and spare healthy, nothing provisioning, every idle node keeping its warm standby
        (`warm`: warmed up too; correctness never depends on it, only how fast a replacement starts)."""
        deadline, why = time.monotonic() + timeout_s, "?"
        while time.monotonic() < deadline:
            if controller_pid(self.client.paths) is None:
                self.say("the controller is not running: `cluster start`")
                start_controller(CLUSTER, timeout_s=90)
            nodes = self.client.nodes()
            live = [n for n in nodes if n["state"] != "terminated"]
            healthy = [n for n in live if n["state"] == "healthy"]
            members = [n for n in healthy if not n["is_spare"]]
            spares = [n for n in healthy if n["is_spare"]]
            cold = [n["name"] for n in healthy if not n.get("job") and not (
                self._standby_warm(n) if warm else (n.get("report") or {}).get("standbys"))]
            why = (f"{len(members)}/{self.s.nodes} members and {len(spares)}/{self.s.spares} spares healthy, "
                   f"{len(live) - len(healthy)} other live node(s), no {'warm ' if warm else ''}standby on {cold}")
            if len(members) == self.s.nodes and len(spares) == self.s.spares and len(live) == len(healthy) \
                    and not cold:
                self.node_pids.update(agent_pid(n) for n in nodes if n.get("handle"))
                return nodes
            time.sleep(0.2)
        raise SoakError(f"the cluster did not get back to full strength within {timeout_s:g} s: {why}")

    def census(self):
        return take_census(self.client.nodes(), controller_pid(self.client.paths))

    # ---- jobs -------------------------------------------------------------------------------------------
    def submit(self, name: str, run_dir: Path, mode: str, layout: str, env: dict | None = None) -> dict:
        from phalanx.train.config import config_from_dict

        config = config_from_dict(job_tree(run_dir, self.data, mode, layout, self.s))
        return self.jobs.submit(config, nodes=self.s.nodes, auto_resume=True, max_retries=self.s.max_retries,
                                name=name, recovery=mode, env=env or {})

    def finish(self, job: dict, started: float) -> tuple[dict, list[str]]:
        """Wait for the job to end (or give up at the trial timeout and cancel it), then for every worker of
        it to be confirmed gone."""
        problems = []
        try:
            remaining = self.s.trial_timeout_s - (time.monotonic() - started)
            info = self.jobs.wait(job["id"], timeout_s=max(1.0, remaining))
        except TimeoutError as err:
            problems.append(f"the job did not finish within {self.s.trial_timeout_s:g} s: {err}")
            try:
                self.jobs.cancel(job["id"], timeout_s=60)
            except Exception as cancel_err:  # noqa: BLE001 - reported with the trial
                problems.append(f"cancelling it failed too: {cancel_err!r}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = self.jobs.describe(job["id"])
            if info["state"] in FINAL_STATES and all(g["ended_at"] for g in info["generations"]):
                break
            time.sleep(0.2)
        self.worker_pids.update(w["pid"] for w in info["workers"] if w.get("pid"))
        return info, problems

    def reference(self, layout: str, modes: list[str]) -> dict:
        """The failure-free losses of `layout`, run once per mode; the modes must agree bit for bit."""
        if layout in self.references:
            return self.references[layout]
        runs = {}
        for mode in modes:
            self.wait_ready()
            run_dir = self.root / "references" / f"{layout}-{mode}"
            shutil.rmtree(run_dir, ignore_errors=True)
            started = time.monotonic()
            info, problems = self.finish(self.submit(f"ref-{layout}-{mode}", run_dir, mode, layout), started)
            records = read_records(run_dir)
            problems += inv.check_finished(info, records, self.s.shape.steps)
            if problems or len(info["generations"]) != 1:
                raise SoakError(f"the failure-free {mode} run ({layout}) did not finish cleanly: "
                                f"{problems or info['generations']}")
            runs[mode] = {s["step"]: s["loss"] for s in inv.step_records(records)}
            span = training_span_s(records)
            self.say(f"reference {layout}/{mode}: {len(runs[mode])} steps, final loss "
                     f"{runs[mode][self.s.shape.steps]:.6f}, {time.monotonic() - started:.1f} s")
        first, *others = modes
        for mode in others:
            if runs[mode] != runs[first]:
                diff = [(k, loss, runs[mode].get(k)) for k, loss in runs[first].items() if loss != runs[mode].get(k)]
                raise SoakError(f"the failure-free runs disagree ({layout}: {first} vs {mode}) at (step, loss, "
                                f"loss): {diff[:4]}; losses cannot be compared exactly")
        self.references[layout] = {"losses": runs[first], "span_s": span, "verified": list(modes)}
        return self.references[layout]

    # ---- one trial ----------------------------------------------------------------------------------------
    def run_trial(self, trial: Trial, reference: dict) -> dict:
        wall = time.monotonic()
        name = f"t{trial.index:03d}-{trial.kind}"
        run_dir = self.root / "trials" / f"{trial.index:03d}-{trial.kind}-{trial.phase}-{trial.mode}"
        shutil.rmtree(run_dir, ignore_errors=True)
        result = {"trial": trial.as_dict(), "label": trial.label(), "run_dir": str(run_dir), "delivered": [],
                  "failures": {}}
        try:
            self.wait_ready()
        except SoakError as err:
            result.update(outcome="failed", failures={"cluster": [str(err)]}, wall_s=0.0)
            return result
        before = self.census()
        drill = drill_for(trial, hold_s=self.s.hold_s, slow_s=self.s.slow_s)
        started = time.monotonic()
        job = self.submit(name, run_dir, trial.mode, trial.layout, env={ENV_VAR: drill.to_env()})
        injector = Injector(self.client, self.jobs, job, run_dir, trial, timeout_s=self.s.trial_timeout_s / 2,
                            drill_in_restart=self.s.drill_in_restart)
        failures: dict[str, list[str]] = {}
        try:
            injector.run()
        except InjectionError as err:
            failures["injected"] = [str(err)]
        result["delivered"], result["hit"] = injector.delivered, injector.hit
        info, problems = self.finish(job, started)
        records = read_records(run_dir)
        failures["finished"] = problems + inv.check_finished(info, records, self.s.shape.steps)
        failures["losses"] = inv.check_losses(records, reference["losses"])
        allowed = steps_allowed(trial, self.s.shape)
        failures["steps_lost"] = inv.check_steps_lost(records, allowed)
        failures["events"] = (inv.check_metrics_events(records)
                              + inv.check_controller_events(info, trial.mode, self.s.shape.steps))
        failures["generations"] = inv.check_generations(info, *trial.expected_generations())
        failures["leaks"] = self._leaks(info, before)
        failures = {k: v for k, v in failures.items() if v}
        recoveries = inv.recoveries(records)
        lost_s = time_lost_s(records, self.s.shape.steps)
        result.update(
            job=info["id"], state=info["state"], generations=len(info["generations"]),
            outcomes=[g["outcome"] for g in info["generations"]], failures=failures,
            outcome="survived" if not failures else "failed", steps_allowed=allowed,
            steps_lost=max((r["lost"] for r in recoveries), default=0),
            restored=[e.get("source") for e in records if e.get("event") == "state_restored"],
            downtime_s=None if lost_s is None else round(lost_s, 2),
            wall_s=round(time.monotonic() - wall, 1))
        if failures:
            result["evidence"] = self._keep_evidence(info, run_dir, result)
        else:
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        (run_dir / "trial.json").write_text(json.dumps(result, indent=1, default=str))
        return result

    def _leaks(self, info: dict, before) -> list[str]:
        pids = {w["pid"] for w in info["workers"] if w.get("pid")}
        ports = sorted({g["master_port"] for g in info["generations"] if g.get("master_port")})
        deadline = time.monotonic() + 15
        while True:  # a worker told to stop gets 3 s before SIGKILL; a standby is replaced in seconds
            alive = {p: cmdline(p) for p in pids if (process_running(p, "phalanx.worker") or process_running(p, "phalanx.train.worker"))}
            try:
                self.wait_ready(timeout_s=60)
                found = inv.check_leaks(before, self.census(), alive, ports)
            except SoakError as err:
                found = [str(err)]
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    def _keep_evidence(self, info: dict, run_dir: Path, result: dict) -> str:
        ev = run_dir / "evidence"
        ev.mkdir(parents=True, exist_ok=True)
        (ev / "describe.json").write_text(json.dumps(info, indent=1, default=str))
        if Path(info["log_dir"]).is_dir():
            shutil.copytree(info["log_dir"], ev / "logs", dirs_exist_ok=True)
        paths = self.client.paths
        nodes = sorted({n for g in info["generations"] for n in g["nodes"]})
        for src, dst in [(paths.controller_log, ev / "controller.log"),
                         *[(paths.node_dir(n) / "agent.log", ev / f"agent-{n}.log") for n in nodes]]:
            try:
                lines = Path(src).read_text(errors="replace").splitlines()[-3000:]
                dst.write_text("\n".join(lines) + "\n")
            except FileNotFoundError:
                pass
        summary = [f"trial {result['label']}: {json.dumps(result['trial'])}",
                   f"job {info['id']} {info['state']}: {info.get('reason')}",
                   "generations: " + str([(g["generation"], g["outcome"], g.get("end_reason"))
                                          for g in info["generations"]]),
                   "faults delivered:", *[f"  {json.dumps(d)}" for d in result["delivered"]],
                   "invariants broken:", *[f"  {k}: {m}" for k, v in result["failures"].items() for m in v],
                   f"metrics: {run_dir / 'metrics.jsonl'}", f"rank logs: {ev / 'logs'}"]
        (ev / "README.txt").write_text("\n".join(summary) + "\n")
        return str(ev)


def run_soak(plan: list[Trial], root: Path, settings: Settings | None = None, *, seed: int | None = None,
             home: Path | None = None, duration_s: float | None = None, say: Callable[[str], None] = print,
             on_trial: Callable[[dict], None] | None = None) -> dict:
    """Run `plan` (stopping early past `duration_s`); returns the report (see `report.summarize`)."""
    from phalanx.chaos.report import summarize

    settings = settings or Settings()
    root = Path(root).resolve()
    previous_home = os.environ.get("PHALANX_HOME")
    if home is not None:
        os.environ["PHALANX_HOME"] = str(Path(home).resolve())
    soak, results, started, left, error = Soak(root, settings, say=say), [], time.monotonic(), [], None
    try:
        soak.start()
        say(f"cluster {CLUSTER}: {settings.nodes} nodes + {settings.spares} spares (local.cpu-1), "
            f"hang_timeout_s={settings.hang_timeout_s:g}, heartbeat_timeout_s={settings.heartbeat_timeout_s:g}")
        modes = {}
        for t in plan:
            modes.setdefault(t.layout, [])
            if t.mode not in modes[t.layout]:
                modes[t.layout].append(t.mode)
        for layout, layout_modes in modes.items():
            soak.reference(layout, sorted(layout_modes))
        for trial in plan:
            if duration_s is not None and time.monotonic() - started > duration_s:
                say(f"--duration {duration_s:g} s reached after {len(results)} trials")
                break
            try:
                result = soak.run_trial(trial, soak.references[trial.layout])
            except Exception as err:  # noqa: BLE001 - a harness error fails this trial; the soak goes on
                import traceback

                result = {"trial": trial.as_dict(), "label": trial.label(), "delivered": [], "outcome": "failed",
                          "failures": {"harness": [f"{type(err).__name__}: {err}"]},
                          "traceback": traceback.format_exc()}
                say(result["traceback"])
            results.append(result)
            if on_trial:
                on_trial(result)
    except SoakError as err:
        error = str(err)
    finally:
        failed = bool(error) or any(r["outcome"] != "survived" for r in results)
        left = soak.close(keep_files=failed)
        if home is not None:
            if previous_home is None:
                os.environ.pop("PHALANX_HOME", None)
            else:
                os.environ["PHALANX_HOME"] = previous_home
    report = summarize(results, seed=seed, wall_s=time.monotonic() - started)
    report.update(settings={**asdict(settings), "shape": asdict(settings.shape)},
                  plan=[t.as_dict() for t in plan], references={k: {"verified": v["verified"], "span_s": v["span_s"]}
                                                               for k, v in soak.references.items()},
                  trials=results, left_running=left, error=error, root=str(root))
    report["summary"]["ok"] = not error and not left and report["summary"]["trials_failed"] == 0
    return report

"""The Python API of jobs; `phalanx job ...` is a thin layer over it.

    jobs = JobClient("demo")                       # the cluster (optional when only one exists)
    job = jobs.submit("recipes/tiny.yaml", nodes=4, auto_resume=True, overrides=["training.max_steps=200"])
    job = jobs.submit(command=["python", "train.py"], nodes=2, max_retries=1)   # any torch.distributed program
    jobs.list()  jobs.describe(job["id"])  jobs.wait(job["id"])  jobs.cancel(job["id"])
    jobs.logs(job["id"], rank=0)  jobs.follow(job["id"], write=print)

`submit` validates before anything starts: `--nodes` against the group's member count, and a training
config with the runtime's own `preflight` at world size = nodes × workers per node (batch arithmetic,
parallel degrees, data files, vocabulary). Relative paths in the config are made absolute against the
submitter's working directory (workers run elsewhere). Reads go to the controller; when it is down,
`list`, `describe`, `logs` and `follow` read SQLite and the log files directly: each job they return then
carries `controller_down_since` (when the controller last recorded anything), because a state that is not
final may have changed since (the CLI shows it as unknown).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable, Sequence

from phalanx.control.client.cluster import ClusterClient, ClusterError
from phalanx.control.http import ApiError, ControllerUnreachable
from phalanx.control.state.jobs import JobRecords
from phalanx.control.spec import INSTANCE_TYPES

FINAL_STATES = ("succeeded", "failed", "cancelled")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class JobError(RuntimeError):
    """A job request that was refused, or a job that cannot be found; nothing was started."""


def absolute_paths(config, cwd: Path):
    """The config with run_dir, data.path, checkpoint.dir and model.hf_path absolute (against `cwd`)."""
    from phalanx.train.config import config_from_dict, dump_config

    tree = dump_config(config)

    def fix(section: dict, key: str) -> None:
        value = section.get(key)
        if value is not None and not Path(value).is_absolute():
            section[key] = str((cwd / value).resolve())

    fix(tree, "run_dir")
    fix(tree["data"], "path")
    fix(tree["checkpoint"], "dir")
    fix(tree["model"], "hf_path")
    return config_from_dict(tree)


def timeout_warning(pg_timeout_s: float, hang_timeout_s: float) -> str | None:
    """The warning `submit` gives when a job's collective timeout does not outlast the cluster's hang timeout
    (the defaults, 300 > 240, agree)."""
    if pg_timeout_s > hang_timeout_s:
        return None
    return (f"pg_timeout_s={pg_timeout_s:g} is not above the cluster's hang_timeout_s={hang_timeout_s:g}: a hung "
            f"rank's peers time out first and the hang is retried as an application error instead of replacing "
            f"its node (raise pg_timeout_s, or lower the spec's health.hang_timeout_s)")


def default_name(text: str) -> str | None:
    """A job name from a run dir or a program name (None: the job id is used)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", text).lstrip("._-")[:64]
    return name or None


class JobClient:
    def __init__(self, cluster: str | None = None, *, timeout_s: float = 10.0):
        self.cluster = ClusterClient(cluster, timeout_s=timeout_s)

    # ---- submit -------------------------------------------------------------------------------------
    def submit(self, config=None, *, command: Sequence[str] | None = None, nodes: int | None = None,
               overrides: Sequence[str] = (), name: str | None = None, group: str | None = None,
               auto_resume: bool = False, max_retries: int = 0, env: dict[str, str] | None = None,
               cwd: Path | str | None = None, recovery: str | None = None, straggler_factor: float | None = None,
               straggler_steps: int | None = None, straggler_policy: str | None = None, priority: int = 0) -> dict:
        """Submit a training config (path or TrainConfig) or a command. Returns the job (state pending),
        with `warnings`. Raises JobError, ClusterError, or the runtime's ConfigError / DataError /
        ParallelConfigError when the config fails preflight — in every case nothing was started.

        `recovery`: restart | checkpointless; default: the training config's `resilience.recovery`.
        `straggler_*`: a rank slower than factor × its peers' median for `steps` reports in a row is a straggler;
        policy report | replace-node (docs/observability.md); default: the controller's (2, 5, report).
        `nodes`: required, but for an elastic config (its `elastic:` section sizes it: docs/elastic.md).
        `priority`: a pending job takes nodes from running elastic jobs of lower priority."""
        if recovery not in (None, "restart", "checkpointless"):
            raise JobError(f"--recovery {recovery!r}: choose restart or checkpointless")
        if straggler_policy not in (None, "report", "replace-node"):
            raise JobError(f"--straggler-policy {straggler_policy!r}: choose report or replace-node")
        if (config is None) == (command is None):
            raise JobError("give either a training config or a command (`-- CMD ...`), not both or neither")
        if name is not None and not NAME.match(name):
            raise JobError(f"--name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or "
                           f"digit")
        cwd = Path(cwd or os.getcwd()).resolve()
        info = self.cluster.describe()
        if not info["controller"]["running"]:
            raise ClusterError(f"the controller of cluster {self.cluster.name} is not running "
                               f"(`phalanx cluster start {self.cluster.name}`)")
        g = self._group(info, group)
        slots = INSTANCE_TYPES[g["instance_type"]].worker_slots
        cfg, warnings = None, []
        if config is not None:
            from phalanx.train.config import TrainConfig, load_config

            cfg = config if isinstance(config, TrainConfig) else load_config(config, list(overrides))
            if cfg.elastic is not None:
                if nodes is not None:
                    raise JobError("--nodes with an elastic config: its size follows elastic.min_replicas/"
                                   "max_replicas (drop --nodes)")
                if cfg.ranks_per_replica % slots:
                    raise JobError(f"elastic: one replica is {cfg.ranks_per_replica} rank(s) (parallel.dp_shard × "
                                   f"tensor_parallel_degree) but a node of group {g['name']} runs {slots} workers; set "
                                   f"dp_shard × tp to a multiple of {slots}")
                nodes = cfg.elastic.min_replicas * cfg.ranks_per_replica // slots
                most = max(cfg.elastic.sizes()) * cfg.ranks_per_replica // slots
                if most > g["count"]:
                    warnings.append(f"elastic.max_replicas={cfg.elastic.max_replicas} needs {most} nodes; group "
                                    f"{g['name']} has {g['count']}: the job grows that far only once the group does "
                                    f"(`phalanx cluster scale {g['name']} --count {most}`)")
        if nodes is None:
            raise JobError("--nodes is required (but for an elastic config, which sizes itself)")
        if nodes < 1 or nodes > g["count"]:
            raise JobError(f"--nodes {nodes} is not possible in cluster {info['name']}: group {g['name']} has "
                           f"{g['count']} worker nodes (+{g['spares']} spares, which stand by to replace faulty "
                           f"nodes and run no jobs); use --nodes 1 to {g['count']}")
        body = {"nodes": nodes, "priority": priority, "name": name, "group": g["name"], "cwd": str(cwd),
                "env": env or {}, "auto_resume": auto_resume, "max_retries": max_retries}
        body.update({k: v for k, v in (("straggler_factor", straggler_factor), ("straggler_steps", straggler_steps),
                                       ("straggler_policy", straggler_policy)) if v is not None})
        if config is not None:
            from phalanx.train.config import dump_config
            from phalanx.train.launch import preflight

            cfg = absolute_paths(cfg, cwd)
            preflight(cfg, nodes * slots)
            warning = timeout_warning(cfg.pg_timeout_s, info["health"]["hang_timeout_s"])
            if warning:
                warnings.append(warning)
            if cfg.elastic is not None:  # a resize regroups in place: survivors keep their processes
                if recovery == "restart":
                    raise JobError("--recovery restart with an elastic config: resizing keeps the processes, which "
                                   "is checkpointless recovery (drop --recovery)")
                recovery = "checkpointless"
            recovery = recovery or cfg.resilience.recovery
            if recovery != cfg.resilience.recovery:  # the job's workers read the mode from the config too
                cfg = cfg.model_copy(update={"resilience": cfg.resilience.model_copy(update={"recovery": recovery})})
            body.update(kind="train", config=dump_config(cfg), checkpoint_dir=str(cfg.checkpoint_dir),
                        name=name or default_name(Path(cfg.run_dir).name), recovery=recovery)
        else:
            if recovery == "checkpointless":
                raise JobError("--recovery checkpointless needs a training config: a command's state is unknown "
                               "to Phalanx (use --auto-resume to rerun it on a fault)")
            body.update(kind="command", argv=list(command), name=name or default_name(Path(command[0]).name))
        try:
            job = self.cluster.call("POST", "/v1/jobs", body)
        except ApiError as err:
            if 400 <= err.status < 500:
                raise JobError(err.detail) from None
            raise
        job["warnings"] = warnings
        return job

    def scale(self, job: str, replicas: int) -> dict:
        """Ask an elastic job to run `replicas` replicas (it changes at its next step boundary)."""
        try:
            return self.cluster.call("POST", f"/v1/jobs/{job}/scale", {"replicas": replicas})
        except ApiError as err:
            if 400 <= err.status < 500:
                raise JobError(err.detail) from None
            raise

    def checkpoint(self, job: str, *, wait: bool = True, timeout_s: float = 300.0, poll_s: float = 0.5) -> dict:
        """Ask a running training job for a checkpoint now, between its intervals: its ranks save after the first
        step all of them have seen the request in. Returns the request ({"job", "generation", "step": the newest
        step the controller knew of, "request": its id}); with `wait`, once the checkpoint serving it is
        committed (or the job succeeded: its final one), with it as "saved" ({"step", "time", ...}). A job
        recovering when asked, or that moves to a new generation before it saves, is asked again once it runs.
        JobError: refused (unknown job, a command job) or the job ended otherwise; TimeoutError past
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        asked = self._ask_checkpoint(job, deadline if wait else None, poll_s)
        while wait:
            info = self.describe(job)
            served, saved = info.get("requested_checkpoint"), info.get("last_checkpoint")
            if served and (served.get("request") or 0) >= asked["request"]:
                return {**asked, "saved": served}
            if info["state"] == "succeeded":  # its final checkpoint holds everything
                return {**asked, "saved": saved}
            if info["state"] in FINAL_STATES:
                raise JobError(f"job {job} {info['state']} before it saved the checkpoint asked for (its newest: "
                               f"{'step ' + str(saved['step']) if saved else 'none'})")
            if info["generation"] != asked["generation"] and info["state"] == "running":
                asked = self._ask_checkpoint(job, deadline, poll_s)  # its generation ended before it saved
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} saved no checkpoint after step {asked['step']} within {timeout_s:g} "
                                   f"s of the request (now {info['state']} at step {info['last_step']})")
            time.sleep(poll_s)
        return asked

    def _ask_checkpoint(self, job: str, deadline: float | None, poll_s: float) -> dict:
        """POST the request; a job not running yet (pending, recovering) is asked again until `deadline`."""
        while True:
            try:
                return self.cluster.call("POST", f"/v1/jobs/{job}/checkpoint")
            except ApiError as err:
                if err.status == 409 and deadline is not None and time.monotonic() < deadline:
                    if self.describe(job)["state"] not in FINAL_STATES:
                        time.sleep(poll_s)
                        continue
                if 400 <= err.status < 500:
                    raise JobError(err.detail) from None
                raise

    @staticmethod
    def _group(info: dict, name: str | None) -> dict:
        groups = info["groups"]
        if name is None:
            if len(groups) > 1:
                raise JobError(f"cluster {info['name']} has several instance groups "
                               f"({', '.join(g['name'] for g in groups)}); name one with --group")
            return groups[0]
        for g in groups:
            if g["name"] == name:
                return g
        raise JobError(f"no instance group {name!r} in cluster {info['name']} "
                       f"(groups: {', '.join(g['name'] for g in groups)})")

    # ---- read ---------------------------------------------------------------------------------------
    def _offline(self, read: Callable[[JobRecords], object]):
        return self.cluster._read_store(lambda store: read(JobRecords(store)))

    @property
    def offline_since(self) -> float | None:
        """After a read served from SQLite (controller down): when the controller last recorded anything."""
        return self.cluster.offline_since

    def list(self) -> list[dict]:
        """Every job; from SQLite when the controller is down (each then with `controller_down_since`)."""
        try:
            jobs = self.cluster.call("GET", "/v1/jobs")
            self.cluster.offline_since = None
            return jobs
        except ControllerUnreachable:
            jobs = self._offline(lambda r: [j.public() for j in r.jobs()])
            return [{**j, "controller_down_since": self.offline_since} for j in jobs]

    def describe(self, job: str, *, brief: bool = False) -> dict:
        """The job with its generations, workers and events (`brief`: without the workers and events); from
        SQLite when the controller is down (then with `controller_down_since`)."""
        try:
            info = self.cluster.call("GET", f"/v1/jobs/{job}" + ("?brief=true" if brief else ""))
            self.cluster.offline_since = None
            return info
        except ApiError as err:
            if err.status == 404:
                raise JobError(err.detail) from None
            raise
        except ControllerUnreachable:
            def read(records: JobRecords):
                found = records.find(job)
                if found is None:
                    raise JobError(f"no job {job!r} in cluster {self.cluster.name}")
                return records.describe(found, brief=brief)

            return {**self._offline(read), "controller_down_since": self.offline_since}

    def goodput(self, job: str, info: dict | None = None):
        """The job's goodput ledger (`phalanx.observability.goodput.Ledger`), computed here from its run's files:
        `<checkpoint_dir>/events.jsonl` and, for a training job, `<run_dir>/metrics.jsonl`. `info`: the job's
        description if already read. Raises JobError for an unknown job, RunFilesMissing naming a missing file."""
        from phalanx.observability.goodput import read_run
        from phalanx.observability.run_events import job_metrics_dir, job_run_dir

        info = info or self.describe(job)
        return read_run(job_run_dir(info["cwd"], info["checkpoint_dir"]),
                        job_metrics_dir(info["kind"], info["cwd"], info.get("config")),
                        end=info["ended_at"], job=info["id"])

    def wait(self, job: str, *, timeout_s: float = 600.0, states: Sequence[str] = FINAL_STATES,
             poll_s: float = 0.2) -> dict:
        """Poll until the job is in one of `states` (default: finished). Raises TimeoutError."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.describe(job, brief=True)  # (a poll: the workers and events only at the end)
            if info["state"] in states:
                return self.describe(job)
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} is still {info['state']} after {timeout_s:g} s ({info['reason']})")
            time.sleep(poll_s)

    def cancel(self, job: str, *, wait: bool = True, timeout_s: float = 30.0) -> dict:
        """Cancel; with `wait`, return once every worker of the job is confirmed stopped."""
        try:
            info = self.cluster.call("POST", f"/v1/jobs/{job}/cancel")
        except ApiError as err:
            if err.status in (404, 409):
                raise JobError(err.detail) from None
            raise
        deadline = time.monotonic() + timeout_s
        while wait:
            info = self.describe(job, brief=True)
            if all(g["ended_at"] for g in info["generations"]):
                info = self.describe(job)
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job}'s workers were not confirmed stopped within {timeout_s:g} s")
            time.sleep(0.2)
        return info

    # ---- logs ---------------------------------------------------------------------------------------
    def log_files(self, job: str, rank: int | None = None) -> dict[int, Path]:
        info = self.describe(job)
        if rank is not None and not 0 <= rank < info["world_size"]:
            raise JobError(f"--rank {rank} is out of range: job {info['id']} has ranks 0-{info['world_size'] - 1}")
        ranks = range(info["world_size"]) if rank is None else [rank]
        return {r: Path(info["log_dir"]) / f"rank{r}.log" for r in ranks}

    def logs(self, job: str, rank: int | None = None) -> str:
        """Every generation's output of one rank, or of all ranks (each line prefixed with its rank)."""
        files = self.log_files(job, rank)
        parts = []
        for r, path in files.items():
            text = path.read_text(errors="replace") if path.exists() else ""
            parts.append(text if rank is not None else "".join(f"[rank {r}] {line}\n" for line in text.splitlines()))
        return "".join(parts)

    def follow(self, job: str, rank: int | None = None, *, write: Callable[[str], None],
               poll_s: float = 0.2) -> dict:
        """Write new log lines as they appear until the job finishes; returns its final description."""
        files = self.log_files(job, rank)
        offsets = {r: 0 for r in files}
        partial = {r: "" for r in files}
        while True:
            info = self.describe(job)
            for r, path in files.items():
                if not path.exists():
                    continue
                with open(path, errors="replace") as f:
                    f.seek(offsets[r])
                    chunk = f.read()
                    offsets[r] = f.tell()
                *lines, partial[r] = (partial[r] + chunk).split("\n")
                for line in lines:
                    write(line if rank is not None else f"[rank {r}] {line}")
            if info["state"] in FINAL_STATES and all(g["ended_at"] for g in info["generations"]):
                for r, rest in partial.items():
                    if rest:
                        write(rest if rank is not None else f"[rank {r}] {rest}")
                return info
            time.sleep(poll_s)

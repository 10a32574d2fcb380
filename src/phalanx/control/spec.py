"""The cluster spec: one typed, validated YAML/JSON file, modelled on HyperPod's CreateCluster request.

    name: demo
    backend: local                  # local: agents on this machine; hosts: agents join from other hosts
                                    # (`phalanx agent --controller URL ...`); slurm: Slurm allocates the
                                    # nodes and runs their agents (see SlurmSpec: `slurm: {partition: ...}`)
    node_recovery: automatic        # automatic: replace faulty nodes (from spares); none: leave them faulty
    instance_groups:
      - name: workers
        instance_type: local.cpu-1  # see INSTANCE_TYPES
        count: 2
        spares: 1
        on_create: lifecycle/on_create.sh   # relative to the spec file; optional
    health: {heartbeat_interval_s: 0.5, heartbeat_timeout_s: 3}
    api: {host: 127.0.0.1, port: 0}

HyperPod has a *controller group* (the Slurm head node). Here the controller is the `phalanx` daemon
itself, started by `phalanx cluster create` on this machine, so there is no controller group to declare;
every instance group is a group of worker nodes.

Validated at the edge, before anything starts; an error names the field, the value and the fix, in
Phalanx's words (`instance_groups.0.cout: unknown field; valid fields: name, ...`), never pydantic's. The
local backend runs every node as an agent process on this machine, so it refuses more than
LOCAL_MAX_NODES nodes (members + spares over every group). Knows nothing about processes, SQLite or HTTP.
"""

from __future__ import annotations

import json
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$"
# The local backend: each node is an agent process on this machine (plus, with warm standbys, one worker
# process per slot with torch imported, ~0.3-0.5 GB each). 64 nodes is far beyond what one machine trains
# with, and still few enough processes that a typo (`spares: 10000`) is refused rather than run.
LOCAL_MAX_NODES = 64


class SpecError(ValueError):
    """A cluster spec that cannot be created."""


@dataclass(frozen=True)
class InstanceType:
    """A resource profile: how many worker processes (CPU) or GPUs one node of this type offers."""

    name: str
    worker_slots: int  # worker processes per node (one per device on GPU types)
    gpus: int  # GPUs the health check expects to see on the node


INSTANCE_TYPES: dict[str, InstanceType] = {
    t.name: t
    for t in (
        InstanceType("local.cpu-1", worker_slots=1, gpus=0),
        InstanceType("local.cpu-2", worker_slots=2, gpus=0),
        InstanceType("local.cpu-4", worker_slots=4, gpus=0),
        InstanceType("gpu.1", worker_slots=1, gpus=1),
        InstanceType("gpu.2", worker_slots=2, gpus=2),
        InstanceType("gpu.4", worker_slots=4, gpus=4),
        InstanceType("gpu.8", worker_slots=8, gpus=8),
    )
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InstanceGroupSpec(_Strict):
    name: str
    instance_type: str
    count: int = Field(..., ge=1, description="member nodes the group keeps in service")
    spares: int = Field(0, ge=0, description="healthy idle nodes kept ready to replace a faulty member")
    on_create: Path | None = Field(None, description="lifecycle script run on every node it provisions")
    warm_standby: bool = Field(True, description="idle nodes (spares, members no job holds) pre-start one "
                                                 "worker process per slot, torch imported, so a replacement "
                                                 "or a new job's rank starts in a fraction of a second")
    worker_template: bool = Field(True, description="every node keeps a worker template (python -m "
                                                    "phalanx.zygote: torch imported once) and forks its "
                                                    "workers and standbys from it instead of starting Python")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.match(NAME_PATTERN, v):
            raise ValueError(f"{v!r} is not a valid group name: use lowercase letters, digits and '-'")
        return v

    @field_validator("instance_type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        if v not in INSTANCE_TYPES:
            raise ValueError(f"unknown instance type {v!r}; valid instance types: {', '.join(INSTANCE_TYPES)}")
        return v

    @property
    def profile(self) -> InstanceType:
        return INSTANCE_TYPES[self.instance_type]


class HealthSpec(_Strict):
    heartbeat_interval_s: float = Field(0.5, gt=0, le=60)
    heartbeat_timeout_s: float = Field(3.0, gt=0, description="no heartbeat this long → node faulty")
    link_grace_s: float | None = Field(0.5, gt=0, le=60, description=(
        "an agent's link closed (its process ended: its kernel closed the connection) and no heartbeat or new "
        "link this long → node faulty, without waiting out heartbeat_timeout_s; null: heartbeats only"))
    mass_silence_fraction: float | None = Field(0.5, gt=0, le=1, description=(
        "more than this fraction of the nodes that heartbeat (and at least 8) silent past heartbeat_timeout_s at "
        "once: none is judged faulty (the controller's own load or network, not that many hosts); null: each alone"))
    # below the training config's default pg_timeout_s (300): a frozen rank is killed by its agent (a node
    # fault: the node is replaced) before its peers' collectives time out (which would read as an app error)
    hang_timeout_s: float = Field(240.0, gt=0, description="no training progress this long → worker killed")
    deep_health_check: bool = Field(False, description="run the deep check (a timed all_reduce with a healthy "
                                                       "peer) while a node is provisioned")
    deep_check_min_busbw_gbps: float = Field(0.05, ge=0, description="deep check: fail a node whose all_reduce "
                                                                     "bus bandwidth is below this (GB/s)")
    deep_check_size_mb: float = Field(8.0, gt=0, le=4096, description="deep check: all_reduce size (MiB)")
    deep_check_iters: int = Field(5, ge=1, le=1000, description="deep check: timed all_reduce iterations")
    deep_check_timeout_s: float = Field(60.0, gt=0, description="deep check: a round must finish within this")
    check_interval_s: float = Field(5.0, gt=0, description="how often agents re-run their health checks")
    min_free_disk_mb: int = Field(512, ge=0, description="free space required in a node's work dir")
    min_free_memory_mb: int = Field(256, ge=0, description="available memory required on the host")
    provision_timeout_s: float = Field(60.0, gt=0, description="agent must register within this")
    lifecycle_timeout_s: float = Field(600.0, gt=0, description="on_create script must finish within this")

    @model_validator(mode="after")
    def _timeout_covers_heartbeats(self) -> HealthSpec:
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_timeout_s={self.heartbeat_timeout_s} must be at least twice "
                f"heartbeat_interval_s={self.heartbeat_interval_s}, or one late heartbeat fails a node"
            )
        return self


class ApiSpec(_Strict):
    host: str = Field("127.0.0.1", description="listen address; loopback by default (backend hosts: the address "
                                               "the agents' hosts reach the controller and its store at)")
    port: int = Field(0, ge=0, le=65535, description="0 = pick a free port")


class SlurmSpec(_Strict):
    """Where and how `backend: slurm` asks Slurm for nodes: one allocation (`sbatch`) per instance group for its
    members + spares, one `srun` step running an agent on every node of it; one-node jobs refill the group."""

    partition: str | None = Field(None, description="sbatch --partition (default: Slurm's default partition)")
    account: str | None = Field(None, description="sbatch --account")
    sbatch_options: list[str] = Field([], description="more sbatch options, each one argument "
                                                      "(e.g. ['--time=7-0', '--gres=gpu:8'])")
    remediator: Literal["drain", "hyperpod", "report"] = Field(
        "drain", description="what a faulty node's Slurm node gets: drain (scontrol: state=drain, reason 'phalanx: "
                             "<fault>'), hyperpod (drain with reason 'Action:Replace', HyperPod's convention), "
                             "report (nothing asked of Slurm: an event only)")
    allocation_timeout_s: float = Field(300.0, gt=0, description="an allocation still pending after this fails "
                                                                 "its nodes (squeue's reason says why)")
    work_root: str = Field("/tmp/phalanx-agents", description="directory on each node for its work dir")
    python: str | None = Field(None, description="the Python on the nodes that has Phalanx installed (default: "
                                                 "the controller's own interpreter, a shared install)")
    allocation: str | None = Field(None, description="run the nodes in this Slurm job's allocation instead of "
                                                     "submitting one (`phalanx cluster up --slurm` sets it from "
                                                     "SLURM_JOB_ID); refills are still one-node jobs")
    spare_timeout_s: float = Field(600.0, gt=0, description="cluster up --slurm --run: a job short of nodes this "
                                                            "long is requeued (scontrol requeue) to resume from "
                                                            "its checkpoint on a fresh allocation")
    controller_lost_s: float = Field(60.0, gt=0, description="cluster up --slurm: agents that cannot reach the "
                                                             "controller (on the batch host) this long ask Slurm "
                                                             "to requeue the job (scontrol requeue)")
    max_requeues: int = Field(3, ge=0, description="cluster up --slurm --run: requeue after a failure at most this "
                                                   "many times (SLURM_RESTART_COUNT counts them, less the requeues "
                                                   "at the time limit); then exit 3, do not requeue")
    time_limit_checkpoint_s: float = Field(90.0, gt=0, description="cluster up --slurm --run: on Slurm's warning "
                                                                   "before the time limit (USR2: `--signal=B:USR2@120` "
                                                                   "in the batch script), wait at most this long for "
                                                                   "the job's checkpoint, then requeue")


class ClusterSpec(_Strict):
    name: str
    backend: Literal["local", "hosts", "slurm"] = "local"
    node_recovery: Literal["automatic", "none"] = "automatic"
    instance_groups: list[InstanceGroupSpec] = Field(..., min_length=1)
    health: HealthSpec = HealthSpec()
    api: ApiSpec = ApiSpec()
    slurm: SlurmSpec | None = Field(None, description="backend slurm: partition, account, remediator, ...")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.match(NAME_PATTERN, v):
            raise ValueError(f"{v!r} is not a valid cluster name: 1-40 lowercase letters, digits and '-'")
        return v

    @model_validator(mode="after")
    def _unique_groups(self) -> ClusterSpec:
        names = [g.name for g in self.instance_groups]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"instance_groups: group names must be unique; repeated: {', '.join(dupes)} "
                             f"(rename one)")
        return self

    @model_validator(mode="after")
    def _hosts_reach_the_controller(self) -> ClusterSpec:
        if self.backend in ("hosts", "slurm") and self.api.host in ("", "0.0.0.0", "::"):
            raise ValueError(f"api.host: {self.api.host!r} is every address; backend {self.backend} hands the "
                             f"controller's address to agents and workers on other hosts (the API and the "
                             f"rendezvous store listen there): set the address those hosts reach this machine at")
        return self

    @model_validator(mode="after")
    def _slurm_section_for_slurm(self) -> ClusterSpec:
        if self.slurm is not None and self.backend != "slurm":
            raise ValueError(f"slurm: set for backend {self.backend!r}; it applies to `backend: slurm` only (set "
                             f"the backend, or remove the section)")
        return self

    @property
    def slurm_settings(self) -> SlurmSpec:
        """The `slurm:` section, or its defaults (Slurm's default partition, drain) when the spec has none."""
        return self.slurm or SlurmSpec()

    @model_validator(mode="after")
    def _fits_the_local_backend(self) -> ClusterSpec:
        total = sum(g.count + g.spares for g in self.instance_groups)
        if self.backend == "local" and total > LOCAL_MAX_NODES:
            parts = ", ".join(f"{g.name}: count {g.count} + spares {g.spares}" for g in self.instance_groups)
            raise ValueError(
                f"instance_groups: {total} nodes in total ({parts}) is more than the local backend runs: at most "
                f"{LOCAL_MAX_NODES} nodes, each an agent process on this machine; lower count or spares"
            )
        return self

    def group(self, name: str) -> InstanceGroupSpec:
        for g in self.instance_groups:
            if g.name == name:
                return g
        raise KeyError(name)


def _model_at(loc: tuple, root: type[BaseModel] = None) -> type[BaseModel] | None:
    """The spec model that holds the fields at `loc` (e.g. ("instance_groups", 0) → InstanceGroupSpec)."""
    model = root or ClusterSpec
    for part in loc:
        if isinstance(part, int):
            continue  # a list item: the list's element type was taken with the list field
        field = model.model_fields.get(part)
        if field is None:
            return None
        inner = field.annotation
        while typing.get_origin(inner) in (list, typing.Union, types.UnionType):
            inner = next((a for a in typing.get_args(inner) if a is not type(None)), None)
        if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
            return None
        model = inner
    return model


def _describe_error(e: dict) -> str:
    """One pydantic error as `field: message (fix)`, in our words."""
    loc = tuple(e["loc"])
    field = ".".join(str(p) for p in loc)
    value = e.get("input")
    if e["type"] == "extra_forbidden":
        model = _model_at(loc[:-1])
        valid = f"; valid fields: {', '.join(model.model_fields)}" if model else ""
        return f"{field}: unknown field{valid}"
    if e["type"] == "missing":
        return f"{field}: required field is missing; add it"
    if e["type"] == "model_type" or e["type"] == "dict_type":
        return f"{field}: expected a mapping of fields, got {type(value).__name__} {value!r}"
    if e["type"] == "list_type":
        return f"{field}: expected a list, got {type(value).__name__} {value!r}"
    msg = e["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if msg.startswith("Input should be "):
        msg = "must be " + msg.removeprefix("Input should be ")
    if not loc:  # a check across fields (its message names them)
        return msg
    shown = "" if isinstance(value, (dict, list)) else f" (got {value!r})"
    return f"{field}: {msg}{shown}"


def _format_validation_error(source: str, err: ValidationError) -> str:
    return f"invalid cluster spec {source}:\n" + "\n".join(f"  {_describe_error(e)}" for e in err.errors())


def spec_from_dict(tree: object, *, source: str = "<dict>", base_dir: Path | None = None) -> ClusterSpec:
    """Validate a parsed spec. Lifecycle script paths are resolved against `base_dir` and must exist."""
    if not isinstance(tree, dict):
        raise SpecError(f"invalid cluster spec {source}: expected a mapping at the top level, "
                        f"got {type(tree).__name__}")
    try:
        spec = ClusterSpec.model_validate(tree)
    except ValidationError as err:
        raise SpecError(_format_validation_error(source, err)) from None
    return _resolve_scripts(spec, base_dir or Path.cwd(), source)


def _resolve_scripts(spec: ClusterSpec, base_dir: Path, source: str) -> ClusterSpec:
    groups = []
    for i, g in enumerate(spec.instance_groups):
        if g.on_create is not None:
            path = (base_dir / g.on_create.expanduser()).resolve()
            if not path.is_file():
                raise SpecError(
                    f"invalid cluster spec {source}:\n  instance_groups.{i}.on_create: lifecycle script "
                    f"{path} does not exist (paths are relative to the spec file's directory)"
                )
            g = g.model_copy(update={"on_create": path})
        groups.append(g)
    return spec.model_copy(update={"instance_groups": groups})


def load_spec(path: Path | str) -> ClusterSpec:
    """Read and validate a YAML or JSON spec file. Raises SpecError naming the field and the fix."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"cluster spec {path} does not exist")
    text = path.read_text()
    try:
        tree = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise SpecError(f"cluster spec {path} is not valid {kind}: {err}") from None
    return spec_from_dict(tree, source=str(path), base_dir=path.parent)


def agent_settings(spec: ClusterSpec, group: str) -> dict:
    """What an agent of `group` runs by: its node's profile, whether it keeps a worker template, and the
    spec's heartbeat and health settings (agent.json for the local backend, the join reply for the hosts one)."""
    g, h = spec.group(group), spec.health
    return {
        "cluster": spec.name, "group": g.name, "instance_type": g.instance_type, "gpus": g.profile.gpus,
        "worker_slots": g.profile.worker_slots, "worker_template": g.worker_template,
        "heartbeat_interval_s": h.heartbeat_interval_s, "check_interval_s": h.check_interval_s,
        "hang_timeout_s": h.hang_timeout_s, "deep_health_check": h.deep_health_check,
        "min_free_disk_mb": h.min_free_disk_mb, "min_free_memory_mb": h.min_free_memory_mb,
        "lifecycle_timeout_s": h.lifecycle_timeout_s,
        # `cluster up --slurm`: the controller lives on the batch host; its silence means the allocation lost it
        "slurm_requeue": ({"job": spec.slurm.allocation, "after_s": spec.slurm.controller_lost_s}
                          if spec.slurm and spec.slurm.allocation else None),
    }


HEARTBEATS_PER_S_TESTED = 8192  # what one controller kept up with on 2 cores (4,096 nodes at 0.5 s, 2026-12-02)


def heartbeat_load_warning(spec: ClusterSpec) -> str | None:
    """A warning when the cluster's nodes would send one controller more heartbeats a second than it was measured
    to keep up with (benchmarks/control_scale.py), with what to change; else None. `cluster create` prints it."""
    nodes = sum(g.count + g.spares for g in spec.instance_groups)
    rate = nodes / spec.health.heartbeat_interval_s
    if rate <= HEARTBEATS_PER_S_TESTED:
        return None
    return (f"{nodes} nodes heartbeating every {spec.health.heartbeat_interval_s:g} s send the controller {rate:,.0f} "
            f"heartbeats a second; one controller on 2 cores kept up with about {HEARTBEATS_PER_S_TESTED:,} a second "
            f"(benchmarks/control_scale.py). If heartbeats arrive late (`phalanx cluster list-nodes`: heartbeat "
            f"ages past the interval), raise health.heartbeat_interval_s to "
            f"{nodes / HEARTBEATS_PER_S_TESTED:g} or more, and heartbeat_timeout_s with it: a node whose agent "
            f"dies is still found by its link within about a second (docs/control-plane.md)")

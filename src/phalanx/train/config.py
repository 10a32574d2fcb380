"""The training job's configuration: one typed, validated YAML file.

Validated at the edge (the CLI, before any process starts): an error names the field, the value and the
fix. `load_config(path, overrides)` reads a YAML recipe (or a JSON config, e.g. a run's resolved
`config.json`), applies `key.sub=value` overrides from the command line and checks the local paths the run
needs (`check_local_paths`: `model.hf_path` holds a readable Hugging Face config.json, `run_dir` is not a
file). Knows nothing about processes or meshes; of models only their names and HF config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from phalanx.models.config import PRESETS
from phalanx.protocol.elastic import ElasticSettings, replicas_of, split_batch


class ConfigError(ValueError):
    """A training config that cannot run."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Strict):
    preset: str | None = "tiny"
    # Continual pretraining: a local Hugging Face directory (config.json + *.safetensors). Its weights
    # initialise the run (when no Phalanx checkpoint exists yet) and its config.json gives the shapes.
    hf_path: Path | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v):
        if v is not None and v not in PRESETS:
            raise ValueError(f"unknown preset {v!r}; choose one of {sorted(PRESETS)} or set model.hf_path")
        return v


class ParallelSection(_Strict):
    dp_replicate: int = Field(1, ge=1, description="replicas (HSDP's replicate degree)")
    dp_shard: int = Field(-1, description="ranks each replica is sharded over (hybrid_shard_degree); -1 = auto")
    tensor_parallel_degree: int = Field(
        1, ge=1, description="ranks that split attention heads and MLP columns; world = dp_replicate × dp_shard × tp"
    )
    expert_parallel_degree: int = Field(
        1, ge=1, description="ranks of one shard group that split the MoE experts; divides n_experts and dp_shard"
    )


class DataSection(_Strict):
    path: Path = Path("data/demo")
    split: str = "train"


class TrainingSection(_Strict):
    global_batch_size: int = Field(32, ge=1, description="samples per optimizer step, all ranks together")
    micro_batch_size: int = Field(4, ge=1, description="samples per forward/backward on one rank")
    max_steps: int = Field(100, ge=1)
    log_interval: int = Field(1, ge=1)


class OptimizerSection(_Strict):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="max global grad norm; 0 disables clipping")


class LRScheduleSection(_Strict):
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    # Length of the cosine decay; defaults to training.max_steps. Set it to train a run in pieces.
    total_steps: int | None = Field(None, ge=1)


class ActivationCheckpointingSection(_Strict):
    mode: Literal["none", "full", "selective"] = "none"
    every: int = Field(2, ge=1, description="selective: checkpoint every k-th block")


class CheckpointSection(_Strict):
    interval: int = Field(50, ge=0, description="steps between checkpoints; 0 = only at the end")
    dir: Path | None = Field(None, description="default: <run_dir>/checkpoints")
    keep: int = Field(3, ge=1, description="committed checkpoints to keep")
    async_save: bool = Field(False, alias="async")
    resume: bool = True
    verify_checksums: bool = True

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class MetricsSection(_Strict):
    """What rank 0 records beside metrics.jsonl."""

    tensorboard: bool = Field(True, description="write TensorBoard scalars (loss, grad_norm, lr, tokens_per_s, "
                                                "mfu) to <run_dir>/tensorboard; false: none")
    peak_flops_per_s: float | None = Field(
        None, gt=0, description="peak FLOP/s of one device, for the `mfu` of each step; default: from the GPU's "
                                "name and `precision` (H100, H200, A100, ...), none on CPU or an unknown GPU")


class FaultDrill(_Strict):
    """A fault drill: worker `rank` kills its own process (SIGKILL, no cleanup) at one moment of training, as a
    crash there would — or, for `network`, stays alive while its collective fails. It fires only in a process
    of the job's first generation, once. For tests and drills of the recovery path; `phalanx fault inject`
    covers faults at an arbitrary wall-clock moment."""

    rank: int = Field(ge=0, description="the rank that dies (its rank in the first generation)")
    step: int = Field(1, ge=1, description="the step during which it dies (the step being computed, or saved)")
    at: Literal["forward", "backward", "optimizer", "checkpoint", "regroup", "network"] = Field(
        description="forward: inside the last block's forward; backward: inside the first block's backward "
                    "(after later blocks' gradients were reduced); optimizer: right after its own optimizer "
                    "update, before the step is counted; checkpoint: as the checkpoint of `step` starts "
                    "(peers are inside the save); regroup: while regrouping after the first fault (a second "
                    "failure during recovery; `step` unused); network: no process dies, the rank's collective "
                    "fails inside the last block's forward as if the network dropped it")


class ResilienceSection(_Strict):
    """How a job on a Phalanx cluster recovers from a failed node or process (`phalanx job submit`)."""

    recovery: Literal["restart", "checkpointless"] = Field(
        "restart", description="restart: every process restarts from the newest checkpoint; checkpointless: "
                               "survivors keep running and the replacement restores from peers' memory")
    snapshot_interval: int = Field(1, ge=0, description="checkpointless without replicas (dp_replicate=1): "
                                                        "steps between buddy snapshots; 0 = off")
    recovery_timeout_s: float = Field(600.0, gt=0, description="how long a survivor waits for the next "
                                                               "generation before giving up (exit 3)")
    regroup_timeout_s: float = Field(120.0, gt=0, description="how long a generation waits for all its ranks "
                                                              "to arrive")
    stuck_grace_s: float = Field(10.0, gt=0, description="a rank still forming a generation (joining, restoring) "
                                 "this long after a newer one was published is blocked where it cannot notice; it "
                                 "exits (code 75) and a fresh process takes its rank. Raise it above the longest "
                                 "model build + checkpoint load")
    drill: FaultDrill | None = Field(None, description="kill one worker at a chosen moment (checkpointless "
                                                       "jobs; see FaultDrill)")


class TrainConfig(_Strict):
    run_dir: Path = Path("runs/default")
    seed: int = 1234
    precision: Literal["bf16", "fp32"] = "bf16"
    reshard_after_forward: bool = True
    compile: bool = Field(False, description="torch.compile each transformer block in place (as torchtitan does; "
                          "checkpoint names unchanged): faster steps on a GPU after a compile of tens of seconds")
    pg_timeout_s: float = Field(300.0, gt=0)
    model: ModelSection = ModelSection()
    parallel: ParallelSection = ParallelSection()
    data: DataSection = DataSection()
    training: TrainingSection = TrainingSection()
    optimizer: OptimizerSection = OptimizerSection()
    lr_schedule: LRScheduleSection = LRScheduleSection()
    activation_checkpointing: ActivationCheckpointingSection = ActivationCheckpointingSection()
    checkpoint: CheckpointSection = CheckpointSection()
    metrics: MetricsSection = MetricsSection()
    resilience: ResilienceSection = ResilienceSection()
    elastic: ElasticSettings | None = Field(None, description="run between min and max data-parallel replicas, "
                                                              "resized in place (a Phalanx cluster job)")

    @model_validator(mode="after")
    def _model_source(self):
        if self.model.hf_path is None and self.model.preset is None:
            raise ValueError("set model.preset or model.hf_path")
        return self

    @model_validator(mode="after")
    def _elastic_layout(self):
        if self.elastic is None:
            return self
        if self.parallel.dp_shard < 1:
            raise ValueError("elastic: set parallel.dp_shard (>= 1) to the ranks that shard one replica; the "
                             "replica count (dp_replicate) follows the job's size")
        if self.parallel.dp_replicate != 1:
            raise ValueError(f"elastic: parallel.dp_replicate={self.parallel.dp_replicate} is chosen at run time "
                             f"for an elastic job; leave it at 1 and set elastic.min_replicas/max_replicas")
        gb, mb = self.training.global_batch_size, self.training.micro_batch_size
        if self.elastic.scale_batch and gb % self.elastic.max_replicas:
            raise ValueError(f"elastic.scale_batch: training.global_batch_size={gb} is the batch at max_replicas="
                             f"{self.elastic.max_replicas}; make it a multiple of {self.elastic.max_replicas}")
        if not self.elastic.valid_sizes(gb, mb, self.ranks_per_replica):
            raise ValueError(f"elastic: no allowed replica count {self.elastic.sizes()} can split "
                             f"training.global_batch_size={gb} into micro-batches of {mb} over "
                             f"{self.ranks_per_replica} rank(s) per replica; raise global_batch_size or lower "
                             f"max_replicas")
        return self

    @property
    def ranks_per_replica(self) -> int:
        """Ranks of one data-parallel replica (dp_shard × tp; -1 dp_shard: the whole world, one replica)."""
        return max(self.parallel.dp_shard, 1) * self.parallel.tensor_parallel_degree

    def for_world(self, world_size: int) -> "TrainConfig":
        """An elastic job's config for a generation of `world_size` ranks: dp_replicate = its replica count (and,
        with `elastic.scale_batch`, that count's global batch and peak learning rate). Any other config is
        returned as is."""
        if self.elastic is None:
            return self
        replicas = replicas_of(world_size, self.ranks_per_replica)
        update = {"parallel": self.parallel.model_copy(update={"dp_replicate": replicas})}
        if self.elastic.scale_batch:  # the batch follows the count, the peak learning rate with it
            gb = self.elastic.batch_at(self.training.global_batch_size, replicas)
            update["training"] = self.training.model_copy(update={"global_batch_size": gb})
            update["optimizer"] = self.optimizer.model_copy(
                update={"lr": self.optimizer.lr * self.elastic.lr_factor(replicas)})
        return self.model_copy(update=update)

    @property
    def checkpoint_dir(self) -> Path:
        return self.checkpoint.dir if self.checkpoint.dir is not None else self.run_dir / "checkpoints"

    @property
    def decay_steps(self) -> int:
        return self.lr_schedule.total_steps or self.training.max_steps

    def grad_accum_steps(self, dp_size: int) -> int:
        """global_batch ÷ (micro_batch × dp); an impossible combination says which numbers to change. An elastic
        job also runs sizes that do not divide the batch (`protocol.elastic.split_batch`: uneven shares)."""
        gb, mb = self.training.global_batch_size, self.training.micro_batch_size
        if self.elastic is not None:
            split = split_batch(gb, mb, dp_size)
            if split is None:
                raise ConfigError(f"training.global_batch_size={gb} cannot be split into micro-batches of {mb} over "
                                  f"{dp_size} data-parallel ranks (some rank would get fewer samples than "
                                  f"micro-batches); valid replica counts: "
                                  f"{self.elastic.valid_sizes(gb, mb, self.ranks_per_replica)}")
            return split[0]
        per_step = mb * dp_size
        if gb % per_step:
            lower, upper = (gb // per_step) * per_step, (gb // per_step + 1) * per_step
            options = [d for d in range(1, mb + 1) if gb % (d * dp_size) == 0]
            raise ConfigError(
                f"training.global_batch_size={gb} is not divisible by training.micro_batch_size={mb} × "
                f"data-parallel size {dp_size} = {per_step}; set global_batch_size to a multiple of {per_step} "
                f"(e.g. {lower or upper} or {upper})"
                + (f", or micro_batch_size to one of {options}" if options else "")
            )
        return gb // per_step


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
    node[keys[-1]] = value


def parse_overrides(items: list[str]) -> dict:
    tree: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. training.max_steps=30)")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw) if raw else None)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "overrides":
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid training config"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"  {field}: {e['msg']}{shown}")
    return "\n".join(lines)


def config_from_dict(tree: dict, source: str = "config") -> TrainConfig:
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def read_config_tree(path: str | Path) -> dict:
    """The raw tree of a config file: JSON when the name ends in .json, YAML otherwise."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass a YAML recipe (e.g. recipes/tiny-llama.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass a YAML recipe (e.g. recipes/tiny-llama.yaml)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be read: {err}") from None
    if path.suffix.lower() == ".json":
        try:
            tree = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON: {err}") from None
    else:
        try:
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return tree


def _existing_file_on(path: Path) -> Path | None:
    """`path` or its nearest existing ancestor, when that is not a directory (so no directory can be made)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def check_local_paths(config: TrainConfig) -> None:
    """The paths a run needs on this machine: `run_dir` (and `checkpoint.dir`) can be directories, and
    `model.hf_path` is a Hugging Face model directory whose config.json Phalanx reads. Raises ConfigError."""
    dirs = [("run_dir", config.run_dir)]
    if config.checkpoint.dir is not None:
        dirs.append(("checkpoint.dir", config.checkpoint.dir))
    for field, path in dirs:
        blocker = _existing_file_on(Path(path))
        if blocker is not None:
            where = "is an existing file" if blocker == Path(path) else f"is inside {blocker}, an existing file"
            raise ConfigError(f"{field}={str(path)!r} {where}; {field} must be a directory (the run writes "
                              f"metrics, its config and checkpoints there): choose another path")
    if config.model.hf_path is not None:
        from phalanx.models.hf import HFFormatError, read_hf_config

        try:
            read_hf_config(config.model.hf_path)
        except HFFormatError as err:
            raise ConfigError(f"model.hf_path={str(config.model.hf_path)!r}: {err}") from None


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    tree: dict = {} if path is None else read_config_tree(path)
    tree = _merge(tree, parse_overrides(overrides or []))
    config = config_from_dict(tree, str(path) if path else "config")
    check_local_paths(config)
    return config


def dump_config(config: TrainConfig) -> dict:
    return config.model_dump(mode="json", by_alias=True)

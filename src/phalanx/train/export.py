"""Export a committed Phalanx checkpoint to a Hugging Face directory (config.json + safetensors).

Runs in one process without a process group: DCP reads every shard of the model entries and
`phalanx.models.hf.save_hf` writes them in the HF layout that transformers loads as is. The output path is
checked before anything is read; given a run dir, the newest checkpoint that verifies is exported (a corrupt
newer one is skipped with a warning, as `phalanx train` does). The model's shapes come from the config the
checkpoint recorded, else from the run's config (config.json next to the run, or `--config`). Every problem
is a ConfigError / HFFormatError naming the path and the fix. Knows nothing about processes, parallel
layouts or recovery.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

from phalanx.models import ModelConfig, Transformer
from phalanx.models.hf import save_hf
from phalanx.train.checkpoint import MANIFEST, committed_steps, read_metadata, step_dir, verify
from phalanx.train.config import ConfigError, load_config


def check_output(out: Path, overwrite: bool) -> None:
    """OUT must be new, empty, or (with `overwrite`) an existing Hugging Face model directory."""
    out = Path(out)
    for ancestor in (out, *out.parents):
        if ancestor.exists():
            if not ancestor.is_dir():
                where = "is an existing file" if ancestor == out else f"is inside {ancestor}, an existing file"
                raise ConfigError(f"OUT {str(out)!r} {where}; choose a new directory for the Hugging Face model")
            break
    if not out.is_dir():
        return
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    if not overwrite:
        raise ConfigError(f"OUT {str(out)!r} already exists and is not empty ({shown}); choose a new directory, "
                          "or pass --overwrite to replace the Hugging Face model there")
    if not (out / "config.json").is_file():
        raise ConfigError(f"OUT {str(out)!r} is not a Hugging Face model directory (no config.json; it holds "
                          f"{shown}); --overwrite replaces only a Hugging Face model: choose another directory")


def find_checkpoint(path: Path, warn: Callable[[str], None] | None = None) -> Path:
    """The checkpoint to export: `path` itself when it is one step dir (it must verify), else the newest
    checkpoint under a run dir or a checkpoints dir that verifies (each skipped one is passed to `warn`)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint path {str(path)!r} does not exist; pass a run dir, its checkpoints dir "
                          "or a step-NNNNNNNN dir")
    if (path / MANIFEST).is_file():
        problem = verify(path, with_checksums=True)
        if problem:
            raise ConfigError(f"checkpoint {path} is unusable: {problem}; pass the run dir to export the newest "
                              "checkpoint that verifies")
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    skipped = []
    for step in committed_steps(root):
        ckpt = step_dir(root, step)
        problem = verify(ckpt, with_checksums=True)
        if problem is None:
            return ckpt
        skipped.append(f"{ckpt.name}: {problem}")
        if warn is not None:
            warn(f"checkpoint {ckpt} is unusable ({problem}); trying an older one")
    if skipped:
        raise ConfigError(f"no usable checkpoint under {path}: " + "; ".join(skipped))
    raise ConfigError(f"no committed checkpoint under {path}; pass a run dir or a step-NNNNNNNN dir")


def _run_config_next_to(ckpt: Path) -> Path | None:
    for candidate in (ckpt.parent.parent / "config.json", ckpt.parent / "config.json"):
        if candidate.is_file():
            return candidate
    return None


def _check_config_path(config_path: Path | None) -> None:
    if config_path is not None and not Path(config_path).is_file():
        raise ConfigError(f"--config {str(config_path)!r} does not exist; pass the run's config.json "
                          "(written next to its checkpoints) or its YAML recipe, or leave --config out")


def model_config_for(ckpt: Path, config_path: Path | None) -> ModelConfig:
    """The model the checkpoint holds: from `config_path` when given (checked against what the checkpoint
    recorded), else what the checkpoint recorded, else the run's config.json next to it."""
    from phalanx.train.trainer import resolve_model_config

    _check_config_path(config_path)
    recorded = read_metadata(ckpt).get("model")
    try:
        recorded_config = ModelConfig(**recorded) if isinstance(recorded, dict) else None
    except (TypeError, ValueError):  # written by another Phalanx version: use the run's config instead
        recorded_config = None
    if config_path is None and recorded_config is not None:
        return recorded_config
    source = config_path or _run_config_next_to(ckpt)
    if source is None:
        raise ConfigError(f"cannot find the run's config.json next to {ckpt}; pass --config")
    model_config = resolve_model_config(load_config(source))
    if isinstance(recorded, dict):
        diffs = model_config.differences(recorded)
        if diffs:
            shown = ", ".join(f"{k} {theirs} (checkpoint) vs {ours} (config)" for k, (theirs, ours) in diffs.items())
            raise ConfigError(f"--config {source} describes a different model than checkpoint {ckpt}: {shown}; "
                              "pass the config of the run that wrote it, or leave --config out")
    return model_config


def export_hf(checkpoint: Path, out: Path, *, config_path: Path | None = None, dtype: torch.dtype | None = None,
              overwrite: bool = False, warn: Callable[[str], None] | None = None) -> Path:
    check_output(out, overwrite)
    _check_config_path(config_path)
    ckpt = find_checkpoint(checkpoint, warn)
    model_config = model_config_for(ckpt, config_path)
    with torch.device("meta"):
        model = Transformer(model_config)
    model.to_empty(device="cpu")
    model_state = model.state_dict()
    try:
        dcp.load({"model_optim": {"model": model_state}}, checkpoint_id=str(ckpt), no_dist=True)
    except (RuntimeError, KeyError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"checkpoint {ckpt} does not hold the weights of the model its config describes "
                          f"({first}); pass the run's own config with --config") from None
    save_hf(model_state, model_config, out, dtype=dtype, overwrite=overwrite)
    return Path(out)

"""Export a committed Phalanx checkpoint to a Hugging Face directory (config.json + safetensors).

Runs in one process without a process group: DCP reads every shard of the model entries and
`phalanx.models.hf.save_hf` writes them in the HF layout that transformers loads as is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from phalanx.models import Transformer
from phalanx.models.hf import save_hf
from phalanx.train.checkpoint import MANIFEST, committed_steps, step_dir, verify
from phalanx.train.config import ConfigError, config_from_dict


def resolve_checkpoint(path: Path) -> tuple[Path, Path]:
    """(checkpoint dir, run config.json) from a run dir, a checkpoints dir or one step dir."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        ckpt = path
    else:
        root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        steps = committed_steps(root)
        if not steps:
            raise ConfigError(f"no committed checkpoint under {path}; pass a run dir or a step-NNNNNNNN dir")
        ckpt = step_dir(root, steps[0])
    for candidate in (ckpt.parent.parent / "config.json", ckpt.parent / "config.json"):
        if candidate.is_file():
            return ckpt, candidate
    raise ConfigError(f"cannot find the run's config.json next to {ckpt}; pass --config")


def export_hf(checkpoint: Path, out: Path, *, config_path: Path | None = None, dtype: torch.dtype | None = None,
              overwrite: bool = False) -> Path:
    ckpt, found_config = resolve_checkpoint(checkpoint)
    problem = verify(ckpt, with_checksums=True)
    if problem:
        raise ConfigError(f"checkpoint {ckpt} is unusable: {problem}")
    from phalanx.train.trainer import resolve_model_config

    run_config = config_from_dict(json.loads(Path(config_path or found_config).read_text()))
    model_config = resolve_model_config(run_config)
    with torch.device("meta"):
        model = Transformer(model_config)
    model.to_empty(device="cpu")
    model_state = model.state_dict()
    dcp.load({"model_optim": {"model": model_state}}, checkpoint_id=str(ckpt), no_dist=True)
    save_hf(model_state, model_config, out, dtype=dtype, overwrite=overwrite)
    return Path(out)

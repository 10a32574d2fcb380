"""The `phalanx train` command: bad input gets one clear error and starts nothing."""

from __future__ import annotations

import math

import pytest
import yaml
from typer.testing import CliRunner

from conftest import run_training, tiny_config
from phalanx.cli import app
from phalanx.train.checkpoint import committed_steps
from phalanx.train.config import ConfigError, load_config
from phalanx.train.metrics import read_metrics

runner = CliRunner()


def write_config(tmp_path, demo_data, **changes):
    tree = tiny_config(tmp_path / "run", demo_data).model_dump(mode="json", by_alias=True)
    for dotted, value in changes.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def invoke(*args):
    result = runner.invoke(app, ["train", *map(str, args)])
    return result.exit_code, " ".join(result.output.split())


def test_impossible_batch_arithmetic_names_the_numbers(tmp_path, demo_data):
    path = write_config(tmp_path, demo_data)
    code, out = invoke(path, "--nproc", 3)
    assert code == 2
    assert "global_batch_size=8" in out and "micro_batch_size=2" in out and "data-parallel size 3" in out
    assert not (tmp_path / "run").exists(), "nothing may start"


def test_degrees_that_do_not_tile_the_world(tmp_path, demo_data):
    code, out = invoke(write_config(tmp_path, demo_data), "--nproc", 4, "parallel.dp_replicate=3")
    assert code == 2 and "dp_replicate=3" in out and "world size 4" in out


def test_more_workers_than_gpus_is_refused_before_anything_starts(tmp_path, demo_data, monkeypatch):
    """On a machine with GPUs each worker takes its own (cuda:LOCAL_RANK); more workers than GPUs would fail inside
    the workers (an invalid device, or NCCL refusing two ranks on one GPU). CI has no GPU: the count is faked."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, out = invoke(write_config(tmp_path, demo_data), "--nproc", 2)
    assert code == 2 and "--nproc=2 but this machine shows 1 GPU" in out and "CUDA_VISIBLE_DEVICES=" in out, out
    assert not (tmp_path / "run").exists(), "nothing may start"


def test_tokenizer_vocab_larger_than_model(tmp_path, demo_data):
    code, out = invoke(write_config(tmp_path, demo_data), "model.overrides={vocab_size: 100}")
    assert code == 2 and "100" in out and "vocab" in out.lower()


def test_missing_data_and_unknown_field(tmp_path, demo_data):
    code, out = invoke(write_config(tmp_path, demo_data), "data.path=/nonexistent/tokens")
    assert code == 2 and "/nonexistent/tokens" in out
    code, out = invoke(write_config(tmp_path, demo_data), "training.max_step=5")
    assert code == 2 and "training.max_step" in out
    code, out = invoke(tmp_path / "missing.yaml")
    assert code == 2 and "missing.yaml" in out


def test_overrides_are_typed_and_validated():
    cfg = load_config(None, ["training.max_steps=7", "optimizer.lr=1e-4", "checkpoint.async=true"])
    assert (cfg.training.max_steps, cfg.optimizer.lr, cfg.checkpoint.async_save) == (7, 1e-4, True)
    with pytest.raises(ConfigError, match="training.max_steps"):
        load_config(None, ["training.max_steps=-1"])
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["training.max_steps"])


def test_every_recipe_validates():
    from pathlib import Path

    from phalanx.train.trainer import resolve_model_config

    recipes = sorted(Path(__file__).parent.parent.joinpath("recipes").glob("*.yaml"))
    assert {p.stem for p in recipes} >= {"tiny-llama", "tiny-mixtral", "mathstral-7b", "mixtral-8x7b", "llama2-7b",
                                         "llama3.1-8b", "llama3.1-70b", "gpt-oss-20b", "tiny-gpt-oss"}
    for path in recipes:
        cfg = load_config(path)
        if cfg.model.hf_path is None:
            resolve_model_config(cfg)


@pytest.mark.slow
def test_moe_bf16_selective_checkpointing_async_save_and_resume(tmp_path, demo_data):
    run_dir = tmp_path / "moe"
    sections = dict(
        precision="bf16",
        model={"preset": "tiny-moe", "overrides": {"vocab_size": 512, "n_layers": 2}},
        activation_checkpointing={"mode": "selective", "every": 2},
        checkpoint={"interval": 3, "async": True, "keep": 2},
    )
    steps = run_training(tiny_config(run_dir, demo_data, training={"max_steps": 6}, **sections), nproc=2)
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert committed_steps(run_dir / "checkpoints") == [6, 3]
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    _, events = read_metrics(run_dir)  # an async save is logged when it starts and again when it commits
    assert [(e["event"], e["step"]) for e in events if e["event"].startswith("checkpoint_")] == \
        [("checkpoint_started", 3), ("checkpoint_saved", 3), ("checkpoint_started", 6), ("checkpoint_saved", 6)]
    assert all(e["async"] for e in events if e["event"] == "checkpoint_saved")

    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 8}, **sections), nproc=2)
    _, events = read_metrics(run_dir)
    assert next(e for e in events if e["event"] == "resumed")["step"] == 6
    assert committed_steps(run_dir / "checkpoints") == [8, 6]

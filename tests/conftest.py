"""Shared fixtures: a small prepared corpus and a helper that runs `phalanx train` for real."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """The bundled demo corpus, BPE-tokenised (vocab 512) into 64-token blocks."""
    from phalanx.data import prepare, write_demo_corpus

    root = tmp_path_factory.mktemp("demo-data")
    corpus = write_demo_corpus(root / "corpus.jsonl")
    prepare([corpus], root / "tokens", block_size=64, vocab_size=512, val_percent=0.0, progress=False)
    return root / "tokens"


def tiny_config(run_dir: Path, data: Path, **sections):
    """A fast fp32 config of the tiny model (2 layers, vocab 512) on `data`."""
    from phalanx.train.config import config_from_dict

    tree = {
        "run_dir": str(run_dir),
        "seed": 7,
        "precision": "fp32",
        "model": {"preset": "tiny", "overrides": {"vocab_size": 512, "n_layers": 2}},
        "data": {"path": str(data)},
        "training": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 10, "log_interval": 5},
        "optimizer": {"lr": 3e-3},
        "lr_schedule": {"warmup_steps": 3, "total_steps": 30},
        "checkpoint": {"interval": 5, "keep": 10},
    }
    for key, value in sections.items():
        if isinstance(value, dict):
            tree.setdefault(key, {}).update(value)
        else:
            tree[key] = value
    return config_from_dict(tree)


_shared: dict = {}  # the session's worker template ("template") and the (device, inode) of its ranks' stdout


def _shared_template():
    """One worker template for the session's `run_training`s (`launch(..., template=)`): a launch then skips the
    template's import of torch and the training code (~8 s of CPU here; the CLI tests still start their own). Its
    ranks write to the stdout it was started with, the session's capture: a test capturing its own (`capfd`) gets
    None, and `launch` a template of its own."""
    from phalanx.train.forked import Template, TemplateError

    out = os.fstat(1)
    stdout = (out.st_dev, out.st_ino)
    if not _shared:
        try:
            _shared.update(template=Template.start(), stdout=stdout)
        except TemplateError:
            return None  # (the launch starts its own, or execs each rank, and says why)
    template = _shared["template"]
    usable = _shared["stdout"] == stdout and not template.broken and template.proc.poll() is None
    return template if usable else None


@pytest.fixture(scope="session", autouse=True)
def _close_shared_template():
    yield
    if _shared:
        _shared["template"].close()


def run_training(config, nproc: int) -> list[dict]:
    """Launch real worker processes; return the step records of metrics.jsonl."""
    from phalanx.train.launch import launch
    from phalanx.train.metrics import read_metrics

    code = launch(config, nproc, threads_per_worker=1, template=_shared_template())
    assert code == 0, f"training exited with {code}"
    steps, _ = read_metrics(config.run_dir)
    return steps

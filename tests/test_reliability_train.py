"""Holes a new user found in training, resuming, exporting and preparing data; each is a regression test.

Retention never deletes the good checkpoints around a corrupt one; a resume into a different model is refused
with the fields named; bad model/run/export paths get one clear error (exit 2, no traceback); a failed
`data prepare` removes only what it created; the worker runs under plain torchrun from a YAML recipe.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from conftest import run_training, tiny_config
from phalanx.cli import app
from phalanx.train.checkpoint import MANIFEST, committed_steps, read_metadata, verify
from phalanx.train.config import ConfigError, dump_config, load_config
from phalanx.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent
runner = CliRunner()


def cli(*args) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def assert_clean_refusal(code: int, out: str, *needles: str) -> None:
    assert code == 2, (code, out)
    assert "Traceback" not in out, out
    flat = " ".join(out.split())
    for needle in needles:
        assert needle in flat, (needle, out)


def write_yaml(path: Path, config) -> Path:
    path.write_text(yaml.safe_dump(dump_config(config)))
    return path


def corrupt(step_dir: Path) -> str:
    """Truncate one shard of a committed checkpoint (its manifest no longer matches); returns the shard's name."""
    shard = sorted(step_dir.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    return shard.name


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_metrics(run_dir)[1] if e["event"] == kind]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, demo_data) -> Path:
    """A finished 1-rank run of the 2-layer tiny model with committed checkpoints at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 2}, checkpoint={"interval": 1, "keep": 3}),
                 nproc=1)
    assert committed_steps(run_dir / "checkpoints") == [2, 1]
    return run_dir


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(run_dir, dst)
    return dst


def test_a_worker_that_resumes_at_the_last_step_still_tells_the_controller_that_step(tmp_path, demo_data, trained_run,
                                                                                      monkeypatch):
    """A restart that resumes from the final checkpoint trains no step; its worker must still publish the step
    (the controller would otherwise record the job as finished at the step before the fault)."""
    import socket

    import torch.distributed as dist
    from phalanx import protocol

    run_dir = copy_run(trained_run, tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = protocol.namespaced(dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False), "tok")
    for key, value in ((protocol.STORE_ADDR, f"127.0.0.1:{port}"), (protocol.JOB_ID, "9"),
                       (protocol.GENERATION, "2"), (protocol.CLUSTER_TOKEN, "tok"),
                       (protocol.PROTOCOL_ENV, str(protocol.PROTOCOL_VERSION))):
        monkeypatch.setenv(key, value)
    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 2}, checkpoint={"interval": 1, "keep": 3}),
                 nproc=1)
    assert events_of(run_dir, "resumed")[-1]["step"] == 2
    assert protocol.read_progress(server, "9", 2, [0])[0]["step"] == 2


# ---- 1. retention counts only checkpoints that verify --------------------------------------------------


@pytest.mark.slow
def test_retention_keeps_the_new_checkpoint_and_moves_a_corrupt_newer_one_aside(tmp_path, demo_data):
    run_dir = tmp_path / "keep1"
    ckpt = run_dir / "checkpoints"
    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 2}, checkpoint={"interval": 1, "keep": 1}),
                 nproc=1)
    assert committed_steps(ckpt) == [2]
    # The newest checkpoint on disk is corrupt (a higher step than anything good).
    shutil.copytree(ckpt / "step-00000002", ckpt / "step-00000005")
    shard = corrupt(ckpt / "step-00000005")

    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 3}, checkpoint={"interval": 1, "keep": 1}),
                 nproc=1)
    assert events_of(run_dir, "resumed")[0]["step"] == 2
    skipped = events_of(run_dir, "checkpoint_skipped")
    assert skipped[0]["step"] == 5 and shard in skipped[0]["reason"] and "moved aside" in skipped[0]["reason"]
    # The step just saved is kept and verifies; the corrupt one is out of the way, never counted or loaded.
    assert committed_steps(ckpt) == [3]
    assert verify(ckpt / "step-00000003", with_checksums=True) is None
    assert (ckpt / "step-00000005.corrupt").is_dir()

    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 4}, checkpoint={"interval": 1, "keep": 1}),
                 nproc=1)
    assert events_of(run_dir, "resumed")[1]["step"] == 3
    assert committed_steps(ckpt) == [4]


@pytest.mark.slow
def test_retention_without_resume_never_deletes_what_it_just_committed(tmp_path, demo_data, trained_run):
    """checkpoint.resume=false in a run dir holding an older run's good step 2 and a corrupt step 9: the save of
    step 1 is the newest checkpoint (whatever the step numbers say); the corrupt one is moved aside."""
    run_dir = copy_run(trained_run, tmp_path)
    ckpt = run_dir / "checkpoints"
    shutil.copytree(ckpt / "step-00000002", ckpt / "step-00000009")
    corrupt(ckpt / "step-00000009")
    shutil.rmtree(ckpt / "step-00000001")

    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 1},
                             checkpoint={"interval": 1, "keep": 1, "resume": False}), nproc=1)
    assert committed_steps(ckpt) == [1]
    assert verify(ckpt / "step-00000001", with_checksums=True) is None
    assert (ckpt / "step-00000009.corrupt").is_dir()


# ---- 2. a resume into a different model is refused -------------------------------------------------------


def _phalanx(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "phalanx.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_resume_into_a_different_model_is_refused_with_the_fields_named(tmp_path, demo_data, trained_run):
    run_dir = copy_run(trained_run, tmp_path)
    recipe = write_yaml(tmp_path / "run.yaml", tiny_config(run_dir, demo_data, training={"max_steps": 4}))
    steps_before = len(read_metrics(run_dir)[0])
    assert read_metadata(run_dir / "checkpoints" / "step-00000002")["model"]["n_layers"] == 2

    # Fewer layers used to load without a word; more layers died with a worker traceback. Both on 2 ranks (the
    # checkpoint is from 1: a world size that differs is not what is refused).
    for n_layers in (1, 3):
        proc = _phalanx("train", recipe, "--nproc", 2, f"model.overrides={{vocab_size: 512, n_layers: {n_layers}}}",
                        cwd=tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2, out
        assert "Traceback" not in out, out
        assert out.count("different model") == 1, out  # one line, from rank 0; the launcher adds nothing
        assert "exited with code" not in out, out
        assert f"n_layers 2 (checkpoint) vs {n_layers} (this run)" in " ".join(out.split()), out
        assert "step-00000002" in out and "world_size" not in out, out
    assert len(read_metrics(run_dir)[0]) == steps_before, "nothing may have trained"

    # The same model on another world size reshards and goes on; so does a checkpoint from before the model
    # config was recorded.
    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 3}), nproc=2)
    resumed = events_of(run_dir, "resumed")
    assert (resumed[-1]["step"], resumed[-1]["from_world_size"], resumed[-1]["world_size"]) == (2, 1, 2)
    manifest_path = run_dir / "checkpoints" / "step-00000003" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    assert manifest.pop("metadata")["model"]["n_layers"] == 2
    manifest_path.write_text(json.dumps(manifest))
    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 4}), nproc=1)
    assert events_of(run_dir, "resumed")[-1]["step"] == 3


def test_model_config_differences_name_only_what_changes_the_weights():
    from phalanx.models import get_preset

    tiny = get_preset("tiny")
    recorded = tiny.to_dict()
    assert tiny.differences(recorded) == {}
    assert tiny.with_overrides(n_layers=2, max_seq_len=64).differences(recorded) == {"n_layers": (4, 2)}
    del recorded["n_layers"]  # a field an older Phalanx did not record is not compared
    assert tiny.with_overrides(n_layers=2).differences(recorded) == {}


# ---- 3. clear errors for bad model, run and export paths -------------------------------------------------


def _recipe(tmp_path: Path, demo_data: Path) -> Path:
    return write_yaml(tmp_path / "recipe.yaml", tiny_config(tmp_path / "run", demo_data))


def _hf_dirs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Broken model.hf_path values, each with what the error must say."""
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text('{"model_type": "llama", ')
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    return {"missing": (tmp_path / "nowhere", "does not exist"), "no config.json": (no_config, "no config.json"),
            "invalid JSON": (bad_json, "not valid JSON"), "unsupported": (gpt2, "'gpt2' is not supported")}


def test_train_with_a_broken_hf_path_is_one_clear_error(tmp_path, demo_data):
    recipe = _recipe(tmp_path, demo_data)
    for path, says in _hf_dirs(tmp_path).values():
        overrides = ["model.preset=null", f"model.hf_path={path}", "model.overrides={}"]
        code, out = cli("train", recipe, *overrides)
        assert_clean_refusal(code, out, "model.hf_path", says)
        # `phalanx job submit` resolves configs with load_config too: the same ConfigError.
        with pytest.raises(ConfigError, match="model.hf_path"):
            load_config(recipe, overrides)
    assert not (tmp_path / "run").exists(), "nothing may start"


def test_train_with_run_dir_an_existing_file(tmp_path, demo_data):
    (tmp_path / "taken").write_text("not a directory")
    code, out = cli("train", _recipe(tmp_path, demo_data), f"run_dir={tmp_path / 'taken'}")
    assert_clean_refusal(code, out, "run_dir=", "is an existing file")
    code, out = cli("train", _recipe(tmp_path, demo_data), f"run_dir={tmp_path / 'taken' / 'below'}")
    assert_clean_refusal(code, out, "run_dir=", "an existing file")


@pytest.mark.slow
def test_export_hf_checks_config_and_output_first(tmp_path, trained_run):
    code, out = cli("export-hf", trained_run, tmp_path / "hf", "--config", tmp_path / "missing.json")
    assert_clean_refusal(code, out, "--config", "missing.json", "does not exist")
    assert not (tmp_path / "hf").exists()

    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("mine")
    # --overwrite into a directory that is not a Hugging Face model: named, and said in CLI terms.
    code, out = cli("export-hf", trained_run, junk, "--overwrite")
    assert_clean_refusal(code, out, "notes.txt", "--overwrite", "no config.json")
    assert "overwrite=True" not in out
    code, out = cli("export-hf", trained_run, junk)
    assert_clean_refusal(code, out, "not empty", "--overwrite")
    assert (junk / "notes.txt").read_text() == "mine"
    # The output is checked before the checkpoint is even looked for.
    code, out = cli("export-hf", tmp_path / "no-such-run", junk)
    assert_clean_refusal(code, out, "notes.txt")
    assert "no-such-run" not in out


@pytest.mark.slow
def test_export_hf_falls_back_past_a_corrupt_newest_checkpoint(tmp_path, trained_run):
    from safetensors.torch import load_file

    from phalanx.train.export import export_hf

    run_dir = copy_run(trained_run, tmp_path)
    corrupt(run_dir / "checkpoints" / "step-00000002")
    (run_dir / "config.json").unlink()  # as under torchrun: the checkpoint's recorded model config is enough
    code, out = cli("export-hf", run_dir, tmp_path / "hf")
    assert code == 0, out
    assert "step-00000002" in " ".join(out.split()) and "warning" in out
    expected = load_file(export_hf(trained_run / "checkpoints" / "step-00000001", tmp_path / "hf1")
                         / "model.safetensors")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert got.keys() == expected.keys() and all((got[k] == expected[k]).all() for k in got)
    # A step dir named explicitly is not replaced by another one.
    code, out = cli("export-hf", run_dir / "checkpoints" / "step-00000002", tmp_path / "hf2")
    assert_clean_refusal(code, out, "unusable")


# ---- 4. a failed `data prepare` removes only what it created ---------------------------------------------


def test_failed_prepare_removes_the_out_dir_it_created(tmp_path):
    out = tmp_path / "new" / "data"
    code, output = cli("data", "prepare", "--demo", "--out", out, "--block-size", 10_000_000, "--vocab-size", 300,
                       "--no-progress")
    assert_clean_refusal(code, output, "block_size=10000000")
    assert not (tmp_path / "new").exists()

    from phalanx.data import DataError, prepare, write_demo_corpus

    corpus = write_demo_corpus(tmp_path / "corpus.jsonl")
    with pytest.raises(DataError, match="block"):
        prepare([corpus], tmp_path / "api" / "out", block_size=10_000_000, vocab_size=300, progress=False)
    assert not (tmp_path / "api").exists()


def test_failed_prepare_leaves_an_existing_out_dir_as_it_was(tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, output = cli("data", "prepare", "--demo", "--out", out, "--val-percent", 80, "--no-progress")
    assert_clean_refusal(code, output, "val_percent=80")
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]  # the demo corpus it wrote is gone again
    code, output = cli("data", "prepare", "--demo", "--out", out / "keep.txt", "--no-progress")
    assert_clean_refusal(code, output, "keep.txt", "existing file")
    assert (out / "keep.txt").read_text() == "mine"


# ---- 5. the worker under plain torchrun, from a YAML recipe ----------------------------------------------


def _torchrun(tmp_path: Path, env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env_extra}
    argv = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", "2",
            "-m", "phalanx.train.worker", *args]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_torchrun_runs_the_worker_from_a_yaml_recipe_with_overrides(tmp_path, demo_data):
    run_dir = tmp_path / "run"
    proc = _torchrun(tmp_path, {"PHALANX_CONFIG": str(REPO / "recipes" / "tiny-llama.yaml"),
                                "PHALANX_OVERRIDES": f"training.max_steps=2 run_dir={run_dir} data.path={demo_data}"},
                     "training.global_batch_size=8", "training.micro_batch_size=2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps, events = read_metrics(run_dir)
    assert [s["step"] for s in steps] == [1, 2]
    started = next(e for e in events if e["event"] == "started")
    assert started["world_size"] == 2 and started["grad_accum"] == 2  # argv overrides applied: 8 ÷ (2 × 2)
    # The recipe's model (4 layers) is recorded with the checkpoint, so the run exports without a config.json.
    assert read_metadata(run_dir / "checkpoints" / "step-00000002")["model"]["n_layers"] == 4
    code, out = cli("export-hf", run_dir, tmp_path / "hf")
    assert code == 0, out


@pytest.mark.slow
def test_torchrun_with_a_bad_recipe_says_so_in_one_line(tmp_path):
    proc = _torchrun(tmp_path, {"PHALANX_CONFIG": str(REPO / "recipes" / "tiny-llama.yaml"),
                                "PHALANX_OVERRIDES": f"training.max_step=2 run_dir={tmp_path / 'run'}"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "error: " in out and "training.max_step: Extra inputs are not permitted" in out, out
    assert "exitcode  : 2" in out, out  # torchrun's summary: the worker exited 2, not with an exception
    assert "JSONDecodeError" not in out and "phalanx/train/worker.py" not in out, out
    assert not (tmp_path / "run").exists()

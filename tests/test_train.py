"""End-to-end training with real processes on CPU/gloo: parallel layouts agree, resume is exact."""

from __future__ import annotations

import shutil

import pytest

from conftest import run_training, tiny_config
from phalanx.train.checkpoint import committed_steps
from phalanx.train.metrics import read_metrics

pytestmark = pytest.mark.slow


def losses(steps: list[dict]) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in steps}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, demo_data):
    """4-rank FSDP, 30 uninterrupted steps."""
    cfg = tiny_config(tmp_path_factory.mktemp("ref"), demo_data, training={"max_steps": 30})
    return losses(run_training(cfg, nproc=4))


def test_one_rank_fsdp4_and_hsdp_2x2_agree(tmp_path, demo_data, reference):
    one = losses(run_training(tiny_config(tmp_path / "one", demo_data), nproc=1))
    hsdp = losses(
        run_training(tiny_config(tmp_path / "hsdp", demo_data, parallel={"dp_replicate": 2, "dp_shard": 2}), nproc=4)
    )
    assert sorted(one) == list(range(1, 11))
    for step in range(1, 11):
        assert abs(one[step] - reference[step]) <= 1e-5, (step, one[step], reference[step])
        assert abs(hsdp[step] - reference[step]) <= 1e-5, (step, hsdp[step], reference[step])
    assert reference[10] < reference[1] - 0.5, "the model should learn"


def test_compiled_blocks_train_like_eager_and_write_checkpoints_an_eager_run_resumes(tmp_path, demo_data, reference,
                                                                                     monkeypatch):
    """`compile: true` (each block compiled in place, before FSDP) gives the eager run's losses, and its checkpoint
    keeps the eager parameter names: a run without compile resumes from it."""
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))  # the workers inherit it: where inductor writes
    compiled = losses(run_training(tiny_config(tmp_path / "c", demo_data, compile=True), nproc=2))
    assert any(cache.rglob("*.py")), "inductor generated no code: the blocks were not compiled"
    assert sorted(compiled) == list(range(1, 11))
    for step in range(1, 11):
        assert abs(compiled[step] - reference[step]) <= 1e-4, (step, compiled[step], reference[step])
    eager = losses(run_training(tiny_config(tmp_path / "c", demo_data, training={"max_steps": 12}), nproc=2))
    _, events = read_metrics(tmp_path / "c")
    assert [e["step"] for e in events if e["event"] == "resumed"] == [10]
    for step in (11, 12):
        assert abs(eager[step] - reference[step]) <= 1e-4, (step, eager[step], reference[step])


def test_metrics_records_and_the_progress_line(tmp_path, demo_data, capfd):
    """metrics.jsonl holds one record per step with the documented fields, and rank 0 prints the HyperPod-like
    progress line every `log_interval` steps (the workers write to this process's stdout)."""
    from phalanx.train.optim import lr_factor

    config = tiny_config(tmp_path / "m", demo_data, training={"max_steps": 4, "log_interval": 2})
    steps = run_training(config, nproc=2)
    out = capfd.readouterr().out
    tokens_per_step = 8 * 64  # global batch 8 × block 64
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for s in steps:
        assert {"time", "step", "loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "samples_consumed"} <= set(s)
        assert s["samples_consumed"] == 8 * s["step"] and s["grad_norm"] > 0 and s["step_time_s"] > 0
        assert s["tokens_per_s"] == pytest.approx(tokens_per_step / s["step_time_s"])
        assert s["lr"] == pytest.approx(3e-3 * lr_factor(s["step"] - 1, warmup_steps=3, decay_steps=30,
                                                          min_lr_ratio=config.lr_schedule.min_lr_ratio))
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and lines[0].startswith("step     2/4 loss ") and lines[1].startswith("step     4/4 ")
    for part in ("grad_norm ", "lr ", "consumed 16 ", "iter ", "tok/s"):
        assert part in lines[0], lines[0]

    # the goodput ledger from the run's files (outside a cluster rank 0's records span the run): every second in
    # exactly one category, the steps productive, nothing replayed or lost to a fault
    from phalanx.observability.goodput import read_run

    ledger = read_run(config.checkpoint_dir, config.run_dir)
    assert abs(sum(ledger.seconds.values()) - ledger.wall) <= 1e-6, ledger.seconds
    step_s = [s["step_time_s"] for s in steps]
    assert sum(step_s[1:]) - 1e-6 <= ledger.seconds["productive"] <= sum(step_s) + 1e-6, (ledger.seconds, step_s)
    assert ledger.seconds["checkpoint_save"] > 0 and ledger.seconds["initialization"] > 0
    assert ledger.seconds["replayed"] == ledger.seconds["failure_detection"] == ledger.seconds["recovery"] == 0
    assert 0 < ledger.goodput < 1


def test_stop_at_15_and_resume_to_30_is_exact(tmp_path, demo_data, reference):
    run_dir = tmp_path / "pieces"
    first = run_training(tiny_config(run_dir, demo_data, training={"max_steps": 15}), nproc=4)
    assert [s["step"] for s in first] == list(range(1, 16))
    assert committed_steps(run_dir / "checkpoints")[0] == 15

    resumed = losses(run_training(tiny_config(run_dir, demo_data, training={"max_steps": 30}), nproc=4))
    assert sorted(resumed) == list(range(1, 31))  # metrics.jsonl is appended across restarts
    for step in range(1, 31):
        # Bit-identical: same ops, same order, same data.
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])
    _, events = read_metrics(run_dir)
    resume = [e for e in events if e["event"] == "resumed"]
    assert resume and resume[0]["step"] == 15 and resume[0]["samples_consumed"] == 15 * 8


def test_checkpoint_from_4_ranks_resumes_on_2(tmp_path, demo_data, reference):
    run_dir = tmp_path / "reshard"
    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 15}), nproc=4)
    resumed = losses(run_training(tiny_config(run_dir, demo_data, training={"max_steps": 30}), nproc=2))
    for step in range(16, 31):
        assert abs(resumed[step] - reference[step]) <= 1e-5, (step, resumed[step], reference[step])
    _, events = read_metrics(run_dir)
    resume = next(e for e in events if e["event"] == "resumed")
    assert (resume["from_world_size"], resume["world_size"]) == (4, 2)


def test_corrupted_and_partial_checkpoints_are_skipped(tmp_path, demo_data, caplog):
    run_dir = tmp_path / "corrupt"
    cfg = tiny_config(run_dir, demo_data, training={"max_steps": 10})
    run_training(cfg, nproc=2)
    ckpt = run_dir / "checkpoints"
    assert committed_steps(ckpt)[:2] == [10, 5]
    # Newest checkpoint: truncate one shard file. A leftover .tmp directory: a crash mid-save.
    shard = sorted((ckpt / "step-00000010").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-7])
    shutil.copytree(ckpt / "step-00000005", ckpt / "step-00000012.tmp")

    steps = run_training(tiny_config(run_dir, demo_data, training={"max_steps": 12}), nproc=2)
    _, events = read_metrics(run_dir)
    resume = next(e for e in events if e["event"] == "resumed")
    assert resume["step"] == 5, "must fall back to the last good checkpoint"
    skipped = next(e for e in events if e["event"] == "checkpoint_skipped")
    assert skipped["step"] == 10 and shard.name in skipped["reason"]
    after = [s["step"] for s in steps][10:]
    assert after == list(range(6, 13))


def test_continual_pretraining_from_a_mistral_checkpoint_is_one_config_line(tmp_path, demo_data):
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    from phalanx.data import GlobalBatchSampler, TokenDataset

    hf_dir = tmp_path / "mistral"
    torch.manual_seed(0)
    hf_config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                              max_position_embeddings=128)
    hf_model = MistralForCausalLM(hf_config).eval()
    hf_model.save_pretrained(hf_dir)

    cfg = tiny_config(tmp_path / "cpt", demo_data, model={"preset": None, "hf_path": str(hf_dir), "overrides": {}},
                      training={"max_steps": 2})
    steps = run_training(cfg, nproc=2)

    # Step 1's loss is the HF model's loss on the same first global batch, before any update.
    dataset = TokenDataset(demo_data)
    batch = dataset.get_batch(GlobalBatchSampler(len(dataset), 8, seed=cfg.seed, dp_rank=0, dp_size=1).global_batch(0))
    with torch.no_grad():
        expected = hf_model(batch, labels=batch).loss.item()
    assert abs(steps[0]["loss"] - expected) <= 1e-5, (steps[0]["loss"], expected)


def test_export_checkpoint_to_hugging_face(tmp_path, demo_data):
    import torch
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from phalanx.cli import app
    from phalanx.data import TokenDataset

    run_dir = tmp_path / "export"
    steps = run_training(tiny_config(run_dir, demo_data, training={"max_steps": 3}), nproc=2)
    result = CliRunner().invoke(app, ["export-hf", str(run_dir), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    batch = TokenDataset(demo_data).get_batch(list(range(4)))
    with torch.no_grad():
        loss = hf_model(batch, labels=batch).loss.item()
    # The exported weights are the trained ones: the loss has moved well below the initial ~6.2.
    assert loss < steps[0]["loss"] - 0.1
    # Exporting the same checkpoint again needs --overwrite.
    again = CliRunner().invoke(app, ["export-hf", str(run_dir), str(tmp_path / "hf")])
    assert again.exit_code == 2 and "overwrite" in again.output


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_after_a_killed_rank(tmp_path, demo_data):
    """`torchrun --max-restarts 1 -m phalanx.train.worker`: a rank SIGKILLed mid-run, torchrun restarts all four
    and they resume from the newest checkpoint (each attempt rendezvouses under its own store prefix)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from phalanx.control.backends.local import child_with_env
    from phalanx.train.config import dump_config

    config = tiny_config(tmp_path / "run", demo_data, training={"max_steps": 40, "log_interval": 10},
                         lr_schedule={"warmup_steps": 3, "total_steps": 40}, checkpoint={"interval": 5, "keep": 3})
    (tmp_path / "run").mkdir()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dump_config(config)))
    env = {**os.environ, "PHALANX_CONFIG": str(path), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "--max-restarts", "1", "--monitor-interval", "0.1", "-m", "phalanx.train.worker"]
    with open(tmp_path / "torchrun.log", "w") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            metrics = tmp_path / "run" / "metrics.jsonl"
            deadline = time.monotonic() + 120
            while not (metrics.exists() and metrics.read_text().count('"loss"') >= 12):
                assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "torchrun.log").read_text()
                time.sleep(0.05)
            victim = child_with_env(proc.pid, "RANK", "1")
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            code = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert code == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    steps, events = read_metrics(tmp_path / "run")
    resumed = [e for e in events if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] >= 10 and resumed[0]["step"] % 5 == 0
    assert max(s["step"] for s in steps) == 40

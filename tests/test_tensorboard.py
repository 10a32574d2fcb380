"""TensorBoard scalars and MFU: the pure MFU arithmetic, one value per step in TensorBoard after a rollback
(inside one process and across a restart from an older checkpoint), and the switch that turns it off."""

from __future__ import annotations

import shutil
import time

import pytest

from conftest import run_training, tiny_config
from phalanx.models import get_preset
from phalanx.train.metrics import read_metrics
from phalanx.train.mfu import flops_per_token, mfu, peak_flops_per_s
from phalanx.train.tensorboard import FLUSH_SECS, SCALARS, TensorBoardScalars


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard shows them (its accumulator applies the purges)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ---- MFU ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
    ("NVIDIA H100 PCIe", "bf16", 756.5e12),
    ("NVIDIA H200", "bf16", 989.5e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12),
    ("NVIDIA L40S", "bf16", 362.05e12),  # not the L4's
    ("Tesla T4", "bf16", None),
    ("", "bf16", None),
    (None, "bf16", None),  # CPU
])
def test_peak_flops_from_the_device_name(name, precision, peak):
    assert peak_flops_per_s(name, precision) == peak


def test_flops_per_token_counts_matmul_params_and_attention():
    dense = get_preset("tiny")  # untied: the input table is a lookup, the output head a matmul
    h, v, layers, seq = dense.dim, dense.vocab_size, dense.n_layers, 64
    head_width = dense.n_heads * dense.head_dim
    assert flops_per_token(dense, seq) == 6 * (dense.num_params() - v * h) + 12 * layers * head_width * seq
    tied = dense.with_overrides(tie_embeddings=True)  # one table, used by the head: counted once
    assert flops_per_token(tied, seq) == 6 * tied.num_params() + 12 * layers * head_width * seq
    moe = dense.with_overrides(n_experts=8, top_k=2)  # a token meets top_k experts, not all 8
    assert flops_per_token(moe, seq) == 6 * (moe.num_params(active=True) - v * h) + 12 * layers * head_width * seq
    assert flops_per_token(moe, seq) < 6 * (moe.num_params() - v * h)
    windowed = dense.with_overrides(sliding_window=16)  # every layer attends within 16 positions
    assert flops_per_token(windowed, seq) == 6 * (dense.num_params() - v * h) + 12 * layers * head_width * 16


def test_mfu_is_the_fraction_of_all_devices_peak():
    assert mfu(tokens_per_s=1000.0, flops_per_token=1e9, peak_per_device=1e12, devices=2) == pytest.approx(0.5)


# ---- TensorBoard ---------------------------------------------------------------------------------------
def record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 100.0}


def test_a_rollback_in_one_process_replaces_the_later_steps(tmp_path):
    """A checkpointless regroup that restores an older step: the same writer gets a step at or below the last
    one it wrote; TensorBoard then shows the new values from that step on, one per step."""
    tb = TensorBoardScalars(tmp_path / "tb")
    for step in range(1, 6):
        tb.write(record(step, 10.0 + step))
    deadline = time.monotonic() + 3 * FLUSH_SECS  # live: the writer's thread flushes within FLUSH_SECS
    while [step for step, _ in scalars(tmp_path / "tb").get("loss", [])] != [1, 2, 3, 4, 5]:
        assert time.monotonic() < deadline, scalars(tmp_path / "tb")
        time.sleep(0.05)
    for step in range(3, 5):  # rolled back to 2: steps 3, 4 again
        tb.write(record(step, 20.0 + step))
    tb.close()
    shown = scalars(tmp_path / "tb")
    assert shown["loss"] == [(1, 11.0), (2, 12.0), (3, 23.0), (4, 24.0)]
    assert set(shown) == {"loss", "grad_norm", "lr", "tokens_per_s"}  # no mfu in these records
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2  # the rollback opened a second file


@pytest.mark.slow
def test_resume_from_an_older_checkpoint_leaves_one_value_per_step(tmp_path, demo_data):
    """Train to 6 (checkpoints at 4 and 6), lose the one at 6, train to 8 from 4: TensorBoard has each step 1..8
    once, the resumed run's values for 5..8; every step has an `mfu` from the configured peak."""
    run_dir = tmp_path / "run"
    peak = 1e9
    settings = {"checkpoint": {"interval": 4}, "metrics": {"peak_flops_per_s": peak}}
    run_training(tiny_config(run_dir, demo_data, training={"max_steps": 6}, **settings), nproc=1)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    config = tiny_config(run_dir, demo_data, training={"max_steps": 8}, **settings)
    run_training(config, nproc=1)

    steps, events = read_metrics(run_dir)
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # metrics.jsonl keeps both runs' lines
    assert [e["step"] for e in events if e["event"] == "resumed"] == [4]
    newest = {s["step"]: s for s in steps}  # the later line of a step wins
    from phalanx.train.trainer import resolve_model_config

    per_token = flops_per_token(resolve_model_config(config), 64)
    shown = scalars(run_dir / "tensorboard")
    assert set(shown) == set(SCALARS)
    for tag in SCALARS:
        assert [step for step, _ in shown[tag]] == list(range(1, 9)), (tag, shown[tag])
        for step, value in shown[tag]:
            assert value == pytest.approx(newest[step][tag], rel=1e-6), (tag, step)
    for s in steps:
        assert s["mfu"] == pytest.approx(mfu(s["tokens_per_s"], per_token, peak, 1))


@pytest.mark.slow
def test_the_switch_off_writes_no_tensorboard_and_cpu_has_no_mfu(tmp_path, demo_data):
    run_dir = tmp_path / "quiet"
    steps = run_training(tiny_config(run_dir, demo_data, training={"max_steps": 2},
                                     metrics={"tensorboard": False}), nproc=1)
    assert [s["step"] for s in steps] == [1, 2]
    assert not (run_dir / "tensorboard").exists()
    assert all("mfu" not in s for s in steps)  # CPU: no peak known, none configured

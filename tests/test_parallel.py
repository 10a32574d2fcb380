"""Parallel layer: degree validation, delayed sharded init, activation checkpointing (real processes)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_distributed
from phalanx.models import build_model, get_preset
from phalanx.parallel import ParallelConfigError, ParallelDims, canonical_name


# ---- degrees ------------------------------------------------------------------------------------
def test_dims_fill_shard_degree_and_describe():
    dims = ParallelDims(8, dp_replicate=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_size, dims.hsdp) == (2, 4, 8, True)
    assert ParallelDims(4).describe() == "FSDP over 4 ranks"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(world_size=4, dp_replicate=3), ["dp_replicate=3", "world size 4", "[1, 2, 4]"]),
        (dict(world_size=8, dp_replicate=2, dp_shard=3), ["dp_replicate=2", "dp_shard=3", "world size is 8", "dp_shard=4"]),
        (dict(world_size=4, dp_shard=0), ["dp_shard=0"]),
    ],
)
def test_dims_errors_name_degrees_world_size_and_fix(kwargs, words):
    with pytest.raises(ParallelConfigError) as err:
        ParallelDims(**kwargs)
    for word in words:
        assert word in str(err.value)


# ---- delayed init -------------------------------------------------------------------------------
def _sharded_init(preset: str, overrides: dict, dp_replicate: int, seed: int, gather: bool):
    import torch.distributed as dist

    from phalanx.models import Transformer
    from phalanx.parallel import apply_fsdp, build_mesh, materialize, random_init_source

    config = get_preset(preset).with_overrides(**overrides)
    with torch.device("meta"):
        model = Transformer(config)
    apply_fsdp(model, build_mesh(ParallelDims(dist.get_world_size(), dp_replicate), "cpu"), precision="fp32")
    local_numel = materialize(model, "cpu", random_init_source(model, seed))
    full = {n: p.full_tensor() for n, p in model.named_parameters()} if gather else None
    return {"local_numel": local_numel, "total": config.num_params(), "full": full}


def test_each_rank_materializes_only_its_shard_of_a_mid_size_model(tmp_path):
    results = run_distributed(_sharded_init, 4, tmp_path, "small", {}, 1, 0, False)
    total = results[0]["total"]
    assert total > 100_000_000
    for r in results:
        assert r["local_numel"] == total // 4


@pytest.mark.parametrize("dp_replicate", [1, 2])
def test_sharded_init_equals_single_process_init(tmp_path, dp_replicate):
    overrides = {"n_layers": 2}
    results = run_distributed(_sharded_init, 4, tmp_path, "tiny-moe", overrides, dp_replicate, 3, True)
    reference = build_model(get_preset("tiny-moe").with_overrides(**overrides), seed=3)
    expected = dict(reference.named_parameters())
    for name, value in results[0]["full"].items():
        assert torch.equal(value, expected[name].detach()), name
    assert results[0]["local_numel"] == results[0]["total"] // (4 // dp_replicate)


# ---- activation checkpointing -------------------------------------------------------------------
@pytest.mark.parametrize("mode, every, wrapped", [("full", 1, 4), ("selective", 2, 2), ("none", 1, 0)])
def test_activation_checkpointing_keeps_loss_and_gradients(mode, every, wrapped):
    from phalanx.parallel import apply_activation_checkpointing

    config = get_preset("tiny")
    plain, checkpointed = build_model(config, seed=1), build_model(config, seed=1)
    assert apply_activation_checkpointing(checkpointed, mode, every) == wrapped
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    for model in (plain, checkpointed):
        model(tokens, tokens)[0].backward()
    assert torch.equal(plain(tokens, tokens)[0], checkpointed(tokens, tokens)[0])
    grads = {canonical_name(n): p.grad for n, p in checkpointed.named_parameters()}
    for name, param in plain.named_parameters():
        assert torch.allclose(param.grad, grads[name], atol=1e-6), name

"""One forward/backward of the same model on the same global micro-batch under several parallel layouts, on
real processes (run with `distributed.run_distributed`), and the single-process reference to compare with."""

from __future__ import annotations

import torch

from phalanx.models import build_model, get_preset

VOCAB, SEQ = 512, 32


def global_batch(batch: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def model_config(preset: str, **overrides):
    return get_preset(preset).with_overrides(vocab_size=VOCAB, n_layers=2, **overrides)


def run_layouts(cases: list[dict], tokens: torch.Tensor, seed: int) -> dict:
    """On every rank: for each case {name, preset, overrides, degrees, ac}, build on meta, `parallelize` it as the
    trainer does, materialise, run this rank's slice of `tokens`, backward. Rank 0's return value holds, per case:
    loss and aux (means over ranks = the global micro-batch's), full gradients, full initial parameters, the
    local shape of each parameter, the global MoE load and the clipped-grad norm."""
    import torch.distributed as dist

    from phalanx.models import Transformer
    from phalanx.parallel import (
        ParallelDims, build_mesh, canonical_name, clip_grad_norm_, dp_rank, materialize, moe_load, parallelize,
        random_init_source,
    )

    world, out = dist.get_world_size(), {}
    for case in cases:
        config = model_config(case["preset"], **case.get("overrides", {}))
        dims = ParallelDims(world, **case["degrees"])
        dims.check_model(n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, n_experts=config.n_experts)
        with torch.device("meta"):
            model = Transformer(config)
        mesh = build_mesh(dims, "cpu")
        parallelize(model, mesh, precision="fp32", ac_mode=case.get("ac", "none"))
        materialize(model, "cpu", random_init_source(model, seed))
        params = {canonical_name(n): p.full_tensor() for n, p in model.named_parameters()}
        local_shapes = {canonical_name(n): tuple(p.to_local().shape) for n, p in model.named_parameters()}

        per_rank = tokens.shape[0] // dims.dp_size
        rank = dp_rank(mesh)
        mine = tokens[rank * per_rank : (rank + 1) * per_rank]
        loss, aux = model(mine, mine)
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), float("inf"))
        means = torch.stack([loss.detach(), aux.detach() if aux is not None else torch.zeros(())])
        dist.all_reduce(means)
        means /= world  # tp ranks of one data-parallel rank hold the same values
        grads = {canonical_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
        if dist.get_rank() == 0:
            out[case["name"]] = {
                "loss": means[0].item(), "aux": means[1].item(), "grads": grads, "params": params,
                "local_shapes": local_shapes, "load": moe_load(model), "grad_norm": norm.item(),
            }
    return out


def reference(preset: str, tokens: torch.Tensor, seed: int, **overrides) -> dict:
    """The single-process model on the whole global micro-batch."""
    model = build_model(model_config(preset, **overrides), seed=seed)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, aux = model(tokens, tokens)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    from phalanx.parallel import moe_load

    return {"loss": loss.item(), "aux": 0.0 if aux is None else aux.item(), "grads": grads, "params": params,
            "load": moe_load(model), "grad_norm": norm.item()}


def max_grad_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in a)

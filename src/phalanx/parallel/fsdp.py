"""FSDP2 / HSDP and activation checkpointing, applied to an unchanged model.

`apply_activation_checkpointing` wraps decoder blocks (none / full / every k-th); `apply_fsdp` calls
`fully_shard` on each block and then the root, over a 1-D (FSDP) or 2-D (HSDP) mesh, with a mixed
precision policy. Expert-parallel experts (see `phalanx.parallel.ep`) are their own FSDP unit over the
ranks that hold the same experts. `clip_grad_norm_` clips gradients that live on several meshes (FSDP
with TP or EP). Knows the model only as "has `.model.layers`"; knows nothing about data or training.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from phalanx.parallel.dims import ParallelMesh
from phalanx.parallel.ep import is_expert_parallel

try:  # torch >= 2.6 exposes FSDP2 here
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - older layout
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import DTensor, Shard

AC_MODES = ("none", "full", "selective")


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int = 1) -> int:
    """Recompute activations of blocks in backward. full: every block; selective: every `every`-th.

    Returns the number of blocks wrapped.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing.mode={mode!r}; choose one of {AC_MODES}")
    if mode == "none":
        return 0
    if every < 1:
        raise ValueError(f"activation_checkpointing.every={every} must be >= 1")
    layers = model.model.layers
    wrapped = 0
    for i in range(len(layers)):
        if mode == "full" or i % every == 0:
            layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False)
            wrapped += 1
    return wrapped


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16: bf16 params/compute with fp32 master weights and fp32 gradient reduction; fp32: fp32 all."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "fp32":
        return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    raise ValueError(f"precision={precision!r}; choose 'bf16' or 'fp32'")


def apply_fsdp(
    model: nn.Module,
    mesh: ParallelMesh | DeviceMesh,
    *,
    precision: str = "bf16",
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard each block, then the root (embeddings, final norm, lm_head).

    `mesh`: from `build_mesh`. Its data-parallel mesh is 1-D (plain FSDP) or 2-D ("dp_replicate",
    "dp_shard"), on which FSDP2 runs HSDP (replicate across dim 0, shard within dim 1). Tensor-parallel
    weights (DTensors on `mesh.tp`) get FSDP sharding on top. Expert-parallel experts are wrapped first, as
    their own unit over `mesh.expert_dp`, sharding dim 1 (their dim 0 is already split over the ep ranks
    and may hold fewer experts than there are ranks to shard over).
    """
    expert_mesh = mesh.expert_dp if isinstance(mesh, ParallelMesh) else None
    dp_mesh = mesh.dp if isinstance(mesh, ParallelMesh) else mesh
    if dp_mesh.ndim == 2 and dp_mesh.size(0) == 1:
        dp_mesh = dp_mesh["dp_shard"]
    policy = mixed_precision(precision)
    layers = model.model.layers
    for i, block in enumerate(layers):
        # The last block's params are needed again at once in backward: keep them unsharded.
        reshard = reshard_after_forward and i < len(layers) - 1
        for module in block.modules():
            if is_expert_parallel(module):
                if expert_mesh is None:
                    raise ValueError("the model has expert-parallel experts; pass the ParallelMesh from build_mesh")
                fully_shard(module, mesh=expert_mesh, mp_policy=policy, reshard_after_forward=reshard,
                            shard_placement_fn=lambda param: Shard(1))
        fully_shard(block, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Clip the global 2-norm of the gradients to `max_norm`; returns that norm (a plain tensor, the same on
    every rank). Unlike `torch.nn.utils.clip_grad_norm_` it takes gradients sharded over different meshes
    (FSDP parameters next to FSDP × TP or FSDP × EP ones), with one all-reduce: each rank sums the squares
    of its local shards, divided by the number of ranks holding a copy of that shard."""
    grads = [p.grad for p in parameters if p.grad is not None]
    world = dist.get_world_size() if dist.is_initialized() else 1
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        local, shards = (g.to_local(), _num_shards(g)) if isinstance(g, DTensor) else (g, 1)
        by_copies.setdefault(world // shards, []).append(local)
    if not grads:
        return torch.zeros(())
    device = grads[0].device
    squares = torch.zeros((), device=device, dtype=torch.float32)
    for copies, group in by_copies.items():
        norms = torch.stack([n.float() for n in torch._foreach_norm(group, 2.0)])
        squares += norms.square().sum().to(device) / copies
    if world > 1:
        dist.all_reduce(squares)
    total = squares.sqrt()
    if max_norm != float("inf"):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for group in by_copies.values():
            torch._foreach_mul_(group, coef.to(group[0].device, group[0].dtype))
    return total


def _num_shards(t: DTensor) -> int:
    """How many distinct pieces a DTensor is cut into (the product of its mesh dims that shard it; FSDP × TP
    uses _StridedShard, which is not `is_shard()`). Gradients are never Partial here (FSDP reduced them)."""
    count = 1
    for size, placement in zip(t.device_mesh.shape, t.placements):
        if placement.is_partial():
            raise ValueError(f"gradient with a Partial placement {t.placements}: reduce it before clipping")
        if not placement.is_replicate():
            count *= size
    return count

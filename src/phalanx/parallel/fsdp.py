"""FSDP2 / HSDP and activation checkpointing, applied to an unchanged model.

`apply_activation_checkpointing` wraps decoder blocks (none / full / every k-th); `apply_fsdp` calls
`fully_shard` on each block and then the root, over a 1-D (FSDP) or 2-D (HSDP) mesh, with a mixed
precision policy. Knows the model only as "has `.model.layers`"; knows nothing about data or training.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

try:  # torch >= 2.6 exposes FSDP2 here
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # pragma: no cover - older layout
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

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
    mesh: DeviceMesh,
    *,
    precision: str = "bf16",
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard each block, then the root (embeddings, final norm, lm_head).

    `mesh`: from `build_mesh`: 1-D (plain FSDP) or 2-D ("dp_replicate", "dp_shard"), on which FSDP2 runs
    HSDP (replicate across dim 0, shard within dim 1).
    """
    if mesh.ndim == 2 and mesh.size(0) == 1:
        mesh = mesh["dp_shard"]
    policy = mixed_precision(precision)
    layers = model.model.layers
    for i, block in enumerate(layers):
        # The last block's params are needed again at once in backward: keep them unsharded.
        last = i == len(layers) - 1
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward and not last)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model

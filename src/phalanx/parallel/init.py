"""Delayed (meta-device) initialisation: materialise only this rank's shard of every parameter.

Build the model on `meta`, shard it (`apply_fsdp`), then `materialize` allocates each rank's local shard
and fills it with exactly the rows that rank owns — either the deterministic init of
`phalanx.models.init` or rows read from a Hugging Face checkpoint. No process ever holds the whole model,
and the sharded values equal the single-process ones. Knows nothing about data or training.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from phalanx.models.init import canonical_name, init_rows

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import DTensor

# (name, full_shape, row_start, row_end, dtype) -> rows [row_start, row_end) of the full parameter
RowSource = Callable[[str, torch.Size, int, int, torch.dtype], torch.Tensor]

def random_init_source(model: nn.Module, seed: int) -> RowSource:
    def source(name, shape, row_start, row_end, dtype):
        return init_rows(name, model.init_spec(name), shape, row_start, row_end, seed, dtype)

    return source


def _local_region(param: torch.Tensor) -> tuple[list[int], list[int]]:
    """(local shape, global offset) of this rank's piece of `param`."""
    if isinstance(param, DTensor):
        try:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        except ImportError:  # pragma: no cover
            from torch.distributed._tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return list(shape), list(offset)
    return list(param.shape), [0] * param.dim()


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str, source: RowSource) -> int:
    """Allocate the local shards on `device` and fill them from `source`. Returns local numel."""
    model.to_empty(device=device)
    local_numel = 0
    for raw_name, param in model.named_parameters():
        name = canonical_name(raw_name)
        local = param.to_local() if isinstance(param, DTensor) else param
        shape, offset = _local_region(param)
        if local.numel() == 0:
            continue
        rows = source(name, param.shape, offset[0], offset[0] + shape[0], local.dtype)
        # Column-sharded placements (tensor parallel) take a slice of the other dims.
        index = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:]))
        local.copy_(rows[(slice(None), *index)] if index else rows)
        local_numel += local.numel()
    model.reset_buffers()
    return local_numel

"""Deterministic, shard-independent parameter initialisation.

Every parameter's full value is a pure function of (seed, parameter name, shape): it is drawn in fixed
blocks of rows, each block from its own generator. A process that holds only rows [a, b) of a parameter
draws only the blocks that cover them, so a model sharded over N ranks is initialised to exactly the same
values as the unsharded model — and no rank ever builds a whole 7B model. Knows nothing about
torch.distributed; `phalanx.parallel.init` feeds it the shard offsets.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

_BLOCK_ELEMENTS = 1 << 20  # about 1M values per generator draw


def rows_per_block(shape: torch.Size) -> int:
    row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, _BLOCK_ELEMENTS // max(1, row_numel))


def _block_seed(seed: int, name: str, block: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 7919 + block) % (2**63 - 1)


def init_rows(
    name: str,
    spec: tuple[str, float],
    shape: torch.Size,
    row_start: int,
    row_end: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows [row_start, row_end) of parameter `name`'s full initial value (shape `shape`), on CPU."""
    kind, std = spec
    rows_shape = (row_end - row_start, *shape[1:])
    if kind == "ones":
        return torch.ones(rows_shape, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(rows_shape, dtype=dtype)
    if kind != "normal":
        raise ValueError(f"unknown init kind {kind!r} for parameter {name}")
    out = torch.empty(rows_shape, dtype=torch.float32)
    if row_end <= row_start:
        return out.to(dtype)
    per_block = rows_per_block(shape)
    generator = torch.Generator()
    for block in range(row_start // per_block, (row_end - 1) // per_block + 1):
        lo, hi = block * per_block, min((block + 1) * per_block, shape[0])
        generator.manual_seed(_block_seed(seed, name, block))
        values = torch.randn((hi - lo, *shape[1:]), generator=generator) * std
        a, b = max(lo, row_start), min(hi, row_end)
        out[a - row_start : b - row_start] = values[a - lo : b - lo]
    return out.to(dtype)


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Parameter name without wrapper prefixes (activation checkpointing, torch.compile)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def init_weights(model: nn.Module, seed: int) -> None:
    """Initialise an unsharded model in place (the reference every sharded init must equal)."""
    with torch.no_grad():
        for raw_name, param in model.named_parameters():
            name = canonical_name(raw_name)
            value = init_rows(name, model.init_spec(name), param.shape, 0, param.shape[0], seed, param.dtype)
            param.copy_(value)
        model.reset_buffers()

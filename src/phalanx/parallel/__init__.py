"""Parallelism applied to an unchanged model: mesh from degrees, FSDP2/HSDP, activation checkpointing,
delayed init. Knows nothing about the controller, agents or data."""

from phalanx.parallel.dims import ParallelConfigError, ParallelDims, build_mesh, dp_rank
from phalanx.parallel.fsdp import apply_activation_checkpointing, apply_fsdp, mixed_precision
from phalanx.parallel.init import canonical_name, materialize, random_init_source

__all__ = [
    "ParallelConfigError",
    "ParallelDims",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "build_mesh",
    "canonical_name",
    "dp_rank",
    "materialize",
    "mixed_precision",
    "random_init_source",
]

"""Parallelism applied to an unchanged model: mesh from degrees, FSDP2/HSDP, tensor and expert parallelism,
activation checkpointing (all four in order: `parallelize`), delayed init. Knows nothing about the controller,
agents, data or the training loop."""

from phalanx.parallel.apply import parallelize
from phalanx.parallel.dims import ParallelConfigError, ParallelDims, ParallelMesh, build_mesh, dp_rank
from phalanx.parallel.ep import apply_ep, moe_load
from phalanx.parallel.fsdp import apply_activation_checkpointing, apply_fsdp, clip_grad_norm_, mixed_precision
from phalanx.parallel.init import canonical_name, materialize, random_init_source
from phalanx.parallel.tp import apply_tp

__all__ = [
    "ParallelConfigError",
    "ParallelDims",
    "ParallelMesh",
    "apply_activation_checkpointing",
    "apply_ep",
    "apply_fsdp",
    "apply_tp",
    "build_mesh",
    "canonical_name",
    "clip_grad_norm_",
    "dp_rank",
    "materialize",
    "mixed_precision",
    "moe_load",
    "parallelize",
    "random_init_source",
]

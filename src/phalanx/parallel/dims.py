"""Parallel degrees → one validated set of DeviceMeshes.

`ParallelDims` checks the degrees against the world size once, at start (and against the model's heads
and experts with `check_model`), with errors that name the field, the value, the valid values and a fix.
`build_mesh` turns them into a `ParallelMesh`: views of one set of ranks that the `apply_*` functions use.

Layout (outer → inner dims; dp_replicate appears only when > 1):
- data parallel: ("dp_shard",) over the default group (plain FSDP) or ("dp_replicate", "dp_shard") (HSDP);
- tensor parallel adds an innermost "tp" dim: world = dp_replicate × dp_shard × tp. Ranks that differ
  only in their tp index form one data-parallel rank: they see the same data;
- expert parallel borrows ranks from dp_shard: dp_shard is viewed as ("dp_shard_mod_ep", "ep") with "ep"
  innermost, so an ep group is `ep` consecutive dp_shard ranks (within one node when ep ≤ GPUs per node).
  Experts are split over "ep"; the ranks that hold the same experts ("dp_shard_mod_ep", with
  "dp_replicate" in HSDP) shard them further with FSDP. EP together with TP is refused, as in SageMaker's
  model-parallel library.
Knows nothing about the model classes, the data or the control plane.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from phalanx.parallel.mesh_cache import reuse_or_clear


class ParallelConfigError(ValueError):
    """Degrees that cannot tile the world size or the model."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """dp_replicate × dp_shard × tp = world size; ep divides dp_shard. dp_shard = -1: "whatever is left"."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ParallelConfigError(f"world size must be >= 1, got {self.world_size}")
        if self.dp_replicate < 1:
            raise ParallelConfigError(f"parallel.dp_replicate={self.dp_replicate} must be >= 1")
        if self.tp < 1:
            raise ParallelConfigError(f"parallel.tensor_parallel_degree={self.tp} must be >= 1")
        if self.ep < 1:
            raise ParallelConfigError(f"parallel.expert_parallel_degree={self.ep} must be >= 1")
        if self.tp > 1 and self.ep > 1:
            raise ParallelConfigError(
                f"parallel.expert_parallel_degree={self.ep} with parallel.tensor_parallel_degree={self.tp}: "
                "expert and tensor parallelism together are not supported (SageMaker's model-parallel library "
                "does not combine them either); set one of them to 1"
            )
        if self.world_size % self.tp:
            raise ParallelConfigError(
                f"parallel.tensor_parallel_degree={self.tp} does not divide the world size {self.world_size}; "
                f"use one of {_divisors(self.world_size)}"
            )
        if self.dp_shard == -1:
            fixed = self.dp_replicate * self.tp
            if self.world_size % fixed:
                what = f"parallel.dp_replicate={self.dp_replicate}" + (
                    f" × parallel.tensor_parallel_degree={self.tp} = {fixed}" if self.tp > 1 else ""
                )
                raise ParallelConfigError(
                    f"{what} does not divide the world size {self.world_size}; use a dp_replicate in "
                    f"{_divisors(self.world_size // self.tp)}"
                )
            object.__setattr__(self, "dp_shard", self.world_size // fixed)
        if self.dp_shard < 1:
            raise ParallelConfigError(f"parallel.dp_shard={self.dp_shard} must be >= 1 or -1 (auto)")
        product = self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            fixed = self.dp_replicate * self.tp
            fix = self.world_size // fixed if self.world_size % fixed == 0 else -1
            tp = f" × parallel.tensor_parallel_degree={self.tp}" if self.tp > 1 else ""
            raise ParallelConfigError(
                f"parallel.dp_replicate={self.dp_replicate} × parallel.dp_shard={self.dp_shard}{tp} = {product}, "
                f"but the world size is {self.world_size}; set dp_shard={fix} (or -1 for auto), or run with "
                f"{product} processes"
            )
        if self.dp_shard % self.ep:
            raise ParallelConfigError(
                f"parallel.expert_parallel_degree={self.ep} does not divide the data-parallel shard degree "
                f"dp_shard={self.dp_shard} (experts are spread over ranks of one shard group); use one of "
                f"{_divisors(self.dp_shard)}"
            )

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (each sees a distinct slice of every global batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    def check_model(self, *, n_heads: int, n_kv_heads: int, n_experts: int, attention_sinks: bool = False) -> None:
        """The degrees must also tile the model: tp divides the heads (and is 1 with attention sinks, which tp
        does not split), ep divides the experts."""
        if self.tp > 1 and attention_sinks:
            raise ParallelConfigError(
                f"parallel.tensor_parallel_degree={self.tp}: this model has attention sinks (GPT-OSS), which tensor "
                "parallelism does not split; set tensor_parallel_degree=1 (FSDP and expert_parallel_degree apply)"
            )
        if self.tp > 1:
            for field, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
                if value % self.tp:
                    valid = [d for d in _divisors(math.gcd(n_heads, n_kv_heads)) if self.world_size % d == 0]
                    raise ParallelConfigError(
                        f"parallel.tensor_parallel_degree={self.tp} does not divide model.{field}={value} "
                        f"(attention heads are split over tp ranks); use one of {valid}"
                    )
        if self.ep > 1:
            if n_experts == 0:
                raise ParallelConfigError(
                    f"parallel.expert_parallel_degree={self.ep} needs a mixture-of-experts model, but "
                    "model.n_experts=0 (dense); set expert_parallel_degree=1"
                )
            if n_experts % self.ep:
                valid = _divisors(math.gcd(n_experts, self.dp_shard))
                raise ParallelConfigError(
                    f"parallel.expert_parallel_degree={self.ep} does not divide model.n_experts={n_experts}; "
                    f"use one of {valid} (it must divide both n_experts and dp_shard={self.dp_shard})"
                )

    def describe(self) -> str:
        if self.hsdp:
            text = f"HSDP {self.dp_replicate} replicas × {self.dp_shard} shards"
        elif self.dp_replicate > 1:
            text = f"DDP-style replication × {self.dp_replicate}"
        else:
            text = f"FSDP over {self.dp_shard} ranks"
        if self.tp > 1:
            text += f" × TP {self.tp}"
        if self.ep > 1:
            text += f", experts over EP {self.ep}"
        return text


@dataclass
class ParallelMesh:
    """The meshes of one job, all views of the same ranks.

    dp: what FSDP shards non-expert parameters over (1-D ("dp_shard",) or 2-D ("dp_replicate", "dp_shard"));
    tp: the tensor-parallel mesh or None; ep: the expert-parallel mesh or None; expert_dp: what FSDP shards
    expert weights over (the ranks holding the same experts) or None; dp_group: the process group of all
    data-parallel ranks (None: the default group, i.e. every rank is its own data-parallel rank).
    """

    dims: ParallelDims
    dp: DeviceMesh
    tp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    expert_dp: DeviceMesh | None = None
    dp_group: dist.ProcessGroup | None = None


def build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """The meshes for `dims` on the current default group. DTensor's caches from the meshes built before are kept
    when they fit these (the same rank of the same world, a checkpointless regroup), else cleared (`mesh_cache`)."""
    mesh = _build_mesh(dims, device_type)
    reuse_or_clear([m for m in (mesh.dp, mesh.tp, mesh.ep, mesh.expert_dp) if m is not None],
                   [mesh.dp_group] if mesh.dp_group is not None else [])
    return mesh


def _build_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    r, s, tp, ep = dims.dp_replicate, dims.dp_shard, dims.tp, dims.ep
    if tp > 1:
        shape, names = ((r, s, tp), ("dp_replicate", "dp_shard", "tp")) if r > 1 else ((s, tp), ("dp_shard", "tp"))
        root = init_device_mesh(device_type, shape, mesh_dim_names=names)
        dp = root["dp_replicate", "dp_shard"] if r > 1 else root["dp_shard"]
        dp_group = (dp._flatten("dp") if r > 1 else dp).get_group()
        return ParallelMesh(dims, dp=dp, tp=root["tp"], dp_group=dp_group)
    if ep == 1:
        if r == 1:
            return ParallelMesh(dims, dp=init_device_mesh(device_type, (s,), mesh_dim_names=("dp_shard",)))
        return ParallelMesh(
            dims, dp=init_device_mesh(device_type, (r, s), mesh_dim_names=("dp_replicate", "dp_shard"))
        )
    return _expert_parallel_mesh(dims, device_type)


def _expert_parallel_mesh(dims: ParallelDims, device_type: str) -> ParallelMesh:
    """dp_shard = dp_shard_mod_ep × ep. Torch ≥ 2.9 unflattens the data-parallel mesh into that view; older
    torch builds the fine-grained mesh and flattens (dp_shard_mod_ep, ep) back into dp_shard."""
    r, s, ep = dims.dp_replicate, dims.dp_shard, dims.ep
    split = ("dp_shard_mod_ep", "ep")
    if hasattr(DeviceMesh, "_unflatten"):
        if r == 1:
            dp = init_device_mesh(device_type, (s,), mesh_dim_names=("dp_shard",))
        else:
            dp = init_device_mesh(device_type, (r, s), mesh_dim_names=("dp_replicate", "dp_shard"))
        fine = dp._unflatten("dp_shard", (s // ep, ep), split)
    else:  # pragma: no cover - torch < 2.9
        shape, names = ((r, s // ep, ep), ("dp_replicate", *split)) if r > 1 else ((s // ep, ep), split)
        fine = init_device_mesh(device_type, shape, mesh_dim_names=names)
        flat = fine[split]._flatten("dp_shard")
        dp = fine["dp_replicate", "dp_shard"] if r > 1 else flat
    expert_dp = fine["dp_replicate", "dp_shard_mod_ep"] if r > 1 else fine["dp_shard_mod_ep"]
    return ParallelMesh(dims, dp=dp, ep=fine["ep"], expert_dp=expert_dp)


def dp_rank(mesh: ParallelMesh | DeviceMesh) -> int:
    """This process's data-parallel rank: replica index × dp_shard + shard index (tp ranks share it)."""
    dp = mesh.dp if isinstance(mesh, ParallelMesh) else mesh
    if dp.ndim == 1:
        return dp.get_local_rank()
    return dp.get_local_rank("dp_replicate") * dp.size(1) + dp.get_local_rank("dp_shard")

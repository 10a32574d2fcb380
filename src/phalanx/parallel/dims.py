"""Parallel degrees → one validated DeviceMesh.

`ParallelDims` checks the degrees against the world size once, at start, with an error that names the
degrees, the world size and a fix; `build_mesh` turns them into a `DeviceMesh` whose dimension names the
`apply_*` functions use. Knows nothing about the model, the data or the control plane.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class ParallelConfigError(ValueError):
    """Degrees that cannot tile the world size."""


@dataclass(frozen=True)
class ParallelDims:
    """dp_replicate × dp_shard = world size. dp_shard = -1 means "whatever is left"."""

    world_size: int
    dp_replicate: int = 1
    dp_shard: int = -1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ParallelConfigError(f"world size must be >= 1, got {self.world_size}")
        if self.dp_replicate < 1:
            raise ParallelConfigError(f"parallel.dp_replicate={self.dp_replicate} must be >= 1")
        if self.dp_shard == -1:
            if self.world_size % self.dp_replicate:
                raise ParallelConfigError(
                    f"parallel.dp_replicate={self.dp_replicate} does not divide the world size "
                    f"{self.world_size}; use a dp_replicate in {_divisors(self.world_size)}"
                )
            object.__setattr__(self, "dp_shard", self.world_size // self.dp_replicate)
        if self.dp_shard < 1:
            raise ParallelConfigError(f"parallel.dp_shard={self.dp_shard} must be >= 1 or -1 (auto)")
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise ParallelConfigError(
                f"parallel.dp_replicate={self.dp_replicate} × parallel.dp_shard={self.dp_shard} = "
                f"{self.dp_replicate * self.dp_shard}, but the world size is {self.world_size}; set "
                f"dp_shard={self.world_size // self.dp_replicate if self.world_size % self.dp_replicate == 0 else -1} "
                f"(or -1 for auto), or run with {self.dp_replicate * self.dp_shard} processes"
            )

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks (each sees a distinct slice of every global batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    def describe(self) -> str:
        if self.hsdp:
            return f"HSDP {self.dp_replicate} replicas × {self.dp_shard} shards"
        if self.dp_replicate > 1:
            return f"DDP-style replication × {self.dp_replicate}"
        return f"FSDP over {self.dp_shard} ranks"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """One replica: a 1-D ("dp_shard",) mesh over the default process group (plain FSDP).
    Several: a 2-D ("dp_replicate", "dp_shard") mesh (HSDP)."""
    if dims.dp_replicate == 1:
        return init_device_mesh(device_type, (dims.dp_shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(
        device_type, (dims.dp_replicate, dims.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard")
    )


def dp_rank(mesh: DeviceMesh) -> int:
    """This process's data-parallel rank: replica index × dp_shard + shard index."""
    if mesh.ndim == 1:
        return mesh.get_local_rank()
    return mesh.get_local_rank("dp_replicate") * mesh.size(1) + mesh.get_local_rank("dp_shard")

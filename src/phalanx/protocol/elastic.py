"""Elastic jobs: the settings both sides read, and the arithmetic of a global batch kept across sizes.

A *replica* is one data-parallel copy of the model: the ranks that hold one full set of shards
(`parallel.dp_shard` × `tensor_parallel_degree`). An elastic job runs any allowed number of replicas between
`min_replicas` and `max_replicas`; the controller picks the count (`control/policy/elastic.py`), the workers
derive `dp_replicate` from the world size of each generation (`replicas_of`).

The global batch stays fixed whatever the count (unless `scale_batch`: then it is `training.global_batch_size` at
`max_replicas` and follows the count, the learning rate scaled with it, `batch_at` and `lr_factor`): `split_batch` says how many micro-batches every rank runs
(the same count on every rank, or FSDP's per-micro-batch collectives would not pair up) and how many samples
each rank takes. Where the batch does not divide evenly, the first `global % dp` ranks take one sample more and
every micro-batch's loss is weighted by its share of the global batch, so the summed gradient is the
fixed-size one. A size that leaves some rank without a sample for one of its micro-batches cannot hold the
batch and is refused.

Knows nothing about torch, processes or the controller: settings and integers.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ElasticSettings(BaseModel):
    """`elastic:` in a training config (or `phalanx job submit --min-replicas/--max-replicas ...`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=1, description="the job runs with no fewer replicas; below it, it waits")
    max_replicas: int = Field(1, ge=1, description="the job grows up to this many replicas")
    replica_step: int = Field(1, ge=1, description="allowed counts: min_replicas, min + step, ... up to max")
    allowed_replicas: list[int] | None = Field(None, description="the allowed counts, listed (instead of "
                                                                 "replica_step)")
    stable_period_s: float = Field(30.0, ge=0, description="at least this long between two capacity-driven "
                                                           "changes (a fault or a `job scale` acts at once)")
    scale_up_delay_s: float = Field(10.0, ge=0, description="idle nodes must stay free this long before the "
                                                            "job grows onto them")
    scale_batch: bool = Field(False, description="the global batch follows the replica count (training."
                                                 "global_batch_size is the batch at max_replicas) instead of being kept")
    lr_scaling: Literal["linear", "sqrt"] | None = Field(None, description="with scale_batch: the peak learning "
                                                         "rate × (replicas ÷ max_replicas), or its square root; "
                                                         "default linear")

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"elastic.min_replicas={self.min_replicas} is more than elastic.max_replicas="
                             f"{self.max_replicas}; set min_replicas <= max_replicas")
        if self.allowed_replicas is not None:
            if not self.allowed_replicas:
                raise ValueError("elastic.allowed_replicas is empty; list at least one count, or leave it out")
            outside = [r for r in self.allowed_replicas if not self.min_replicas <= r <= self.max_replicas]
            if outside:
                raise ValueError(f"elastic.allowed_replicas {outside} outside [min_replicas={self.min_replicas}, "
                                 f"max_replicas={self.max_replicas}]")
        if self.lr_scaling is not None and not self.scale_batch:
            raise ValueError("elastic.lr_scaling applies only with elastic.scale_batch: true (a kept global batch "
                             "keeps the learning rate)")
        return self

    def batch_at(self, global_batch: int, replicas: int) -> int:
        """The global batch at `replicas`: kept, or (scale_batch) the batch at max_replicas scaled to the count."""
        return global_batch // self.max_replicas * replicas if self.scale_batch else global_batch

    def lr_factor(self, replicas: int) -> float:
        """The peak learning rate's multiplier at `replicas`: 1 with a kept batch."""
        if not self.scale_batch:
            return 1.0
        ratio = replicas / self.max_replicas
        return math.sqrt(ratio) if self.lr_scaling == "sqrt" else ratio

    def sizes(self) -> list[int]:
        """Every allowed replica count, ascending."""
        if self.allowed_replicas is not None:
            return sorted(set(self.allowed_replicas))
        return list(range(self.min_replicas, self.max_replicas + 1, self.replica_step))

    def valid_sizes(self, global_batch: int, micro_batch: int, ranks_per_replica: int) -> list[int]:
        """The allowed counts whose data-parallel size can hold the global batch."""
        return [r for r in self.sizes()
                if split_batch(self.batch_at(global_batch, r), micro_batch, r * ranks_per_replica) is not None]


def split_batch(global_batch: int, micro_batch: int, dp_size: int) -> tuple[int, list[int]] | None:
    """(micro-batches per rank, samples per data-parallel rank) for a global batch over `dp_size` ranks; None
    when some rank would have fewer samples than micro-batches (the size cannot hold the batch)."""
    base, extra = divmod(global_batch, dp_size)
    accum = -(-(base + (extra > 0)) // micro_batch)  # enough micro-batches for the largest share
    if base < accum:
        return None
    return accum, [base + (r < extra) for r in range(dp_size)]


def replicas_of(world_size: int, ranks_per_replica: int) -> int:
    """The replica count of a generation of `world_size` ranks (the controller only forms whole replicas)."""
    if world_size % ranks_per_replica:
        raise ValueError(f"world size {world_size} is not a whole number of replicas of {ranks_per_replica} ranks")
    return world_size // ranks_per_replica

"""Expert parallelism for the MoE blocks of an unchanged model, and MoE statistics over the global batch.

`apply_ep(model, mesh)` turns every `MoEFeedForward` (Mixtral's, GPT-OSS's: any subclass) into its parallel
form (same parameters, same state-dict keys; the class is swapped for a subclass that mixes the parallel
behaviour into the model's own class, the way `fully_shard` does it):

- Token counts → global. The router's load-balancing loss uses f_e = the fraction of *all* data-parallel
  ranks' tokens routed to expert e (the counts are summed over the data-parallel group, one small
  all-reduce per layer and micro-batch) times P_e = this rank's mean router probability. The trainer
  averages losses and gradients over data-parallel ranks, and mean_d(f · P_d) = f · P over the global
  micro-batch, so loss and gradients equal those of one process running the whole global micro-batch,
  whatever the layout (FSDP, HSDP, EP, TP). Done for ep = 1 too.
- With an "ep" mesh (ep > 1): expert weights ([E, ...] stacked) become DTensors sharded Shard(0) over
  the ep ranks — rank j of an ep group holds experts [j·E/ep, (j+1)·E/ep). A forward pass routes locally,
  sorts the (token, expert) pairs by expert (so they are grouped by destination rank), exchanges the
  per-expert counts with one `all_to_all_single`, sends the tokens with a second one (uneven splits),
  runs the local experts batched (the experts module's own `compute` on the local slices of its stacked
  parameters: Mixtral's SwiGLU, GPT-OSS's clamped SwiGLU with biases), sends
  the outputs back the same way and combines them with the routing weights. Autograd runs through both
  token all-to-alls (the backward of each is the reverse all-to-all). The optional capacity is applied
  on the source rank before dispatch, so which pairs are dropped does not depend on ep.

Sharding of the expert weights (what composes with `fully_shard` and DCP): each expert parameter (weights
and biases, all stacked along dim 0) is a DTensor on the ep mesh (Shard(0)); `apply_fsdp` wraps `experts` as
its own FSDP unit over the ranks
that hold the same experts (`mesh.expert_dp`: dp_shard / ep ranks, plus dp_replicate in HSDP), sharding
dim 1 (dim 0 may hold fewer experts than ranks). The result is one DTensor per weight with placements
(Shard(1) on expert_dp, Shard(0) on ep): ordinary placements that DCP saves with global offsets and
reshards on load, so a run can resume with a different ep, and `full_tensor()` gives the HF layout.
Gradients: the local expert gradient after the backward all-to-all is the sum over the ep group's
ranks; it is scaled by 1/ep in autograd so that FSDP's mean over expert_dp gives the mean over all
data-parallel ranks, as for every other parameter.

Knows nothing about the trainer, the data or the control plane; the model only as "has MoEFeedForward".
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from phalanx.models.moe import MoEFeedForward, combine, sort_pairs
from phalanx.parallel.dims import ParallelMesh

try:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import DTensor, Shard, distribute_tensor


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward sends the gradients back the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_in, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _source_major_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """counts [P, L]: rows received from source p for local expert l, laid out source-major. Returns the
    index that reorders them expert-major (expert 0's rows from every source first)."""
    sizes = counts.flatten()
    starts = (sizes.cumsum(0) - sizes).view_as(counts).t().flatten()  # source-major start of each block
    sizes = counts.t().flatten()  # block sizes in expert-major order
    new_starts = sizes.cumsum(0) - sizes
    total = int(sizes.sum())
    return torch.arange(total, device=counts.device) + torch.repeat_interleave(starts - new_starts, sizes)


class ExpertParallelExperts:
    """Mixed into an experts module whose parameters are DTensors sharded over the ep ranks: computes with the
    local experts (the module's `compute` on the local slices)."""

    ep_size: int = 1

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        weights = [_ScaleGrad.apply(_local(w), 1.0 / self.ep_size) for w in self.parameters(recurse=False)]
        return self.compute(x_sorted, tokens_per_expert, *weights)


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


@functools.cache
def _mixed(mixin: type, cls: type) -> type:
    """`cls` with `mixin`'s methods first (one class per pair, so repeated calls give the same class)."""
    return cls if issubclass(cls, mixin) else type(f"{mixin.__name__}[{cls.__name__}]", (mixin, cls), {})


class ParallelMoEFeedForward:
    """Mixed into a `MoEFeedForward`: counts summed over the data-parallel group and, with an ep group,
    experts spread over ranks and tokens dispatched to them with all-to-all."""

    count_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    ep_size: int = 1
    ep_rank: int = 0

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if dist.get_world_size(self.count_group) > 1:
            dist.all_reduce(counts, group=self.count_group)
        return counts

    def expert_outputs(self, x, top_w, top_idx, keep):
        if self.ep_group is None:
            return super().expert_outputs(x, top_w, top_idx, keep)
        group, n_ranks = self.ep_group, self.ep_size
        local_experts = self.n_experts // n_ranks
        pairs = sort_pairs(top_idx, self.n_experts, keep)  # grouped by expert, hence by destination rank
        send_counts = pairs.counts
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)  # [E] = [P × L] both ways
        send_counts, recv_counts = send_counts.view(n_ranks, local_experts), recv_counts.view(n_ranks, local_experts)
        in_splits, out_splits = send_counts.sum(1).tolist(), recv_counts.sum(1).tolist()

        received = _AllToAll.apply(x[pairs.token], out_splits, in_splits, group)  # source-major
        if local_experts > 1:
            to_expert_major = _source_major_to_expert_major(recv_counts)
            received = received[to_expert_major]
        expert_out = self.experts(received, recv_counts.sum(0).tolist())
        if local_experts > 1:
            expert_out = expert_out[torch.argsort(to_expert_major)]  # back to source-major
        returned = _AllToAll.apply(expert_out, in_splits, out_splits, group)  # in `pairs` order
        return combine(x, returned, top_w, pairs)


def apply_ep(model: nn.Module, mesh: ParallelMesh) -> int:
    """Make every MoE block count tokens over the global batch and, when `mesh.ep` is set, spread its experts
    over the ep ranks. Call before `apply_fsdp` (on the meta device is fine). Returns the blocks changed."""
    blocks = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    ep_mesh = mesh.ep
    for block in blocks:
        block.__class__ = _mixed(ParallelMoEFeedForward, type(block))
        block.count_group = mesh.dp_group
        if ep_mesh is None:
            continue
        if block.n_experts % ep_mesh.size():
            raise ValueError(f"{block.n_experts} experts cannot be split over {ep_mesh.size()} ep ranks")
        block.ep_group, block.ep_size, block.ep_rank = ep_mesh.get_group(), ep_mesh.size(), ep_mesh.get_local_rank()
        experts = block.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        experts.__class__ = _mixed(ExpertParallelExperts, type(experts))
        experts.ep_size = ep_mesh.size()
    return len(blocks)


def is_expert_parallel(module: nn.Module) -> bool:
    return isinstance(module, ExpertParallelExperts)


def moe_load(model: nn.Module) -> dict:
    """Routed (token, expert) pairs per expert and dropped pairs of the last micro-batch, summed over the MoE
    layers (global over data-parallel ranks once `apply_ep` ran)."""
    blocks = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not blocks:
        return {}
    per_expert = torch.stack([b.tokens_per_expert for b in blocks]).sum(0)
    return {
        "tokens_per_expert": [int(v) for v in per_expert.tolist()],
        "dropped_pairs": int(sum(float(b.dropped_pairs) for b in blocks)),
    }

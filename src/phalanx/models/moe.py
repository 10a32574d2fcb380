"""Mixtral-style sparse mixture-of-experts block (plain PyTorch, single process).

A linear router picks the top-k experts per token (softmax, then the k weights renormalised, as in
Mixtral); the selected (token, expert) pairs are grouped by expert, each expert runs once on its group
(one grouped matmul where torch has a usable `_grouped_mm`, a loop otherwise), and the outputs are
combined by the routing weights. Dropless by default; with `capacity_factor` an expert takes at most
`ceil(factor × tokens × k / n_experts)` pairs (first choices before second choices, then token order) and
the overflow pairs contribute nothing — the token passes through the block's residual — and are counted.
Also returns the Switch/GShard load-balancing loss.

The block is written in pieces (`route`, `capacity_mask`, `expert_outputs`, `reduce_counts`) so that
`phalanx.parallel.ep` can replace the two that must talk to other ranks (the expert computation → an
all-to-all dispatch; the token counts → a sum over data-parallel ranks) and reuse the rest unchanged.
Expert weights are stacked ([n_experts, ...]) so that wrapper can shard them along dim 0. Knows nothing
about torch.distributed.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.models.config import ModelConfig


class Router(nn.Module):
    """Linear gate: scores every expert for every token."""

    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


@functools.lru_cache(maxsize=None)
@torch.no_grad()  # saves nothing for backward: the first call may run inside activation checkpointing
def _grouped_mm_works(device_type: str, dtype: torch.dtype, column_major: bool = True) -> bool:
    """Whether this torch has a `_grouped_mm` kernel for this device, dtype and weight layout (probed once):
    column_major: weights passed as `w.transpose(-2, -1)` of a contiguous [E, out, in]; else contiguous
    [E, in, out]."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(16, 16, device=device_type, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device_type, dtype=dtype)
        offs = torch.tensor([8, 16], device=device_type, dtype=torch.int32)
        out = torch._grouped_mm(x, w.transpose(-2, -1) if column_major else w, offs=offs)
        return bool(torch.allclose(out.float(), torch.full_like(out, 16.0).float()))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_usable(x: torch.Tensor, *weights: torch.Tensor, column_major: bool = True) -> bool:
    """Whether `torch._grouped_mm` can multiply `x` [rows, in] by these stacked weights here."""
    # _grouped_mm needs 16-byte aligned row strides and at least one row.
    align = 16 // x.element_size()
    if x.shape[0] == 0 or x.shape[-1] % align or any(w.shape[-2] % align or w.shape[-1] % align for w in weights):
        return False
    return _grouped_mm_works(x.device.type, x.dtype, column_major)


def expert_swiglu(
    x_sorted: torch.Tensor, tokens_per_expert: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of each expert on its group of rows: x_sorted holds expert 0's rows first, then expert 1's...

    w1/w3 [E, inter, dim], w2 [E, dim, inter]. Every expert is part of the autograd graph even with no rows
    (its gradient is then zero), so data-parallel ranks always reduce the same set of gradients.
    """
    if grouped_mm_usable(x_sorted, w1, w2, w3):
        offs = torch.tensor(tokens_per_expert, device=x_sorted.device).cumsum(0).to(torch.int32)
        gate = torch._grouped_mm(x_sorted, w1.transpose(-2, -1), offs=offs)
        up = torch._grouped_mm(x_sorted, w3.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
    outputs = []
    for e, chunk in enumerate(torch.split(x_sorted, tokens_per_expert)):
        h = F.silu(F.linear(chunk, w1[e])) * F.linear(chunk, w3[e])
        outputs.append(F.linear(h, w2[e]))
    return torch.cat(outputs)


class Experts(nn.Module):
    """N SwiGLU experts with stacked weights: w1/w3 [E, inter, dim], w2 [E, dim, inter] (HF w1=gate, w3=up).

    Every parameter of an experts module is stacked along dim 0 (one slice per expert) and `compute` takes
    them in registration order: an expert-parallel wrapper passes its local slices instead.
    """

    def __init__(self, dim: int, intermediate_size: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, intermediate_size, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, intermediate_size))
        self.w3 = nn.Parameter(torch.empty(n_experts, intermediate_size, dim))

    def compute(self, x_sorted: torch.Tensor, tokens_per_expert: list[int], *weights: torch.Tensor) -> torch.Tensor:
        return expert_swiglu(x_sorted, tokens_per_expert, *weights)

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """x_sorted: tokens grouped by expert (expert 0's first); returns the expert outputs in that order."""
        return self.compute(x_sorted, tokens_per_expert, *self.parameters(recurse=False))


def capacity_mask(top_idx: torch.Tensor, n_experts: int, capacity_factor: float | None) -> torch.Tensor | None:
    """[T, k] bool, True for the (token, expert) pairs an expert takes; None when dropless.

    Capacity = ceil(factor × T × k / n_experts) pairs per expert. Priority: every token's first choice
    before any second choice (GShard), then token order.
    """
    if capacity_factor is None:
        return None
    tokens, k = top_idx.shape
    capacity = math.ceil(capacity_factor * tokens * k / n_experts)
    slot_major = F.one_hot(top_idx.t().reshape(-1), n_experts)  # [k*T, E]
    position = (slot_major.cumsum(0) * slot_major).sum(-1) - 1  # 0-based place in its expert's queue
    return (position < capacity).reshape(k, tokens).t()


def load_balancing_loss(router_probs: torch.Tensor, slot_fraction: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss: n_experts * sum_{s,e} f_{s,e} * P_e.

    slot_fraction f [k, E]: fraction of the tokens whose s-th choice is expert e (as HF Mixtral; over the
    global batch when a parallel wrapper sums the counts over ranks); P_e: mean router probability of
    expert e over this call's tokens. Equals 1 (times k-slot normalisation) when perfectly balanced.
    """
    prob_per_expert = router_probs.mean(dim=0)  # [E]
    return n_experts * (slot_fraction.to(prob_per_expert.dtype) * prob_per_expert.unsqueeze(0)).sum()


class MoEFeedForward(nn.Module):
    """Router + experts. Returns (output, aux_loss).

    Kept for metrics (non-persistent buffers, values of the last call): `tokens_per_expert` [E], the
    (token, expert) pairs routed to each expert, and `dropped_pairs`, how many of them exceeded the capacity.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.capacity_factor = config.capacity_factor
        self.build(config)
        self.register_buffer("tokens_per_expert", torch.zeros(config.n_experts), persistent=False)
        self.register_buffer("dropped_pairs", torch.zeros(()), persistent=False)

    def build(self, config: ModelConfig) -> None:
        """The router and the experts, under Hugging Face's names for this architecture."""
        self.gate = Router(config.dim, config.n_experts)
        self.experts = Experts(config.dim, config.intermediate_size, config.n_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router_probs [T, E] fp32, top_w [T, k] renormalised, top_idx [T, k])."""
        router_probs = torch.softmax(self.gate(x).float(), dim=-1)
        top_w, top_idx = torch.topk(router_probs, self.top_k, dim=-1)
        return router_probs, top_w / top_w.sum(dim=-1, keepdim=True), top_idx

    def expert_outputs(self, x: torch.Tensor, top_w: torch.Tensor, top_idx: torch.Tensor,
                       keep: torch.Tensor | None) -> torch.Tensor:
        """sum_k top_w × expert(x) per token, over the kept pairs. Single process: every expert is here."""
        pairs = sort_pairs(top_idx, self.n_experts, keep)
        expert_out = self.experts(x[pairs.token], pairs.counts.tolist())
        return combine(x, expert_out, top_w, pairs)

    def reduce_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Sum integer statistics over the ranks that share a global batch (identity in one process)."""
        return counts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router_probs, top_w, top_idx = self.route(x)
        keep = capacity_mask(top_idx, self.n_experts, self.capacity_factor)
        out = self.expert_outputs(x, top_w, top_idx, keep)

        # One integer vector for everything counted: routed pairs per (slot, expert), dropped pairs, tokens.
        with torch.no_grad():
            slot_counts = F.one_hot(top_idx, self.n_experts).sum(0)  # [k, E]
            dropped = (~keep).sum().reshape(1) if keep is not None else slot_counts.new_zeros(1)
            tokens = slot_counts.new_full((1,), x.shape[0])
            counts = self.reduce_counts(torch.cat([slot_counts.flatten(), dropped, tokens]))
            slot_counts, dropped, tokens = counts[:-2].view_as(slot_counts), counts[-2], counts[-1]
            self.tokens_per_expert.copy_(slot_counts.sum(0).to(self.tokens_per_expert.dtype))
            self.dropped_pairs.copy_(dropped.to(self.dropped_pairs.dtype))
        aux = load_balancing_loss(router_probs, slot_counts / tokens, self.n_experts)
        return out.reshape(shape), aux


class SortedPairs:
    """The kept (token, expert) pairs sorted by expert (stable: token order within an expert)."""

    def __init__(self, order: torch.Tensor, token: torch.Tensor, counts: torch.Tensor):
        self.order = order  # index into the flattened [T*k] pairs
        self.token = token  # token of each sorted pair
        self.counts = counts  # [E] pairs per expert


def sort_pairs(top_idx: torch.Tensor, n_experts: int, keep: torch.Tensor | None) -> SortedPairs:
    flat_expert = top_idx.reshape(-1)
    if keep is not None:  # dropped pairs get expert id n_experts: sorted last, then cut off
        flat_expert = torch.where(keep.reshape(-1), flat_expert, n_experts)
    order = torch.argsort(flat_expert, stable=True)
    counts = torch.bincount(flat_expert, minlength=n_experts + 1)[:n_experts]
    if keep is not None:
        order = order[: int(counts.sum())]
    return SortedPairs(order, order // top_idx.shape[1], counts)


def combine(x: torch.Tensor, expert_out: torch.Tensor, top_w: torch.Tensor, pairs: SortedPairs) -> torch.Tensor:
    """Weight each pair's expert output by its routing weight and add it to its token's row."""
    weighted = expert_out * top_w.reshape(-1)[pairs.order].unsqueeze(-1).to(expert_out.dtype)
    return torch.zeros_like(x).index_add_(0, pairs.token, weighted.to(x.dtype))

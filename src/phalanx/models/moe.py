"""Mixtral-style sparse mixture-of-experts block (plain PyTorch, single process).

A linear router picks the top-k experts per token (softmax, then the k weights renormalised, as in
Mixtral); every selected (token, expert) pair is computed — dropless — and combined by the routing
weights. Expert weights are stacked ([n_experts, ...]) so a later expert-parallel wrapper can shard
them along dim 0 and run one grouped matmul per local expert. Also returns the Switch/GShard
load-balancing loss. Knows nothing about torch.distributed.
"""

from __future__ import annotations

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


class Experts(nn.Module):
    """N SwiGLU experts with stacked weights: w1/w3 [E, inter, dim], w2 [E, dim, inter] (HF w1=gate, w3=up)."""

    def __init__(self, dim: int, intermediate_size: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, intermediate_size, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, intermediate_size))
        self.w3 = nn.Parameter(torch.empty(n_experts, intermediate_size, dim))

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """x_sorted: tokens grouped by expert (expert 0's first); returns the expert outputs in that order."""
        outputs = []
        for e, chunk in enumerate(torch.split(x_sorted, tokens_per_expert)):
            if chunk.shape[0] == 0:
                continue
            h = F.silu(F.linear(chunk, self.w1[e])) * F.linear(chunk, self.w3[e])
            outputs.append(F.linear(h, self.w2[e]))
        if not outputs:
            return x_sorted.new_zeros(x_sorted.shape)
        return torch.cat(outputs)


def load_balancing_loss(router_probs: torch.Tensor, top_idx: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch/GShard auxiliary loss: n_experts * sum_e f_e * P_e.

    f_e: fraction of the top-k assignments routed to expert e, averaged over the k slots (as HF Mixtral);
    P_e: mean router probability of expert e. Equals 1 (times k-slot normalisation) when perfectly balanced.
    """
    assignment = F.one_hot(top_idx, n_experts).float()  # [T, k, E]
    tokens_per_expert = assignment.mean(dim=0)  # [k, E]
    prob_per_expert = router_probs.mean(dim=0)  # [E]
    return n_experts * (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum()


class MoEFeedForward(nn.Module):
    """Router + experts. Returns (output, aux_loss); `tokens_per_expert` of the last call is kept for metrics."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_experts = config.n_experts
        self.top_k = config.top_k
        self.gate = Router(config.dim, config.n_experts)
        self.experts = Experts(config.dim, config.intermediate_size, config.n_experts)
        self.register_buffer("tokens_per_expert", torch.zeros(config.n_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        router_probs = torch.softmax(self.gate(x).float(), dim=-1)  # [T, E]
        top_w, top_idx = torch.topk(router_probs, self.top_k, dim=-1)  # [T, k]
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)

        # Group the T*k (token, expert) pairs by expert so each expert runs one matmul.
        flat_expert = top_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_of_pair = order // self.top_k
        counts = torch.bincount(flat_expert, minlength=self.n_experts)
        expert_out = self.experts(x[token_of_pair], counts.tolist())
        weighted = expert_out * top_w.reshape(-1)[order].unsqueeze(-1).to(expert_out.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of_pair, weighted.to(x.dtype))

        with torch.no_grad():
            self.tokens_per_expert.copy_(counts.to(self.tokens_per_expert.dtype))
        aux = load_balancing_loss(router_probs, top_idx, self.n_experts)
        return out.reshape(shape), aux

"""What GPT-OSS (openai/gpt-oss-*) adds to a Llama-family decoder: its MoE block and attention with sinks.

- MoE (`GptOssMoE`, HF's `mlp`): a linear router *with bias* scores the experts; the top-k logits are
  softmaxed among themselves (the routing weights); each expert is a clamped SwiGLU with biases:
  gate_up = x @ W_gu + b_gu, gate = gate_up[..., 0::2] clamped above at `limit`, up = gate_up[..., 1::2]
  clamped to ±limit, out = ((up + 1) · gate · sigmoid(alpha · gate)) @ W_d + b_d. Weights are stored as
  HF stores them: gate_up_proj [E, dim, 2·inter] (gate and up interleaved), down_proj [E, inter, dim], so
  checkpoints map one to one. Routing, capacity, dispatch and the load-balancing loss are
  `phalanx.models.moe.MoEFeedForward`'s, so expert parallelism applies unchanged.
- Attention sinks: one learned logit per head that joins every softmax (and takes probability mass) but has
  no value: softmax([q·k_1, ..., q·k_t, sink_h]) with the sink's column dropped. `attention_with_sinks` runs
  it in `scaled_dot_product_attention` with one extra key: queries get a feature equal to 1, real keys 0 there,
  and the sink key sink_h / scale, so its score is exactly sink_h; its value is zero. Features are padded to a
  multiple of 8 so fused kernels take it. Same math as transformers' eager path, without an explicit
  [T, T] probability matrix where a fused kernel runs.
Plain PyTorch: no torch.distributed, no training loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.models.config import ModelConfig
from phalanx.models.moe import MoEFeedForward, grouped_mm_usable

_SINK_FEATURES = 8  # extra query/key features for the sink key (1 used, the rest zero padding)


class GptOssRouter(nn.Module):
    """Linear gate with a bias: logits [T, E]."""

    def __init__(self, dim: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.bias = nn.Parameter(torch.empty(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_expert_mlp(
    x_sorted: torch.Tensor, tokens_per_expert: list[int], gate_up: torch.Tensor, gate_up_bias: torch.Tensor,
    down: torch.Tensor, down_bias: torch.Tensor, alpha: float, limit: float,
) -> torch.Tensor:
    """Each expert's clamped SwiGLU on its group of rows (x_sorted holds expert 0's rows first, then expert 1's...).
    gate_up [E, dim, 2·inter], gate_up_bias [E, 2·inter], down [E, inter, dim], down_bias [E, dim]."""
    if grouped_mm_usable(x_sorted, gate_up, down, column_major=False):
        counts = torch.tensor(tokens_per_expert, device=x_sorted.device)
        offs = counts.cumsum(0).to(torch.int32)
        expert_of_row = torch.repeat_interleave(torch.arange(len(tokens_per_expert), device=x_sorted.device), counts)
        h = torch._grouped_mm(x_sorted, gate_up, offs=offs) + gate_up_bias[expert_of_row]
        return torch._grouped_mm(clamped_swiglu(h, alpha, limit), down, offs=offs) + down_bias[expert_of_row]
    outputs = []
    for e, chunk in enumerate(torch.split(x_sorted, tokens_per_expert)):
        h = clamped_swiglu(chunk @ gate_up[e] + gate_up_bias[e], alpha, limit)
        outputs.append(h @ down[e] + down_bias[e])
    return torch.cat(outputs)


class GptOssExperts(nn.Module):
    """N clamped-SwiGLU experts with biases, stacked along dim 0 in HF's layout (see the module docstring)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, dim, inter = config.n_experts, config.dim, config.intermediate_size
        self.n_experts, self.alpha, self.limit = e, config.swiglu_alpha, config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, dim, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(e, inter, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(e, dim))

    def compute(self, x_sorted: torch.Tensor, tokens_per_expert: list[int], *weights: torch.Tensor) -> torch.Tensor:
        return gpt_oss_expert_mlp(x_sorted, tokens_per_expert, *weights, alpha=self.alpha, limit=self.limit)

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        return self.compute(x_sorted, tokens_per_expert, *self.parameters(recurse=False))


class GptOssMoE(MoEFeedForward):
    """GPT-OSS's sparse MLP (HF: `mlp.router`, `mlp.experts`). Returns (output, aux_loss) like Mixtral's block."""

    def build(self, config: ModelConfig) -> None:
        self.router = GptOssRouter(config.dim, config.n_experts)
        self.experts = GptOssExperts(config)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(router_probs [T, E] fp32 for the aux loss, top_w [T, k] = softmax of the top-k logits, top_idx)."""
        logits = self.router(x)
        top_logits, top_idx = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(logits.float(), dim=-1), torch.softmax(top_logits.float(), dim=-1), top_idx


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax also counts one sink logit per head. q/k/v [B, H, T, D] (k/v already repeated
    to H heads), sinks [H], mask [T, T + 1] bool (True = attend; column 0 is the sink, always True).
    Returns [B, H, T, D]."""
    b, h, t, d = q.shape
    scale = d**-0.5
    extra = q.new_zeros(b, h, t, _SINK_FEATURES)
    q = torch.cat([q, extra[..., :1] + 1, extra[..., 1:]], dim=-1)
    k = torch.cat([k, extra], dim=-1)
    v = torch.cat([v, extra], dim=-1)
    sink_key = torch.cat([q.new_zeros(h, d), (sinks.to(q.dtype) / scale).unsqueeze(-1),
                          q.new_zeros(h, _SINK_FEATURES - 1)], dim=-1)
    k = torch.cat([sink_key[:, None, :].expand(b, h, 1, d + _SINK_FEATURES), k], dim=2)
    v = torch.cat([v.new_zeros(b, h, 1, d + _SINK_FEATURES), v], dim=2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[..., :d]

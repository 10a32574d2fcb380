"""Our decoder: the Llama family (Llama 2 / 3.x, Mistral, Mathstral; Mixtral when the config has experts) and
GPT-OSS (`architecture="gpt_oss"`).

RMSNorm, rotary embeddings (HF "rotate_half" layout; default / linear / llama3 / yarn scaling, see
`phalanx.models.rope`), grouped-query attention with an optional sliding window on all or every other layer,
a SwiGLU MLP or a sparse MoE block, tied or untied embeddings. GPT-OSS adds biases in attention, a learned sink
per head and its own MoE block (`phalanx.models.gpt_oss`). Module names equal Hugging Face's
(`model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`), so checkpoints map directly.
Plain PyTorch: no torch.distributed, no resilience, no training loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.models.config import ModelConfig
from phalanx.models.gpt_oss import GptOssMoE, attention_with_sinks
from phalanx.models.moe import MoEFeedForward
from phalanx.models.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def attention_mask(seq_len: int, sliding_window: int | None, device, *, sink: bool = False) -> torch.Tensor | None:
    """None when plain causal attention suffices; else a boolean mask (True = attend): [T, T], or with `sink`
    [T, T + 1] whose column 0 (the sink key) every query attends to."""
    if not sink and (sliding_window is None or seq_len <= sliding_window):
        return None
    i = torch.arange(seq_len, device=device)
    distance = i[:, None] - i[None, :]
    mask = distance >= 0
    if sliding_window is not None:
        mask &= distance < sliding_window
    return F.pad(mask, (1, 0), value=True) if sink else mask


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        bias = config.architecture == "gpt_oss"
        self.q_proj = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=bias)
        sinks = nn.Parameter(torch.empty(self.n_heads)) if config.has_attention_sinks else None
        self.register_parameter("sinks", sinks)  # GPT-OSS: one learned logit per head

    def forward(self, x, cos, sin, mask):
        bsz, seq_len, _ = x.shape
        # Head counts come from the weights so a tensor-parallel wrapper can shard heads unchanged.
        q = self.q_proj(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if self.sinks is not None:
            out = attention_with_sinks(q, k, v, self.sinks, mask)
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate_size, bias=False)
        self.up_proj = nn.Linear(dim, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block. Returns (hidden, aux_loss); aux_loss is None for a dense block."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        if config.architecture == "gpt_oss":
            self.mlp = GptOssMoE(config)
        elif config.is_moe:
            self.block_sparse_moe = MoEFeedForward(config)
        else:
            self.mlp = FeedForward(config.dim, config.intermediate_size)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        ff = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        if isinstance(ff, MoEFeedForward):
            out, aux = ff(h)
            return x + out, aux
        return x + ff(h), None


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class Transformer(nn.Module):
    """Causal LM. `forward(input_ids)` → logits; `forward(input_ids, labels)` → (loss, aux_loss).

    labels are the token ids themselves (shifted inside); loss = cross-entropy + coef × mean MoE aux loss.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        # Tied: the output projection reads the embedding matrix (no second, aliased Parameter, which
        # `to_empty` and sharding would silently untie).
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        h = self.model.embed_tokens(input_ids)
        seq_len = input_ids.shape[1]
        cos, sin = self.model.rotary_emb(seq_len, h.dtype)
        sink, window = self.config.has_attention_sinks, self.config.sliding_window
        masks = {windowed: attention_mask(seq_len, window if windowed else None, h.device, sink=sink)
                 for windowed in {self.config.layer_is_windowed(i) for i in range(self.config.n_layers)}}
        aux_losses = []
        for i, layer in enumerate(self.model.layers):
            h, aux = layer(h, cos, sin, masks[self.config.layer_is_windowed(i)])
            if aux is not None:
                aux_losses.append(aux)
        h = self.model.norm(h)
        logits = self.lm_head(h) if self.lm_head is not None else F.linear(h, self.model.embed_tokens.weight)
        if labels is None:
            return logits
        # Predict token t+1 at position t; the last position has no target (ignored). Shifting the
        # targets rather than slicing the logits avoids copying the [B, T, vocab] logits.
        targets = F.pad(labels[:, 1:], (0, 1), value=-100)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        aux_loss = torch.stack(aux_losses).mean() if aux_losses else None
        if aux_loss is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss
        return loss, aux_loss

    # ---- initialisation -------------------------------------------------------------------------
    def init_spec(self, name: str) -> tuple[str, float]:
        """How parameter `name` is initialised: ("normal", std), ("ones", 0) or ("zeros", 0), as transformers
        does (biases zero but the router's). Used by every init path."""
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            return ("ones", 0.0)
        if name.endswith("bias") and not name.endswith("router.bias"):
            return ("zeros", 0.0)
        return ("normal", self.config.init_std)

    def reset_buffers(self) -> None:
        self.model.rotary_emb.reset_parameters()
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.tokens_per_expert.zero_()

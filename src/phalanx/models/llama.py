"""Llama-family decoder: Llama 2, Mistral, Mathstral, and Mixtral when the config has experts.

RMSNorm, rotary embeddings (HF "rotate_half" layout, configurable theta), grouped-query attention with an
optional sliding window, SwiGLU MLP or a sparse MoE block, tied or untied embeddings. Module names equal
Hugging Face's (`model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`), so checkpoints map directly.
Plain PyTorch: no torch.distributed, no resilience, no training loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phalanx.models.config import ModelConfig
from phalanx.models.moe import MoEFeedForward


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


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed per call from positions (cheap; nothing to keep in sync with max_seq_len)."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self, device=None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / (self.theta**exponents)

    def reset_parameters(self) -> None:
        self.inv_freq = self._inv_freq(self.inv_freq.device)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def attention_mask(seq_len: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """None when plain causal attention suffices; else a boolean [T, T] mask (True = attend)."""
    if sliding_window is None or seq_len <= sliding_window:
        return None
    i = torch.arange(seq_len, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < sliding_window)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False)

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
        if mask is None:
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
        if config.is_moe:
            self.block_sparse_moe = MoEFeedForward(config)
        else:
            self.mlp = FeedForward(config.dim, config.intermediate_size)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        h = self.post_attention_layernorm(x)
        if hasattr(self, "block_sparse_moe"):
            out, aux = self.block_sparse_moe(h)
            return x + out, aux
        return x + self.mlp(h), None


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


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
        mask = attention_mask(seq_len, self.config.sliding_window, h.device)
        aux_losses = []
        for layer in self.model.layers:
            h, aux = layer(h, cos, sin, mask)
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
        """How parameter `name` is initialised: ("normal", std) or ("ones", 0). Used by every init path."""
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            return ("ones", 0.0)
        return ("normal", self.config.init_std)

    def reset_buffers(self) -> None:
        self.model.rotary_emb.reset_parameters()
        for module in self.modules():
            if isinstance(module, MoEFeedForward):
                module.tokens_per_expert.zero_()

"""Rotary position embeddings and their context-extension scalings: default, linear, llama3 (Llama 3.1+), yarn.

Each scaling is a rewrite of the inverse frequencies (one per pair of head dimensions), computed once from the
config; yarn also scales cos/sin by an "attention factor" (so q·k scales by its square). The formulas are those
of the papers / reference code, in the form transformers uses, so logits agree with it:
- linear: every frequency / factor (positions interpolated);
- llama3: wavelengths above original_context / low_freq_factor are divided by factor, those below
  original_context / high_freq_factor kept, the ones in between interpolated by a smooth ramp;
- yarn (NTK-by-parts): dimensions that rotate more than beta_fast times over the original context keep their
  frequency, those that rotate fewer than beta_slow times are interpolated (/ factor), a linear ramp between;
  attention factor 0.1 ln(factor) + 1 unless given.
Plain PyTorch; knows nothing about parallelism or training.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from phalanx.models.config import ModelConfig


def _default_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) & ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, cfg: ModelConfig, device=None) -> torch.Tensor:
    base, factor = cfg.rope_theta, cfg.rope_factor
    original = cfg.rope_original_max_seq_len

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the original frequency; 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep


def rope_inv_freq(cfg: ModelConfig, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] fp32, attention factor) for `cfg`'s RoPE type."""
    head_dim = cfg.head_dim
    if cfg.rope_type == "yarn":
        factor = cfg.rope_attention_factor
        if factor is None:
            factor = 0.1 * math.log(cfg.rope_factor) + 1.0 if cfg.rope_factor > 1 else 1.0
        return _yarn_inv_freq(head_dim, cfg, device), float(factor)
    inv_freq = _default_inv_freq(head_dim, cfg.rope_theta, device)
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, cfg)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed per call from positions (cheap; nothing to keep in sync with max_seq_len)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        inv_freq, self.attention_factor = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_parameters(self) -> None:
        self.inv_freq, self.attention_factor = rope_inv_freq(self.config, self.inv_freq.device)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + head_dim/2) of `x` [B, H, T, head_dim] (HF's "rotate_half" layout)."""
    return x * cos + _rotate_half(x) * sin

"""MXFP4 (OCP microscaling FP4), the format of GPT-OSS's published expert weights: dequantization on load.

A weight W [..., rows, cols] is stored as two tensors:
- `<name>_blocks` uint8 [..., rows, cols / 32, 16]: 32 consecutive values of a row per block, two 4-bit
  E2M1 codes per byte, the low nibble first (value 2j in the low nibble of byte j, value 2j + 1 in the high);
- `<name>_scales` uint8 [..., rows, cols / 32]: one power-of-two scale per block, stored as exponent + 127.
A code's value is FP4_VALUES[code] (sign bit, 2 exponent bits, 1 mantissa bit), times 2^(scale - 127).
GPT-OSS stores its experts output-major (gate_up_proj_blocks [E, 2·inter, dim / 32, 16]), the transpose of
the in-memory layout (gate_up_proj [E, dim, 2·inter]); `phalanx.models.hf` transposes after this module.
Every MXFP4 value is exactly representable in bf16 and fp32, so dequantizing to either loses nothing.
Knows nothing about checkpoints' files or the model.
"""

from __future__ import annotations

import torch

BLOCK_VALUES = 32  # values per scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., rows, G, 16], scales uint8 [..., rows, G] → W [..., rows, G · 32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK_VALUES // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit: need blocks "
            f"[..., rows, G, {BLOCK_VALUES // 2}] and scales [..., rows, G]"
        )
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., rows, G, 32], low nibble first
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(table[codes.long()], exponents.unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)

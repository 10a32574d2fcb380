"""Model FLOPs utilisation (MFU): the FLOPs one trained token costs, from the model's shapes, and the peak
FLOP/s of a device, from its name.

    mfu = tokens/s (all ranks) × FLOPs per token / (peak FLOP/s of one device × devices)

FLOPs per token is the usual estimate (PaLM appendix B, torchtitan): 6 × the parameters a token meets in
matmuls (forward 2, backward 4), plus attention's scores and weighted sum, 12 × layers × (heads × head_dim) ×
context. Counted: every block's weights (for MoE the `top_k` experts a token is routed to, plus the router)
and the output head (a matmul even when tied to the embedding); not counted: the input embedding (a lookup),
norms, activations, softmax. Context is the sequence length, or the window on sliding-window layers; the
causal mask is not halved (torchtitan's convention), so attention-heavy shapes read a little high.

The peak table holds dense (no sparsity) figures from the vendors' data sheets: bf16 tensor-core FLOP/s, and
fp32 without TF32 (PyTorch's default for matmuls). A device not in it has no MFU unless the config gives the
peak (`metrics.peak_flops_per_s`). Pure functions: knows nothing about processes, meshes or the loop.
"""

from __future__ import annotations

# (device-name substring, bf16, fp32) dense peak FLOP/s of one device; the first substring found wins, so
# the more specific names come first ("H100 PCIe" before "H100", "L40S" before "L4").
PEAK_FLOPS = [
    ("H200", 989.5e12, 66.9e12),  # also GH200
    ("H100 PCIe", 756.5e12, 51.2e12),
    ("H100 NVL", 835.5e12, 60.0e12),
    ("H100", 989.5e12, 66.9e12),  # SXM
    ("A100", 312e12, 19.5e12),
    ("L40S", 362.05e12, 91.6e12),
    ("L4", 121e12, 30.3e12),
]


def peak_flops_per_s(device_name: str | None, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of the device named `device_name` (e.g. torch.cuda.get_device_name()) at `precision`
    ("bf16" or "fp32"); None when unknown (a CPU: `device_name` None)."""
    if not device_name:
        return None
    for key, bf16, fp32 in PEAK_FLOPS:
        if key in device_name:
            return bf16 if precision == "bf16" else fp32
    return None


def flops_per_token(model_config, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token of a `seq_len`-token sample of `model_config`."""
    c = model_config
    lookup = c.vocab_size * c.dim * (0 if c.tie_embeddings else 1)  # the input table; the head is a matmul
    matmul_params = c.num_params(active=True) - lookup
    attention = sum(12 * c.n_heads * c.head_dim * (min(seq_len, c.sliding_window) if c.layer_is_windowed(layer)
                                                  else seq_len) for layer in range(c.n_layers))
    return 6 * matmul_params + attention


def mfu(tokens_per_s: float, flops_per_token: float, peak_per_device: float, devices: int) -> float:
    """The fraction of the devices' peak the step's throughput used."""
    return tokens_per_s * flops_per_token / (peak_per_device * devices)

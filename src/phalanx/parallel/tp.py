"""Tensor parallelism (Megatron-style) for the blocks of an unchanged model, with DTensor.

`apply_tp(model, tp_mesh)` calls `parallelize_module` on every decoder block:
- attention: q/k/v projections column-wise (each tp rank holds n_heads/tp query heads and n_kv_heads/tp
  KV heads — consecutive heads, so every local query head's KV head is local too), the output projection
  row-wise (its partial sums are all-reduced). The attention code reads the head count from the local
  projection's width, so it runs unchanged on the local heads;
- dense MLP: gate/up column-wise, down row-wise (the SwiGLU product is elementwise, so it stays local).
One all-reduce per attention and per MLP in forward, one each in backward. Embeddings, norms, the router,
MoE experts and the LM head stay replicated over tp (plain parameters, identical on every tp rank; FSDP
still shards them over the data-parallel ranks): simplest correct choice — vocabulary/sequence
parallelism would save memory and is not done here. Apply before `apply_fsdp`; FSDP then shards the
DTensor weights over the data-parallel mesh on top (2-D (dp_shard, tp) or 3-D (dp_replicate, dp_shard, tp)).
Knows nothing about the trainer, the data or the control plane.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

try:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
except ImportError:  # pragma: no cover
    from torch.distributed._tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def tp_plan(block: nn.Module) -> dict:
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    if hasattr(getattr(block, "mlp", None), "gate_proj"):  # dense block; an MoE block's experts stay replicated
        plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                     "mlp.down_proj": RowwiseParallel()})
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> int:
    """Split attention heads and MLP columns/rows over `tp_mesh`. Returns the number of blocks changed."""
    config = model.config
    tp = tp_mesh.size()
    if config.n_heads % tp or config.n_kv_heads % tp:
        raise ValueError(
            f"tensor parallel degree {tp} must divide n_heads={config.n_heads} and n_kv_heads={config.n_kv_heads}"
        )
    if getattr(config, "has_attention_sinks", False):
        raise ValueError(
            f"tensor parallel degree {tp} with model.architecture={config.architecture!r}: attention sinks are not "
            "split over tp ranks; use tensor_parallel_degree=1 (FSDP and expert parallelism apply)"
        )
    layers = model.model.layers
    for block in layers:
        parallelize_module(block, tp_mesh, tp_plan(block))
    return len(layers)

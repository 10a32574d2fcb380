"""One call that makes a model built on the meta device parallel: tensor parallel, expert parallel, activation
checkpointing, torch.compile per block, then FSDP2 / HSDP — in that order, the only one that composes (TP and EP
turn weights into DTensors that FSDP then shards on top; checkpoint wrappers and compiled blocks must be inside
the FSDP units, as in torchtitan).

The trainer, the warm standby's warm-up and the layout tests all build their models through `parallelize`,
so they cannot drift apart. Knows nothing about the training config, data or the control plane: the caller
passes the options it needs.
"""

from __future__ import annotations

from torch import nn

from phalanx.parallel.dims import ParallelMesh
from phalanx.parallel.ep import apply_ep
from phalanx.parallel.fsdp import apply_activation_checkpointing, apply_fsdp
from phalanx.parallel.tp import apply_tp


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    precision: str = "bf16",
    reshard_after_forward: bool = True,
    ac_mode: str = "none",
    ac_every: int = 1,
    compile: bool = False,
) -> nn.Module:
    """Apply tp (when `mesh.tp` is set), ep (MoE blocks: global token counts; experts spread over `mesh.ep`
    when set), activation checkpointing (`ac_mode`: none / full / selective every `ac_every`-th block) and
    FSDP with the `precision` policy, to `model` in place. Returns `model`. Its parameters are still on the
    meta device: materialise them afterwards (`phalanx.parallel.materialize`)."""
    if mesh.tp is not None:
        apply_tp(model, mesh.tp)
    apply_ep(model, mesh)  # a no-op for a dense model
    apply_activation_checkpointing(model, ac_mode, ac_every)
    if compile:
        for block in model.model.layers:
            block.compile()
    apply_fsdp(model, mesh, precision=precision, reshard_after_forward=reshard_after_forward)
    return model

"""Process groups across a fault: `release_process_groups` lets go of a failed generation's groups so their
sockets close at once (and the next generation's groups get the names its peers expect); `warm_up` runs, once,
on a one-process group, what a rank runs first in a generation, so a warm standby pays those first-call costs
before it is needed.

Knows nothing about generations, membership, the controller or the training loop (the warm-up builds its own
tiny model).
"""

from __future__ import annotations

import dataclasses
import gc
import time

import torch
import torch.distributed as dist

from phalanx.parallel.mesh_cache import let_go_of_groups


def release_process_groups(marks: dict | None = None) -> None:
    """Destroy the process groups and drop the last references Python keeps to them, so their sockets close
    now (a peer blocked on this rank then fails at once instead of waiting out its timeout). Besides the
    model and optimizer (already dropped by the caller), DTensor's caches hold specs and their meshes, and a
    mesh holds its groups: the meshes let go of them here, and the caches stay for the next generation where
    its meshes fit them (`phalanx.parallel.mesh_cache`)."""
    marks = {} if marks is None else marks
    let_go_of_groups()
    marks["caches"] = time.time()
    gc.collect()  # FSDP modules hold reference cycles
    marks["gc"] = time.time()
    if dist.is_initialized():
        dist.destroy_process_group()
    # Group names come from a per-process counter that only destroying WORLD resets: a generation whose
    # `init_process_group` or mesh failed half-way leaves it advanced, and the next generation's groups would
    # then rendezvous under other names than its peers' (each waiting on keys nobody writes).
    _c10d = dist.distributed_c10d
    if hasattr(_c10d, "_world"):
        _c10d._world.group_count = 0
    marks["destroyed"] = time.time()
    gc.collect()
    gc.freeze()  # what survives is this process's long-lived state: later collections skip it


def warm_up(device: torch.device) -> None:
    """Run once, on a one-process group, the code a rank runs first in a generation — mesh, FSDP wrapping,
    materialization, forward and backward, grad clipping, AdamW — so that a warm standby adopted after a
    fault does not pay those first-call costs (lazy imports, dispatch tables) on the recovery's critical
    path. A 1-layer model of tiny shapes; everything is released before returning."""
    from phalanx.models import Transformer, get_preset
    from phalanx.parallel import ParallelDims, build_mesh, clip_grad_norm_, materialize, parallelize, random_init_source

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        for preset in ("tiny", "tiny-moe"):
            config = dataclasses.replace(get_preset(preset), n_layers=1, vocab_size=64)
            mesh = build_mesh(ParallelDims(world_size=1), device.type)
            with torch.device("meta"):
                model = Transformer(config)
            parallelize(model, mesh, precision="fp32")
            materialize(model, device, random_init_source(model, 0))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            tokens = torch.randint(0, 64, (1, 16), device=device)
            loss, _aux = model(tokens, tokens)
            loss.backward()
            clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del model, optimizer, loss, _aux
    finally:
        release_process_groups()

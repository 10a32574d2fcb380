"""DTensor's caches across generations of process groups (checkpointless recovery rebuilds every group in the
same process).

DTensor caches what it works out per operator — sharding propagation (Python and C++), redistribution plans,
mesh topology — keyed by specs whose meshes compare equal by layout alone. A cache filled on an earlier
generation's meshes would serve the next one, and refilling it costs the first step after a recovery 0.3–0.5 s
on a 2-core CPU box (every operator's propagation again). Two things made keeping it unsafe:

- a cached spec holds its mesh, and a root mesh holds its process groups (`_pg_registry`, torch 2.13 here): the old
  generation's sockets would stay open, and a peer blocked on this rank would wait out its timeout instead of
  failing at once;
- a mesh fixes this rank's coordinates when it is made: a spec made when this process was another rank would
  place its shard wrongly.

So `let_go_of_groups()` (when a generation is left) empties the registries of every mesh built here — the
groups close — and `reuse_or_clear()` (when `build_mesh` builds the next generation's meshes) keeps the caches
only for the same rank of the same world on meshes of the same layout whose groups have the same names (names
come from a counter the release resets, or from the ranks): then a cached spec's old mesh resolves each group
by its name to the new group of the same ranks, and its registry is pointed at the new one (what
torch.compile's tracing reads). Any difference clears the caches, as every release did before.

Knows nothing about the trainer, recovery or the control plane.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

# The root meshes built here, by id (meshes compare equal by layout: a set would keep one of two generations')
_roots: "weakref.WeakValueDictionary[int, DeviceMesh]" = weakref.WeakValueDictionary()
_built_for: tuple | None = None  # the signature of the meshes the caches were filled on (None: unknown)


def _root(mesh: DeviceMesh) -> DeviceMesh:
    get = getattr(mesh, "_get_root_mesh", None)
    return get() if get is not None else mesh


def _group_names(mesh: DeviceMesh) -> tuple | None:
    """The names of the mesh's groups, per dimension (None: this torch keeps them some other way)."""
    names = getattr(mesh, "_dim_group_names", None)
    if names is None:
        infos = getattr(mesh, "_dim_group_infos", None)
        names = [info[-1] for info in infos] if infos is not None else None
    return tuple(names) if names is not None else None


def signature(meshes: list[DeviceMesh], extra_groups: list) -> tuple | None:
    """What must be equal for cached specs to be valid: this rank, the world, each mesh's ranks, dims and group
    names. None when a group name cannot be read (the caches are then never kept)."""
    parts = []
    for mesh in meshes:
        names = _group_names(mesh)
        if names is None:
            return None
        parts.append((tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names, names))
    extra = tuple(getattr(g, "group_name", None) for g in extra_groups)
    if None in extra:
        return None
    return dist.get_rank(), dist.get_world_size(), tuple(parts), extra


def reuse_or_clear(meshes: list[DeviceMesh], extra_groups: list = ()) -> None:
    """After `build_mesh` made `meshes` (and `extra_groups` beside them): keep DTensor's caches if they were filled
    on meshes of the same signature — pointing the old meshes' registries at the new groups — else clear them."""
    global _built_for
    new = signature(meshes, list(extra_groups))
    kept = new is not None and new == _built_for
    new_roots = {id(r): r for r in map(_root, meshes)}
    if kept:
        for old in list(_roots.values()):
            if id(old) in new_roots or not hasattr(old, "_pg_registry"):
                continue
            match = next((r for r in new_roots.values() if r == old), None)
            if match is not None:
                old._pg_registry = match._pg_registry  # torch.compile's tracing resolves groups through it
    else:
        clear_dtensor_caches()
    for key, root in new_roots.items():
        _roots[key] = root
    _built_for = new


def let_go_of_groups() -> None:
    """Drop the references the meshes built here hold to their process groups, so destroying the groups closes
    their sockets even while DTensor's caches keep the meshes."""
    for root in list(_roots.values()):
        for mesh in (root, *getattr(root, "_flatten_mapping", {}).values()):
            registry = getattr(mesh, "_pg_registry", None)
            if isinstance(registry, dict):
                registry.clear()


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches: sharding propagation (Python and C++), redistribution plans, mesh topology."""
    global _built_for
    _built_for = None
    try:
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
    except (ImportError, AttributeError):  # pragma: no cover - other torch layouts
        return
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        cached = getattr(propagator, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):
        torch._C._clear_DTensor_sharding_propagator_cache()
    try:
        from torch.distributed.tensor import _collective_utils, _redistribute
    except ImportError:  # pragma: no cover
        return
    for cached in (getattr(_redistribute, "_gen_transform_infos", None),
                   getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()

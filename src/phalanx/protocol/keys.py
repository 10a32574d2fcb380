"""The store keys of the seam (all under the cluster's namespace, see `phalanx.protocol.store`): a worker's
progress, liveness beat and compute seconds per step, a checkpointless generation's layout, arrivals,
departures and recovery summary, and a warm standby's assignment. The package docstring lists them with their meaning.

Must not know: who serves the store or how it is secured (`store.py`); imports no torch (the readers take a
live store).
"""

from __future__ import annotations

import json

def generation_prefix(job_id: str, generation: int) -> str:
    """Key prefix of one generation of a job; workers build process groups on PrefixStore(this, store)."""
    return f"{job_id}/gen{generation}"


def progress_key(job_id: str, generation: int, rank: int) -> str:
    """Store key holding the last step `rank` finished in this generation (an ASCII integer)."""
    return f"{generation_prefix(job_id, generation)}/progress/{rank}"


def step_time_key(job_id: str, generation: int, rank: int) -> str:
    """Store key holding `"<step> <seconds>"`: the compute seconds `rank` spent on that step (the straggler rule
    reads it). A sibling of `progress_key`, so a reader of the step alone is unchanged."""
    return f"{generation_prefix(job_id, generation)}/steptime/{rank}"


def alive_key(job_id: str, generation: int, rank: int) -> str:
    """Store key of the liveness counter rank `rank` bumps every BEAT_S (an ASCII integer)."""
    return f"{generation_prefix(job_id, generation)}/alive/{rank}"


def checkpoint_request_key(job_id: str, generation: int) -> str:
    """Store key holding the newest checkpoint request to a generation (`phalanx job checkpoint`, Slurm's warning
    before a time limit): an id that only grows (the controller's clock in milliseconds). Every rank's reporter
    reads it; the ranks save once all of them have seen a request they had not served
    (`ProgressReporter.pending_checkpoint`)."""
    return f"{generation_prefix(job_id, generation)}/checkpoint-request"


def generation_key(job_id: str) -> str:
    """Store key holding the newest generation of a job (checkpointless jobs watch it)."""
    return f"{job_id}/generation"


def layout_key(job_id: str, generation: int) -> str:
    return f"{generation_prefix(job_id, generation)}/layout"


def pg_prefix(job_id: str, generation: int) -> str:
    """The PrefixStore prefix a checkpointless generation's process groups rendezvous under."""
    return f"{generation_prefix(job_id, generation)}/pg"


def joined_key(job_id: str, generation: int) -> str:
    return f"{generation_prefix(job_id, generation)}/joined"


def recovered_key(job_id: str, generation: int) -> str:
    return f"{generation_prefix(job_id, generation)}/recovered"


def left_key(job_id: str, generation: int) -> str:
    return f"{generation_prefix(job_id, generation)}/left"


def finished_key(job_id: str) -> str:
    """Checkpointless: set by rank 0 once every rank has completed the last step and its final checkpoint —
    an exit after that (however it ends) loses nothing, and the controller ends the job instead of recovering."""
    return f"{job_id}/finished"


def standby_key(standby_id: str) -> str:
    """Where the warm standby worker `standby_id` waits for the env of the rank it must become. Ids are
    unique (node, slot, sequence): a key is only ever read by the process it was written for."""
    return f"standby/{standby_id}"


def standby_warm_key(standby_id: str) -> str:
    """Set by the warm standby `standby_id` once it is warmed up (torch imported, one step run) and waiting;
    deleted when it is activated. The controller grows an elastic job onto a node once its standbys are warm."""
    return f"standby-warm/{standby_id}"


def publish_generation(store, job_id: str, generation: int, nodes: list[str], workers_per_node: int,
                       cause: str = "fault") -> None:
    """Controller side: the layout first, then the generation number (a watcher that sees the number can
    read the layout). `cause`: why the generation before it ended — "fault", or "resize" (an elastic job's
    size changed: its workers record a `resized` event, not a `fault_detected`)."""
    layout = {"nodes": list(nodes), "workers_per_node": workers_per_node,
              "world_size": len(nodes) * workers_per_node, "cause": cause}
    store.set(layout_key(job_id, generation), json.dumps(layout))
    store.set(generation_key(job_id), str(generation))


def _read(store, keys: list[str], all_or_none: bool) -> list[bytes | None] | None:
    """Each key's value, None where it is not set. A running job's keys are all set: one `check` and one
    `multi_get` then, two round trips to the store whatever the number of keys (the controller reads its nodes'
    ranks at every heartbeat: a check and a get per key held its lock for a round trip each). Else, or a store
    without `multi_get`, key by key — get() would block on a missing key, so each is checked first — unless
    `all_or_none`: then None (a read of every rank of a generation must not cost a round trip per rank)."""
    batched = hasattr(store, "multi_get")
    if keys and batched and store.check(keys):
        return list(store.multi_get(keys))
    if all_or_none:
        return None if keys else []
    return [store.get(key) if store.check([key]) else None for key in keys]


def read_progress(store, job_id: str, generation: int, ranks: list[int], *, all_or_none: bool = False,
                  beats: bool = True) -> dict[int, dict] | None:
    """Rank → {"step": last reported step, "beat": liveness counter} (None before the first report); without
    `beats`, {"step"} only (the controller's tick: the beats are its agents' business, read on their nodes).
    `store`: a TCPStore. `all_or_none`: None unless every rank reported what is read (see `_read`)."""
    per = 2 if beats else 1
    keys = [key for rank in ranks for key in (progress_key(job_id, generation, rank), alive_key(job_id, generation,
                                                                                                 rank))[:per]]
    raw = _read(store, keys, all_or_none)
    if raw is None:
        return None
    values = [int(v) if v is not None else None for v in raw]
    return {rank: {"step": values[per * i], **({"beat": values[per * i + 1]} if beats else {})}
            for i, rank in enumerate(ranks)}


def read_step_times(store, job_id: str, generation: int, ranks: list[int], *,
                    all_or_none: bool = False) -> dict[int, tuple[int, float]] | None:
    """Controller side: rank → (step, compute seconds of that step), for the ranks that reported one.
    `all_or_none`: None unless every rank reported one (see `_read`)."""
    values = _read(store, [step_time_key(job_id, generation, rank) for rank in ranks], all_or_none)
    if values is None:
        return None
    out: dict[int, tuple[int, float]] = {}
    for rank, raw in zip(ranks, values):
        if raw is not None:
            step, seconds = (raw.decode() if isinstance(raw, bytes) else str(raw)).split()
            out[rank] = (int(step), float(seconds))
    return out

"""Run a function on N real processes with a gloo process group; collect each rank's return value.

The ranks are forked from multiprocessing's fork server, started once per test session with what a node's worker
template imports (`phalanx.zygote.PRELOAD`): a spawned rank was a fresh interpreter importing torch (~3 s of CPU
each, 45 of them in a run of the suite). Each rank is still a process of its own, with its own process group. A rank
inherits the environment the server started with, not the caller's: what a rank needs goes in its arguments.
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import pickle
import socket
from datetime import timedelta
from pathlib import Path

import torch.multiprocessing as mp

from phalanx.process import exit_without_teardown
from phalanx.zygote import PRELOAD

multiprocessing.forkserver.set_forkserver_preload(list(PRELOAD))  # (what a node's worker template imports)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, out_dir: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        result = fn(*args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    exit_without_teardown(0)  # as Phalanx's workers do: teardown can abort in a gloo destructor


def run_distributed(fn, world_size: int, tmp_path: Path, *args) -> list:
    """`fn(*args)` on `world_size` forked processes; returns [rank 0's result, rank 1's, ...]."""
    out_dir = Path(tmp_path) / f"results-{fn.__name__}-{world_size}"
    out_dir.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_entry, args=(fn, world_size, _free_port(), str(out_dir), args), nprocs=world_size, join=True,
                       start_method="forkserver")
    return [pickle.loads((out_dir / f"rank{r}.pkl").read_bytes()) for r in range(world_size)]

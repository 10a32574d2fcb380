"""DTensor's caches across generations of process groups in the same processes (`phalanx.parallel.mesh_cache`):
kept when a rank regroups as the same rank of the same world — the first step after a checkpointless recovery
then skips refilling them — while the old groups' sockets still close at release; cleared when the rank
changes (a mesh fixes its coordinates when it is made), and the sharded results stay right both ways."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from phalanx.parallel import ParallelDims, build_mesh
    from phalanx.resilience.groups import release_process_groups

    ports, me = [int(p) for p in sys.argv[1].split(",")], int(sys.argv[2])
    stores = []  # kept open: what is left after a release is the stores' sockets, the groups' are closed

    def sockets():
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
            except OSError:
                pass
        return n

    def cached():
        stats = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", None)
        if stats is not None:
            return stats()[1]
        return DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize

    def generation(port, rank):
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
        stores.append(store)  # (the master returns once both are connected)
        alone = sockets()
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        mesh = build_mesh(ParallelDims(world_size=2, dp_shard=2), "cpu").dp
        kept = cached()
        x = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
        y = x * 3 + 1
        out = {"rank": rank, "kept": kept, "local": y.to_local().tolist(), "full": y.full_tensor().tolist(),
               "sum": float(y.sum().full_tensor()), "with_groups": sockets()}
        release_process_groups()
        out["released"], out["store_only"] = sockets(), alone
        return out

    gens = [generation(ports[0], me), generation(ports[1], me), generation(ports[2], 1 - me)]
    print(json.dumps(gens), flush=True)
""")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _ranks(script: str, world: int, *args: str) -> list[str]:
    """Run `script` as ranks 0..world-1 (three store ports, the rank, `args`); their stdout."""
    ports = ",".join(map(str, _free_ports(3)))
    env = {"GLOO_SOCKET_IFNAME": "lo", "PATH": "/usr/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", script, ports, str(r), *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    try:
        ends = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (_out, err) in zip(procs, ends):
        assert p.returncode == 0, err[-2000:]
    return [out for out, _err in ends]


def test_caches_are_kept_for_the_same_rank_and_cleared_for_another_and_the_groups_close(tmp_path):
    ends = _ranks(SCRIPT, 2)
    full = [[3.0 * v + 1 for v in (2 * i, 2 * i + 1)] for i in range(6)]
    for out in ends:
        first, same, swapped = json.loads(out)
        for gen in (first, same, swapped):
            assert gen["full"] == full and gen["sum"] == sum(map(sum, full)), gen
            rank = gen["rank"]
            assert gen["local"] == full[3 * rank:3 * rank + 3], gen  # this rank's rows, whichever rank it is now
            assert gen["with_groups"] > gen["released"], gen  # the groups had sockets...
            assert gen["released"] <= gen["store_only"], gen  # ...and none is left once released
        assert first["kept"] == 0
        assert same["kept"] > 0, "the same rank of the same world regrouped: the caches were kept"
        assert swapped["kept"] == 0, "this process is another rank now: the caches were cleared"


TRAINER_SCRIPT = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    from pathlib import Path
    import torch, torch.distributed as dist
    from phalanx.parallel.mesh_cache import clear_dtensor_caches
    from phalanx.resilience.groups import release_process_groups
    from phalanx.resilience.restore import ShardState
    from phalanx.train.config import config_from_dict
    from phalanx.train.trainer import Trainer

    ports, rank, tree = [int(p) for p in sys.argv[1].split(",")], int(sys.argv[2]), json.loads(sys.argv[3])
    config, stores = config_from_dict(tree), []

    def cached():
        stats = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", None)
        if stats is not None:
            return stats()[1]
        from torch.distributed.tensor import DTensor
        return DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_info().currsize

    def generation(port, state=None, steps=3):
        store = dist.TCPStore("127.0.0.1", port, 4, is_master=rank == 0, timeout=timedelta(seconds=60))
        stores.append(store)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
        trainer = Trainer(config, torch.device("cpu"), init_weights=state is None)
        kept = cached()  # entries once the trainer is built
        if state is not None:
            state.apply(trainer)
        losses = [trainer.advance()["loss"] for _ in range(steps)]
        state = ShardState.capture(trainer)
        trainer.abandon()
        release_process_groups()
        return state, losses, kept

    at_3, _, _ = generation(ports[0])                  # a first generation trains 3 steps and is left
    _, kept_losses, kept = generation(ports[1], at_3)  # regrouped as the same rank: the caches are kept
    clear_dtensor_caches()
    _, fresh_losses, fresh = generation(ports[2], at_3)  # the same steps again from empty caches
    print(json.dumps({"kept": kept, "fresh": fresh, "kept_losses": kept_losses, "fresh_losses": fresh_losses}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("parallel, model", [
    ({"dp_replicate": 2, "dp_shard": 1, "tensor_parallel_degree": 2}, "tiny"),
    ({"dp_replicate": 2, "dp_shard": 2, "expert_parallel_degree": 2}, "tiny-moe"),
], ids=["hsdp-tp", "hsdp-ep"])
def test_a_trainer_regrouped_as_the_same_rank_trains_bit_for_bit_the_same_with_the_caches_kept(
        tmp_path, demo_data, parallel, model):
    """TP and EP meshes (a flattened data-parallel group, expert meshes): the steps after a regroup that kept the
    caches equal the same steps from empty caches, bit for bit (fp32 on CPU)."""
    tree = {"run_dir": str(tmp_path / "run"), "seed": 7, "precision": "fp32", "parallel": parallel,
            "model": {"preset": model, "overrides": {"vocab_size": 512, "n_layers": 2}},
            "data": {"path": str(demo_data)},
            "training": {"global_batch_size": 8, "micro_batch_size": 2, "max_steps": 100},
            "checkpoint": {"interval": 0}, "metrics": {"tensorboard": False}}
    for out in _ranks(TRAINER_SCRIPT, 4, json.dumps(tree)):
        r = json.loads(out.strip().splitlines()[-1])
        assert r["kept"] > r["fresh"], r  # (building the trainer fills a few entries: its own DTensor ops)
        assert r["kept_losses"] == r["fresh_losses"], r

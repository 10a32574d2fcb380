"""The deep health check's probe: `python -m phalanx.control.agent.deep_probe --out FILE`, one process per device
slot of each node in a deep-check round, started by the agents (`deep_check.DeepCheckRunner`).

It joins a torch.distributed group from the usual env (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT; NCCL on GPU nodes, gloo otherwise), runs a timed all_reduce of `--size-mb` MiB `--iters`
times after one warm-up, checks the sum is exact (a link that corrupts data fails here, not only a slow
one), and writes one JSON line to `--out`:

    {"rank", "world_size", "backend", "device", "seconds_per_iter", "algbw_gbps", "busbw_gbps", "correct"}

Bus bandwidth follows nccl-tests: busbw = algbw × 2(n−1)/n, so figures compare across group sizes and
against nccl-tests output. Knows nothing about nodes, the controller or the verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

from phalanx import protocol


def measure(size_mb: float, iters: int, timeout_s: float) -> dict:
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available() and os.environ.get("PHALANX_DEEP_CHECK_GPU", "1") == "1"
    if gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if gpu else "gloo"
    timeout = timedelta(seconds=timeout_s)
    # rank 0 serves the rendezvous on MASTER_ADDR only (env://'s would listen on every interface)
    store = protocol.env_rendezvous_store(os.environ, timeout)
    if store is None:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    try:
        n = dist.get_world_size()
        numel = max(1, int(size_mb * 2**20) // 4)
        buf = torch.ones(numel, dtype=torch.float32, device=device)
        dist.all_reduce(buf)  # warm-up: connections, buffers
        buf.fill_(1.0)
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        dist.barrier()
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        seconds = (time.perf_counter() - start) / iters
        # after `iters` sums of n ones (starting from 1): n ** iters, exact in fp32 for these sizes
        expected = float(n) ** iters
        correct = bool(torch.all(buf == expected).item()) if expected < 2**24 else bool(torch.isfinite(buf).all())
        algbw = numel * 4 / seconds / 1e9
        return {"rank": dist.get_rank(), "world_size": n, "backend": backend, "device": str(device),
                "seconds_per_iter": seconds, "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (n - 1) / n if n > 1 else None, "correct": correct}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="timed all_reduce probe of the deep health check")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size-mb", type=float, default=8.0)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = measure(args.size_mb, args.iters, args.timeout_s)
    args.out.write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    from phalanx.process import exit_without_teardown

    exit_without_teardown(main())  # the result is written: a gloo destructor must not turn it into a crash

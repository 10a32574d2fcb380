"""How long N ranks take to build a process group on the controller's rendezvous store, beside the same on a
store rank 0 hosts (torchrun's and env://'s way), for N up to what this machine holds.

Each rank is its own process (torch imported before the clock starts): it connects to the store, says it is
ready, and waits for a start key. The clock starts when the benchmark sets that key; each rank then runs
`dist.init_process_group("gloo", store=..., rank, world_size)` and one `dist.barrier()` and writes the time
it finished. Figure: the last rank's finish − the start (the group built and usable by every rank).

  controller  the controller's store: `protocol.serve_store` on loopback (a TCPStore owned by the controller
              process, listening on one address), keys under the cluster token's namespace and the job's
              generation prefix, as checkpointless jobs use it
  rank0       a store that rank 0 hosts (`TCPStore(is_master=True)` in rank 0's process), keys under the
              generation prefix only

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rendezvous.py --sizes 2,4,8,16,32 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from report import RESULTS_DIR, cpu_env, median, write_results  # noqa: E402

RANK = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    import torch.distributed as dist
    from phalanx import protocol

    mode, host, port, rank, world, run = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \\
        int(sys.argv[5]), sys.argv[6]
    if mode == "controller":
        base = protocol.namespaced(dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=300)), "tok")
        control = base
    else:  # rank 0 hosts the store, the way env:// does
        base = dist.TCPStore(host, port, world_size=None, is_master=rank == 0, timeout=timedelta(seconds=300),
                             wait_for_workers=False)
        control = base
    store = dist.PrefixStore(f"job/1/gen/{run}/pg", base)
    control.add(f"ready/{run}", 1)
    control.wait([f"go/{run}"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    dist.barrier()
    control.set(f"done/{run}/{rank}", str(time.time()))
    control.add(f"finished/{run}", 1)
    control.wait([f"exit/{run}"])
    dist.destroy_process_group()
""")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(mode: str, n: int, run: str) -> float:
    import torch.distributed as dist
    from phalanx import protocol

    port = free_port()
    if mode == "controller":
        server = protocol.serve_store("127.0.0.1", port)
        control = protocol.namespaced(server, "tok")
    else:
        server = None
    env = cpu_env()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, mode, "127.0.0.1", str(port), str(r), str(n), run],
                              env=env) for r in range(n)]
    try:
        if mode != "controller":  # rank 0 hosts it: connect once it listens
            from datetime import timedelta

            control = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
        deadline = time.monotonic() + 600
        while control.add(f"ready/{run}", 0) < n:
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"{mode} n={n}: ranks did not get ready")
            time.sleep(0.05)
        start = time.time()
        control.set(f"go/{run}", "1")
        while control.add(f"finished/{run}", 0) < n:
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"{mode} n={n}: a rank failed")
            time.sleep(0.005)
        done = max(float(control.get(f"done/{run}/{r}")) for r in range(n))
        control.set(f"exit/{run}", "1")
        for p in procs:
            p.wait(timeout=120)
        return done - start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        del server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2,4,8,16,32", help="comma-separated world sizes")
    parser.add_argument("--runs", type=int, default=3, help="runs per size and store (interleaved)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "rendezvous.json")
    args = parser.parse_args()
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    rows, samples = [], {}
    for n in [int(x) for x in args.sizes.split(",")]:
        for mode in ("controller", "rank0"):
            samples[(mode, n)] = []
        for i in range(args.runs):
            for mode in ("controller", "rank0"):
                seconds = one_run(mode, n, f"{n}-{i}")
                samples[(mode, n)].append(seconds)
                print(f"n={n:>3} run {i + 1}/{args.runs} {mode:>10}: {seconds:.3f} s", flush=True)
        row = {"ranks": n, "controller_s": median(samples[("controller", n)]), "rank0_s": median(samples[("rank0", n)])}
        row["ratio"] = row["controller_s"] / row["rank0_s"]
        rows.append(row)
        print(f"n={n:>3} median: controller store {row['controller_s']:.3f} s, rank-0 store {row['rank0_s']:.3f} s, "
              f"ratio {row['ratio']:.2f}", flush=True)
    biggest = rows[-1]
    path = write_results(args.out, {
        "benchmark": "rendezvous",
        "command": "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/rendezvous.py " + " ".join(sys.argv[1:]),
        "rows": rows, "runs": {f"{m}-{n}": v for (m, n), v in samples.items()},
        "summary": {"rendezvous_ranks_max": biggest["ranks"], "rendezvous_s_at_max": biggest["controller_s"],
                    "rendezvous_rank0_s_at_max": biggest["rank0_s"], "rendezvous_ratio_at_max": biggest["ratio"]},
    })
    print(json.dumps({"rows": rows}, indent=1))
    print(f"results: {path}")


if __name__ == "__main__":
    main()

"""What idle warm standbys cost: a local cluster of `--nodes` idle nodes with warm standbys (one per node, warmed
up and waiting for an assignment), CPU seconds per second over `--seconds`, read from /proc, of the controller
and of the standby processes together.

Before 2026-11-26 a standby checked its assignment key every 10 ms; it now blocks in the store's `wait`. The
figures of both, measured with this script (the older one at the parent commit of that change), are in the
closing note of that session; `benchmarks/results/standby_idle.json` holds this code's.

    .venv/bin/python benchmarks/standby_idle.py --nodes 6 --seconds 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from report import RESULTS_DIR, write_results  # noqa: E402

HZ = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / HZ


def pids(pattern: str) -> list[int]:
    return [int(p) for p in subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "standby_idle.json")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="phalanx-standby-idle-"))
    os.environ["PHALANX_HOME"] = str(root / "home")
    from phalanx.control.client.cluster import ClusterClient, create_cluster, delete_cluster

    spec = root / "idle.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "idle", "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": args.nodes,
                                             "spares": 0, "warm_standby": True}],
        "health": {"heartbeat_interval_s": 0.5, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 120.0}}))
    create_cluster(spec, timeout_s=180)
    try:
        client = ClusterClient("idle")
        deadline = time.time() + 180
        while True:
            logs = [Path(n["work_dir"]) / "standby-0.log" for n in client.nodes()]
            ready = sum(1 for log in logs if log.exists() and "waiting" in (log.read_text(errors="replace")
                                                                            .splitlines() or [""])[-1])
            if ready == args.nodes or time.time() > deadline:
                break
            time.sleep(1)
        if ready != args.nodes:
            raise RuntimeError(f"only {ready} of {args.nodes} standbys warmed up")
        time.sleep(3)
        controller = pids(f"daemon --cluster-dir {root}")[0]
        standbys = pids("worker --standby")
        c0, s0 = cpu_s(controller), sum(cpu_s(p) for p in standbys)
        time.sleep(args.seconds)
        c1, s1 = cpu_s(controller), sum(cpu_s(p) for p in standbys)
    finally:
        delete_cluster("idle")
    summary = {"nodes": args.nodes, "standbys": len(standbys),
               "controller_cores": round((c1 - c0) / args.seconds, 4),
               "standby_cores": round((s1 - s0) / args.seconds, 4)}
    print(summary)
    print(f"wrote {write_results(args.out, {'config': {'nodes': args.nodes, 'seconds': args.seconds}, 'summary': summary})}")


if __name__ == "__main__":
    main()

"""What bringing up a local cluster costs the machine: `phalanx cluster create` of `--nodes` members + 1 spare
(`local.cpu-1`, worker templates on, no warm standby, no job), until every node's worker template is ready to
fork a worker.

Figures per run:
  create_s           `create_cluster` returned (every node healthy)
  ready_s            every node's agent log says its worker template is ready (a job's workers fork at once)
  machine_cpu_s      busy CPU-seconds of the whole machine (/proc/stat) from the create to `ready_s`: run it on
                     an otherwise idle machine
  pss_mb, rss_mb     the cluster's processes once ready (each node's session, and the host template where there
                     is one): proportional set size (shared pages split among their sharers) and resident size

To compare two trees, run this file under each with PYTHONPATH=<tree>/src, interleaved (what
`benchmarks/results/local_bringup_host_template_ab.json` did):

    OMP_NUM_THREADS=1 PYTHONPATH=<tree>/src .venv/bin/python benchmarks/local_bringup.py --runs 3 --out F.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def busy_cpu_s() -> float:
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def memory_mb(pid: int) -> dict[str, float]:
    out = {}
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            key, value = line.split(":", 1)
            if key in ("Rss", "Pss"):
                out[key] = int(value.split()[0]) / 1024
    except OSError:  # gone meanwhile
        pass
    return out


def one_run(nodes: int) -> dict:
    from phalanx.control.backends.local import cmdline, processes_mentioning, session_members
    from phalanx.control.client.cluster import ClusterClient, create_cluster, delete_cluster

    home = Path(tempfile.mkdtemp(prefix="phalanx-bringup-"))
    os.environ["PHALANX_HOME"] = str(home / "home")
    spec = home / "cluster.yaml"
    spec.write_text(f"name: bringup\nbackend: local\ninstance_groups:\n- {{name: workers, instance_type: "
                    f"local.cpu-1, count: {nodes}, spares: 1, warm_standby: false}}\n")
    try:
        cpu0, t0 = busy_cpu_s(), time.monotonic()
        create_cluster(str(spec), timeout_s=180)
        create_s = time.monotonic() - t0
        client = ClusterClient("bringup")
        while not all("template ready" in (Path(n["work_dir"]) / "agent.log").read_text() for n in client.nodes()):
            if time.monotonic() - t0 > 300:
                raise SystemExit("the worker templates were not ready after 300 s")
            time.sleep(0.1)
        ready_s, cpu_s = time.monotonic() - t0, busy_cpu_s() - cpu0
        time.sleep(1.0)  # (what a template does right after it said ready: lowering its priority, a throwaway fork)
        pids = {p for n in client.nodes() for p in session_members(int(n["handle"]))}
        pids.update(p for p in processes_mentioning(str(home)) if "phalanx.zygote --for-host" in cmdline(p))
        mem = [memory_mb(p) for p in pids]
        return {"create_s": round(create_s, 2), "ready_s": round(ready_s, 2), "machine_cpu_s": round(cpu_s, 1),
                "processes": len(pids), "pss_mb": round(sum(m.get("Pss", 0) for m in mem)),
                "rss_mb": round(sum(m.get("Rss", 0) for m in mem))}
    finally:
        delete_cluster("bringup")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4, help="members (one spare is added)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import phalanx

    runs = []
    for i in range(args.runs):
        runs.append(one_run(args.nodes))
        print(json.dumps(runs[-1]), flush=True)
    result = {"benchmark": "local cluster bring-up", "nodes": args.nodes + 1, "phalanx": str(Path(phalanx.__file__)
                                                                                               .parent),
              "runs": runs, "median": {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}}
    print(json.dumps(result["median"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

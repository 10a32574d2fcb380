"""How soon the controller finds an agent killed on another host: by its link's close (`link_grace_s`, 0.5 s), or
only at the heartbeat timeout.

A `backend: hosts` cluster of `--agents` nodes (the default heartbeat: 0.5 s, timeout 3 s; no spares and
`node_recovery: none`, so the faulty nodes stay as they are) and as many simulated agents (benchmarks/control_scale.py's:
the real join, heartbeats and link over HTTP, no processes). Then `--kills` of them are killed one after another,
each at a random moment (0-2 s after the last was found): its connections close, as a killed process's kernel does.
Measured: kill → its node faulty (`state_since`), each kill; how many took longer than half the heartbeat timeout
(found by the timeout, not the link).

On 2026-12-01 (`--runs 2`, 40 kills each) the tree before `Watch.remind` found 10 of 40 only at 2.6-3.1 s, the
timeout (the close came just before the node's silence check, which found it within its grace and forgot it), p50
0.59 s; the fixed tree 40 of 40 by the link, p50 0.62 s, max 0.70 s (`link_detection_before_fix.json`,
`link_detection.json`; the tree before from a worktree, `PYTHONPATH=<tree>/src`).

Writes benchmarks/results/link_detection.json (summary: detect_gone_p50_s, detect_gone_max_s, found_late).

    PYTHONPATH=src .venv/bin/python benchmarks/link_detection.py --agents 24 --kills 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from control_scale import Bench, Conn, SimAgent, controller_api  # noqa: E402
from report import RESULTS_DIR, write_results  # noqa: E402

RESULTS = RESULTS_DIR / "link_detection.json"


async def measure(agents_n: int, kills: int, root: Path) -> dict:
    os.environ["PHALANX_HOME"] = str(root / "home")
    from phalanx.control.client.cluster import ClusterClient, create_cluster, delete_cluster
    from phalanx.control.spec import spec_from_dict
    spec = spec_from_dict({"name": "detect", "backend": "hosts", "api": {"host": "127.0.0.1"}, "node_recovery": "none",
                           "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": agents_n,
                                                "warm_standby": False, "worker_template": False}]})
    interval, timeout = spec.health.heartbeat_interval_s, spec.health.heartbeat_timeout_s
    created: dict = {}
    creator = threading.Thread(target=lambda: created.setdefault("info", create_cluster(spec, timeout_s=300)),
                               daemon=True)
    creator.start()
    host, port, token, _ = await controller_api(spec.name)
    loop = asyncio.get_running_loop()
    bench = Bench()
    agents = [SimAgent(i, Conn(host, port, token), interval, bench) for i in range(agents_n)]

    async def run(agent: SimAgent) -> None:
        await agent.join()
        asyncio.create_task(agent.hold_link())
        await agent.run()

    tasks = [asyncio.create_task(run(a)) for a in agents]
    while creator.is_alive():
        await asyncio.sleep(0.1)
    if "info" not in created:
        raise RuntimeError("the cluster did not come into service")
    await asyncio.sleep(2 * interval)
    client = ClusterClient(spec.name, timeout_s=60)
    found: list[float | None] = []
    for victim in agents[:kills]:
        await asyncio.sleep(random.random() * 2)  # (a random moment of its heartbeat and silence-check cycles)
        died_at = time.time()
        victim.die()
        while True:
            node = await loop.run_in_executor(None, lambda: client.call("GET", f"/v1/nodes/{victim.name}"))
            if node["state"] in ("faulty", "replacing", "terminated"):
                found.append(round(node["state_since"] - died_at, 3))
                break
            if time.time() - died_at > timeout + 30:
                found.append(None)
                break
            await asyncio.sleep(0.02)
        print(f"{victim.name} killed: faulty after {found[-1]} s", flush=True)
    await loop.run_in_executor(None, lambda: delete_cluster(spec.name, timeout_s=60))
    for a in agents:
        a.stopped = True
        a.conn.close()
    for t in tasks:
        t.cancel()
    return {"agents": agents_n, "kills": kills, "heartbeat_interval_s": interval, "heartbeat_timeout_s": timeout,
            "link_grace_s": spec.health.link_grace_s, "detect_gone_s": found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=24)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    runs = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            runs.append(uvloop.run(measure(args.agents, min(args.kills, args.agents), Path(tmp))))
    times = [t for r in runs for t in r["detect_gone_s"]]
    timeout = runs[0]["heartbeat_timeout_s"]
    late = sum(1 for t in times if t is None or t > timeout / 2)
    known = sorted(t for t in times if t is not None)
    summary = {"detect_gone_p50_s": statistics.median(known) if known else None,
               "detect_gone_max_s": known[-1] if known else None, "found_late": late, "kills": len(times)}
    print(f"{len(times)} agents killed: faulty after p50 {summary['detect_gone_p50_s']} s, max "
          f"{summary['detect_gone_max_s']} s; {late} found after half the heartbeat timeout ({timeout / 2:g} s)")
    write_results(args.out, {"command": " ".join(sys.argv), "config": vars(args) | {"out": str(args.out)},
                             "runs": runs, "summary": summary})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

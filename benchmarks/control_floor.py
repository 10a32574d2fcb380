"""The floor of benchmarks/control_scale.py on this machine: its simulated agents against a server that does no
controller work, so that a heartbeat p99 can be read against what the harness itself allows.

The server (a process of its own, as the controller is) is the controller's HTTP stack — uvicorn on uvloop with
httptools, a plain ASGI route — answering the same protocol with nothing behind it: a join gets the next node
name, a heartbeat is validated (`Heartbeat.model_validate_json`, as the controller does) and answered with a fixed
reply (no workers), a link is held open with a beat down it every LINK_BEAT_S and its beats up it read. No
SQLite, no reconciler, no other thread. The agents are control_scale's (`SimAgent`: the real join, heartbeats,
beats and link, one uvloop loop, each agent's period ± 5 %), at the same heartbeat interval; measured over
`--window` seconds once every agent has joined and settled: the heartbeats' p50 / p99 (full heartbeats only: the
beats have no answer), the server's and the agents' CPU, and the agents' own loop lag (a 10 ms timer).

If the floor's p99 is above a target at some N, no controller can show that target at N on this machine with this
harness: what is left is the harness's (its loop and the server's sharing the cores), not the controller's.

Writes benchmarks/results/control_floor.json (summary per N: floor_hb_p50_ms_<N>, floor_hb_p99_ms_<N>,
floor_agents_lag_p99_ms_<N>, floor_server_cpu_<N>).

    PYTHONPATH=src .venv/bin/python benchmarks/control_floor.py --nodes 1024 4096 --heartbeat-interval 2 --runs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from control_scale import Bench, Conn, SimAgent, cpu_seconds, percentile_ms, sample_lag  # noqa: E402
from report import RESULTS_DIR, write_results  # noqa: E402

RESULTS = RESULTS_DIR / "control_floor.json"
TOKEN = "floor"


def serve(port: int) -> None:
    """The server process: the controller's HTTP stack answering the protocol with nothing behind it."""
    import uvicorn

    from phalanx.protocol import PROTOCOL_VERSION
    from phalanx.protocol.messages import LINK_BEAT, LINK_BEAT_S, Heartbeat

    names: dict[str, str] = {}  # handle → node name (a join sent again gets the same)

    async def body(receive) -> bytes:
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def answer(send, reply: dict) -> None:
        data = json.dumps(reply, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]})
        await send({"type": "http.response.body", "body": data})

    async def link(receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": LINK_BEAT, "more_body": True})

        async def read():
            while (await receive())["type"] != "http.disconnect":
                pass

        reading = asyncio.ensure_future(read())
        while True:
            done, _ = await asyncio.wait({reading}, timeout=LINK_BEAT_S)
            if done:
                return
            await send({"type": "http.response.body", "body": LINK_BEAT, "more_body": True})

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/v1/join":
            handle = json.loads(await body(receive))["handle"]
            await answer(send, {"node": names.setdefault(handle, f"workers-{len(names)}")})
        elif path.endswith("/heartbeat"):
            Heartbeat.model_validate_json(await body(receive))
            await answer(send, {"protocol": PROTOCOL_VERSION, "sent_at": time.time(), "controller": 0.0,
                                "workers": [], "faults": [], "action": "run", "state": "healthy"})
        elif path.endswith("/link"):
            await link(receive, send)
        else:
            await answer(send, {})

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    print("ready", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", loop="uvloop",
                                  http="httptools", server_header=False, date_header=False,
                                  timeout_keep_alive=60)).run(sockets=[sock])


async def measure(n: int, interval: float, window: float, port: int, processes: int) -> dict:
    from agent_processes import AgentProcesses, split
    from agent_processes import window as cut

    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], stdout=subprocess.PIPE, text=True)
    children = AgentProcesses("127.0.0.1", port, TOKEN, interval, "uvloop")
    try:
        assert server.stdout.readline().strip() == "ready"
        await asyncio.sleep(1.0)
        bench = Bench()
        (first, own), *others = split(n, processes)  # this process's agents, and the children's
        agents = [SimAgent(i, Conn("127.0.0.1", port, TOKEN), interval, bench) for i in range(first, first + own)]
        await children.start(others)  # (all at once: nothing here to bring up)
        gate = asyncio.Semaphore(64)

        async def join_and_run(agent: SimAgent) -> None:
            async with gate:
                await agent.join()
            asyncio.create_task(agent.hold_link())
            await agent.run()

        tasks = [asyncio.create_task(join_and_run(a)) for a in agents]
        lag_task = asyncio.create_task(sample_lag(bench))
        while not (all(a.link_up for a in agents) and children.joined()):
            await asyncio.sleep(0.1)
        await asyncio.sleep(3 * interval)  # (joined together: their first heartbeats in step, then spread)
        bench.latencies.clear()
        bench.beats, bench.recording = 0, True
        cpu0, own0, t0 = cpu_seconds(server.pid), time.process_time() + children.cpu_seconds(), time.monotonic()
        await asyncio.sleep(window)
        cpu1, own1, t1 = cpu_seconds(server.pid), time.process_time() + children.cpu_seconds(), time.monotonic()
        bench.recording = False
        theirs = cut(await children.stop(), t0, t1)
        lat, lags = sorted(bench.latencies + theirs["latencies"]), list(bench.lags) + theirs["lags"]
        bench.beats += theirs["beats"]
        for a in agents:
            a.stopped = True
            a.die()
        for t in (*tasks, lag_task):
            t.cancel()
        await asyncio.gather(*tasks, lag_task, return_exceptions=True)
    finally:
        AgentProcesses.kill_all()
        server.kill()
        server.wait()
    return {"nodes": n, "agent_processes": processes, "heartbeat_interval_s": interval, "heartbeats": len(lat),
            "beats": bench.beats,
            "hb_p50_ms": percentile_ms(lat, 0.5), "hb_p99_ms": percentile_ms(lat, 0.99),
            "server_cpu_cores": round((cpu1 - cpu0) / (t1 - t0), 3),
            "agents_cpu_cores": round((own1 - own0) / (t1 - t0), 3),
            "agents_lag_p50_ms": percentile_ms(lags, 0.5), "agents_lag_p99_ms": percentile_ms(lags, 0.99)}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--heartbeat-interval", type=float, default=2.0)
    parser.add_argument("--window", type=float, default=15.0)
    parser.add_argument("--runs", type=int, default=1, help="rounds over every N")
    parser.add_argument("--agent-processes", type=int, nargs="+", default=[1, 8],
                        help="the processes the agents run in (benchmarks/agent_processes.py); each measured")
    parser.add_argument("--port", type=int, default=18790)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    random.seed(0)
    rows = []
    for r in range(args.runs):  # (every N and process count in turn, each round)
        for n in args.nodes:
            for k in args.agent_processes:
                row = uvloop.run(measure(n, args.heartbeat_interval, args.window, args.port, max(1, min(k, n))))
                rows.append(row)
                print(f"round {r + 1} N={n}: {json.dumps(row)}", flush=True)
    summary = {}
    print(f"{'N':>6} {'procs':>6} {'hb p50 ms':>10} {'hb p99 ms':>10} {'lag p99 ms':>11} {'server cpu':>11} "
          f"{'agents cpu':>11}")
    for n in args.nodes:
        for k in args.agent_processes:
            mine = [row for row in rows if row["nodes"] == n and row["agent_processes"] == max(1, min(k, n))]
            med = {key: statistics.median(row[key] for row in mine) for key in
                   ("hb_p50_ms", "hb_p99_ms", "agents_lag_p99_ms", "server_cpu_cores", "agents_cpu_cores")}
            tag = f"{n}_p{k}"
            summary.update({f"floor_hb_p50_ms_{tag}": med["hb_p50_ms"], f"floor_hb_p99_ms_{tag}": med["hb_p99_ms"],
                            f"floor_agents_lag_p99_ms_{tag}": med["agents_lag_p99_ms"],
                            f"floor_server_cpu_{tag}": med["server_cpu_cores"]})
            print(f"{n:6d} {k:6d} {med['hb_p50_ms']:10.2f} {med['hb_p99_ms']:10.2f} {med['agents_lag_p99_ms']:11.2f} "
                  f"{med['server_cpu_cores']:11.3f} {med['agents_cpu_cores']:11.3f}")
    write_results(args.out, {"command": " ".join(sys.argv), "config": vars(args) | {"out": str(args.out)},
                             "rows": rows, "summary": summary})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

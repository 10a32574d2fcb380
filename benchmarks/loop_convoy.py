"""What a busy Python thread does to an event loop's answers in the same process (the controller's situation: its
uvicorn loop answers heartbeats while the reconciler thread folds thousands of beats and flushes rows).

A server process (uvloop, or `--loop asyncio`) answers `--clients` keep-alive TCP connections, each sending a
200-byte request every 2 s ± 5 % (about clients / 2 requests a second), with a little Python per answer. In some
conditions a second thread of the server runs pure Python for 100 ms of every 200 ms (`busy`), under a given
`sys.setswitchinterval` (the GIL's hand-over interval; CPython's default is 5 ms). The clients run in this process
(uvloop) and time each round trip. Conditions alternate, `--runs` rounds of each; reported: p50 / p99 per
condition, medians over the rounds, and each p99 as a ratio to the idle server's.

Why: uvloop runs each of libuv's callbacks under the GIL taken anew; while another thread runs Python, each take
waits up to the switch interval. On 2026-12-01 (this 2-core VM, one round each) the idle server answered with a
p99 of 0.6 ms, with the busy thread 47 ms, and 4.4 ms with a 0.5 ms switch interval (docs/control-scale-log.md,
which also says why the same setting did not move the controller's own p99 at 4,096 nodes).

Writes benchmarks/results/loop_convoy.json (summary: p99_ms_<condition> and p99_ratio_<condition>).

    .venv/bin/python benchmarks/loop_convoy.py --runs 3
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, write_results  # noqa: E402

RESULTS = RESULTS_DIR / "loop_convoy.json"
REQUEST = b"x" * 200
# (name, busy thread, switch interval in s; None: CPython's default)
CONDITIONS = [("idle", False, None), ("busy", True, None), ("busy_switch_0.5ms", True, 0.0005),
              ("busy_switch_20ms", True, 0.02)]


def serve(port: int, loop: str, busy: bool, switch: float | None, seconds: float) -> None:
    """The server process: answer every request with its own bytes; optionally a thread busy half the time."""
    if switch is not None:
        sys.setswitchinterval(switch)
    if loop == "uvloop":
        import uvloop
        uvloop.install()

    class Echo(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport

        def data_received(self, data):
            sum(range(200))  # (a little Python per answer, as a heartbeat's handling has)
            self.transport.write(data)

    def spin():
        while True:
            until = time.monotonic() + 0.1
            while time.monotonic() < until:
                sum(range(1000))
            time.sleep(0.1)

    if busy:
        threading.Thread(target=spin, daemon=True).start()

    async def main():
        server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", port, backlog=4096)
        print("ready", flush=True)
        await asyncio.sleep(seconds)
        server.close()

    asyncio.run(main())


async def clients(port: int, n: int, seconds: float) -> list[float]:
    """`n` connections, each a request every 2 s ± 5 % for `seconds`; every round trip's seconds."""
    took: list[float] = []

    async def one():
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(random.random() * 2)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.monotonic()
            writer.write(REQUEST)
            await reader.readexactly(len(REQUEST))
            took.append(time.monotonic() - t0)
            await asyncio.sleep(2 * (0.95 + 0.1 * random.random()))
        writer.close()

    await asyncio.gather(*(one() for _ in range(n)))
    return took


def measure(port: int, loop: str, busy: bool, switch: float | None, n: int, seconds: float) -> dict:
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), loop, str(int(busy)), str(switch or 0),
                               str(seconds + 10)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        import uvloop
        took = sorted(uvloop.run(clients(port, n, seconds)))
    finally:
        server.kill()
        server.wait()
    return {"requests": len(took), "p50_ms": round(1e3 * took[len(took) // 2], 2),
            "p99_ms": round(1e3 * took[int(0.99 * (len(took) - 1))], 2)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        port, loop, busy, switch, seconds = sys.argv[2:7]
        serve(int(port), loop, busy == "1", float(switch) or None, float(seconds))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="rounds of every condition, alternating")
    parser.add_argument("--clients", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=20.0, help="each condition's measured time")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="the server's event loop")
    parser.add_argument("--port", type=int, default=18777)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    samples: dict[str, list[dict]] = {name: [] for name, _, _ in CONDITIONS}
    for r in range(args.runs):
        for name, busy, switch in CONDITIONS:
            got = measure(args.port, args.loop, busy, switch, args.clients, args.seconds)
            samples[name].append(got)
            print(f"round {r + 1} {name:18} {got['requests']:6d} requests  p50 {got['p50_ms']:7.2f} ms  "
                  f"p99 {got['p99_ms']:7.2f} ms", flush=True)
    p99 = {name: statistics.median(s["p99_ms"] for s in got) for name, got in samples.items()}
    summary = {**{f"p99_ms_{k}": v for k, v in p99.items()},
               **{f"p99_ratio_{k}": round(v / p99["idle"], 1) for k, v in p99.items() if k != "idle"}}
    print(f"{'condition':18} {'p50 ms':>8} {'p99 ms':>8} {'p99 / idle':>10}")
    for name, got in samples.items():
        print(f"{name:18} {statistics.median(s['p50_ms'] for s in got):8.2f} {p99[name]:8.2f} "
              f"{p99[name] / p99['idle']:10.1f}")
    write_results(args.out, {"command": " ".join(sys.argv), "config": vars(args) | {"out": str(args.out)},
                             "conditions": [{"name": n, "busy_thread": b, "switch_interval_s": s}
                                            for n, b, s in CONDITIONS],
                             "samples": samples, "summary": summary})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

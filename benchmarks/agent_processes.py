"""Simulated agents in processes of their own, for benchmarks/control_scale.py: real agents run on hosts of their
own, and thousands of them in one Python loop were the harness's own bottleneck. Against a server that does no
controller work (benchmarks/control_floor.py), 4,096 agents at a 2 s heartbeat in one process measured a p99 of
141-723 ms (median 528 ms, 7 runs), the same agents in 8 processes 6-255 ms (median 15 ms, 5 runs; 2026-12-01,
this 2-core VM): that one loop's pauses (its own lag p99 up to 105 ms), not the server, were those heartbeats' tail.

A child (`python benchmarks/agent_processes.py HOST PORT TOKEN FIRST COUNT INTERVAL LOOP`) runs agents FIRST ..
FIRST+COUNT-1 (control_scale's `SimAgent`: join, link, heartbeats, beats, replies applied) and records everything
with when it happened (time.monotonic, the same clock in every process here): each heartbeat's answer, each
failure, each beat, its loop's lag. It says on stdout when every one of its agents has joined and when each has
a job's assignment; on `stop` (stdin) it stops its agents and prints what it recorded. `AgentProcesses` is the
parent's side: start them, ask, stop them, and cut what they recorded to a window.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from control_scale import Bench, Conn, SimAgent  # noqa: E402


class StampedBench(Bench):
    """A child's record: everything, each with when (`time.monotonic`)."""

    def __init__(self):
        super().__init__()
        self.recording = True
        self.answered: list[tuple[float, float]] = []  # (answered at, seconds it took)
        self.failed_at: list[tuple[float, float]] = []  # (given up at, seconds it took)
        self.beat_at: list[float] = []
        self.lag_at: list[tuple[float, float]] = []  # (at, how late a 10 ms timer ran)

    def failed(self, seconds: float) -> None:
        self.failures_total += 1
        self.failed_at.append((time.monotonic(), seconds))

    def heartbeat(self, seconds: float) -> None:
        self.answered.append((time.monotonic(), seconds))

    def beat(self) -> None:
        self.beat_at.append(time.monotonic())


def say(event: dict) -> None:
    try:
        print(json.dumps(event), flush=True)
    except BrokenPipeError:  # the parent is gone (a failed run): nobody to tell
        pass


async def child(host: str, port: int, token: str, first: int, count: int, interval: float) -> None:
    bench = StampedBench()
    agents = [SimAgent(i, Conn(host, port, token), interval, bench) for i in range(first, first + count)]
    gate = asyncio.Semaphore(64)  # (joins 64 at a time, as the parent's)
    links: list[asyncio.Task] = []

    async def join_and_run(agent: SimAgent) -> None:
        async with gate:
            await agent.join()
        links.append(asyncio.create_task(agent.hold_link()))
        await agent.run()

    async def watch() -> None:  # joined; each job's assignment on every agent; the loop's own lag
        loop, told, joined, healthy = asyncio.get_running_loop(), set(), False, False
        while True:
            start = loop.time()
            await asyncio.sleep(0.01)
            bench.lag_at.append((time.monotonic(), max(0.0, loop.time() - start - 0.01)))
            if not joined and all(a.name for a in agents):
                joined = True
                say({"joined": count})
            if not healthy and all(a.state == "healthy" for a in agents):
                healthy = True
                say({"healthy": count})
            for job in {j for a in agents for j in a.assigned_at} - told:
                if all(job in a.assigned_at for a in agents):
                    told.add(job)
                    say({"assigned": job, "times": [a.assigned_at[job] for a in agents]})

    tasks = [asyncio.create_task(join_and_run(a)) for a in agents]
    watcher = asyncio.create_task(watch())
    loop = asyncio.get_running_loop()
    while (line := await loop.run_in_executor(None, sys.stdin.readline)) and line.strip() != "stop":
        pass
    for a in agents:
        a.stopped = True
        a.conn.close()
        if a.link_writer is not None:
            a.link_writer.close()
    for t in (*tasks, *links, watcher):
        t.cancel()
    await asyncio.gather(*tasks, *links, watcher, return_exceptions=True)
    say({"report": {"answered": bench.answered, "failed": bench.failed_at, "beats": bench.beat_at,
                    "lags": bench.lag_at, "failures_total": bench.failures_total, "links_ended": bench.links_ended,
                    "cpu_s": time.process_time()}})


class AgentProcesses:
    """The parent's side: `start` children for agents `ranges` [(first, count), ...], then `joined`, `healthy`,
    `assigned`, `cpu_seconds`, and `stop` (their records). `kill_all()`: every child still running (a run that
    failed)."""

    live: list[asyncio.subprocess.Process] = []

    def __init__(self, host: str, port: int, token: str, interval: float, loop: str):
        self.args = [host, str(port), token]
        self.interval, self.loop = interval, loop
        self.procs: list[asyncio.subprocess.Process] = []
        self.events: list[list[dict]] = []
        self.readers: list[asyncio.Task] = []

    async def start(self, ranges: list[tuple[int, int]]) -> None:
        for first, count in ranges:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, *self.args, str(first), str(count), str(self.interval), self.loop,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, limit=1 << 30)
            self.procs.append(proc)
            AgentProcesses.live.append(proc)
            self.events.append([])
            self.readers.append(asyncio.create_task(self._read(proc, self.events[-1])))

    @staticmethod
    async def _read(proc, events: list[dict]) -> None:
        while line := await proc.stdout.readline():
            events.append(json.loads(line))

    def joined(self) -> bool:
        return all(any("joined" in e for e in events) for events in self.events)

    def healthy(self) -> bool:
        """Every agent of every child started so far has been told its node is healthy."""
        return all(any("healthy" in e for e in events) for events in self.events)

    def assigned(self, job: str) -> list[float] | None:
        """Every child's agents' times of `job`'s first assignment (wall clock), once all have it; else None."""
        times = []
        for events in self.events:
            got = next((e["times"] for e in events if e.get("assigned") == job), None)
            if got is None:
                return None
            times += got
        return times

    def cpu_seconds(self) -> float:
        from control_scale import cpu_seconds

        return sum(cpu_seconds(p.pid) for p in self.procs)

    async def stop(self) -> list[dict]:
        for p in self.procs:
            p.stdin.write(b"stop\n")
            await p.stdin.drain()
        await asyncio.wait_for(asyncio.gather(*self.readers), 120)
        for p in self.procs:
            await p.wait()
            AgentProcesses.live.remove(p)
        return [next(e["report"] for e in events if "report" in e) for events in self.events]

    @classmethod
    def kill_all(cls) -> None:
        for p in cls.live:
            try:
                p.kill()
            except ProcessLookupError:  # (ended already)
                pass
        cls.live.clear()


def window(reports: list[dict], t0: float, t1: float) -> dict:
    """What the children recorded answered (or given up on, or beaten, or lagged) within [t0, t1]."""
    inside = lambda at: t0 <= at <= t1  # noqa: E731
    return {"latencies": [took for r in reports for at, took in r["answered"] + r["failed"] if inside(at)],
            "timeline": [(at - took, took) for r in reports for at, took in r["answered"] if inside(at)],
            "failures": sum(1 for r in reports for at, _ in r["failed"] if inside(at)),
            "beats": sum(1 for r in reports for at in r["beats"] if inside(at)),
            "lags": [lag for r in reports for at, lag in r["lags"] if inside(at)]}


def split(n: int, processes: int) -> list[tuple[int, int]]:
    """Agents 0..n-1 in `processes` contiguous ranges (first, count), the first the parent's."""
    base, extra = divmod(n, processes)
    ranges, first = [], 0
    for p in range(processes):
        count = base + (1 if p < extra else 0)
        ranges.append((first, count))
        first += count
    return ranges


if __name__ == "__main__":
    host, port, token, first, count, interval, loop_name = sys.argv[1:8]
    import uvloop

    run = uvloop.run if loop_name == "uvloop" else asyncio.run
    run(child(host, int(port), token, int(first), int(count), float(interval)))

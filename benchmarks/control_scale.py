"""The control plane at scale: the real controller against N simulated agents.

For each N in `--nodes` (default 64, 256, 1024): `phalanx cluster create` of a `backend: hosts` cluster of N
nodes (one group, no spares) on loopback, and N simulated agents in `--agent-processes` processes (default 8: this
one and 7 children, `agent_processes.py`, which start one after another, each once the agents before it are healthy;
1 in every result before 2026-12-01), each an event loop (uvloop; `--agents-loop asyncio`) — no torch in the agents, no processes — that speak the real protocol over HTTP/1.1 keep-alive: `POST /v1/join`, then a heartbeat every
`heartbeat_interval_s` (0.5 s, the default; `--heartbeat-interval S` sets it, and the timeout to 6 × S) with the body a real agent sends (phase, lifecycle, health,
workers, address, free ports), and each holds its link open (`GET /v1/nodes/{name}/link`) as a real agent does. The controller, its reconciler and SQLite are the real ones. Measured:

  ready        first join → the cluster in service (every node healthy)
  heartbeat    round-trip of each heartbeat over a `--window` of steady state: p50 / p99, and the rate
               actually delivered against N / interval (the simulated agents share the machine's cores). A
               heartbeat unanswered twice (REQUEST_TIMEOUT_S each) counts among them with the time it took, and in
               hb_failed (hb_failed_total: over the whole run); its agent goes on, as a real one does
  cpu          the controller process's CPU seconds per second over that window (1.0 = one core); and the
               simulated agents' (this process: at 1.0 their own loop is late, and so are the latencies it times)
  agents lag   how late the simulated agents' loop ran a 10 ms timer over each window, p50 / p99: a lag near the
               heartbeat latencies says they are the simulator's own (it shares the machine with the controller).
               Each agent's period varies ± 5 % a cycle, as on hosts of their own: in one loop, agents whose timers
               fired together after a lag of it were answered together and sent together again, a wave every cycle
  scrape       GET /metrics, median of 5
  schedule     a command job on all N nodes submitted → the last agent's heartbeat reply carries its
               assignment
  busy         the job "runs" (each simulated agent reports its worker running, as a real agent does, and each
               rank's step, beat and step time are in the controller's store, written once from this process
               with torch's TCPStore client, as workers keep them): the heartbeats' p50 / p99 and the controller's
               CPU over a second window
  stop         the job cancelled → every worker confirmed stopped by its agent (its generation ended)
  detect       one agent's last heartbeat → the controller marks its node faulty; and the excess over
               heartbeat_timeout_s (what the reconciler adds to the timeout itself): an agent that goes silent
               and keeps its connections (a frozen host)
  detect_gone  an agent killed (its connections closed, as a killed process's kernel does) → its node faulty: its
               link's close tells the controller (`health.link_grace_s`, 0.5 s), not the timeout
  calibration  one core's speed just before each N: a fixed pure-Python loop, the fastest of 5, ms. It tells a slow
               core, not a crowded host: on 2026-12-02 it stayed at 41-47 ms while the busy p99 rose from 40-45 to
               47-63 ms; the controller's CPU for the same work (cpu) is the better witness of that

Writes benchmarks/results/control_scale.json (summary per N: ready_s, hb_p50_ms, hb_p99_ms, hb_rate_ratio,
cpu_cores, agents_cpu_cores, agents_lag_p99_ms, busy_agents_lag_p99_ms, scrape_ms, schedule_s, busy_hb_p50_ms, busy_hb_p99_ms, busy_cpu_cores, stop_s,
detect_s, detect_excess_s, detect_gone_s).

    PYTHONPATH=src .venv/bin/python benchmarks/control_scale.py --nodes 64 256 1024

`--timeline FILE` also writes every heartbeat timed (when it was sent, how long its answer took), to tell a stall
of the whole controller (every heartbeat sent in the same second is late) from a slow few.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import RESULTS_DIR, write_results  # noqa: E402

from phalanx.control.agent.link import BEAT_CHUNK, news as link_news, next_wait  # noqa: E402
from phalanx.protocol import PROTOCOL_VERSION  # noqa: E402
from phalanx.protocol.messages import FULL_HEARTBEAT_MAX_S, LINK_BEAT_S, LINK_POKE  # noqa: E402

RESULTS = RESULTS_DIR / "control_scale.json"
REQUEST_TIMEOUT_S = 10.0
CHECK_INTERVAL_S = 5.0  # the spec's default (health.check_interval_s)
HEALTH = [{"name": "disk", "status": "ok", "detail": "simulated", "action": None},
          {"name": "memory", "status": "ok", "detail": "simulated", "action": None}]


def controller_errors(cluster: str, last: int = 3) -> str:
    """The last ERROR lines of the cluster's controller log (why a run failed; the log goes with its directory)."""
    from phalanx.control.state.paths import ClusterPaths

    log = ClusterPaths.for_name(cluster).controller_log
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if " ERROR " in line] \
        if log.is_file() else []
    return " | ".join(line[:300] for line in lines[-last:]) or "none"


class Conn:
    """One keep-alive HTTP/1.1 connection to the controller."""

    def __init__(self, host: str, port: int, token: str):
        self.host, self.port, self.token = host, port, token
        self.reader = self.writer = None
        self.dead = False  # its agent was killed: no request goes out any more

    async def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        """One request; a connection the controller closed, or a reply that never came within REQUEST_TIMEOUT_S (an
        agent's own timeout), is tried again once on a new connection, as an HTTP client would."""
        if self.dead:
            raise ConnectionAbortedError("the agent was killed")
        try:
            return await asyncio.wait_for(self._request(method, path, body), REQUEST_TIMEOUT_S)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as err:
            if self.dead:
                raise ConnectionAbortedError("the agent was killed") from None
            print(f"{method} {path}: {type(err).__name__} {err}; again on a new connection", file=sys.stderr, flush=True)
            self.close()
        try:
            return await asyncio.wait_for(self._request(method, path, body), REQUEST_TIMEOUT_S)
        except BaseException:
            # closed, as a real agent's connection (`control/http.py`): a request sent next on this one would wait,
            # unseen, behind the unanswered one (HTTP/1.1 answers in order), and its agent would read as silent
            self.close()
            raise

    async def _request(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        if self.writer is None or self.writer.is_closing():  # (a connection the controller closed meanwhile)
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nAuthorization: Bearer {self.token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
        try:
            self.writer.write(head.encode() + data)
        except RuntimeError as err:  # uvloop's word for a write on a transport closed under it
            raise ConnectionResetError(str(err)) from None
        await self.writer.drain()
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the controller closed the connection")
        status = int(status_line.split()[1])
        length = 0
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        payload = await self.reader.readexactly(length) if length else b""
        return status, (json.loads(payload) if payload else {})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class SimAgent:
    def __init__(self, i: int, conn: Conn, interval: float, bench: "Bench"):
        self.i, self.conn, self.interval, self.bench = i, conn, interval, bench
        self.name: str | None = None
        self.handle = f"sim:{i}"
        self.silent = False
        self.stopped = False
        self.assigned_at: dict[str, float] = {}
        self.workers: dict[tuple, dict] = {}  # (job, generation, rank) → its report: the job "runs" here
        self.reply_sent_at: float | None = None  # the last reply's sent_at, echoed as a real agent does
        self.last_sent: float | None = None  # wall time of the newest heartbeat (or beat) sent
        self.link_writer: asyncio.StreamWriter | None = None
        self.link_up = False  # its link answered: beats go up it, pokes come down it
        self.next_s: float | None = None  # the last reply's next_heartbeat_s
        self.state: str | None = None  # the node's state, as the last reply said
        self.full_every = max(interval, FULL_HEARTBEAT_MAX_S)
        self.poked = asyncio.Event()  # the controller has news for this node (`LINK_POKE`)
        self.hurried = False  # the last reply asked for the next heartbeat sooner (`next_heartbeat_s`)
        # its health check's time: news every CHECK_INTERVAL_S, as a real agent's (agents started at different moments)
        self.checked_at = time.time() - random.random() * CHECK_INTERVAL_S
        self.full_at, self.said = float("-inf"), None  # the last full heartbeat, and what it said (`node_agent.py`)

    def die(self) -> None:
        """As a killed agent process: no more heartbeats, and its kernel closes its connections (the link's too)."""
        self.silent = True
        self.conn.dead = True
        self.conn.close()
        if self.link_writer is not None:
            self.link_writer.close()

    async def join(self) -> None:
        while True:  # like `phalanx agent` (`agent/join.py`): a 503 while the cluster is created (rows not all
            try:  # provisioned) is retried, and a join unanswered (the same handle: it gets the node it claimed)
                status, reply = await self.conn.request("POST", "/v1/join", {
                    "protocol": PROTOCOL_VERSION, "group": "workers", "handle": self.handle, "address": "127.0.0.1",
                    "ifname": "lo", "work_root": "/nonexistent/sim", "hostname": f"sim{self.i}"})
            except asyncio.TimeoutError:
                await asyncio.sleep(1.0)
                continue
            if status != 503:
                break
            await asyncio.sleep(0.5)
        if status != 200:
            raise RuntimeError(f"join refused: {status} {reply}")
        self.name = reply["node"]

    async def hold_link(self) -> None:
        """The agent's link (`control/agent/link.py`): one more connection, held open while the agent lives (a
        silent agent keeps it: a frozen host closes nothing), and opened again when it ends while the agent lives,
        as a real agent's (a link that ended unnoticed left a killed agent to the heartbeat timeout)."""
        while not (self.stopped or self.conn.dead):
            opened_at = time.monotonic()
            try:
                await self._hold_link_once()
            except (ConnectionError, OSError, asyncio.TimeoutError) as err:
                if not (self.stopped or self.conn.dead):
                    print(f"link of {self.name}: {type(err).__name__} {err}", file=sys.stderr, flush=True)
            if self.stopped or self.conn.dead or self.silent:  # (a frozen host opens nothing)
                return
            self.bench.links_ended += 1
            self.poked.set()  # (heartbeat now, as a real agent whose link dropped)
            if time.monotonic() - opened_at < 1.0:
                await asyncio.sleep(self.interval)

    async def _hold_link_once(self) -> None:
        reader, writer = await asyncio.open_connection(self.conn.host, self.conn.port)
        self.link_writer = writer
        writer.write(f"POST /v1/nodes/{self.name}/link?handle={self.handle} HTTP/1.1\r\nHost: {self.conn.host}\r\n"
                     f"Authorization: Bearer {self.conn.token}\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        await writer.drain()
        try:
            while not self.stopped:
                down = await asyncio.wait_for(reader.read(64), 3 * LINK_BEAT_S)  # (a real agent's read timeout)
                if not down:
                    break
                self.link_up = True  # (the response's head and first beat came)
                if LINK_POKE in down:
                    self.poked.set()
        finally:
            self.link_up = False
            writer.close()

    def body(self) -> dict:
        now = time.time()
        return {"protocol": PROTOCOL_VERSION, "handle": self.handle, "phase": "ready",
                "lifecycle": {"ok": True, "exit_code": None, "duration_s": 0.0, "tail": "", "log": None,
                              "detail": "no on_create script"},
                "health": {"ok": True, "checked_at": self.checked_at, "checks": HEALTH}, "sent_at": now,
                "workers": [dict(w) for w in self.workers.values()], "reply_sent_at": self.reply_sent_at, "deep_check": None,
                "standbys": {}, "address": "127.0.0.1", "ifname": "lo",
                "free_ports": [40000 + self.i % 20000]}

    async def run(self) -> None:
        await asyncio.sleep(random.random() * self.interval)  # agents joined together send at different moments
        while not self.stopped:
            start = time.monotonic()
            if not self.silent:
                self.last_sent = time.time()
                if time.time() - self.checked_at >= CHECK_INTERVAL_S:
                    self.checked_at = time.time()
                body = self.body()
                news = link_news(body)
                if self.link_up and not (self.hurried or self.poked.is_set()) and news == self.said \
                        and start - self.full_at < self.full_every:
                    self.link_writer.write(BEAT_CHUNK)  # as `agent/link.py`'s beat: nothing new to say
                    self.bench.beat()
                else:
                    self.poked.clear()
                    try:
                        status, reply = await self.conn.request("POST", f"/v1/nodes/{self.name}/heartbeat", body)
                    except ConnectionAbortedError:
                        break  # killed with a heartbeat in flight
                    except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                        # unanswered twice: a real agent logs it and sends a full heartbeat again (never a beat)
                        # after its wait (`next_wait`: a random part of the interval), as long as it lives; counted,
                        # its time among the latencies
                        self.bench.failed(time.monotonic() - start)
                        self.said = None
                    else:
                        took = time.monotonic() - start
                        self.bench.heartbeat(took)
                        if status != 200 or reply.get("action") == "terminate":
                            self.stopped = True
                            break
                        self.apply(reply)
                        self.full_at, self.said = time.monotonic() - random.random() * self.full_every / 2, news
            # (± 5 % a cycle: real agents' timers run on their own hosts; thousands in one loop fire in the same
            # iteration after any lag of it, and the answers to such a burst made the next one: a wave every cycle)
            period = min(self.next_s or self.interval, self.interval) * random.uniform(0.95, 1.05)
            wait = next_wait(period, time.monotonic() - start)
            if wait > 0:
                try:
                    await asyncio.wait_for(self.poked.wait(), wait)  # a poke: heartbeat at once
                except asyncio.TimeoutError:
                    pass


    def apply(self, reply: dict) -> None:
        """As an agent's supervisor, without processes: a rank assigned is reported running from the next heartbeat
        on; a rank no longer assigned is reported exited (stopped) once, then forgotten."""
        now = time.time()
        self.reply_sent_at = reply.get("sent_at")
        self.next_s = reply.get("next_heartbeat_s")
        self.state = reply.get("state")
        self.hurried = self.next_s is not None
        for key in [k for k, w in self.workers.items() if w["state"] == "exited"]:
            del self.workers[key]  # (its exit was in the heartbeat this reply answers)
        wanted = set()
        for a in reply.get("workers", []):
            self.assigned_at.setdefault(a["job"], now)
            for r in a.get("ranks", []):
                key = (a["job"], a["generation"], r["rank"])
                wanted.add(key)
                self.workers.setdefault(key, {
                    "job": a["job"], "generation": a["generation"], "rank": r["rank"], "local_rank": r["local_rank"],
                    "pid": 100000 + 8 * self.i + r["local_rank"], "state": "running", "exit_code": None,
                    "detail": None, "hang": None, "stopped": False, "started_at": now, "ended_at": None})
        for key, w in self.workers.items():
            if key not in wanted and w["state"] == "running":
                w.update(state="exited", exit_code=-15, detail="stopped by the agent (SIGTERM)", stopped=True,
                         ended_at=now)


class Bench:
    def __init__(self):
        self.recording = False
        self.latencies: list[float] = []
        self.timeline: list[tuple[float, float]] = []  # (sent at, time.monotonic; seconds to the answer), recorded
        self.lags: list[float] = []  # how late the simulator's own loop ran a 10 ms timer, recorded (`sample_lag`)
        self.beats = 0
        self.failures = 0  # heartbeats unanswered twice (`Conn.request`), while recording
        self.failures_total = 0  # over the whole run: the creation, the stop and the detections too
        self.links_ended = 0  # links that ended while their agent lived (opened again), over the whole run

    def failed(self, seconds: float) -> None:
        self.failures_total += 1
        if self.recording:
            self.failures += 1
            self.latencies.append(seconds)

    def heartbeat(self, seconds: float) -> None:
        if self.recording:
            self.latencies.append(seconds)
            self.timeline.append((time.monotonic() - seconds, seconds))

    def beat(self) -> None:
        if self.recording:
            self.beats += 1


async def sample_lag(bench: Bench) -> None:
    """The simulated agents' loop timing itself: a heartbeat's round trip includes how late this loop is to read
    its answer, so a lag near the latencies says they are the simulator's, not the controller's."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(0.01)
        if bench.recording:
            bench.lags.append(max(0.0, loop.time() - start - 0.01))


def calibration_ms(runs: int = 5) -> float:
    """A fixed pure-Python workload (one core, no allocation to speak of), the fastest of `runs`, in ms."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i * i % 7
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 1)


def percentile_ms(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return round(1000 * values[int(q * (len(values) - 1))], 2) if values else None


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def publish_progress(addr: str, token: str, job: str, generation: int, ranks: int) -> None:
    """Each rank's step, liveness beat and step time in the controller's rendezvous store, as a training job's
    workers keep them (the controller reads them for every rank and relays them in heartbeat replies)."""
    from datetime import timedelta

    import torch.distributed as dist

    from phalanx import protocol

    host, port = addr.rsplit(":", 1)
    store = protocol.namespaced(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60)), token)
    keys, values = [], []
    for rank in range(ranks):
        keys += [protocol.progress_key(job, generation, rank), protocol.alive_key(job, generation, rank),
                 protocol.step_time_key(job, generation, rank)]
        values += ["1", "1", "1 0.1"]
    store.multi_set(keys, values)


def http_get(url: str, token: str) -> tuple[float, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=60) as r:
        data = r.read()
    return time.perf_counter() - start, data


async def controller_api(cluster: str) -> tuple[str, int, str, int]:
    """The cluster's controller once its API answers: (host, port, token, pid), from the files `cluster create`
    writes."""
    from phalanx.control.state.paths import ClusterPaths

    paths = ClusterPaths.for_name(cluster)
    while not (paths.endpoint.is_file() and paths.token.is_file()):
        await asyncio.sleep(0.05)
    ep, token = json.loads(paths.endpoint.read_text()), paths.token.read_text().strip()
    host, port = ep["connect_host"], ep["api_port"]
    loop = asyncio.get_running_loop()
    for _ in range(600):  # (the endpoint file is written before the API listens)
        try:
            await loop.run_in_executor(None, http_get, f"http://{host}:{port}/v1/cluster", token)
            break
        except OSError:
            await asyncio.sleep(0.1)
    return host, port, token, ep["pid"]


async def keep_niced(pid: int, nice: int) -> None:
    """Every thread of process `pid` at `nice` (a negative one needs root), the threads it starts later too: the
    controller given the cores first, as on a host of its own, while the simulated agents take what it leaves."""
    while True:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            return
        for tid in tids:
            try:
                if os.getpriority(os.PRIO_PROCESS, int(tid)) != nice:
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            except ProcessLookupError:
                pass  # (a thread that ended meanwhile)
        await asyncio.sleep(1.0)


def pokes(url: str, token: str) -> float:
    """The controller's count of pokes sent down agents' links (/metrics)."""
    for line in http_get(f"{url}/metrics", token)[1].decode().splitlines():
        if line.startswith("phalanx_link_pokes_total "):
            return float(line.split()[1])
    return 0.0


async def measure(n: int, window: float, root: Path, interval: float | None = None,
                  timeline: Path | None = None, processes: int = 1, agents_loop: str = "uvloop",
                  bring_up: str = "waves", controller_nice: int = 0) -> dict:
    os.environ["PHALANX_HOME"] = str(root / f"home-{n}")
    from phalanx.control.client.cluster import ClusterClient, create_cluster, delete_cluster
    from phalanx.control.spec import spec_from_dict

    spec = spec_from_dict({"name": f"scale{n}", "backend": "hosts", "api": {"host": "127.0.0.1"},
                           "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": n,
                                                "warm_standby": False, "worker_template": False}],
                           "health": {"provision_timeout_s": 600, **({} if interval is None else {
                               "heartbeat_interval_s": interval, "heartbeat_timeout_s": 6 * interval})}})
    interval, timeout = spec.health.heartbeat_interval_s, spec.health.heartbeat_timeout_s
    created: dict = {}
    def create() -> None:
        try:
            created["info"] = create_cluster(spec, timeout_s=1800)
        except Exception as err:  # noqa: BLE001 - reported below
            created["error"] = str(err).splitlines()[0]

    creator = threading.Thread(target=create, daemon=True)
    creator.start()
    host, port, token, pid = await controller_api(spec.name)
    niced = asyncio.create_task(keep_niced(pid, controller_nice)) if controller_nice else None
    url = f"http://{host}:{port}"
    loop = asyncio.get_running_loop()
    from agent_processes import AgentProcesses, split
    from agent_processes import window as cut

    bench = Bench()
    (first, own), *others = split(n, processes)  # this process's agents, and the children's (`--agent-processes`)
    agents = [SimAgent(i, Conn(host, port, token), interval, bench) for i in range(first, first + own)]
    children = AgentProcesses(host, port, token, interval, agents_loop)
    first_join = time.monotonic()
    gate = asyncio.Semaphore(64)
    links: list[asyncio.Task] = []

    async def join_and_run(a: SimAgent) -> None:  # like an agent: heartbeats start as soon as its join is answered
        try:
            async with gate:
                await a.join()
            links.append(asyncio.create_task(a.hold_link()))
            await a.run()
        except Exception as err:  # noqa: BLE001 - said, not swallowed: the cluster then never comes into service
            print(f"simulated agent {a.i} ({a.name or 'not joined'}) stopped: {type(err).__name__}: {err}",
                  file=sys.stderr, flush=True)
            raise

    tasks = [asyncio.create_task(join_and_run(a)) for a in agents]
    lag_task = asyncio.create_task(sample_lag(bench))

    async def waves() -> None:
        """The other processes' agents, a process at a time, each once every agent before it is healthy: 4,096
        agents coming up from 4 processes at once left the controller's creation 1,500-4,100 heartbeats unanswered
        for 10 s, and a node judged silent failed it (one process could not send that fast; 2026-12-01)."""
        if bring_up == "together":  # every agent at once, as one `srun` step starts them
            await children.start(others)
            print(f"N={n}: every agent starts at once ({processes} processes)", flush=True)
            return
        for i, (start, count) in enumerate(others):
            while not (all(a.state == "healthy" for a in agents) and children.healthy()):
                await asyncio.sleep(0.2)
            await children.start([(start, count)])
            print(f"N={n}: agents {start}-{start + count - 1} (process {i + 2} of {processes}) start", flush=True)

    starting = asyncio.create_task(waves())
    while creator.is_alive():
        await asyncio.sleep(0.1)
    if "info" not in created:
        raise RuntimeError(f"the cluster did not come into service: {created.get('error')}; the controller's "
                           f"last errors: {controller_errors(spec.name)}")
    ready = time.monotonic() - first_join
    print(f"N={n}: in service {ready:.1f} s after the first join", flush=True)

    await asyncio.sleep(2 * interval)
    bench.latencies.clear()
    bench.beats, bench.failures, bench.recording = 0, 0, True
    pokes0 = await loop.run_in_executor(None, pokes, url, token)
    cpu0, own0, t0 = cpu_seconds(pid), time.process_time() + children.cpu_seconds(), time.monotonic()
    await asyncio.sleep(window)
    cpu1, own1, t1 = cpu_seconds(pid), time.process_time() + children.cpu_seconds(), time.monotonic()
    bench.recording = False
    idle_pokes = await loop.run_in_executor(None, pokes, url, token) - pokes0
    lat, beats, failures, lags = sorted(bench.latencies), bench.beats, bench.failures, list(bench.lags)
    bench.lags.clear()

    scrapes = [(await loop.run_in_executor(None, http_get, f"{url}/metrics", token))[0] for _ in range(5)]

    print(f"N={n}: a job submitted on every node", flush=True)
    submitted = time.time()
    req = urllib.request.Request(f"{url}/v1/jobs", method="POST", data=json.dumps(
        {"kind": "command", "nodes": n, "argv": ["sleep", "600"], "cwd": str(root), "name": "scale"}).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    job = json.loads(await loop.run_in_executor(None, lambda: urllib.request.urlopen(req, timeout=60).read()))["id"]
    deadline = time.monotonic() + 300
    while not (all(job in a.assigned_at for a in agents) and children.assigned(job) is not None) \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    theirs = children.assigned(job)
    if theirs is None or not all(job in a.assigned_at for a in agents):
        raise RuntimeError(f"the job's assignment did not reach every agent within 300 s; the controller's last "
                           f"errors: {controller_errors(spec.name)}")
    times = [a.assigned_at[job] for a in agents] + theirs
    reached = sorted(t - submitted for t in times)
    schedule = reached[-1]
    print(f"N={n}: its assignment reached half the agents {reached[n // 2]:.1f} s after the submit, 90 % "
          f"{reached[int(0.9 * (n - 1))]:.1f} s, the last {reached[-1]:.1f} s", flush=True)

    def describe() -> dict:
        req = urllib.request.Request(f"{url}/v1/jobs/{job}?brief=true",  # (a poll: not its 4,096 workers)
                                     headers={"Authorization": f"Bearer {token}"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())

    # the job runs on every node (each agent reports its worker, each rank's progress is in the store): the same
    # window, busy
    gen = (await loop.run_in_executor(None, describe))["generations"][-1]
    await loop.run_in_executor(None, publish_progress, gen["store_addr"], token, job, gen["generation"], n)
    await asyncio.sleep(2 * interval)
    print(f"N={n}: the job runs on every node; the busy window ({window:g} s)", flush=True)
    bench.latencies.clear()
    bench.beats, bench.failures, bench.recording = 0, 0, True
    pokes0 = await loop.run_in_executor(None, pokes, url, token)
    busy_cpu0, busy_t0 = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(window)
    busy_t1 = time.monotonic()
    busy_cpu = (cpu_seconds(pid) - busy_cpu0) / (busy_t1 - busy_t0)
    bench.recording = False
    busy_pokes = await loop.run_in_executor(None, pokes, url, token) - pokes0
    busy, busy_beats, busy_failures, busy_lags = sorted(bench.latencies), bench.beats, bench.failures, bench.lags
    lag_task.cancel()

    def stopped() -> bool:
        """The job's generation ended: every worker confirmed stopped by its agent."""
        req = urllib.request.Request(f"{url}/v1/jobs/{job}?brief=true",  # (a poll: not its 4,096 workers)
                                     headers={"Authorization": f"Bearer {token}"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())["generations"][-1]["ended_at"] is not None

    busy_job = await loop.run_in_executor(None, describe)
    busy_job_state = busy_job["state"]  # running, unless the controller judged a node faulty (late heartbeats)
    if busy_job_state != "running":
        print(f"N={n}: the job is {busy_job_state} after the busy window: {busy_job.get('reason')}", flush=True)
    stop = None
    if busy_job_state in ("running", "recovering"):
        cancel = urllib.request.Request(f"{url}/v1/jobs/{job}/cancel", method="POST", data=b"{}", headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        print(f"N={n}: cancelling the job", flush=True)
        cancelled_at = time.monotonic()
        await loop.run_in_executor(None, lambda: urllib.request.urlopen(cancel, timeout=60).read())
        while not await loop.run_in_executor(None, stopped) and time.monotonic() - cancelled_at < 300:
            await asyncio.sleep(0.05)
        stop = time.monotonic() - cancelled_at
        print(f"N={n}: every worker stopped {stop:.1f} s after the cancel", flush=True)
    await asyncio.sleep(3 * interval)

    victim = agents[len(agents) // 2]  # (this process's agents: the detections are timed here)
    victim.silent = True
    await asyncio.sleep(interval)  # its heartbeat in flight, if any, lands
    silent_at = victim.last_sent  # the heartbeat timeout counts from the newest heartbeat received
    client = ClusterClient(spec.name, timeout_s=60)

    async def faulty_after(agent: SimAgent, since: float) -> float | None:
        """Seconds from `since` to the controller marking `agent`'s node faulty (its `state_since`); None: not
        within the timeout + 60 s."""
        while time.time() - since < timeout + 60:
            node = await loop.run_in_executor(None, lambda: client.call("GET", f"/v1/nodes/{agent.name}"))
            if node["state"] in ("faulty", "replacing", "terminated"):
                return node["state_since"] - since
            await asyncio.sleep(0.05)
        return None

    detect = await faulty_after(victim, silent_at)

    killed = agents[len(agents) // 2 + 1]  # a killed agent: its link closes, the controller learns it without the timeout
    await asyncio.sleep(interval)
    died_at = time.time()  # (from the kill: the link closes then, whenever its last heartbeat was)
    killed.die()
    detect_gone = await faulty_after(killed, died_at)

    if niced is not None:
        niced.cancel()
    await loop.run_in_executor(None, lambda: delete_cluster(spec.name, timeout_s=120))
    for a in agents:
        a.stopped = True
    await asyncio.gather(*tasks, return_exceptions=True)
    for t in links:  # the controller ended them as it stopped (or they wait on a closed socket)
        t.cancel()
    await asyncio.gather(*links, return_exceptions=True)
    for a in agents:
        a.conn.close()
    reports = await children.stop()  # what the other agent processes recorded, cut to the two windows
    idle, busy_w = cut(reports, t0, t1), cut(reports, busy_t0, busy_t1)
    lat, beats, failures = sorted(lat + idle["latencies"]), beats + idle["beats"], failures + idle["failures"]
    lags = lags + idle["lags"]
    busy, busy_beats = sorted(list(busy) + busy_w["latencies"]), busy_beats + busy_w["beats"]
    busy_failures, busy_lags = busy_failures + busy_w["failures"], list(busy_lags) + busy_w["lags"]
    bench.failures_total += sum(r["failures_total"] for r in reports)
    bench.links_ended += sum(r["links_ended"] for r in reports)
    rate = (len(lat) + beats) / (t1 - t0) / (n / interval)  # (a beat on the link stands for a heartbeat)
    if timeline is not None:  # each heartbeat answered in the idle and busy windows: when it was sent, how long it took
        timeline.write_text(json.dumps({"nodes": n, "interval_s": interval, "busy_from_s": 0.0, "busy_t0_monotonic": busy_t0,
                                        "heartbeats": [
            [round(sent - busy_t0, 4), round(took, 4)]
            for sent, took in sorted(bench.timeline + idle["timeline"] + busy_w["timeline"])]}))
    out = {"nodes": n, "agent_processes": processes, "ready_s": round(ready, 3), "heartbeats": len(lat), "beats": beats,
           "busy_heartbeats": len(busy), "busy_beats": busy_beats, "hb_failed": failures,
           "busy_hb_failed": busy_failures, "hb_failed_total": bench.failures_total, "pokes": idle_pokes, "busy_pokes": busy_pokes,
           "hb_p50_ms": round(1000 * lat[len(lat) // 2], 2), "hb_p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 2),
           "hb_rate_ratio": round(rate, 3), "cpu_cores": round((cpu1 - cpu0) / (t1 - t0), 3),
           "agents_cpu_cores": round((own1 - own0) / (t1 - t0), 3),
           "agents_lag_p50_ms": percentile_ms(lags, 0.5), "agents_lag_p99_ms": percentile_ms(lags, 0.99),
           "busy_agents_lag_p99_ms": percentile_ms(busy_lags, 0.99),
           "scrape_ms": round(1000 * statistics.median(scrapes), 2), "schedule_s": round(schedule, 3),
           "busy_hb_p50_ms": round(1000 * busy[len(busy) // 2], 2) if busy else None,
           "busy_hb_p99_ms": round(1000 * busy[int(0.99 * (len(busy) - 1))], 2) if busy else None,
           "busy_cpu_cores": round(busy_cpu, 3), "busy_job_state": busy_job_state,
           "stop_s": round(stop, 3) if stop is not None else None,
           "detect_s": round(detect, 3) if detect is not None else None,
           "detect_excess_s": round(detect - timeout, 3) if detect is not None else None,
           "detect_gone_s": round(detect_gone, 3) if detect_gone is not None else None,
           "heartbeat_interval_s": interval, "heartbeat_timeout_s": timeout, "links_ended": bench.links_ended}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--window", type=float, default=15.0, help="seconds of steady heartbeats measured")
    parser.add_argument("--heartbeat-interval", type=float, help="the agents' heartbeat period (timeout: 6 ×); "
                        "default: the spec's (0.5 s, timeout 3 s)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--agents-loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="the simulated agents' event loop (uvloop since 2026-11-29: the agents take less of the "
                        "cores the controller shares; asyncio is what every earlier result used)")
    parser.add_argument("--agent-processes", type=int, default=8, help="processes the simulated agents run in "
                        "(default 8; every result before 2026-12-01 used 1: that one loop's pauses were the heartbeats' "
                        "tail at 4,096 agents, benchmarks/agent_processes.py)")
    parser.add_argument("--bring-up", choices=("waves", "together"), default="waves",
                        help="waves (default): the agent processes start one after another, each once the agents "
                        "before it are healthy; together: all at once, as one `srun` step starts a cluster's agents")
    parser.add_argument("--controller-nice", type=int, default=0, help="the controller's threads at this nice "
                        "value (default 0, as every result before 2026-12-02; -10: the controller takes the cores "
                        "first, as on a host of its own, the simulated agents what it leaves; root)")
    parser.add_argument("--timeline", type=Path, help="write each heartbeat of the idle and busy windows (sent at, "
                        "seconds from the busy window's start; answered after, seconds) to TIMELINE_<N>.json")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # N keep-alive sockets here and in the controller
    rows = []
    with tempfile.TemporaryDirectory(prefix="phalanx-scale-") as tmp:
        for n in args.nodes:
            try:
                timeline = args.timeline.with_name(f"{args.timeline.stem}_{n}.json") if args.timeline else None
                run = uvloop.run if args.agents_loop == "uvloop" else asyncio.run
                calibration = calibration_ms()
                rows.append({**run(measure(n, args.window, Path(tmp), args.heartbeat_interval, timeline,
                                           processes=max(1, min(args.agent_processes, n)),
                                           agents_loop=args.agents_loop, bring_up=args.bring_up,
                                           controller_nice=args.controller_nice)),
                             "agents_loop": args.agents_loop, "bring_up": args.bring_up,
                             "controller_nice": args.controller_nice, "calibration_ms": calibration})
            except Exception as err:  # noqa: BLE001 - recorded: how the controller fails at this N is the figure
                reason = str(err).splitlines()[0][:300]
                print(f"N={n}: failed: {reason}", flush=True)
                rows.append({"nodes": n, "error": reason})
            finally:  # a failed measurement leaves no controller nor agent process behind to skew the next one
                from agent_processes import AgentProcesses
                from phalanx.control.client.cluster import delete_cluster

                AgentProcesses.kill_all()
                from phalanx.control.state.paths import list_clusters

                for name in list_clusters():
                    delete_cluster(name, timeout_s=30)
    print(f"{'N':>6} {'ready s':>8} {'hb p50 ms':>10} {'hb p99 ms':>10} {'rate':>6} {'cpu':>6} {'agents':>6} "
          f"{'scrape ms':>10} {'schedule s':>11} {'busy p50':>9} {'busy p99':>9} {'busy cpu':>8} {'stop s':>7} "
          f"{'detect s':>9} {'gone s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['nodes']:>6} failed: {r['error']}")
            continue
        print(f"{r['nodes']:>6} {r['ready_s']:>8} {r['hb_p50_ms']:>10} {r['hb_p99_ms']:>10} {r['hb_rate_ratio']:>6} "
              f"{r['cpu_cores']:>6} {r['agents_cpu_cores']:>6} {r['scrape_ms']:>10} {r['schedule_s']:>11} "
              f"{r['busy_hb_p50_ms']!s:>9} {r['busy_hb_p99_ms']!s:>9} {r['busy_cpu_cores']:>8} {r['stop_s']!s:>7} "
              f"{r['detect_s']!s:>9} {r['detect_gone_s']!s:>7}")
    summary = {f"{k}_{r['nodes']}": r[k] for r in rows if "error" not in r for k in (
        "ready_s", "hb_p50_ms", "hb_p99_ms", "hb_rate_ratio", "cpu_cores", "agents_cpu_cores", "agents_lag_p99_ms",
        "busy_agents_lag_p99_ms", "scrape_ms",
        "schedule_s", "busy_hb_p50_ms", "busy_hb_p99_ms", "busy_cpu_cores", "stop_s", "detect_s", "detect_excess_s",
        "detect_gone_s", "hb_failed", "busy_hb_failed", "hb_failed_total", "calibration_ms")}
    write_results(args.out, {"benchmark": "control_scale", "runs": rows, "summary": summary,
                             "command": "PYTHONPATH=src .venv/bin/python benchmarks/control_scale.py --nodes "
                                        + " ".join(map(str, args.nodes)) + (
                                            f" --heartbeat-interval {args.heartbeat_interval}"
                                            if args.heartbeat_interval else "")
                                        + f" --agent-processes {args.agent_processes}"
                                        + (" --bring-up together" if args.bring_up == "together" else "")
                                        + (f" --controller-nice {args.controller_nice}" if args.controller_nice
                                           else "")})


if __name__ == "__main__":
    main()

"""Agents' links: the request each agent holds open (`agent/link.py`), and when each one closed.

An agent process that ends — killed, crashed, its node's daemons killed with it — has its connections closed by
its kernel, so its link ends at once; before links the controller learnt it only after `heartbeat_timeout_s` of
silence on every backend whose agents are not its own children (hosts, Slurm). A host that dies or drops off the
network closes nothing: its silence is still what finds it.

`AgentLinks` only records (opened, closed, by which agent handle); `lost()` answers the reconciler's question and
the reconciler decides (`policy/reconciler.py`). An agent that lives through its link's end (a reset on the way)
heartbeats at once and opens another, which `lost()` sees.

The link carries the steady state both ways (protocol 5), so that a thousand agents with nothing to say cost the
controller a few bytes each, not an HTTP request and a reply computed for nothing:
- up (the request's chunked body): the agent's liveness beat (`LINK_BEAT`), each heartbeat interval in which it
  sends no full heartbeat. `take_beats()` hands the newest per agent to the reconciler, which counts it as a
  heartbeat (`last_heartbeat`): silence is judged as before.
- down: `LINK_POKE` when the controller wrote something an agent's reply depends on (`Store.on_change` →
  `poke`): its agent sends a full heartbeat at once, and so hears of a new generation, a stop or a directive as
  fast as it did when every heartbeat was full. Pokes are coalesced: a burst of writes is one poke per link.

Silence is judged against what the controller could hear: an agent whose full heartbeat is being answered is
heard until its answer (`answering`), and while the server's loop is stalled agents are judged only up to when it
last ran (`heard_until`).

Knows nothing about nodes' states or what a fault leads to.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

from starlette.responses import Response

from phalanx.protocol.messages import LINK_BEAT, LINK_BEAT_S, LINK_POKE


POKES_PER_S, POKE_BATCH = 1000.0, 50  # at most as many heartbeats as hurried nodes send (`FAST_POLL_PER_S`)
STAMP_S = 0.1  # how often the server's loop says it is running (`heard_until`)


class AgentLinks:
    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], int] = {}  # (node, handle) → links open
        self._closed: dict[tuple[str, str], float] = {}  # (node, handle) → when its last link closed
        self._closes: list[tuple[str, float]] = []  # (node, when) of the closes since `take_closes`
        self.stopped = asyncio.Event()  # set on the server's loop (`stop`): every link ends, none opens
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beats: dict[tuple[str, str], float] = {}  # (node, handle) → its newest beat since `take_beats`
        self._pokes: dict[str, set[asyncio.Event]] = {}  # (the loop's) node → its open links' poke events
        self._poke_all, self._poke_names, self._poke_due = False, set(), False  # pokes not delivered yet
        self.beats = self.pokes = self.heartbeats = 0  # counted for /metrics (full heartbeats: `heartbeat_route`)
        self._stamp: float | None = None  # the server's loop last ran at (`_tick`): it reads every agent's messages
        self._answering: dict[tuple[str, str], int] = {}  # (node, handle) → its heartbeats being answered

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """The server's loop (the first link or heartbeat it serves): pokes go through it, and it stamps the time
        every STAMP_S while it runs."""
        if self._loop is not loop:
            self._loop = loop
            self._tick()

    def _tick(self, due: float | None = None) -> None:
        """Every STAMP_S: the loop has read what came before `due` (when this call was due), or before now when it
        runs on time. A call late by a stall (the process paused, the GIL held) runs before the sockets' backlog is
        read: it says only that the loop was running until `due`."""
        now = time.time()
        self._stamp = now if due is None else min(now, due)
        if not self.stopped.is_set():
            self._loop.call_later(STAMP_S, self._tick, now + STAMP_S)

    def heard_until(self, now: float) -> float:
        """Until when the controller has read what agents sent: `now`, unless its loop has not run for a while (a
        stall: the GIL held by a long tick, the process paused), when messages that came since wait unread in its
        sockets; an agent's silence is judged up to this time, not to `now`, so the controller's own stall never
        reads as many agents' silence at once. `now` once the links are stopped (its stamps stop with them)."""
        stamp = self._stamp
        return now if stamp is None or self.stopped.is_set() else min(now, stamp + 2 * STAMP_S)

    def stop(self) -> None:
        """End every link (the controller stops: uvicorn waits for open responses before it exits). From any thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.stopped.set)

    def opened(self, node: str, handle: str) -> None:
        with self._lock:
            self._open[(node, handle)] = self._open.get((node, handle), 0) + 1

    def closed(self, node: str, handle: str, at: float) -> None:
        with self._lock:
            left = self._open.get((node, handle), 1) - 1
            if left:
                self._open[(node, handle)] = left
            else:
                self._open.pop((node, handle), None)
                self._closed[(node, handle)] = at
                self._closes.append((node, at))

    def take_closes(self) -> list[tuple[str, float]]:
        """(node, when) of every agent's last link that closed since the last call: the reconciler looks at each
        node again once `lost` may say so."""
        with self._lock:
            closes, self._closes = self._closes, []
        return closes

    def lost(self, node: str, handle: str | None, last_heartbeat: float | None, now: float,
             grace_s: float | None) -> float | None:
        """Seconds since the link of `node`'s agent `handle` closed, when it closed at least `grace_s` ago, no link
        of that agent is open again and no heartbeat came after the close; else None (and always with `grace_s`
        None: links off, `health.link_grace_s: null`)."""
        if grace_s is None or handle is None:
            return None
        with self._lock:
            at = self._closed.get((node, handle))
            if at is None or (node, handle) in self._open:
                return None
        if (last_heartbeat or 0.0) > at or now - at < grace_s:
            return None
        return now - at

    def beat(self, node: str, handle: str, at: float) -> None:
        """A beat on the link of `node`'s agent `handle`: it was heard from at `at`."""
        self._beats[(node, handle)] = at  # (the loop's thread; `take_beats` swaps the dict whole)
        self.beats += 1

    @contextmanager
    def answering(self, node: str, handle: str):
        """Around answering a full heartbeat (the loop's thread): its agent was heard from when it arrived, and is
        not silent while it waits for the answer — it sends nothing else meanwhile, and in a burst (a job launched
        on a thousand nodes) the answers queue for seconds. Unless its link has closed (and none is open again):
        a killed agent does not wait for its answer, and a stamp after its link's close would hide the close
        (`lost`), leaving it to the heartbeat timeout."""
        key = (node, handle)
        self._beats[key] = time.time()
        self._answering[key] = self._answering.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._answering.pop(key) - 1
            if left:
                self._answering[key] = left
            if self._linked(key):
                self._beats[key] = time.time()

    def heard_at(self, node: str, handle: str, arrived: float) -> float:
        """When the agent of a heartbeat answered now was last heard from: now while its link is open (it waits for
        this answer: a first heartbeat queued 15 s at 4,096 agents started together, dated from its arrival, read as
        15 s of silence, and failed the cluster's creation), else when the heartbeat arrived (a killed agent's)."""
        return time.time() if self._linked((node, handle)) else arrived

    def _linked(self, key: tuple[str, str]) -> bool:
        """This agent's link is open, or none of its was seen closing (links off, or not opened yet)."""
        with self._lock:
            return key in self._open or key not in self._closed

    def take_beats(self) -> dict[tuple[str, str], float]:
        """The newest beat of each agent since the last call (the reconciler's tick); now, for an agent whose
        heartbeat is being answered (and whose link has not closed)."""
        beats, self._beats = self._beats, {}
        now = time.time()
        for key in list(self._answering):
            if self._linked(key):
                beats[key] = now
        return beats

    def poke(self, names: tuple[str, ...] | None = None) -> None:
        """Ask the agents of `names` (None: every node) to heartbeat now. From any thread, under any lock: it only
        marks them and, once per burst, schedules the delivery on the server's loop."""
        loop = self._loop
        if loop is None:
            return
        with self._lock:
            if not self._poke_all:
                if names is None:
                    self._poke_all = True
                    self._poke_names.clear()
                else:
                    self._poke_names.update(names)
            if self._poke_due:
                return
            self._poke_due = True
        try:
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the server's loop has ended (the controller stops): no link is left to poke
            with self._lock:
                self._poke_due = False

    def _deliver(self) -> None:
        with self._lock:
            everyone, names = self._poke_all, self._poke_names
            self._poke_all, self._poke_names, self._poke_due = False, set(), False
        self._send_pokes([name for name in (self._pokes if everyone else names) if name in self._pokes])

    def _send_pokes(self, names: list[str]) -> None:
        """POKE_BATCH links now, the rest paced at POKES_PER_S: a poke to every agent of a large cluster (a job
        submitted, a generation ended) must not bring all their heartbeats at the same instant."""
        for name in names[:POKE_BATCH]:
            for event in self._pokes.get(name, ()):
                event.set()
                self.pokes += 1
        if len(names) > POKE_BATCH:
            self._loop.call_later(POKE_BATCH / POKES_PER_S, self._send_pokes, names[POKE_BATCH:])

    def forget(self, node: str) -> None:
        """The node is terminated: nothing more to ask about its agents (keeps this to the live nodes)."""
        with self._lock:
            for key in [k for k in [*self._open, *self._closed] if k[0] == node]:
                self._open.pop(key, None)
                self._closed.pop(key, None)


class LinkResponse(Response):
    """A response that never ends by itself: a byte every LINK_BEAT_S (or `LINK_POKE` when poked) until the
    agent's side closes (recorded in `links`) or the controller stops (`links.stop()`). The agent's beats, its
    request's body, are read by a task of their own that wakes once per beat and records it; the response waits
    on a poke, the stop and that task's end together, not by polling. Served ahead of FastAPI
    (`heartbeat_route.py`): each wake-up of a coroutine under FastAPI's middleware stack resumes a dozen frames."""

    def __init__(self, links: AgentLinks, node: str, handle: str):
        super().__init__(media_type="text/plain")
        self.links, self.node, self.handle = links, node, handle

    async def _read(self, receive) -> None:
        """The agent's beats, until it disconnects."""
        links, node, handle = self.links, self.node, self.handle
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if LINK_BEAT in message.get("body", b""):
                links.beat(node, handle, time.time())

    async def __call__(self, scope, receive, send) -> None:
        links = self.links
        links.attach(asyncio.get_running_loop())
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"cache-control", b"no-store")]})
        links.opened(self.node, self.handle)
        poked = asyncio.Event()
        links._pokes.setdefault(self.node, set()).add(poked)
        reading = asyncio.ensure_future(self._read(receive))
        stopping = asyncio.ensure_future(links.stopped.wait())
        poking = asyncio.ensure_future(poked.wait())
        try:
            await send({"type": "http.response.body", "body": LINK_BEAT, "more_body": True})
            while True:
                done, _ = await asyncio.wait({reading, stopping, poking}, timeout=LINK_BEAT_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                if stopping in done:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if reading in done:
                    return
                if poking in done:
                    poked.clear()
                    poking = asyncio.ensure_future(poked.wait())
                    await send({"type": "http.response.body", "body": LINK_POKE, "more_body": True})
                else:
                    await send({"type": "http.response.body", "body": LINK_BEAT, "more_body": True})
        finally:
            reading.cancel()
            stopping.cancel()
            poking.cancel()
            mine = links._pokes.get(self.node)
            if mine is not None:
                mine.discard(poked)
                if not mine:
                    del links._pokes[self.node]
            links.closed(self.node, self.handle, time.time())

"""Agents' links: the request each agent holds open (`agent/link.py`), and when each one closed.

An agent process that ends — killed, crashed, its node's daemons killed with it — has its connections closed by
its kernel, so its link ends at once; before links the controller learnt it only after `heartbeat_timeout_s` of
silence on every backend whose agents are not its own children (hosts, Slurm). A host that dies or drops off the
network closes nothing: its silence is still what finds it.

`AgentLinks` only records (opened, closed, by which agent handle); `lost()` answers the reconciler's question and
the reconciler decides (`policy/reconciler.py`). An agent that lives through its link's end (a reset on the way)
heartbeats at once and opens another, which `lost()` sees.

Knows nothing about nodes' states or what a fault leads to.
"""

from __future__ import annotations

import asyncio
import threading
import time

from starlette.responses import Response

from phalanx.protocol.messages import LINK_BEAT_S


class AgentLinks:
    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[tuple[str, str], int] = {}  # (node, handle) → links open
        self._closed: dict[tuple[str, str], float] = {}  # (node, handle) → when its last link closed
        self.stopped = asyncio.Event()  # set on the server's loop (`stop`): every link ends, none opens
        self._loop: asyncio.AbstractEventLoop | None = None

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

    def forget(self, node: str) -> None:
        """The node is terminated: nothing more to ask about its agents (keeps this to the live nodes)."""
        with self._lock:
            for key in [k for k in [*self._open, *self._closed] if k[0] == node]:
                self._open.pop(key, None)
                self._closed.pop(key, None)


class LinkResponse(Response):
    """A response that never ends by itself: a byte every LINK_BEAT_S until the agent's side closes (recorded in
    `links`) or the controller stops (`links.stop()`). One wake-up per beat: it waits on the connection and the
    stop together, not by polling."""

    def __init__(self, links: AgentLinks, node: str, handle: str):
        super().__init__(media_type="text/plain")
        self.links, self.node, self.handle = links, node, handle

    async def __call__(self, scope, receive, send) -> None:
        links = self.links
        links._loop = asyncio.get_running_loop()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"cache-control", b"no-store")]})
        links.opened(self.node, self.handle)
        receiving = asyncio.ensure_future(receive())
        stopping = asyncio.ensure_future(links.stopped.wait())
        try:
            await send({"type": "http.response.body", "body": b".", "more_body": True})
            while True:
                done, _ = await asyncio.wait({receiving, stopping}, timeout=LINK_BEAT_S,
                                             return_when=asyncio.FIRST_COMPLETED)
                if stopping in done:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if receiving in done:
                    if receiving.result()["type"] == "http.disconnect":
                        return
                    receiving = asyncio.ensure_future(receive())  # the (empty) request body: wait on
                    continue
                await send({"type": "http.response.body", "body": b".", "more_body": True})
        finally:
            receiving.cancel()
            stopping.cancel()
            links.closed(self.node, self.handle, time.time())

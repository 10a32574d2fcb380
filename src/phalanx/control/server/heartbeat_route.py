"""`POST /v1/nodes/{name}/heartbeat`, the route every agent calls when it has news (or every few seconds), and
`POST /v1/nodes/{name}/link`, each agent's link held open (`links.py`): a plain ASGI layer ahead of FastAPI's
router (inside the token check, `api.RequireToken`).

FastAPI's routing, dependency resolution and body validation cost more per request than answering the heartbeat
itself; at a thousand agents that was the controller's ceiling (benchmarks/control_scale.py). Here the body is
validated by pydantic straight from its bytes (`Heartbeat.model_validate_json`), the refusals are the route's
(409 another protocol version, 404 no such node, 410 a terminated node or another agent's handle, 422 a body that
is not a heartbeat), and every other path goes on to FastAPI. Answers are FastAPI's shape: a JSON object, or
`{"detail": ...}` with the status.

Must not know: what a heartbeat changes (`heartbeat.answer_heartbeat`), processes.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, nullcontext
from typing import Callable, TypeVar

from pydantic import ValidationError

from phalanx.control.server.heartbeat import answer_heartbeat
from phalanx.control.server.links import LinkResponse
from phalanx.control.state.store import NodeState
from phalanx.protocol import ProtocolMismatch, check_version
from phalanx.protocol.messages import Heartbeat

T = TypeVar("T")
PREFIX, SUFFIX, LINK_SUFFIX = "/v1/nodes/", "/heartbeat", "/link"
MAX_BODY = 4 << 20  # an agent's heartbeat is a few kB; a larger body is refused before it is read whole
MAKE_WAY_S = 0.05  # a long write waits at most this long between its transactions for the queued heartbeats


class Refused(Exception):
    def __init__(self, status: int, detail):
        super().__init__(detail)
        self.status, self.detail = status, detail


class LockQueue:
    """One thread that answers the heartbeats which found a lock taken, in their order. One thread, not Starlette's
    pool of 40: heartbeats take those locks in turn anyway, and 40 threads contending for them (and the GIL) halved
    the rate the controller answered at 1,024 nodes. `handed` is counted on the event loop, `answered` on the
    thread: each written by one thread only."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heartbeats")
        self.handed = self.answered = 0

    def submit(self, fn: Callable[[], T]) -> Future:
        self.handed += 1
        return self.pool.submit(self._answer, fn)

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    def _answer(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        finally:
            self.answered += 1

    def make_way(self) -> None:
        """Wait (at most MAKE_WAY_S) until every heartbeat queued before this call is answered. Called by a thread
        between the transactions of a long write (the store's flush): a lock is not fair, and a flush that took the
        store's lock back 1 ms after letting it go let one or two queued heartbeats in each time, the rest waiting
        for later transactions (4,096 nodes, flushes of 0.15-0.3 s: heartbeats sent during one waited up to 0.1 s,
        at most 49 ms since; tests/test_links.py shows the order)."""
        target, deadline = self.handed, time.monotonic() + MAKE_WAY_S
        while self.answered < target and time.monotonic() < deadline:
            time.sleep(0.0005)


async def inline_or_queued(fn: Callable[[], T], locks, queue: LockQueue) -> T:
    """`fn()` on the event loop when every lock in `locks` is free at once, else on `queue`'s one thread. A
    heartbeat's handling takes ~0.15 ms, less than a hand-off to a worker thread costs, but it takes the scheduler's
    and the store's locks, which a reconciler tick holds for a while: the loop (every route) must never wait on
    them."""
    taken = []
    try:
        for lock in locks:
            if not lock.acquire(blocking=False):
                break
            taken.append(lock)
        else:
            return fn()
    finally:
        for lock in reversed(taken):
            lock.release()
    return await queue.run(fn)


async def _send_json(send, status: int, reply) -> None:
    body = json.dumps(reply, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


class HeartbeatRoute:
    """ASGI middleware: answers heartbeats and holds agents' links (`POST /v1/nodes/{name}/link?handle=H`,
    `links.LinkResponse`), passes everything else to `app`. `ctl`: the running controller."""

    def __init__(self, app, ctl):
        self.app, self.ctl, self.store = app, ctl, ctl.store
        self.locks = [lock for lock in (getattr(ctl.jobs, "lock", None), ctl.store.lock) if lock is not None]
        self.queue = LockQueue()
        # the store's long writes let the heartbeats queued for its lock in between their transactions
        self.store.make_way = self.queue.make_way
        self.links = getattr(ctl, "links", None)  # (counts the heartbeats answered, for /metrics)

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "POST" or not path.startswith(PREFIX) \
                or not path.endswith((SUFFIX, LINK_SUFFIX)) or path.count("/") != PREFIX.count("/") + 1:
            await self.app(scope, receive, send)
            return
        name, _, route = path[len(PREFIX):].partition("/")
        if route == LINK_SUFFIX[1:]:
            await self._link(name, scope, receive, send)
            return
        try:
            hb = self._parse(await self._body(receive))
            arrived = time.time()  # its node's last_heartbeat if its link has closed by its answer (`_answer`)
            try:
                check_version(hb.protocol, f"the agent of node {name}")
            except ProtocolMismatch as err:
                raise Refused(409, str(err)) from None
            links = self.links
            if links is not None:
                links.attach(asyncio.get_running_loop())
            # its agent is heard from now, however long the answer waits for the store's lock
            with links.answering(name, hb.handle) if links is not None else nullcontext():
                status, reply = 200, await inline_or_queued(lambda: self._answer(name, hb, arrived), self.locks,
                                                            self.queue)
            if links is not None:
                links.heartbeats += 1
        except Refused as err:
            status, reply = err.status, {"detail": err.detail}
        await _send_json(send, status, reply)

    async def _link(self, name: str, scope, receive, send) -> None:
        """Held open while the node's agent lives (`server/links.py`). Nothing looked up: a link counts only for
        the agent a node's row names (`AgentLinks.lost` is asked with the node's handle), and the event loop
        must not wait on the store's lock (a thousand agents open theirs while the cluster is created)."""
        handle = urllib.parse.parse_qs(scope.get("query_string", b"").decode()).get("handle", [None])[0]
        if self.links is None or self.links.stopped.is_set() or not handle:
            status, detail = ((404, "this controller keeps no agent links") if self.links is None else
                              (503, "the controller is stopping") if handle else (422, "query: handle is required"))
            await _send_json(send, status, {"detail": detail})
            return
        await LinkResponse(self.links, name, handle)(scope, receive, send)

    @staticmethod
    async def _body(receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refused(400, "the agent closed the connection before its heartbeat was read")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY:
                raise Refused(413, f"a heartbeat of more than {MAX_BODY} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    def _parse(body: bytes) -> Heartbeat:
        try:
            return Heartbeat.model_validate_json(body)
        except ValidationError as err:  # FastAPI's 422 shape: a list of {type, loc, msg}, loc from "body"
            raise Refused(422, [{"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]}
                                for e in err.errors(include_url=False, include_input=False)]) from None

    def _answer(self, name: str, hb: Heartbeat, arrived: float) -> dict:
        with ExitStack() as held:  # the locks its answer takes, first: its agent waited for them (`heard_at`)
            for lock in self.locks:
                held.enter_context(lock)
            return self._answer_held(name, hb, arrived)

    def _answer_held(self, name: str, hb: Heartbeat, arrived: float) -> dict:
        node = self.store.node(name)
        if node is None:
            raise Refused(404, f"no node named {name!r}")
        if node.state == NodeState.TERMINATED:
            raise Refused(410, f"node {name} is terminated ({node.reason})")
        if node.handle is not None and hb.handle != node.handle:
            raise Refused(410, f"node {name} is run by the agent with handle {node.handle}, not {hb.handle}")
        ctl = self.ctl
        # (not now if its link has closed: a killed agent's last heartbeat answered after its link's close was read
        # must not date from after it, or `AgentLinks.lost` leaves the node to the heartbeat timeout)
        heard = self.links.heard_at(name, hb.handle, arrived) if self.links is not None else arrived
        return answer_heartbeat(self.store, ctl.jobs, ctl.deep_checks, ctl.started_at, node, hb, heard,
                                getattr(ctl, "poke", None))

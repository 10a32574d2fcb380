"""The agent's link: one HTTP request to the controller that stays open while the agent lives.

When the agent process ends — killed, crashed, its node's daemons killed — its kernel closes the connection, and
the controller knows within a tick instead of after `heartbeat_timeout_s` of silence (`server/links.py` records
it, the reconciler decides). A host that dies or drops off the network closes nothing: heartbeats still find it.

If the link ends while the agent lives (the controller restarted, a connection reset on the way), the agent
heartbeats at once and opens it again, so the controller sees it alive within its grace (`link_grace_s`).

The link also carries the steady state (protocol 5): `beat()` sends a liveness beat up it (the request's chunked
body) in place of a full heartbeat that would say nothing new, and a poke coming down (`LINK_POKE`: the controller
has news for this node) calls `poked`, so the agent heartbeats at once.

Stdlib only, like `control/http.py`. Knows nothing about the agent but its name, handle, token and controller.
"""

from __future__ import annotations

import http.client
import logging
import random
import threading
import time
import urllib.parse
from collections.abc import Callable

from phalanx.protocol.messages import LINK_BEAT, LINK_BEAT_S, LINK_POKE

log = logging.getLogger("phalanx.agent")


BEAT_CHUNK = b"%x\r\n%s\r\n" % (len(LINK_BEAT), LINK_BEAT)  # one chunk of the request's body


def news(body: dict) -> dict:
    """What a heartbeat's body tells the controller that the previous one may not have: not its timestamps, nor the
    free ports it lists, nor when its health was checked and the details of checks that all pass (a detail such
    as the disk's free MiB changes at nearly every check, every `check_interval_s`): the full heartbeat every
    `full_every` keeps those fresh enough. A failing check is news at every check: the controller counts a
    job-restart failure only when it was checked after the job's generation started."""
    said = {k: v for k, v in body.items() if k not in ("sent_at", "reply_sent_at", "free_ports")}
    health = body.get("health")
    if health and not any(c.get("status") == "fail" for c in health.get("checks") or []):
        said["health"] = {"ok": health.get("ok"), "checks": [(c.get("name"), c.get("status"), c.get("action"))
                                                             for c in health.get("checks") or []]}
    return said


def next_wait(period: float, took: float) -> float:
    """How long an agent waits before its next heartbeat or beat, `took` seconds after it began this one: the rest
    of `period`, so that it keeps its phase; answered after a whole period or more (the controller stalled, and
    the agents waiting on it were answered together), a random part of one, so that they do not stay in step.
    Without it, 4,096 agents answered late during a cluster's creation went on sending in bursts of hundreds at
    each interval, which were the heartbeats' p99 (benchmarks/control_scale.py)."""
    return period - took if took < period else random.uniform(0.0, period)


class Link(threading.Thread):
    def __init__(self, name: str, handle: str, token: str, url: Callable[[], str | None], *, interval: float,
                 stop: threading.Event, dropped: Callable[[], None], poked: Callable[[], None] | None = None):
        super().__init__(name="link", daemon=True)
        self.path = f"/v1/nodes/{urllib.parse.quote(name)}/link?handle={urllib.parse.quote(handle)}"
        self.token, self.url, self.interval = token, url, interval
        self.stop, self.dropped, self.poked = stop, dropped, poked or dropped
        self._sock = None  # the open link's socket (`beat` writes to it while this thread reads)
        self._send = threading.Lock()

    def beat(self) -> bool:
        """A liveness beat up the open link. False: no link is open, or the send failed (send a full heartbeat)."""
        sock = self._sock
        if sock is None:
            return False
        try:
            with self._send:
                sock.sendall(BEAT_CHUNK)
            return True
        except OSError as err:
            log.debug("link beat failed: %s", err)
            return False

    def run(self) -> None:
        while not self.stop.is_set():
            opened_at = time.monotonic()
            held = self._hold()
            if self.stop.is_set():
                return
            if held:
                self.dropped()  # heartbeat now: the controller learns this agent lives before it judges the close
            if not held or time.monotonic() - opened_at < 1.0:  # refused, unreachable, or ended at once (the
                self.stop.wait(self.interval)  # controller stopping): again after a heartbeat interval, not in a loop

    def _hold(self) -> bool:
        """Open the link and read its beats until it ends. True when it was open (so try again at once)."""
        url = self.url()
        if url is None:
            return False
        parts = urllib.parse.urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=3 * LINK_BEAT_S)
        try:
            conn.putrequest("POST", self.path)
            conn.putheader("Authorization", f"Bearer {self.token}")
            conn.putheader("Transfer-Encoding", "chunked")  # the beats: a body that ends with the link
            conn.endheaders()
            resp = conn.getresponse()
            if resp.status != 200:
                log.debug("link refused: HTTP %d %s", resp.status, resp.read(500))
                return False
            self._sock = conn.sock
            while not self.stop.is_set():
                down = resp.read1(64)
                if not down:
                    break
                if LINK_POKE in down:
                    self.poked()
            return True
        except (OSError, http.client.HTTPException) as err:  # unreachable, reset, or silent past the beat
            log.debug("link to %s ended: %s", url, err)
            return False
        finally:
            self._sock = None
            with self._send:  # (not closed under a beat being sent)
                conn.close()

"""The agent's link: one HTTP request to the controller that stays open while the agent lives.

When the agent process ends — killed, crashed, its node's daemons killed — its kernel closes the connection, and
the controller knows within a tick instead of after `heartbeat_timeout_s` of silence (`server/links.py` records
it, the reconciler decides). A host that dies or drops off the network closes nothing: heartbeats still find it.

If the link ends while the agent lives (the controller restarted, a connection reset on the way), the agent
heartbeats at once and opens it again, so the controller sees it alive within its grace (`link_grace_s`).

Stdlib only, like `control/http.py`. Knows nothing about the agent but its name, handle, token and controller.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable

from phalanx.protocol.messages import LINK_BEAT_S

log = logging.getLogger("phalanx.agent")


class Link(threading.Thread):
    def __init__(self, name: str, handle: str, token: str, url: Callable[[], str | None], *, interval: float,
                 stop: threading.Event, dropped: Callable[[], None]):
        super().__init__(name="link", daemon=True)
        self.path = f"/v1/nodes/{urllib.parse.quote(name)}/link?handle={urllib.parse.quote(handle)}"
        self.token, self.url, self.interval = token, url, interval
        self.stop, self.dropped = stop, dropped

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
            conn.request("GET", self.path, headers={"Authorization": f"Bearer {self.token}"})
            resp = conn.getresponse()
            if resp.status != 200:
                log.debug("link refused: HTTP %d %s", resp.status, resp.read(500))
                return False
            while not self.stop.is_set() and resp.read1(64):
                pass
            return True
        except (OSError, http.client.HTTPException) as err:  # unreachable, reset, or silent past the beat
            log.debug("link to %s ended: %s", url, err)
            return False
        finally:
            conn.close()

"""An agent's link, with real sockets and a real process: the agent side (`control/agent/link.py`) holds a request
open against the controller's route (`server/links.py` under uvicorn), and when the agent process is SIGKILLed its
kernel closes the connection, which the controller records at once. The policy that acts on it is in
test_policy.py; a killed host on its own network namespace in test_hosts.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, HTTPException

from clusters import wait_for
from phalanx.control.server.links import AgentLinks, LinkResponse

AGENT = textwrap.dedent("""
    import sys, threading
    from phalanx.control.agent.link import Link
    port, = sys.argv[1:]
    stop = threading.Event()
    link = Link("n1", "host:42", "secret", lambda: f"http://127.0.0.1:{port}", interval=0.1, stop=stop,
                dropped=lambda: print("dropped", flush=True))
    link.start()
    link.join()
""")


def _serve(links: AgentLinks) -> tuple[uvicorn.Server, int]:
    app = FastAPI()

    @app.get("/v1/nodes/{name}/link")
    async def link(name: str, handle: str):
        if links.stopped.is_set():
            raise HTTPException(503, "stopping")
        return LinkResponse(links, name, handle)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    wait_for(lambda: server.started, 20, "uvicorn to start")
    return server, sock.getsockname()[1]


@pytest.fixture
def linked():
    """(links, the agent process): a server holding links, and an agent process whose link is open."""
    links = AgentLinks()
    server, port = _serve(links)
    agent = subprocess.Popen([sys.executable, "-c", AGENT, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ("n1", "host:42") in links._open, 30, "the agent's link to open")
        yield links, agent
    finally:
        agent.kill()
        agent.wait(timeout=10)
        server.should_exit = True


def test_a_killed_agent_process_closes_its_link_at_once_and_the_controller_records_it(linked):
    links, agent = linked
    assert links.lost("n1", "host:42", None, time.time() + 10, grace_s=0.5) is None  # open: never lost
    os.kill(agent.pid, signal.SIGKILL)
    killed_at = time.time()
    agent.wait(timeout=10)
    closed_at = wait_for(lambda: links._closed.get(("n1", "host:42")), 5, "the controller to see the link close")
    assert closed_at - killed_at < 1.0, closed_at - killed_at  # the kernel's FIN, not a timeout
    assert links.lost("n1", "host:42", None, closed_at + 0.2, grace_s=0.5) is None  # within the grace
    assert links.lost("n1", "host:42", None, closed_at + 0.6, grace_s=0.5) is not None
    assert links.lost("n1", "host:42", closed_at + 0.1, closed_at + 0.6, grace_s=0.5) is None  # it heartbeat
    assert links.lost("n1", "other:1", None, closed_at + 0.6, grace_s=0.5) is None  # another agent's handle


def test_an_agent_whose_link_ends_while_it_lives_opens_another_at_once(linked):
    links, agent = linked
    links.stop()  # the controller ends every link (as it does when it stops): the agent opens another
    assert agent.stdout.readline().strip() == "dropped"  # and heartbeats at once (here: says so)
    wait_for(lambda: ("n1", "host:42") in links._closed, 5, "the first link to close")
    links._loop.call_soon_threadsafe(links.stopped.clear)  # a controller that serves again
    wait_for(lambda: ("n1", "host:42") in links._open, 5, "a new link")
    assert agent.poll() is None

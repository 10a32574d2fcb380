"""The agents' HTTP client (`control/http.py`) against a real uvicorn server on loopback: an agent's heartbeats go
over one kept connection, survive the controller closing it while idle, and fail with the same errors as a
one-shot request."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, HTTPException, Request

from clusters import wait_for
from phalanx.control.http import ApiError, ControllerUnreachable, KeepAlive, request_json

KEEP_ALIVE_S = 1


@pytest.fixture
def server():
    """(base url, the client ports each request came from)."""
    app, seen = FastAPI(), []

    @app.post("/v1/nodes/{name}/heartbeat")
    async def heartbeat(name: str, body: dict, request: Request):
        seen.append(request.client.port)
        if name == "nope":
            raise HTTPException(404, f"no node named {name!r}")
        return {"node": name, "sent_at": body["sent_at"]}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: srv.started, 20, "uvicorn to start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    finally:
        srv.should_exit = True
        thread.join(10)


def test_heartbeats_reuse_one_connection_and_a_closed_idle_one_is_replaced(server):
    url, seen = server
    session = KeepAlive()
    for i in range(5):
        assert session.request_json("POST", f"{url}/v1/nodes/n1/heartbeat", "t", {"sent_at": i}) == \
            {"node": "n1", "sent_at": i}
    assert len(seen) == 5 and len(set(seen)) == 1, f"five heartbeats on one connection, came from ports {seen}"
    time.sleep(KEEP_ALIVE_S + 1.0)  # the server closes the idle connection
    assert session.request_json("POST", f"{url}/v1/nodes/n1/heartbeat", "t", {"sent_at": 9})["sent_at"] == 9
    assert len(seen) == 6 and seen[-1] != seen[0], "the request went again on a new connection, once"
    session.close()


def test_error_replies_and_an_unreachable_controller_read_as_with_one_shot_requests(server):
    url, _ = server
    session = KeepAlive()
    with pytest.raises(ApiError) as kept:
        session.request_json("POST", f"{url}/v1/nodes/nope/heartbeat", "t", {"sent_at": 1})
    with pytest.raises(ApiError) as once:
        request_json("POST", f"{url}/v1/nodes/nope/heartbeat", "t", {"sent_at": 1})
    assert (kept.value.status, kept.value.detail) == (once.value.status, once.value.detail) == \
        (404, "no node named 'nope'")
    with pytest.raises(ApiError) as invalid:  # FastAPI's 422 list, as one line
        session.request_json("POST", f"{url}/v1/nodes/n1/heartbeat", "t", None)
    assert (invalid.value.status, invalid.value.detail) == (422, "Field required")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nothing listens on
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(ControllerUnreachable, match=f"127.0.0.1:{port}"):
        session.request_json("POST", f"http://127.0.0.1:{port}/v1/nodes/n1/heartbeat", "t", {"sent_at": 1})
    # and the session works again against a reachable controller
    assert session.request_json("POST", f"{url}/v1/nodes/n1/heartbeat", "t", {"sent_at": 2})["sent_at"] == 2

"""An agent's link, with real sockets and a real process: the agent side (`control/agent/link.py`) holds a request
open against the controller's route (`server/links.py` under uvicorn), and when the agent process is SIGKILLed its
kernel closes the connection, which the controller records at once. The policy that acts on it is in
test_policy.py; a killed host on its own network namespace in test_hosts.py."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest
import uvicorn
from fastapi import FastAPI, HTTPException

from clusters import home, wait_for  # noqa: F401  (home is a fixture)
from phalanx.control.client.cluster import ClusterClient, create_cluster
from phalanx.control.server.links import AgentLinks, LinkResponse
from phalanx.control.state.paths import ClusterPaths
from prometheus_client.parser import text_string_to_metric_families
from test_jobs import write_spec

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


BEATING_AGENT = textwrap.dedent("""
    import sys, threading, time
    from phalanx.control.agent.link import Link
    port, = sys.argv[1:]
    link = Link("n1", "host:42", "secret", lambda: f"http://127.0.0.1:{port}", interval=0.1, stop=threading.Event(),
                dropped=lambda: None, poked=lambda: print("poked", flush=True))
    link.start()
    while True:  # as the agent's loop does when a full heartbeat would say nothing new
        link.beat()
        time.sleep(0.1)
""")


def _serve(links: AgentLinks) -> tuple[uvicorn.Server, int]:
    app = FastAPI()

    @app.post("/v1/nodes/{name}/link")
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


def test_beats_come_up_the_link_and_pokes_go_down_it_to_the_node_named(tmp_path):
    links = AgentLinks()
    server, port = _serve(links)
    agent = subprocess.Popen([sys.executable, "-c", BEATING_AGENT, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: ("n1", "host:42") in links._open, 30, "the agent's link to open")
        before = time.time()
        beat = wait_for(lambda: links.take_beats().get(("n1", "host:42")), 10, "a beat up the link")
        assert beat >= before - 0.2 and links.beats > 0
        links.poke(("n2",))  # another node's: delivered to no link
        links.poke(("n1",))
        assert agent.stdout.readline().strip() == "poked"
        assert links.pokes == 1
        for _ in range(50):  # a burst of writes: coalesced, at most a poke or two, never one per write
            links.poke()
        assert agent.stdout.readline().strip() == "poked"
        time.sleep(0.5)
        assert 2 <= links.pokes <= 3, links.pokes
    finally:
        agent.kill()
        agent.wait(timeout=10)
        server.should_exit = True


def test_an_agent_waiting_for_its_answer_or_unread_in_a_stalled_loop_is_not_silent():
    """Silence is the agent's, never the controller's: a heartbeat being answered counts as heard until its answer,
    and while the server's loop is stalled (the GIL held, the process paused) silence is judged only up to when the
    loop last ran (`heard_until`), since what agents sent since waits unread in its sockets."""
    links = AgentLinks()
    with links.answering("n1", "host:42"):
        time.sleep(0.3)
        during = time.time()
        assert links.take_beats()[("n1", "host:42")] >= during  # waiting on the controller: heard now
    assert links.take_beats()[("n1", "host:42")] >= during  # answered: heard when the answer was made
    assert links.take_beats() == {}  # then only what it sends
    assert links.heard_until(123.0) == 123.0  # no loop yet: judged up to now

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        loop.call_soon_threadsafe(links.attach, loop)
        wait_for(lambda: links._stamp is not None, 5, "the loop's first stamp")
        time.sleep(0.3)
        assert links.heard_until(time.time()) == pytest.approx(time.time(), abs=0.01)  # running: now
        loop.call_soon_threadsafe(time.sleep, 1.5)  # the loop stalls
        time.sleep(1.0)
        now = time.time()
        assert links.heard_until(now) < now - 0.5, "judged only up to the stall"
        time.sleep(1.0)  # running again: its stamps catch up
        assert links.heard_until(time.time()) == pytest.approx(time.time(), abs=0.01)
    finally:
        loop.call_soon_threadsafe(links.stopped.set)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def agent_messages(client: ClusterClient) -> dict[str, float]:
    req = urllib.request.Request(f"{client.url()}/metrics",
                                 headers={"Authorization": f"Bearer {ClusterPaths.for_name('c1').read_token()}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    return {s.labels["kind"]: s.value for s in families["phalanx_agent_messages"].samples if s.name.endswith("_total")}


def test_a_killed_agent_with_a_heartbeat_being_answered_is_still_found_by_its_links_close():
    """A poke to every agent brings a burst of full heartbeats; an agent killed while its heartbeat waits for an
    answer closes its link, and is not stamped heard meanwhile nor at its answer: the close decides (`lost`), not the
    heartbeat timeout (control_scale at 1,024 nodes: a killed agent found at 3.1 s, the timeout, instead of 0.6 s)."""
    links = AgentLinks()
    key = ("n1", "host:42")
    links.opened(*key)
    with links.answering(*key):
        arrived = links._beats[key]
        time.sleep(0.05)
        closed_at = time.time()
        links.closed(*key, closed_at)
        assert links.take_beats() == {key: arrived}  # killed while waiting: heard when it arrived, not now
        time.sleep(0.05)
    assert links.take_beats() == {}  # nor when its answer was made
    assert links.lost("n1", "host:42", arrived, closed_at + 0.6, grace_s=0.5) == pytest.approx(0.6)
    links.opened(*key)  # an agent alive whose link was reset and opened again: heard while answered, as before
    with links.answering(*key):
        assert key in links.take_beats()


@pytest.mark.slow
def test_steady_agents_beat_on_their_links_instead_of_full_heartbeats_and_stay_healthy(tmp_path, home):
    """Protocol 5 on a real cluster: with nothing new to say (no job, health checked rarely), an agent beats on its
    link every heartbeat interval and sends a full heartbeat at most every FULL_HEARTBEAT_MAX_S; the beats count
    as heartbeats (the nodes' last_heartbeat stays fresh, nobody is judged silent). How fast news reaches an agent
    through a poke is what the fault tests time (test_control.py: a fault injected is acted on within 3 s)."""
    create_cluster(write_spec(tmp_path, count=2, spares=0, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0,
                              check_interval_s=60.0), timeout_s=90)
    client = ClusterClient("c1")
    time.sleep(1.0)  # (the bring-up's heartbeats, each with news, are over)
    first = agent_messages(client)
    time.sleep(4.0)
    then = agent_messages(client)
    beats, full = then["beat"] - first["beat"], then["heartbeat"] - first["heartbeat"]
    assert beats >= 20, (beats, full)  # 2 agents × 4 s / 0.2 s = 40 beats
    assert full <= 6, (beats, full)  # every 5 s at most, per agent (40 before protocol 5)
    now = time.time()
    for n in client.nodes():
        assert n["state"] == "healthy", n
        assert now - n["last_heartbeat"] < 1.5, (n["name"], now - n["last_heartbeat"])


def test_a_passing_health_checks_time_and_details_are_no_news_a_failing_check_always_is():
    """An agent sends a full heartbeat only with news (`agent/link.py: news`). A health check every
    `check_interval_s` (5 s) whose checks all pass differs from the last only in its time and details (the disk's
    free MiB): no news, or every agent would send a full heartbeat every check. A failing check is news at every
    check: the controller counts a job-restart failure only when checked after the job's generation started."""
    from phalanx.control.agent.link import news

    def body(checked_at: float, free_mb: int, status: str = "pass") -> dict:
        checks = [{"name": "host.disk", "status": status, "detail": f"{free_mb} MiB free", "action": None},
                  {"name": "host.memory", "status": "pass", "detail": "ok", "action": None}]
        return {"phase": "ready", "workers": [], "sent_at": checked_at, "free_ports": [free_mb],
                "health": {"ok": True, "checked_at": checked_at, "checks": checks}}

    assert news(body(1.0, 500)) == news(body(6.0, 499))
    assert news(body(1.0, 500)) != news(body(6.0, 500, status="fail"))
    assert news(body(1.0, 500, status="fail")) != news(body(6.0, 500, status="fail"))
    assert news(body(1.0, 500)) != {**news(body(1.0, 500)), "phase": "configuring"}


def test_a_heartbeat_answered_late_is_dated_from_its_arrival(monkeypatch):
    """Heartbeats that waited for the locks a tick held are answered on the heartbeat thread later, one after
    another; each node's last_heartbeat is when its heartbeat arrived: a killed agent's last heartbeat answered after its link's close was read must
    not date from after the close (`AgentLinks.lost`; control_scale at 1,024 nodes: one killed agent of four was
    found by the 3 s timeout, not its link's close)."""
    import json as jsonlib
    from types import SimpleNamespace

    from phalanx.control.server import heartbeat_route
    from phalanx.control.state.store import NodeState
    from phalanx.protocol import PROTOCOL_VERSION

    answered = []
    tick_lock = threading.RLock()

    def answer(store, jobs, deep, cid, node, hb, now, poke):  # (as `answer_heartbeat`: under the scheduler's lock)
        with jobs.lock:
            answered.append((now, time.time()))
        return {"action": "run"}

    monkeypatch.setattr(heartbeat_route, "answer_heartbeat", answer)
    node = SimpleNamespace(state=NodeState.HEALTHY, handle="host:42")
    ctl = SimpleNamespace(jobs=SimpleNamespace(lock=tick_lock), store=SimpleNamespace(lock=threading.RLock(),
                          node=lambda name: node), links=None, deep_checks=None, started_at=0.0)
    route = heartbeat_route.HeartbeatRoute(None, ctl)
    body = jsonlib.dumps({"protocol": PROTOCOL_VERSION, "handle": "host:42", "phase": "ready",
                          "sent_at": time.time()}).encode()
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    held = threading.Event()

    def tick():  # a reconciler tick holding the scheduler's lock for 0.3 s
        with tick_lock:
            held.set()
            time.sleep(0.3)

    ticking = threading.Thread(target=tick)
    ticking.start()
    held.wait(5)
    arrived = time.time()

    async def two_heartbeats():  # both wait for the lock, the second on the heartbeat thread behind the first
        scope = {"type": "http", "method": "POST", "path": "/v1/nodes/n1/heartbeat"}
        await asyncio.gather(route(scope, receive, send), route(scope, receive, send))

    asyncio.run(two_heartbeats())
    ticking.join()
    assert [m["status"] for m in sent if "status" in m] == [200, 200], sent
    assert len(answered) == 2 and all(answered_at - arrived > 0.2 for _, answered_at in answered), \
        "answered after the tick let go of the lock"
    assert all(dated - arrived < 0.1 for dated, _ in answered), f"dated after their arrival: {answered}, {arrived}"


@pytest.mark.parametrize("link", ["open", "closed"])
def test_a_heartbeat_answered_late_is_dated_from_its_answer_while_its_agents_link_is_open(monkeypatch, link):
    """An agent whose heartbeat waits in the queue (15 s for a first heartbeat at 4,096 agents started together)
    is heard until its answer, as `answering` says: dated from its arrival, that wait read as silence and failed
    the cluster's creation. A killed agent's (its link closed) is still dated from its arrival."""
    import json as jsonlib
    from types import SimpleNamespace

    from phalanx.control.server import heartbeat_route
    from phalanx.control.state.store import NodeState
    from phalanx.protocol import PROTOCOL_VERSION

    dated = []

    def answer(store, jobs, deep, cid, node, hb, now, poke):  # (as `answer_heartbeat`: under the store's lock)
        with store.lock:
            dated.append((now, time.time()))
        return {"action": "run"}

    monkeypatch.setattr(heartbeat_route, "answer_heartbeat", answer)
    links = AgentLinks()
    links.opened("n1", "host:42")
    node = SimpleNamespace(state=NodeState.HEALTHY, handle="host:42")
    store_lock = threading.RLock()
    ctl = SimpleNamespace(jobs=None, store=SimpleNamespace(lock=store_lock, node=lambda name: node), links=links,
                          deep_checks=None, started_at=0.0)
    route = heartbeat_route.HeartbeatRoute(None, ctl)
    body = jsonlib.dumps({"protocol": PROTOCOL_VERSION, "handle": "host:42", "phase": "ready",
                          "sent_at": time.time()}).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        pass

    held = threading.Event()

    def tick():  # a reconciler tick holding the store's lock for 0.3 s; the agent killed meanwhile, or not
        with store_lock:
            held.set()
            time.sleep(0.1)
            if link == "closed":
                links.closed("n1", "host:42", time.time())
            time.sleep(0.2)

    ticking = threading.Thread(target=tick)
    ticking.start()
    held.wait(5)
    arrived = time.time()
    asyncio.run(route({"type": "http", "method": "POST", "path": "/v1/nodes/n1/heartbeat"}, receive, send))
    ticking.join()
    ((when, answered_at),) = dated
    assert answered_at - arrived > 0.25, "answered after the lock was let go"
    if link == "open":
        assert when >= answered_at - 0.05, f"dated at its answer: {when - arrived:.3f} s after its arrival"
    else:
        assert when - arrived < 0.05, f"its link closed: dated from its arrival, not {when - arrived:.3f} s later"


def test_the_flush_lets_the_heartbeats_queued_for_the_stores_lock_in_between_its_transactions(tmp_path, monkeypatch):
    """A flush writes FLUSH_ROWS nodes per transaction under the store's lock; heartbeats that found it taken wait on
    the route's one thread (`heartbeat_route.LockQueue`). A lock is not fair: taken back 1 ms after it was let go, it
    let in one or two of them each time and the rest waited for later transactions (4,096 nodes: up to 0.1 s). Now
    every heartbeat queued during a transaction is answered before the next one begins."""
    from types import SimpleNamespace

    from phalanx.control.server import heartbeat_route
    from phalanx.control.spec import load_spec
    from phalanx.control.state import store as store_module

    monkeypatch.setattr(store_module, "FLUSH_ROWS", 2)
    monkeypatch.setattr(heartbeat_route, "MAKE_WAY_S", 60.0)  # (bounded in the controller; here: the order alone)
    store = store_module.Store(tmp_path / "state.db", owner=True)
    store.initialize(load_spec(write_spec(tmp_path, count=5, spares=1)))
    names = [store.add_node("workers", is_spare=False, work_root=tmp_path, reason="test").name for _ in range(6)]
    store.observe_beats({name: 10.0 + i for i, name in enumerate(names)})  # three transactions' worth
    route = heartbeat_route.HeartbeatRoute(None, SimpleNamespace(jobs=SimpleNamespace(), store=store, links=None))
    assert store.make_way == route.queue.make_way
    order, write = [], store._write_observed

    def heartbeat(i: int) -> None:  # as answered on the route's thread: under the store's lock, a little work each
        with store.lock:
            time.sleep(0.005)
            order.append(f"heartbeat {i}")

    def transaction(pending: dict) -> None:  # each transaction of the flush (under the store's lock)
        write(pending)
        order.append("transaction")
        if len(order) == 1:  # heartbeats arrive while the first one holds the lock: queued, as the route does
            for i in range(8):
                route.queue.submit(lambda i=i: heartbeat(i))

    monkeypatch.setattr(store, "_write_observed", transaction)
    assert store.flush_observed() == 6
    assert order == ["transaction", *(f"heartbeat {i}" for i in range(8)), "transaction", "transaction"], order
    reader = store_module.Store(tmp_path / "state.db")  # in SQLite, every one
    assert [reader.node(name).last_heartbeat for name in names] == [10.0 + i for i in range(6)]
    reader.close()
    route.queue.pool.shutdown()
    store.close()


def test_agents_answered_together_after_a_stall_do_not_stay_in_step():
    """An agent keeps its phase (the rest of its period after each heartbeat); answered a whole period late, as
    every agent waiting on a stalled controller is, it picks a random one: agents answered in the same instant
    would otherwise send in the same instant at every interval from then on."""
    from phalanx.control.agent.link import next_wait

    assert next_wait(2.0, 0.5) == 1.5 and next_wait(2.0, 0.0) == 2.0
    waits = [next_wait(2.0, 3.0) for _ in range(200)]  # 200 agents answered together, 3 s after they sent
    assert all(0.0 <= w <= 2.0 for w in waits)
    assert len({round(w, 1) for w in waits}) >= 15, "spread over the period, not one instant"

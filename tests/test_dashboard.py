"""The controller's live web dashboard (control/server/dashboard.py, static/).

Fast: the routes served by uvicorn over the fake cluster of tests/fakes.py (a real SQLite store, a job whose
node is killed and that resumes on the promoted spare): the page and its assets need no token, the data does;
the shapes the page reads; where the timeline places each recovery phase. Slow: a real local cluster and a
training job, the page opened in Debian's headless Chromium, a node killed; the node grid and the job's
timeline must show it, and a screenshot is kept (test-artifacts/dashboard.png, or under
$PHALANX_TEST_ARTIFACTS).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from clusters import home, wait_for  # noqa: F401  (home is a fixture)
from conftest import tiny_config
from fakes import FakeCluster
from phalanx.cli import app
from phalanx.control.http import ApiError, request_json
from phalanx.control.server.dashboard import STATIC, timeline
from phalanx.observability.events import Event, EventKind as K

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("PHALANX_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("PHALANX_CHROMEDRIVER", "/usr/bin/chromedriver")


# ---- the routes, over the fake cluster ---------------------------------------------------------------------
def serve(app) -> tuple[str, callable]:
    """`app` on uvicorn in a thread, on a free port of 127.0.0.1: (base URL, stop)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 10, "uvicorn to start")

    def stop():
        server.should_exit = True
        thread.join(10)
        sock.close()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


def get_raw(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["content-type"], r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["content-type"], err.read()


@pytest.fixture
def fake_api(tmp_path):
    """A fake cluster (2 members, 1 spare) whose job lost workers-1 and resumed; its API served for real."""
    from phalanx.control.server.api import build_app

    c = FakeCluster(tmp_path / "fake").create()
    job = c.submit(nodes=2, auto_resume=True)
    c.run_until(lambda: len(c.workers(job.id, 1)) == 2, "generation 1 running")
    c.inject_fault("workers-1", "kill-node")
    c.run_until(lambda: len(c.workers(job.id, 2)) == 2, "generation 2 running")
    token = c.paths.read_token()
    ctl = SimpleNamespace(store=c.store, token=token, jobs=c.jobs, backend=c.backend, deep_checks=c.deep,
                          started_at=c.started_at, spec=c.spec, log=None, request_exit=c.exit_requests.append)
    url, stop = serve(build_app(ctl))
    yield SimpleNamespace(url=url, token=token, job=job.id, cluster=c)
    stop()
    c.close()


def test_an_injected_faults_event_is_dated_from_before_its_signal_not_after_the_fault_it_caused(tmp_path):
    """`POST /v1/nodes/{name}/faults` signals first and records its event after: on a busy host the reconciler had
    already recorded the killed node faulty, and `make demo` printed "fault detected -0.01 s after the kill" (CI-like
    run, 2026-11-30). The event is dated from the moment before the signal."""
    import logging

    from phalanx.control.server.api import build_app
    from phalanx.control.state.store import NodeState

    c = FakeCluster(tmp_path / "fake").create()
    kill = c.backend.kill

    def kill_found_at_once(node):  # the death is recorded (0.5 s later) before the API writes its own event
        pids = kill(node)
        c.clock.advance(0.5)
        c.store.transition(node.name, NodeState.FAULTY, "agent process killed by SIGKILL")
        return pids

    c.backend.kill = kill_found_at_once
    token = c.paths.read_token()
    ctl = SimpleNamespace(store=c.store, token=token, jobs=c.jobs, backend=c.backend, deep_checks=c.deep,
                          started_at=c.started_at, spec=c.spec, log=logging.getLogger("test"),
                          request_exit=c.exit_requests.append)
    url, stop = serve(build_app(ctl))
    try:
        before = c.clock()
        request_json("POST", f"{url}/v1/nodes/workers-0/faults", token, {"kind": "kill-node"})
    finally:
        stop()
    events = c.store.events(node="workers-0")
    injected = next(e for e in events if e["kind"] == "fault-injected")
    faulty = next(e for e in events if e["to_state"] == "faulty")
    assert injected["time"] == before < faulty["time"] == before + 0.5, (injected, faulty)
    c.close()


def test_the_page_needs_no_token_and_the_data_needs_the_cluster_token(fake_api):
    url, token = fake_api.url, fake_api.token
    status, kind, page = get_raw(f"{url}/dashboard")
    assert status == 200 and kind.startswith("text/html")
    assert b'id="signin"' in page and b"token" in page and b"workers-" not in page, "the page holds no data"
    assert b"http" not in page.replace(b"http://www.w3.org", b""), "nothing fetched from elsewhere (no CDN)"
    for name, mime in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
        status, kind, body = get_raw(f"{url}/dashboard/{name}")
        assert status == 200 and kind.startswith(mime) and body == (STATIC / name).read_bytes()
        assert b"https://" not in body, f"{name} fetches nothing from elsewhere"
    for path in ("/v1/dashboard", f"/v1/jobs/{fake_api.job}/dashboard", "/dashboard/other.js", "/v1/nodes"):
        for wrong in (None, "not-the-token"):
            with pytest.raises(ApiError) as err:
                request_json("GET", url + path, wrong)
            assert err.value.status == 401, path
    with pytest.raises(ApiError) as err:
        request_json("GET", f"{url}/v1/jobs/nope/dashboard", token)
    assert err.value.status == 404 and "nope" in err.value.detail


def test_the_overview_and_the_job_view_show_the_fault_and_the_recovery(fake_api):
    url, token, job = fake_api.url, fake_api.token, fake_api.job
    o = request_json("GET", f"{url}/v1/dashboard", token)
    assert o["cluster"]["name"] == "c1"
    nodes = {n["name"]: n for n in o["nodes"]}
    assert nodes["workers-1"]["state"] in ("faulty", "replacing", "terminated") and not nodes["workers-1"]["live"]
    assert nodes["workers-2"]["role"] == "member" and nodes["workers-2"]["state"] == "healthy", "the spare promoted"
    assert nodes["workers-0"]["health"] == "ok" and nodes["workers-0"]["group"] == "workers"
    assert 0 <= nodes["workers-0"]["heartbeat_age_s"] < 60
    (j,) = o["jobs"]
    assert j["id"] == job and j["state"] == "running" and j["generation"] == 2 and j["node_faults"] == 1
    assert set(j) >= {"step", "goodput", "loss", "tokens_per_s", "nodes", "recovery"}

    d = request_json("GET", f"{url}/v1/jobs/{job}/dashboard", token)
    assert d["job"]["id"] == job and set(d["series"]) == {"step", "time", "loss", "tokens_per_s"}
    t = d["timeline"]
    assert [(g["generation"], g["outcome"]) for g in t["generations"]] == [(1, "node-fault"), (2, None)]
    (fault,) = [e for e in t["entries"] if e["kind"] == "fault"]
    assert fault["after"] == 1 and fault["generation"] == 2 and "workers-1" in fault["detail"]
    assert t["generations"][0]["start"] <= fault["start"] <= t["generations"][1]["start"]
    assert any(e["kind"] == "generation" for e in d["events"]), "the job's events, from its events.jsonl"
    # (a command job has no step records: no curve, no detect/restore phases; the real test below has them)


def test_the_timeline_places_each_recovery_phase_where_it_happened():
    t0 = 1000.0
    job = SimpleNamespace(created_at=t0, ended_at=t0 + 60, recovery="restart")
    gen = lambda n, start, end, outcome: SimpleNamespace(  # noqa: E731
        generation=n, started_at=start, ended_at=end, stop_at=end, outcome=outcome, end_reason=f"gen {n} ended",
        nodes=["a", "b"], first_step_at=None)
    gens = [gen(1, t0 + 1, t0 + 22, "node-fault"), gen(2, t0 + 24, t0 + 60, "succeeded")]
    ev = lambda t, kind, source="controller", **f: Event(t, kind, source, job="1", fields=f)  # noqa: E731
    events = [ev(t0 + 1, K.GENERATION), ev(t0 + 21, K.JOB, to_state="recovering"), ev(t0 + 24, K.GENERATION),
              ev(t0 + 27, K.STARTED, "rank:0"), ev(t0 + 30, K.RESUMED, "rank:0", step=6, seconds=2.0)]
    steps = [{"step": 7, "time": t0 + 33.0, "step_time_s": 2.5}]
    recoveries = [{"detect": 1.5, "regroup": 6.0, "restore": 2.0, "first_step": 2.5}]
    out = timeline(job, gens, events, steps, recoveries)
    at = {e["kind"]: (e["start"] - t0, e["seconds"]) for e in out["entries"]}
    assert at == {"fault": (19.5, 0.0), "detect": (19.5, 1.5), "regroup": (21.0, 6.0), "restore": (28.0, 2.0),
                  "first_step": (30.5, 2.5)}
    assert {e["generation"] for e in out["entries"]} == {2} and out["start"] == t0 and out["end"] == t0 + 60
    # a job that ended without a fault has no recovery; one whose last generation failed has its fault only
    assert timeline(job, gens[1:], events, steps, [])["entries"] == []
    failed = timeline(job, [gen(1, t0 + 1, t0 + 22, "app-error")], events, steps, [])["entries"]
    assert [(e["kind"], e["generation"], e["after"]) for e in failed] == [("fault", None, 1)]


def test_the_assets_ship_as_package_data():
    (line,) = re.findall(r'^"phalanx.control.server" = \[(.*)\]', (REPO / "pyproject.toml").read_text(), re.M)
    globs = re.findall(r'"([^"]+)"', line)  # ([tool.setuptools.package-data]; no tomllib on Python 3.10)
    shipped = {p.name for p in STATIC.iterdir()}
    assert shipped == {"dashboard.html", "dashboard.js", "dashboard.css"}
    assert all(any(Path("static", name).match(g) for g in globs) for name in shipped), globs


# ---- the page in headless Chromium against a real cluster ----------------------------------------------------
def chromium():
    """Debian's chromium through its chromedriver (Selenium Manager never runs: nothing is downloaded)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (Path(p).exists() or shutil.which(p))]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: run `make system-deps` (Debian's chromium and chromium-driver, "
                    f"as root) or set PHALANX_CHROMIUM / PHALANX_CHROMEDRIVER")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ.setdefault("SE_OFFLINE", "true")  # were Selenium Manager ever consulted, it may not download

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000", "--hide-scrollbars"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def page(driver, script: str):
    """What the page shows, read in one go (the page redraws every second: no element handles kept)."""
    return driver.execute_script(script)


NODES = "return [...document.querySelectorAll('[data-node]')].map(e => [e.dataset.node, e.dataset.state, e.dataset.role])"
TIMELINE = ("return [...document.querySelectorAll('#timeline tr[data-kind]')]"
            ".map(e => [e.dataset.kind, e.dataset.generation, Number(e.dataset.seconds)])")
STATUS = ("return [document.getElementById('updated').textContent, document.getElementById('job').hidden, "
          "document.getElementById('job-title').textContent]")
SHOWN = "return [document.getElementById('signin').offsetParent !== null, document.getElementById('app').offsetParent !== null]"


@pytest.mark.slow
def test_the_dashboard_in_chromium_shows_a_killed_node_and_the_jobs_recovery(tmp_path, home, demo_data):
    from phalanx.control.client.cluster import ClusterClient, create_cluster
    from phalanx.control.client.jobs import JobClient

    spec = tmp_path / "c1.yaml"
    spec.write_text(yaml.safe_dump({"name": "c1", "instance_groups": [
        {"name": "workers", "instance_type": "local.cpu-1", "count": 2, "spares": 1, "warm_standby": False}],
        "health": {"heartbeat_timeout_s": 5.0, "hang_timeout_s": 60.0}}))
    create_cluster(spec, timeout_s=60)
    jobs, client = JobClient("c1"), ClusterClient("c1")
    config = tiny_config(tmp_path / "run", demo_data, training={"max_steps": 400, "log_interval": 10},
                         checkpoint={"interval": 3, "keep": 20})
    job = jobs.submit(config, nodes=2, auto_resume=True, name="tiny")["id"]
    shown = CliRunner().invoke(app, ["cluster", "dashboard", "c1", "--token"])  # where it is, how to sign in
    url = f"{client.url()}/dashboard"
    assert shown.exit_code == 0 and shown.output.split()[0] == url and client.token in shown.output, shown.output
    assert str(client.paths.token) in " ".join(shown.output.split()), shown.output
    driver = chromium()
    try:
        driver.get(url)
        wait_for(lambda: page(driver, SHOWN) == [True, False], 10, "the sign-in, alone")
        assert page(driver, NODES) == [], "no node shown without the token"
        sign_in(driver, "not-the-token")
        wait_for(lambda: "refused" in page(driver, "return document.getElementById('signin-error').textContent"),
                 10, "the wrong token refused")
        assert page(driver, SHOWN) == [True, False] and page(driver, NODES) == []
        sign_in(driver, client.token)
        wait_for(lambda: page(driver, SHOWN) == [False, True], 10, "the dashboard after signing in")
        wait_for(lambda: {n[0]: n[1:] for n in page(driver, NODES)} == {
            "workers-0": ["healthy", "member"], "workers-1": ["healthy", "member"], "workers-2": ["healthy", "spare"]},
            10, "the node grid: two members and the spare, healthy")
        # the job trains: its curve has points; once a checkpoint is committed, rank 1's node is killed
        wait_for(lambda: (i := jobs.describe(job))["last_step"] is not None and i["last_step"] >= 5, 90, "step 5")
        # (the chart has no point count until the job's first dashboard reply is drawn: NaN, read as None)
        points = "return Number(document.getElementById('chart-loss').dataset.points)"
        try:
            wait_for(lambda: (page(driver, points) or 0) > 0, 30, "the loss curve")
        except AssertionError as err:
            save_screenshot(driver, "dashboard-failed.png")
            raise AssertionError(f"{err}; page: {page(driver, STATUS)}; job: {jobs.describe(job)['last_step']}") from None
        victim = jobs.describe(job)["generations"][0]["nodes"][1]
        client.inject_fault(victim, "kill-node")
        wait_for(lambda: dict((n[0], n[1:]) for n in page(driver, NODES)).get(victim, [""])[0]
                 in ("faulty", "replacing", "terminated"), 15, f"the grid to show {victim} faulty")
        wait_for(lambda: {n[0]: n[1:] for n in page(driver, NODES)}.get("workers-2") == ["healthy", "member"],
                 30, "the spare promoted to member")
        want = {("generation", "1"), ("generation", "2"), ("fault", "2"), ("detect", "2"), ("regroup", "2"),
                ("restore", "2"), ("first_step", "2")}
        try:
            phases = wait_for(lambda: (rows := page(driver, TIMELINE)) and {(k, g) for k, g, _ in rows} >= want and rows, 75,
                              "the timeline: generation 2 after the fault, detect, regroup, restore and first step")
        except AssertionError as err:
            save_screenshot(driver, "dashboard-failed.png")
            raise AssertionError(f"{err}; shown: {page(driver, TIMELINE)}; job: {jobs.describe(job)['state']}") from None
        secs = {k: s for k, g, s in phases if g == "2"}
        assert 0 < secs["detect"] < 10 and secs["restore"] > 0 and secs["first_step"] > 0, secs
        assert page(driver, "return document.querySelectorAll('#timeline-chart [data-kind=fault]').length") == 1
        wait_for(lambda: {"productive", "failure_detection", "recovery"} <= set(page(
            driver, "return [...document.querySelectorAll('#goodput-legend [data-category]')]"
                    ".map(e => e.dataset.category)")), 15, "the goodput bar's categories")
        shot = save_screenshot(driver)
        assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot
    finally:
        driver.quit()


def sign_in(driver, token: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "token-input")
    box.clear()
    box.send_keys(token)
    driver.find_element(By.ID, "sign-in").click()


def save_screenshot(driver, name: str = "dashboard.png") -> Path:
    """The whole page (the window stretched to its height), as test-artifacts/<name>."""
    root = Path(os.environ.get("PHALANX_TEST_ARTIFACTS") or REPO / "test-artifacts")
    root.mkdir(parents=True, exist_ok=True)
    height, chrome = page(driver, "return [document.documentElement.scrollHeight, outerHeight - innerHeight]")
    driver.set_window_size(1400, min(max(height, 800), 4000) + chrome + 4)
    time.sleep(1.2)  # one redraw at the new size
    path = root / name
    path.unlink(missing_ok=True)
    driver.save_screenshot(str(path))
    return path

"""Rank logs from hosts that do not see the controller's files (`control/agent/log_ship.py`,
`control/server/rank_logs.py`, `POST /v1/jobs/{id}/logs/{rank}`).

A command job on backend hosts or slurm keeps its job dir in the controller's cluster directory, which its nodes do
not see: its assignments ask the agents to write each rank's log on their node and ship it. Here a real worker
supervisor runs a real process whose output reaches the controller's rank log, over the controller's real API (a
fake cluster's policy, served by uvicorn), its exit line before its exit is reported; the shipper's rules (whole
lines, chunks, a lost answer, a gap, a restarted controller, an unreachable one) are driven directly. Across real
network namespaces: tests/test_hosts.py."""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from clusters import wait_for
from fakes import FakeCluster
from phalanx.control.agent.log_ship import LogShipper
from phalanx.control.agent.supervisor import WorkerSupervisor
from phalanx.control.http import ApiError, ControllerUnreachable, request_json
from phalanx.control.server.rank_logs import RankLogs
from phalanx.protocol.messages import LOG_CHUNK_BYTES, Assignment
from test_dashboard import serve

PY = sys.executable


@pytest.fixture
def hosts_api(tmp_path):
    """A fake cluster of backend hosts (2 nodes) running a 2-rank command job; its API served for real."""
    from phalanx.control.server.api import build_app

    c = FakeCluster(tmp_path / "fake", spares=0, backend="hosts").create()
    job = c.submit(nodes=2)
    c.run_until(lambda: len(c.workers(job.id, 1)) == 2, "generation 1 running")
    token = c.paths.read_token()
    ctl = SimpleNamespace(store=c.store, token=token, jobs=c.jobs, backend=c.backend, deep_checks=c.deep,
                          started_at=c.started_at, spec=c.spec, log=None, request_exit=c.exit_requests.append)
    url, stop = serve(build_app(ctl))
    yield SimpleNamespace(url=url, token=token, job=c.jobs.records.job(job.id), cluster=c)
    stop()
    c.close()


def test_a_command_jobs_rank_log_reaches_the_controller_before_its_exit_is_reported(tmp_path, hosts_api):
    c, job = hosts_api.cluster, hosts_api.job
    node = c.jobs.records.generation(job.id, 1).nodes[1]
    sent = Assignment.model_validate(c.agents[node].assigned[(job.id, 1)])
    assert sent.ship_log and sent.log_dir == f"{job.job_dir}/logs"
    # rank 1's worker, for real: a line, 300 KB in lines (more than a chunk), and a last line with no newline
    script = ("import sys; print('hello from rank 1', flush=True); "
              "[print('x' * 99) for _ in range(3000)]; sys.stdout.write('the end, unfinished'); sys.stdout.flush()")
    sent = sent.model_copy(update={"argv": [PY, "-c", script], "cwd": str(tmp_path)})
    work = tmp_path / "node"
    sup = WorkerSupervisor(node, hosts_api.token, 60.0, wake=lambda: None, work_dir=work,
                           controller_url=lambda: hosts_api.url)
    sup.apply([sent])
    mine = work / "job-logs" / job.id / "rank1.log"
    theirs = Path(job.job_dir) / "logs" / "rank1.log"

    def exited():
        sup.poll()
        return next(r for r in sup.report() if r["rank"] == 1)["state"] == "exited"
    wait_for(exited, 30, "rank 1 to exit")
    # its exit is reported with all of its log at the controller, the exit line its agent wrote included
    text = theirs.read_text()
    assert text == mine.read_text(), (len(text), mine.stat().st_size)
    assert "=== phalanx: job" in text and "hello from rank 1\n" in text and text.count("x" * 99) == 3000
    assert "the end, unfinished=== phalanx: rank 1 exited with code 0 ===\n" in text
    assert theirs.stat().st_size > LOG_CHUNK_BYTES
    sup.stop_all()

    # what the route refuses, each naming the field
    def refused(rank, body) -> ApiError:
        with pytest.raises(ApiError) as err:
            request_json("POST", f"{hosts_api.url}/v1/jobs/{job.id}/logs/{rank}", hosts_api.token, body)
        return err.value
    chunk = {"node": node, "offset": 0, "data": base64.b64encode(b"x\n").decode()}
    assert refused(2, chunk).status == 422 and "rank: job" in refused(2, chunk).detail
    assert "data: not base64" in refused(0, {**chunk, "data": "not*base64"}).detail
    assert refused(0, {**chunk, "node": "nobody"}).status == 404
    assert "offset" in refused(0, {**chunk, "offset": -1}).detail
    with pytest.raises(ApiError) as err:
        request_json("POST", f"{hosts_api.url}/v1/jobs/{job.id}/logs/0", "wrong-token", chunk)
    assert err.value.status == 401


class Controller:
    """What the shipper posts to, in process: the controller's `RankLogs` behind a switch that drops requests
    (unreachable) or answers (a lost answer: written, then the connection fails)."""

    def __init__(self, job_dir: Path):
        self.job_dir, self.logs, self.down, self.lose_answer, self.posts = job_dir, RankLogs(), False, False, 0

    def post(self, job: str, rank: int, chunk) -> int:
        self.posts += 1
        if self.down:
            raise ControllerUnreachable("connection refused")
        held = self.logs.append(str(self.job_dir), job, rank, chunk.node, chunk.offset, base64.b64decode(chunk.data))
        if self.lose_answer:
            self.lose_answer = False
            raise ControllerUnreachable("connection reset")
        return held

    def text(self, rank: int = 0) -> str:
        path = self.job_dir / "logs" / f"rank{rank}.log"
        return path.read_text() if path.exists() else ""


def test_the_shipper_sends_whole_lines_once_each_through_lost_answers_gaps_and_restarts(tmp_path):
    ctl = Controller(tmp_path / "job")
    log = tmp_path / "node" / "rank0.log"
    log.parent.mkdir()
    log.write_bytes(b"before it was watched\n")
    shipper = LogShipper("n1", "token", lambda: "http://unused", post=ctl.post)
    shipper.watch("j", 0, log)  # (from its current end: a log watched again was sent in full)
    with open(log, "ab") as out:
        out.write(b"one\ntw")
    assert not shipper.ship_all() and ctl.text() == "one\n"  # an unfinished line waits a round
    assert shipper.ship_all() and ctl.text() == "one\ntw"  # ... unfinished still: sent as it is
    with open(log, "ab") as out:
        out.write(b"o\nthree\n")
    ctl.lose_answer = True  # written, the answer lost: sent again, not written twice
    assert not shipper.ship_all()
    assert shipper.ship_all() and ctl.text() == "one\ntwo\nthree\n"

    ctl.down = True  # unreachable: the log waits on the node; a worker's exit does not wait for it
    with open(log, "ab") as out:
        out.write(b"four\n")
    assert not shipper.ship_all()
    posts = ctl.posts
    assert not shipper.ship_now("j", 0) and ctl.posts == posts
    ctl.down = False  # back: the next round sends it (and a worker's exit waits for its lines again)
    assert shipper.ship_all() and ctl.text() == "one\ntwo\nthree\nfour\n"
    with open(log, "ab") as out:
        out.write(b"four and a half")
    assert shipper.ship_now("j", 0) and ctl.text() == "one\ntwo\nthree\nfour\nfour and a half"
    with open(log, "ab") as out:
        out.write(b"\n")

    ctl.logs = RankLogs()  # a restarted controller takes the next chunk at its word
    with open(log, "ab") as out:
        out.write(b"five\n")
    assert shipper.ship_all() and ctl.text().endswith("half\nfive\n") and ctl.text().count("four\n") == 1

    # the controller holds less than the shipper was told (its last 5 bytes never reached its disk): a chunk past
    # what it holds is not written, its answer says what it holds, and the shipper sends again from there
    ctl.logs._received[("j", 0, "n1")] -= 5
    held = ctl.job_dir / "logs" / "rank0.log"
    held.write_bytes(held.read_bytes()[:-5])
    with open(log, "ab") as out:
        out.write(b"six\n" + b"y" * (2 * LOG_CHUNK_BYTES) + b"\n")  # (in 3 chunks)
    assert shipper.ship_all()
    assert ctl.text() == log.read_text().removeprefix("before it was watched\n")
    assert ctl.text().endswith("five\nsix\n" + "y" * (2 * LOG_CHUNK_BYTES) + "\n")
    shipper.close()


def test_a_rank_that_moves_to_another_node_keeps_one_log_with_both_nodes_lines(tmp_path):
    ctl = Controller(tmp_path / "job")
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    ship_a = LogShipper("n1", "token", lambda: None, post=ctl.post)
    ship_b = LogShipper("n2", "token", lambda: None, post=ctl.post)
    ship_a.watch("j", 0, a)
    a.write_bytes(b"generation 1 on n1\n")
    assert ship_a.ship_all()
    ship_b.watch("j", 0, b)
    b.write_bytes(b"generation 2 on n2\n")
    with open(a, "ab") as out:
        out.write(b"n1's exit line, late\n")
    assert ship_b.ship_all() and ship_a.ship_all()
    assert ctl.text() == "generation 1 on n1\ngeneration 2 on n2\nn1's exit line, late\n"
    for s in (ship_a, ship_b):
        s.close()


def test_a_job_the_controller_does_not_know_is_no_longer_shipped(tmp_path):
    calls = []

    def post(job, rank, chunk):
        calls.append(job)
        raise ApiError(404, f"no job {job!r}")
    log = tmp_path / "r.log"
    shipper = LogShipper("n1", "token", lambda: None, post=post)
    shipper.watch("gone", 0, log)
    log.write_text("a line\n")
    assert shipper.ship_all() and calls == ["gone"]
    log.write_text("a line\nanother\n")
    assert shipper.ship_all() and calls == ["gone"]
    shipper.close()


def test_a_refusal_of_another_kind_is_said_once_and_the_log_sent_once_it_passes(tmp_path, caplog):
    ctl, answers = Controller(tmp_path / "job"), [ApiError(507, "disk full"), ApiError(507, "disk full")]

    def post(job, rank, chunk):
        if answers:
            raise answers.pop()
        return ctl.post(job, rank, chunk)
    log = tmp_path / "r.log"
    shipper = LogShipper("n1", "token", lambda: None, post=post)
    shipper.watch("j", 0, log)
    log.write_text("a line\n")
    assert not shipper.ship_all() and not shipper.ship_all()
    assert shipper.ship_all() and ctl.text() == "a line\n"
    assert sum("shipping its log failed" in r.message for r in caplog.records) == 1
    shipper.close()


def test_a_node_keeps_the_logs_of_its_recent_jobs_and_a_job_that_comes_back_goes_on_where_the_controller_is(
        tmp_path):
    """`JobLogs.prune`: the dirs past the `keep_jobs` most recently written go, except a job still watched; their
    sizes stay in shipped.json, from which a job back on the node goes on: the controller's log loses nothing."""
    from phalanx.control.agent.log_ship import SHIPPED, JobLogs
    ctls = {job: Controller(tmp_path / job) for job in ("j1", "j2", "j3")}
    logs = JobLogs(tmp_path / "job-logs", keep_jobs=1)
    shipper = LogShipper("n1", "token", lambda: None, post=lambda job, rank, chunk: ctls[job].post(job, rank, chunk))
    for age, job in enumerate(("j3", "j2", "j1")):  # j1 the oldest
        path = logs.path(job, 0)
        shipper.watch(job, 0, path, base=logs.base(job, 0))
        path.parent.mkdir(parents=True)
        path.write_text(f"{job} generation 1\n")
        os.utime(path, (time.time() - 100 * (age + 1),) * 2)
    assert shipper.ship_all()
    assert logs.prune(busy={"j1"}) == ["j2"]  # j3 the newest, j1 still watched
    assert not (tmp_path / "job-logs" / "j2").exists() and logs.path("j1", 0).exists()
    assert json.loads((tmp_path / "job-logs" / SHIPPED).read_text()) == {"j2": {"0": len("j2 generation 1\n")}}
    assert logs.prune(busy={"j1"}) == []

    # j2 comes back to this node (its log on the node forgotten by the shipper): it goes on from what was shipped
    again = LogShipper("n1", "token", lambda: None, post=lambda job, rank, chunk: ctls[job].post(job, rank, chunk))
    path = logs.path("j2", 0)
    assert logs.base("j2", 0) == len("j2 generation 1\n")
    again.watch("j2", 0, path, base=logs.base("j2", 0))
    path.parent.mkdir()
    path.write_text("j2 generation 5\n")
    assert again.ship_all() and ctls["j2"].text() == "j2 generation 1\nj2 generation 5\n"
    # ... and when it goes a second time, its sizes add up
    os.utime(path, (time.time() - 1000,) * 2)
    (tmp_path / "job-logs" / "j9").mkdir()
    assert "j2" in logs.prune(busy=set())
    assert logs.base("j2", 0) == 2 * len("j2 generation 1\n")
    for s in (shipper, again):
        s.close()


def test_the_supervisor_removes_old_jobs_logs_when_a_new_job_starts_on_its_node(tmp_path, hosts_api):
    from phalanx.control.agent.log_ship import KEEP_JOBS
    c, job = hosts_api.cluster, hosts_api.job
    node = c.jobs.records.generation(job.id, 1).nodes[1]
    sent = Assignment.model_validate(c.agents[node].assigned[(job.id, 1)])
    sent = sent.model_copy(update={"argv": [PY, "-c", "print('hi')"], "cwd": str(tmp_path)})
    work = tmp_path / "node"
    for i in range(KEEP_JOBS + 2):  # earlier jobs' logs, old-0 the oldest
        log = work / "job-logs" / f"old-{i}" / "rank1.log"
        log.parent.mkdir(parents=True)
        log.write_text(f"old job {i}\n")
        os.utime(log, (time.time() - 1000 + i,) * 2)
    sup = WorkerSupervisor(node, hosts_api.token, 60.0, wake=lambda: None, work_dir=work,
                           controller_url=lambda: hosts_api.url)
    sup.apply([sent])
    left = {d.name for d in (work / "job-logs").iterdir() if d.is_dir()}
    assert left == {job.id, *(f"old-{i}" for i in range(3, KEEP_JOBS + 2))}, left  # the new job's and 15 newest
    sup.stop_all()

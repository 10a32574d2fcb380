"""The agent's worker supervisor (`control/agent/supervisor.py`), driven directly.

A worker due while its node's worker template is still importing torch waits for the template (forked once it is
ready) instead of being exec'd beside it: two imports at once on every node of a host finish later than the
template alone. The wait is bounded, a template that dies ends it, and a worker stopped while it waits was never
started. Here a stand-in template answers (what the supervisor asks of it is the whole contract); one test drives
the real one. And a worker killed for a hang stays a hang when the controller stops it before its exit is seen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusters import wait_for
from phalanx import protocol
from phalanx.control.agent import supervisor as supervisor_module
from phalanx.control.agent.supervisor import Worker, WorkerSupervisor
from phalanx.control.agent.template import TemplateUnavailable, WorkerTemplate
from phalanx.protocol.messages import Assignment, RankSlot

WORKER = [sys.executable, "-m", protocol.TRAIN_WORKER_MODULE]


class Forked:
    """What a template's fork returns, for a worker that runs until the test ends."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        return self.returncode


class StandInTemplate:
    """The calls the supervisor makes on a `WorkerTemplate`, answered from the test's settings."""

    def __init__(self):
        self.ready, self.alive, self.hurried = False, True, 0
        self.forks: list[tuple[list[str], dict]] = []

    def importing(self) -> bool:
        return self.alive and not self.ready

    def coming(self) -> bool:
        return self.importing()

    def hurry(self) -> None:
        self.hurried += 1

    def fork(self, argv, env, cwd, log_path):
        if not self.ready:
            raise TemplateUnavailable("the worker template is gone")
        self.forks.append((argv, env))
        return Forked(40000 + len(self.forks))

    def close(self) -> None:
        pass


def assignment(tmp_path: Path, generation: int = 1, argv: list[str] = WORKER, carry: bool = False) -> Assignment:
    return Assignment(job="1", generation=generation, recovery=protocol.CHECKPOINTLESS, argv=argv,
                      cwd=str(tmp_path), log_dir=str(tmp_path / "logs"), world_size=2, local_world_size=1,
                      master_addr="127.0.0.1", master_port=29500, store_addr="127.0.0.1:9",
                      checkpoint_dir=str(tmp_path / "ckpt"), config_path=str(tmp_path / "missing.yaml"),
                      ranks=[RankSlot(rank=1, local_rank=0, carry=carry)])


def supervisor(template) -> WorkerSupervisor:
    return WorkerSupervisor("n1", "t", hang_timeout_s=60.0, wake=lambda: None, template=template)


def test_a_worker_due_while_the_template_imports_is_forked_from_it_once_ready(tmp_path):
    template = StandInTemplate()
    sup = supervisor(template)
    sup.apply([assignment(tmp_path)])
    (w,) = sup.workers.values()
    assert (w.pid, w.proc, w.state) == (None, None, "running") and template.hurried == 1
    assert sup.report()[0]["pid"] is None and not (tmp_path / "logs" / "rank1.log").exists()
    assert sup.report()[0]["detail"] == "waiting for the node's worker template (importing torch)"
    sup.poll()
    assert w.proc is None and not template.forks and template.hurried == 2, "still waiting, the template hurried"

    template.ready = True
    sup.poll()
    ((argv, env),) = template.forks
    assert argv == WORKER and (env[protocol.RANK], env[protocol.WORLD_SIZE], env["MASTER_PORT"]) == ("1", "2", "29500")
    assert w.pid == 40001 and w.launch is None and (sup.report()[0]["pid"], sup.report()[0]["detail"]) == (40001, None)
    assert "job 1 generation 1 rank 1 on node n1, started" in (tmp_path / "logs" / "rank1.log").read_text()


def test_a_worker_stopped_while_it_waits_was_never_started_and_one_of_a_newer_generation_waits_afresh(tmp_path):
    template = StandInTemplate()
    sup = supervisor(template)
    sup.apply([assignment(tmp_path, generation=1)])
    # a newer generation counts on the survivor of slot 0: one that never started cannot carry the old env over
    sup.apply([assignment(tmp_path, generation=2, carry=True)])
    old, new = sup.workers[("1", 1, 1)], sup.workers[("1", 2, 1)]
    assert old is not new and new.launch is not None
    assert (old.state, old.stopped, old.exit_code, old.pid) == ("exited", True, -signal.SIGTERM, None)
    assert "stopped before it started" in old.detail

    sup.apply([])
    assert (new.state, new.stopped) == ("exited", True)
    template.ready = True
    sup.poll()
    assert not template.forks, "nothing stopped is started later"


@pytest.mark.parametrize("why", ["the template died", "the wait ran out"])
def test_a_worker_whose_template_never_becomes_ready_is_execd(tmp_path, monkeypatch, why):
    template = StandInTemplate()
    if why == "the wait ran out":
        monkeypatch.setattr(supervisor_module, "WAIT_S", 0.0)
    sup = supervisor(template)
    sup.apply([assignment(tmp_path)])
    (w,) = sup.workers.values()
    if why == "the template died":
        sup.poll()
        assert w.proc is None
        template.alive = False
    sup.poll()
    try:
        assert isinstance(w.proc, subprocess.Popen) and w.pid == w.proc.pid and not template.forks
        assert w.proc.wait(timeout=60) == 2  # (exec'd `python -m phalanx.worker`: its config does not exist)
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
    assert "missing.yaml does not exist" in (tmp_path / "logs" / "rank1.log").read_text()


def test_with_the_real_template_a_worker_due_during_its_import_is_forked_and_the_template_yields_again(tmp_path):
    template = WorkerTemplate("n1", tmp_path)
    template.start()
    sup = supervisor(template)
    try:
        sup.apply([assignment(tmp_path)])
        (w,) = sup.workers.values()
        assert w.launch is not None, "the template was still importing torch"
        started = time.monotonic()
        wait_for(lambda: (sup.poll(), w.proc is not None)[1], 120, "the worker to start")
        assert template.ready and time.monotonic() - started < 60
        assert w.proc.wait(timeout=60) == 2 and type(w.proc).__name__ == "ForkedProcess"
        assert "missing.yaml does not exist" in (tmp_path / "logs" / "rank1.log").read_text()
        if os.geteuid() == 0:  # (CI) hurried while a worker waited, back under SCHED_IDLE once ready
            assert os.sched_getscheduler(template.proc.pid) == os.SCHED_IDLE
    finally:
        template.close()


def test_a_worker_killed_for_a_hang_and_then_stopped_by_the_controller_reports_the_hang(tmp_path):
    """The controller stops the generation when another rank's exit reaches it first (that rank's collective broke
    when the hung one was killed); the hung worker's exit, seen after the stop, is still the hang's."""
    sup = supervisor(None)
    now = time.monotonic()
    proc = subprocess.Popen(["sleep", "30"], process_group=0)
    w = Worker("1", 1, 1, 0, pid=proc.pid, started_at=time.time(), proc=proc, log_path=tmp_path / "rank1.log",
               last_step=5, last_beat=9, last_change=now - 70.0, last_beat_change=now - 70.0)
    sup.workers[("1", 1, 1)] = w
    sup._judge_hang(w, now)
    sup.apply([])  # no longer assigned, before the kill's exit was noticed
    wait_for(lambda: (sup.poll(), w.state == "exited")[1], 10, "the exit to be noticed")
    (report,) = sup.report()
    assert (report["stopped"], report["exit_code"], report["frozen"]) == (False, -signal.SIGKILL, True)
    assert report["hang"] and "no progress" in report["hang"]

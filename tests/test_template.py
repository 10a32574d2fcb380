"""The node's worker template (`python -m phalanx.zygote`, driven by `control/agent/template.py`): a worker it
forks runs as a fresh `python -m phalanx.worker` would (its own process group, cwd, env, log and command line),
its exit reaches the agent with the code Popen would give, and a template that dies leaves its workers watched
and is started again. A real cluster job forking its workers is checked in test_jobs (the restart after a
killed node)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from clusters import wait_for
from phalanx import protocol
from phalanx.control.agent.template import ForkedProcess, TemplateUnavailable, WorkerTemplate
from phalanx.control.backends.local import argv as process_argv

WORKER = [sys.executable, "-m", protocol.TRAIN_WORKER_MODULE]


def text(path: Path) -> str:
    return path.read_text() if path.exists() else ""  # (the forked child creates its log)


def ready_template(work: Path) -> WorkerTemplate:
    template = WorkerTemplate("n1", work)
    template.start()
    wait_for(lambda: template.ready, 120, "the template to import torch")
    return template


def standby(template: WorkerTemplate, tmp_path: Path, sid: str) -> ForkedProcess:
    """A forked warm standby: it imports nothing new and waits (for a store nobody serves) until killed."""
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", protocol.STANDBY_ID: sid,
           protocol.STORE_ADDR: "127.0.0.1:9", protocol.CLUSTER_TOKEN: "t"}
    return template.fork(WORKER + ["--standby"], env, tmp_path / "cwd", tmp_path / f"{sid}.log")


def test_a_forked_worker_runs_like_a_fresh_one_and_its_exit_reaches_the_agent(tmp_path):
    (tmp_path / "cwd").mkdir()
    template = ready_template(tmp_path)
    try:
        with pytest.raises(TemplateUnavailable, match="not a training worker command"):
            template.fork(["/bin/true"], {}, tmp_path, tmp_path / "x.log")
        assert not (tmp_path / "x.log").exists()

        # a worker with a config that cannot run: its error line in its log, exit code 2 (as exec'd)
        env = {"PATH": os.environ["PATH"], protocol.CONFIG: str(tmp_path / "missing.yaml")}
        started = time.perf_counter()
        bad = template.fork(WORKER, env, tmp_path / "cwd", tmp_path / "bad.log")
        forked_in = time.perf_counter() - started
        assert bad.wait(timeout=30) == 2
        assert f"config file {tmp_path / 'missing.yaml'} does not exist" in (tmp_path / "bad.log").read_text()

        sb = standby(template, tmp_path, "sb-1")
        wait_for(lambda: "standby for standby/sb-1: warm" in text(tmp_path / "sb-1.log"), 60,
                   "the standby to say it is warm (its env is the one it was given)")
        assert sb.poll() is None
        if os.geteuid() == 0:  # (CI): the template and the standby's warm-up yield to training on the host
            assert os.sched_getscheduler(template.proc.pid) == os.SCHED_IDLE
            assert os.sched_getscheduler(sb.pid) == os.SCHED_IDLE
        assert os.getpgid(sb.pid) == sb.pid, "a process group of its own"
        assert os.getsid(sb.pid) == os.getsid(template.proc.pid), "in the node's session"
        assert os.readlink(f"/proc/{sb.pid}/cwd") == str(tmp_path / "cwd")
        assert " ".join(process_argv(sb.pid)).startswith(" ".join(WORKER + ["--standby"])), process_argv(sb.pid)
        os.kill(sb.pid, signal.SIGKILL)
        assert sb.wait(timeout=10) == -signal.SIGKILL
        print(f"\nfork answered in {forked_in * 1e3:.1f} ms")
    finally:
        template.close()
    assert template.proc is None


def test_a_dead_template_leaves_its_workers_watched_and_the_next_fork_starts_another(tmp_path):
    (tmp_path / "cwd").mkdir()
    template = ready_template(tmp_path)
    try:
        sb = standby(template, tmp_path, "sb-2")
        first = template.proc
        os.kill(first.pid, signal.SIGKILL)
        wait_for(lambda: getattr(first, "drained", False), 10, "the agent to see the template gone")
        assert sb.poll() is None, "its worker runs on without it"
        os.kill(sb.pid, signal.SIGKILL)
        assert sb.wait(timeout=10) == -signal.SIGKILL  # (reaped by init: the code is SIGKILL's, said so)

        with pytest.raises(TemplateUnavailable, match="starting"):
            standby(template, tmp_path, "sb-3")
        assert template.starts == 2 and template.proc is not first
        wait_for(lambda: template.ready, 120, "the new template to import torch")
        again = standby(template, tmp_path, "sb-4")
        assert again.poll() is None
        os.kill(again.pid, signal.SIGTERM)
        assert again.wait(timeout=10) == -signal.SIGTERM
    finally:
        template.close()


def test_an_activated_standby_runs_at_the_priority_its_template_had_before_it_lowered_it(tmp_path):
    from datetime import timedelta

    from distributed import _free_port

    (tmp_path / "cwd").mkdir()
    port = _free_port()
    server = protocol.serve_store("127.0.0.1", port, timedelta(seconds=30))  # noqa: F841 - serves while alive
    template = ready_template(tmp_path)
    try:
        env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", protocol.STANDBY_ID: "sb-5",
               protocol.STORE_ADDR: f"127.0.0.1:{port}", protocol.CLUSTER_TOKEN: "t"}
        sb = template.fork(WORKER + ["--standby"], env, tmp_path / "cwd", tmp_path / "sb-5.log")
        wait_for(lambda: "standby for standby/sb-5: warm" in text(tmp_path / "sb-5.log"), 60, "the standby warm")
        rank_env = {"RANK": "3", "WORLD_SIZE": "4", protocol.CONFIG: str(tmp_path / "missing.yaml")}
        store = protocol.connect_store(f"127.0.0.1:{port}", "t", timedelta(seconds=10))
        store.set(protocol.standby_key("sb-5"), protocol.standby_assignment("t", "sb-5", rank_env,
                                                                                str(tmp_path / "rank3.log")))
        assert sb.wait(timeout=60) == 2  # it became rank 3, whose config does not exist
        assert f"warm standby activated as rank 3 (scheduling policy {os.sched_getscheduler(0)})" in \
            text(tmp_path / "rank3.log")
    finally:
        template.close()

"""`phalanx train --nproc N` forks its ranks from one worker template (`train/forked.py`): the ranks are the
template's children and run `python -m phalanx.worker`, their output reaches the launcher's stdout and stderr,
a rank that dies is reported with its code and the others are stopped, and `PHALANX_LAUNCH_FORK=0` (or a
template that cannot start) execs each rank as before. A template the caller keeps (`launch(..., template=)`)
serves many launches and stays open.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import tiny_config
from phalanx.train.config import dump_config
from phalanx.train.forked import Template
from phalanx.train.launch import launch
from phalanx.train.metrics import read_metrics


def _processes() -> dict[int, tuple[int, str]]:
    """pid → (parent pid, command line) of every process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry)] = (ppid, cmdline)
    return found


class Census(threading.Thread):
    """Watches, every 50 ms, the templates started under `root` (a pid) from now on (not one already running: the
    session's, `conftest.run_training`'s) and the workers each forked."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root, self.done = root, threading.Event()
        self.earlier = {pid for pid, (_, cmd) in _processes().items() if "phalanx.zygote --for-launcher" in cmd}
        self.templates: set[int] = set()
        self.workers: dict[int, tuple[int, str]] = {}  # pid → (its parent, its command line)

    def run(self) -> None:
        while not self.done.wait(0.05):
            procs = _processes()
            for pid, (ppid, cmd) in procs.items():
                if "phalanx.zygote --for-launcher" in cmd and ppid == self.root and pid not in self.earlier:
                    self.templates.add(pid)
                if "-m phalanx.worker" in cmd:
                    self.workers[pid] = (ppid, cmd)

    def stop(self) -> None:
        self.done.set()
        self.join()


def test_the_ranks_are_forked_from_one_template_and_speak_on_the_launchers_stdout(tmp_path, demo_data):
    config = tiny_config(tmp_path / "run", demo_data, training={"max_steps": 6, "log_interval": 1})
    recipe = tmp_path / "run.yaml"
    recipe.write_text(yaml.safe_dump(dump_config(config)))
    proc = subprocess.Popen([sys.executable, "-m", "phalanx.cli", "train", str(recipe), "--nproc", "2"],
                            cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    census = Census(proc.pid)
    census.start()
    out, err = proc.communicate(timeout=300)
    census.stop()
    assert proc.returncode == 0, out + err
    assert len(census.templates) == 1, (census.templates, out, err)
    template = next(iter(census.templates))
    forked = [pid for pid, (ppid, _) in census.workers.items() if ppid == template]
    execd = [pid for pid, (ppid, _) in census.workers.items() if ppid == proc.pid]
    assert len(forked) == 2 and not execd, (census.workers, template)
    assert all(census.workers[pid][1].endswith("-m phalanx.worker") for pid in forked), census.workers
    assert "finished step=6" in out and "Traceback" not in err, out + err  # rank 0 prints on the launcher's stdout
    assert [s["step"] for s in read_metrics(config.run_dir)[0]] == [1, 2, 3, 4, 5, 6]
    assert not any(pid in _processes() for pid in (template, *forked)), "everything it started has ended"


def test_a_template_the_caller_keeps_serves_many_launches_and_stays_open(tmp_path, demo_data):
    template = Template.start()
    census = Census(os.getpid())
    census.start()
    try:
        for run in ("a", "b"):
            code = launch(tiny_config(tmp_path / run, demo_data, training={"max_steps": 2}), 2, threads_per_worker=1,
                          template=template)
            assert code == 0 and template.proc.poll() is None, "the caller's template is the caller's to close"
            assert [s["step"] for s in read_metrics(tmp_path / run)[0]] == [1, 2]
        census.stop()
        forked = [pid for pid, (ppid, _) in census.workers.items() if ppid == template.proc.pid]
        execd = [pid for pid, (ppid, _) in census.workers.items() if ppid == os.getpid()]
        assert len(forked) == 4 and not execd, (census.workers, template.proc.pid)
        assert not census.templates, "no launch started a template of its own"
        assert all(template.exit_code(pid) == 0 for pid in forked), template.exits
    finally:
        census.stop()
        template.close()
    assert template.proc.returncode is not None


def test_without_the_template_every_rank_is_execd(tmp_path, demo_data, monkeypatch):
    monkeypatch.setenv("PHALANX_LAUNCH_FORK", "0")
    census = Census(os.getpid())
    census.start()
    code = launch(tiny_config(tmp_path / "run", demo_data, training={"max_steps": 3}), 2, threads_per_worker=1)
    census.stop()
    assert code == 0
    execd = [pid for pid, (ppid, _) in census.workers.items() if ppid == os.getpid()]
    assert not census.templates and len(execd) == 2, (census.templates, census.workers)


def test_a_forked_rank_killed_stops_the_others_and_gives_its_code(tmp_path, demo_data):
    config = tiny_config(tmp_path / "run", demo_data, training={"max_steps": 10_000, "log_interval": 1},
                         checkpoint={"interval": 0})
    census = Census(os.getpid())
    census.start()
    result = {}
    launcher = threading.Thread(target=lambda: result.update(code=launch(config, 2, threads_per_worker=1)))
    launcher.start()
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(config.run_dir)[0]) < 2:  # both ranks are training
            assert time.monotonic() < deadline and launcher.is_alive(), "training did not start"
            time.sleep(0.1)
        assert len(census.templates) == 1, census.templates
        template = next(iter(census.templates))
        ranks = {pid: cmd for pid, (ppid, cmd) in census.workers.items() if ppid == template}
        assert len(ranks) == 2, census.workers
        victim = max(ranks)  # (either: the other one is stopped)
        os.kill(victim, signal.SIGKILL)
        launcher.join(timeout=60)
    finally:  # (a run of 10,000 steps left behind would slow every test after this one)
        census.stop()
        for pid, (ppid, _) in census.workers.items():
            if ppid in census.templates:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert not launcher.is_alive()
    assert result["code"] == 128 + signal.SIGKILL, result
    assert not any(pid in _processes() for pid in (template, *ranks)), "the other rank and the template ended"


def test_the_template_reports_how_a_worker_ended_and_one_it_never_saw_end_counts_as_killed(tmp_path):
    template = Template.start()
    try:
        env = {**os.environ, "PHALANX_CONFIG": str(tmp_path / "missing.yaml"), "RANK": "0", "WORLD_SIZE": "1"}
        refused = template.fork([sys.executable, "-m", "phalanx.worker"], env, str(tmp_path))
        assert refused.wait(timeout=60) != 0  # a config that is not there: the worker refuses and exits
        assert refused.poll() == refused.returncode
        assert refused.pid not in _processes()
    finally:
        template.close()
    assert template.proc.returncode is not None
    # its template gone, a worker that is gone too ended unseen: counted as killed, not as running forever
    assert template.exit_code(2**22 + 1) == -signal.SIGKILL


def test_a_fork_the_template_does_not_answer_in_time_is_given_up_and_killed_if_it_comes_late(tmp_path, monkeypatch):
    """The launcher execs a rank whose fork went unanswered (`FORK_TIMEOUT_S`); the template gets no more requests,
    and a late answer's worker is killed, so the rank never runs twice."""
    import phalanx.train.forked as forked

    template = Template.start()
    try:
        monkeypatch.setattr(forked, "FORK_TIMEOUT_S", 0.0)  # (the answer comes after the launcher stopped waiting)
        env = {**os.environ, "PHALANX_CONFIG": str(tmp_path / "missing.yaml"), "RANK": "0", "WORLD_SIZE": "1"}
        with pytest.raises(forked.TemplateError, match="did not answer"):
            template.fork([sys.executable, "-m", "phalanx.worker"], env, str(tmp_path))
        with template.cond:  # the late answer: its worker killed as soon as it is read
            assert template.cond.wait_for(lambda: len(template.exits) == 1, 30), template.exits
            (code,) = template.exits.values()
        assert code == -signal.SIGKILL
        with pytest.raises(forked.TemplateError, match="stopped answering"):  # the rest of the ranks are exec'd
            template.fork([sys.executable, "-m", "phalanx.worker"], env, str(tmp_path))
    finally:
        template.close()

"""The agent's side of the node's worker template (`python -m phalanx.zygote`, see there): start it, ask it to
fork a worker, learn how each forked worker ends.

`WorkerTemplate.start()` launches the template as the agent's child (same session: killing the node kills it; its
stderr goes to WORK_DIR/template.log). Until it says it is ready (torch imported) `fork()` raises
`TemplateUnavailable`. A worker due while the template is importing waits for it (the supervisor, at most WAIT_S;
`hurry()` lifts the template's SCHED_IDLE meanwhile): an exec'd worker would import torch beside it, two imports
per node at once, and on a host of several nodes both finish later than the template alone (in a test here five
nodes' templates alone imported in 6.5-7 s; beside them, exec'd workers took 9.5 s to start training). A template
that is gone, or not ready after WAIT_S, and a command the template cannot run: the worker is exec'd. A forked
worker is a child of the template, not of the agent, so the agent holds a `ForkedProcess`: the Popen calls the
supervisor uses (pid, poll, wait, returncode), fed by the template's exit reports. If the template dies, its
workers that are still running are still watched (through /proc); one that is gone without a report counts as
killed (SIGKILL), and the next `fork()` starts a new template (at most `MAX_STARTS` in the agent's life).

Standard library only (and `phalanx.zygote`'s constants). Must not know: torch, scheduling policy.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from phalanx.control.agent.slurm_allocation import ignoring_usr2
# (zygote's module level is the standard library: torch loads only in `preload`)
from phalanx.zygote import FORKABLE, ForkedChild, running

log = logging.getLogger("phalanx.agent.template")

TEMPLATE_MODULE = "phalanx.zygote"
FORK_TIMEOUT_S = 5.0
MAX_STARTS = 3
WAIT_S = 20.0  # how long a worker due while the template imports waits for it before it is exec'd


class TemplateUnavailable(Exception):
    """The template cannot fork this worker now (not ready, gone, or the command is not a worker's)."""


def on_this_host(argv: list[str]) -> list[str]:
    """Phalanx's own worker (`<python> -m phalanx.worker`) is run by this agent's interpreter: the controller
    names the one it runs under, a path another host may not have. Any other command is run as given."""
    if len(argv) >= 3 and argv[1] == "-m" and argv[2] in FORKABLE:
        return [sys.executable, *argv[1:]]
    return argv


def forkable(argv: list[str]) -> bool:
    """A training worker this interpreter would run (`python -m phalanx.worker ...`): the template runs it."""
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] in FORKABLE and \
        os.path.realpath(argv[0]) == os.path.realpath(sys.executable)


class ForkedProcess(ForkedChild):
    """A worker forked by the template: what the supervisor calls on a `subprocess.Popen`."""

    def __init__(self, template: "WorkerTemplate", source: subprocess.Popen, pid: int):
        self.template = template
        self.source = source  # the template process that forked it (the one that reports its exit)
        self.pid = pid
        self.args = ["(forked from the worker template)"]

    def _exit_code(self) -> int | None:
        return self.template.exit_code(self.source, self.pid)


class WorkerTemplate:
    def __init__(self, node: str, work_dir: Path):
        self.node = node
        self.work_dir = work_dir
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.starts = 0
        self.closed = False  # the agent is exiting: no new template
        self.lock = threading.Lock()  # one start, one request at a time on the pipe
        self.cond = threading.Condition()
        self.replies: dict[int, dict] = {}
        self.exits: dict[int, int] = {}
        self._seq = 0

    # ---- life -------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self.lock:
            if self.closed or self.starts >= MAX_STARTS or (self.proc is not None and self.proc.poll() is None):
                return
            self.starts += 1
            self.ready = False
            with open(self.work_dir / "template.log", "ab") as err:
                argv = ignoring_usr2([sys.executable, "-m", TEMPLATE_MODULE, "--for-node", self.node])
                self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                             cwd=self.work_dir, bufsize=0)
            threading.Thread(target=self._read, args=(self.proc,), name="template", daemon=True).start()
            log.info("worker template started (pid %d): torch imported once, workers forked from it", self.proc.pid)

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                log.warning("worker template said something unreadable: %r", line[:200])
                continue
            with self.cond:
                if "exited" in msg:
                    self.exits[msg["exited"]] = msg["code"]
                elif "ready" in msg:
                    self.ready = True
                    log.info("worker template ready (pid %d, imports took %.2f s%s)", msg["pid"], msg["import_s"],
                             ", under SCHED_IDLE" if msg.get("idle") else "")
                elif "id" in msg:
                    self.replies[msg["id"]] = msg
                self.cond.notify_all()
        code = proc.wait()
        with self.cond:
            proc.drained = True  # every exit it reported is in `exits`
            if proc is self.proc:
                self.ready = False
            self.cond.notify_all()
        if not getattr(proc, "closing", False):
            log.warning("worker template (pid %d) ended (code %s); its running workers are watched through /proc, "
                        "the next worker starts a new template", proc.pid, code)

    def close(self) -> None:
        """The agent is exiting: end the template (its stdin closes; SIGKILL after 2 s). One still importing torch
        reads its stdin only once the import is done, and has forked nothing yet: it is killed at once."""
        with self.lock:
            proc, self.proc, self.closed = self.proc, None, True
        if proc is None:
            return
        proc.closing = True
        with self.cond:
            importing = not self.ready
        if not importing:
            try:
                proc.stdin.close()
                proc.wait(timeout=2.0)
                return
            except (OSError, subprocess.TimeoutExpired):
                pass
        proc.kill()
        proc.wait()
        proc.stdin.close()

    def coming(self) -> bool:
        """Not ready, but importing (or to be started again): a warm standby can wait for it rather than import
        torch a second time in a process of its own."""
        alive = self.proc is not None and self.proc.poll() is None
        return not self.ready and not self.closed and (alive or self.starts < MAX_STARTS)

    def importing(self) -> bool:
        """Started and alive, not ready yet: a worker forked from it soon starts sooner than one exec'd now."""
        proc = self.proc
        return not self.ready and not self.closed and proc is not None and proc.poll() is None

    def hurry(self) -> None:
        """A worker waits for this template: its import no longer yields to the host's other work (every thread
        back to the agent's own scheduling policy; the template yields again once ready, see `phalanx.zygote`).
        Where this is not allowed it stays as it is: the wait is bounded (WAIT_S)."""
        proc = self.proc
        if proc is None or self.ready:
            return
        policy = os.sched_getscheduler(0)
        try:
            for tid in os.listdir(f"/proc/{proc.pid}/task"):
                if os.sched_getscheduler(int(tid)) != policy:
                    os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except OSError as err:  # (gone, or not permitted: the wait is bounded either way)
            log.debug("could not lift the worker template's SCHED_IDLE: %s", err)

    # ---- forking ----------------------------------------------------------------------------------------
    def fork(self, argv: list[str], env: dict[str, str], cwd: str | Path, log_path: Path) -> ForkedProcess:
        """Fork a worker running `argv` (which must be `forkable`) with exactly `env`, in `cwd`, output appended
        to `log_path`. Raises TemplateUnavailable when the template cannot (the caller execs it instead)."""
        if not forkable(argv):
            raise TemplateUnavailable(f"not a training worker command: {' '.join(argv[:3])}")
        proc = self.proc
        if proc is None or proc.poll() is not None:
            self.start()  # (a template that died; none before the node's bring-up started one)
            raise TemplateUnavailable("the worker template is starting")
        if not self.ready:
            raise TemplateUnavailable("the worker template is still importing torch")
        with self.lock:
            self._seq += 1
            rid = self._seq
            request = {"id": rid, "argv": list(argv), "env": dict(env), "cwd": str(cwd), "log": str(log_path)}
            try:
                proc.stdin.write((json.dumps(request) + "\n").encode())
            except (OSError, ValueError) as err:
                raise TemplateUnavailable(f"the worker template is gone ({err})") from None
            deadline = time.monotonic() + FORK_TIMEOUT_S
            with self.cond:
                while rid not in self.replies:
                    left = deadline - time.monotonic()
                    if left <= 0 or getattr(proc, "drained", False):
                        raise TemplateUnavailable("the worker template did not answer")
                    self.cond.wait(left)
                reply = self.replies.pop(rid)
                if "error" in reply:
                    raise TemplateUnavailable(reply["error"])
        return ForkedProcess(self, proc, reply["pid"])

    def exit_code(self, source: subprocess.Popen, pid: int) -> int | None:
        """How the worker `pid` forked by `source` ended, None while it runs."""
        with self.cond:
            if pid in self.exits:
                return self.exits.pop(pid)
            if not getattr(source, "drained", False) or running(pid):
                return None  # its template will report its exit (or, gone, it still runs)
        return -signal.SIGKILL  # its template died before it, and it is gone: nobody saw how it ended

    def is_template(self, pid: int) -> bool:
        return self.proc is not None and self.proc.pid == pid

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

An agent forked from its local cluster's host template (`python -m phalanx.zygote --for-host`: torch and the
training code imported already) forks its first template from itself instead (`fork_now`, `fork_template`),
while it has no thread: no import at all, ready at once. The local backend holds its host template through this
same class (`host=True`): it forks agents, each in a session of its own.

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
import traceback
from pathlib import Path

from phalanx.control.agent.slurm_allocation import ignoring_usr2
# (zygote's module level is the standard library: torch loads only in `preload`)
from phalanx import zygote
from phalanx.zygote import AGENT_MODULE, FORKABLE, ForkedChild, running

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


def forkable(argv: list[str], modules: tuple[str, ...] = FORKABLE) -> bool:
    """A training worker this interpreter would run (`python -m phalanx.worker ...`): the template runs it."""
    return len(argv) >= 3 and argv[1] == "-m" and argv[2] in modules and \
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


class AdoptedTemplate(ForkedChild):
    """A worker template this agent forked from itself (`fork_template`): what `WorkerTemplate` calls on the
    `subprocess.Popen` of one it started (pid, stdin, stdout, poll, wait, kill)."""

    def __init__(self, pid: int, stdin, stdout):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.args = ["(forked from the agent)"]
        self._status: int | None = None
        self._lock = threading.Lock()  # (the reader thread and close() both wait for it: one reaps it)

    def _exit_code(self) -> int | None:
        with self._lock:
            if self._status is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # (not this process's child any more: how it ended is unknown)
                    self._status = -signal.SIGKILL
                else:
                    if pid:
                        self._status = os.waitstatus_to_exitcode(status)
            return self._status

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def fork_template(node: str, work_dir: Path) -> AdoptedTemplate:
    """Fork the node's worker template from this process: an agent forked from a host template (the imports
    done), before it starts any thread. The child serves like `python -m phalanx.zygote --for-node NODE` (and is
    named so in `ps`): stdin and stdout are pipes to this agent, stderr WORK_DIR/template.log."""
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(to_r, 0)
            os.dup2(from_w, 1)
            for fd in (to_r, to_w, from_r, from_w):
                os.close(fd)
            err = os.open(work_dir / "template.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(err, 2)
            os.close(err)
            argv = [sys.executable, "-m", TEMPLATE_MODULE, "--for-node", node]
            try:
                import setproctitle

                setproctitle.setproctitle(" ".join(argv))
            except ImportError:  # pragma: no cover - a dependency
                pass
            sys.argv = [argv[0], *argv[3:]]
            zygote.serve()
        except BaseException:  # noqa: BLE001 - into template.log; the agent sees the template gone
            traceback.print_exc()
        os._exit(127)
    os.close(to_r)
    os.close(from_w)
    return AdoptedTemplate(pid, os.fdopen(to_w, "wb", buffering=0), os.fdopen(from_r, "rb"))


class WorkerTemplate:
    def __init__(self, node: str, work_dir: Path, *, fork_now: bool = False, host: bool = False):
        """`fork_now`: fork the template from this process now (see `fork_template`), when it is safe: this
        process has the imports and runs no other thread; otherwise `start()` launches one as usual. `host`: a
        local cluster's host template (`node` names the cluster's dir), which forks agents."""
        self.node = node
        self.work_dir = work_dir
        self.host = host
        self.modules = (AGENT_MODULE,) if host else FORKABLE
        self.label = "agent template" if host else "worker template"
        self.adopted = fork_template(node, work_dir) if (
            fork_now and not host and zygote.preloaded() and threading.active_count() == 1) else None
        self.proc: subprocess.Popen | AdoptedTemplate | None = None
        self.ready = False
        self.starts = 0
        self.closed = False  # the agent is exiting: no new template
        self.lock = threading.Lock()  # one start, one request at a time on the pipe
        self.cond = threading.Condition()
        self.replies: dict[int, dict] = {}
        self.exits: dict[int, int] = {}
        self.unseen: set[int] = set()  # forked processes that ended after their template: no report of how
        self._seq = 0

    # ---- life -------------------------------------------------------------------------------------------
    def start(self) -> None:
        with self.lock:
            adopted, self.adopted = self.adopted, None
            if adopted is not None and (self.closed or adopted.poll() is not None):
                adopted.stdin.close()  # (gone already, or not wanted: one started below, or none)
                adopted.kill()
                adopted = None
            if self.closed or self.starts >= MAX_STARTS or (self.proc is not None and self.proc.poll() is None):
                return
            self.starts += 1
            self.ready = False
            if adopted is not None:
                self.proc = adopted
                how = "forked from this agent, whose host template imported torch"
            else:
                log_name, mode = ("agent-template.log", "--for-host") if self.host else ("template.log", "--for-node")
                with open(self.work_dir / log_name, "ab") as err:
                    argv = ignoring_usr2([sys.executable, "-m", TEMPLATE_MODULE, mode, self.node])
                    self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                                 cwd=self.work_dir, bufsize=0)
                how = "torch imported once"
            threading.Thread(target=self._read, args=(self.proc,), name="template", daemon=True).start()
            log.info("%s started (pid %d): %s, %s forked from it", self.label, self.proc.pid, how,
                     "agents" if self.host else "workers")

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                log.warning("%s said something unreadable: %r", self.label, line[:200])
                continue
            with self.cond:
                if "exited" in msg:
                    self.exits[msg["exited"]] = msg["code"]
                elif "ready" in msg:
                    self.ready = True
                    log.info("%s ready (pid %d, imports took %.2f s%s)", self.label, msg["pid"], msg["import_s"],
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
            log.warning("%s (pid %d) ended (code %s); what it forked and still runs is watched through /proc, "
                        "the next fork starts a new template", self.label, proc.pid, code)

    def close(self) -> None:
        """The agent is exiting: end the template (its stdin closes; SIGKILL after 2 s). One still importing torch
        reads its stdin only once the import is done, and has forked nothing yet: it is killed at once, as is one
        forked from this agent and never started (its node never became healthy)."""
        with self.lock:
            proc, self.proc, self.closed = self.proc or self.adopted, None, True
            self.adopted = None
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

    def wait_ready(self, timeout: float) -> bool:
        """Start the template if it is not running, and wait until it is ready (at most `timeout` s), hurrying
        it meanwhile (`hurry`: the caller waits for it)."""
        self.start()
        deadline = time.monotonic() + timeout
        while True:
            self.hurry()  # (again each time: one that had not lowered itself yet)
            with self.cond:
                proc, left = self.proc, deadline - time.monotonic()
                if self.ready:
                    return True
                if proc is None or getattr(proc, "drained", False) or left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))

    # ---- forking ----------------------------------------------------------------------------------------
    def fork(self, argv: list[str], env: dict[str, str], cwd: str | Path, log_path: Path,
             **extra) -> ForkedProcess:
        """Fork a worker running `argv` (which must be `forkable`) with exactly `env`, in `cwd`, output appended
        to `log_path` (`extra`: more fields of the request, see `phalanx.zygote`). Raises TemplateUnavailable when
        the template cannot (the caller execs it instead)."""
        if not forkable(argv, self.modules):
            what = "an agent" if self.host else "a training worker"
            raise TemplateUnavailable(f"not {what} command: {' '.join(argv[:3])}")
        proc = self.proc
        if proc is None or proc.poll() is not None:
            self.start()  # (a template that died; none before the node's bring-up started one)
            raise TemplateUnavailable("the worker template is starting")
        if not self.ready:
            raise TemplateUnavailable("the worker template is still importing torch")
        with self.lock:
            self._seq += 1
            rid = self._seq
            request = {"id": rid, "argv": list(argv), "env": dict(env), "cwd": str(cwd), "log": str(log_path),
                       **extra}
            try:
                proc.stdin.write((json.dumps(request) + "\n").encode())
            except (OSError, ValueError) as err:
                raise TemplateUnavailable(f"the {self.label} is gone ({err})") from None
            deadline = time.monotonic() + FORK_TIMEOUT_S
            with self.cond:
                while rid not in self.replies:
                    left = deadline - time.monotonic()
                    if left <= 0 or getattr(proc, "drained", False):
                        raise TemplateUnavailable(f"the {self.label} did not answer")
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
            self.unseen.add(pid)
        return -signal.SIGKILL  # its template died before it, and it is gone: nobody saw how it ended

    def is_template(self, pid: int) -> bool:
        return self.proc is not None and self.proc.pid == pid

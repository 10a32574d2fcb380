"""`phalanx train --nproc N`'s workers forked from one worker template (`python -m phalanx.zygote
--for-launcher`): torch and the training code are imported once for the N ranks, not once per rank. Where ranks
outnumber cores the N imports queued for the CPU (4 ranks on 2 cores: ~7 s before the first step, ~3.5 s forked);
the forked ranks also share the imported pages. Used for CPU ranks on Linux; ranks on GPUs are exec'd (whether
CUDA is safe in a child forked after these imports is not tested on a GPU yet).

`Template.start()` starts it and waits until it is ready; `fork()` returns a `ForkedWorker`, which answers what
the launcher asks of a `subprocess.Popen` (pid, poll, wait, send_signal, kill, returncode). A forked worker is the
template's child: its exit code comes in the template's report. A template that does not start, or a fork it
refuses, raises `TemplateError`, and the launcher starts that worker with a plain exec instead (`launch.py`).

Must not know: what a worker does inside, the control plane (a node agent's template is driven by
`control/agent/template.py`, for a node's many workers over its life; this one forks one set and watches it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

from phalanx.zygote import ForkedChild, running  # (its module level is the standard library)

READY_TIMEOUT_S = 120.0  # the template's imports (a cold page cache on a network filesystem can take a while)
FORK_TIMEOUT_S = 10.0
REPORT_WAIT_S = 1.0  # a worker seen gone: how long its template's report of how it ended may take


class TemplateError(Exception):
    """The template cannot fork this worker (it did not start, it died, or it refused the request)."""


class Template:
    def __init__(self, proc: subprocess.Popen, stdout_fd: int):
        self.proc, self.stdout_fd = proc, stdout_fd
        self.cond = threading.Condition()
        self.ready = False
        self.drained = False  # its output ended: every exit it reported is in `exits`
        self.closed = False
        self.broken = False  # a fork went unanswered: no more requests (the launcher execs the rest)
        self.abandoned: set[int] = set()  # requests given up on
        self.replies: dict[int, dict] = {}
        self.exits: dict[int, int] = {}
        self._seq = 0
        threading.Thread(target=self._read, name="worker-template", daemon=True).start()

    @classmethod
    def spawn(cls) -> "Template":
        """Start the template; it imports torch meanwhile (`wait_ready`). Raises TemplateError."""
        out = os.dup(1)  # the launcher's stdout, for the workers (the template's own stdout answers the launcher)
        try:
            proc = subprocess.Popen([sys.executable, "-m", "phalanx.zygote", "--for-launcher"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, pass_fds=(out,), bufsize=0,
                                    start_new_session=True)  # (a terminal's Ctrl-C goes to the launcher, which stops
            #                                                   the workers; the template exits with its stdin)
        except OSError as err:
            os.close(out)
            raise TemplateError(f"could not start the worker template: {err}") from None
        return cls(proc, out)

    @classmethod
    def start(cls, timeout_s: float = READY_TIMEOUT_S) -> "Template":
        """A template that has imported torch (`spawn` + `wait_ready`)."""
        template = cls.spawn()
        template.wait_ready(timeout_s)
        return template

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the template has imported torch. Raises TemplateError if it is not ready in `timeout_s` or has
        exited (it is ended then)."""
        with self.cond:
            self.cond.wait_for(lambda: self.ready or self.drained, timeout_s)
            ready = self.ready
        if not ready:
            self.close()
            raise TemplateError(f"the worker template was not ready within {timeout_s:g} s"
                                if self.proc.returncode is None else
                                f"the worker template exited with {self.proc.returncode}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self.cond:
                if "exited" in msg:
                    self.exits[msg["exited"]] = msg["code"]
                elif "ready" in msg:
                    self.ready = True
                elif "id" in msg and msg["id"] in self.abandoned:
                    if "pid" in msg:  # forked after the launcher gave up on it and exec'd the rank
                        try:
                            os.kill(msg["pid"], signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                elif "id" in msg:
                    self.replies[msg["id"]] = msg
                    # a template kept for many launches may fork a pid again: an earlier worker's report (sent
                    # when it was reaped, so before this reply) is not this one's
                    self.exits.pop(msg.get("pid"), None)
                self.cond.notify_all()
        with self.cond:
            self.drained = True
            self.cond.notify_all()

    def fork(self, argv: list[str], env: dict[str, str], cwd: str) -> "ForkedWorker":
        """A worker running `argv` (`python -m phalanx.worker`) with exactly `env`, in `cwd`, its stdout the
        launcher's."""
        with self.cond:
            if self.broken:
                raise TemplateError("the worker template stopped answering")
            self._seq += 1
            rid = self._seq
        request = {"id": rid, "argv": list(argv), "env": dict(env), "cwd": cwd, "stdout_fd": self.stdout_fd}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
        except (OSError, ValueError) as err:
            raise TemplateError(f"the worker template is gone ({err})") from None
        with self.cond:
            self.cond.wait_for(lambda: rid in self.replies or self.drained, FORK_TIMEOUT_S)
            reply = self.replies.pop(rid, None)
            if reply is None:  # the launcher execs this rank: a late fork of it is killed (`_read`), none follows
                self.abandoned.add(rid)
                self.broken = True
        if reply is None:
            raise TemplateError(f"the worker template did not answer within {FORK_TIMEOUT_S:g} s")
        if "error" in reply:
            raise TemplateError(reply["error"])
        return ForkedWorker(self, reply["pid"], argv)

    def exit_code(self, pid: int, wait_s: float = 0.0) -> int | None:
        """How the forked worker `pid` ended, None while it runs. One that is gone gets `wait_s` for the report."""
        with self.cond:
            if pid in self.exits:
                return self.exits[pid]
            if running(pid):
                return None
            self.cond.wait_for(lambda: pid in self.exits or self.drained, wait_s)
            if pid in self.exits:
                return self.exits[pid]
            # gone, and its template ended without a word about it (killed): nobody saw how it ended
            return -signal.SIGKILL if self.drained and not running(pid) else None

    def close(self) -> None:
        """End the template: its stdin closes, and it exits (SIGKILL after 2 s; at once while it imports, when it
        reads nothing and has forked nothing). Forked workers are not its to stop."""
        with self.cond:
            ready, closed, self.closed = self.ready, self.closed, True
        if closed:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=2.0 if ready else 0.0)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        try:
            os.close(self.stdout_fd)
        except OSError:
            pass


class ForkedWorker(ForkedChild):
    """A worker forked by the template: what the launcher calls on a `subprocess.Popen`."""

    def __init__(self, template: Template, pid: int, argv: list[str]):
        self.template, self.pid, self.args = template, pid, argv

    def _exit_code(self) -> int | None:
        return self.template.exit_code(self.pid, REPORT_WAIT_S)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

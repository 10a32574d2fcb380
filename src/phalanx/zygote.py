"""A node's worker template, `python -m phalanx.zygote --for-node NAME`: one process per node, started by its
agent, that imports torch and the training code once and then forks every worker (and warm standby) the agent
asks for. A forked worker skips the interpreter start and the imports (3.4 s of CPU on the CI box), which is
what a cold replacement, a restarted generation and a standby refill used to spend before their first step.
`python -m phalanx.zygote --for-launcher` is the same for `phalanx train --nproc N` (`train/forked.py`): one
import for the N ranks, and no yielding (`lower_priority`): the ranks it forks are all there is to run.
`python -m phalanx.zygote --for-host CLUSTER_DIR` is the local backend's: every node of a local cluster is on this
machine, so one process imports torch, the training code and the agent, and forks each node's *agent* (a session
of its own: the node), which at once forks its node's worker template from itself, before it starts a thread
(`control/agent/template.py`): one import per local cluster instead of one per node (4.5-7 s of CPU each here).

The agent speaks JSON lines on the template's stdin and stdout (`control/agent/template.py` is the other
side):

    → {"id": N, "argv": [python, "-m", "phalanx.worker", ...], "env": {...}, "cwd": DIR, "log": FILE}
      (or "stdout_fd": FD instead of "log": the worker's stdout is the template's inherited descriptor FD and its
      stderr the template's own, as a plain child of the launcher would have them)
    ← {"ready": true, "pid": P, "import_s": S, "idle": B}  once, when the imports are done (B: under SCHED_IDLE)
    ← {"id": N, "pid": P} | {"id": N, "error": "..."}  the answer to each request
    ← {"exited": P, "code": C}                         a forked worker ended (C as Popen.returncode)

A request with `"session": true` (an agent) makes the child a session leader and may name its `"umask"`.
The child becomes what a fresh `python -m phalanx.worker` would be: its own process group, stdin from
/dev/null, stdout and stderr appended to FILE, the working directory and the environment it was given (the
template's own environment is dropped whole), its command line in `ps` (setproctitle) — then it runs
`phalanx.worker.entry`, which never returns. The template itself runs no torch op and starts no thread of
its own, so forking it is safe; it exits when its stdin closes (its agent is gone). Only modules named in
`FORKABLE` can be forked; anything else the agent starts with a plain exec.

Knows nothing about the controller; imports the worker's code but runs none of it.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import NoReturn

from phalanx.process import exit_without_teardown  # (the standard library only)

FORKABLE = ("phalanx.worker", "phalanx.train.worker")
AGENT_MODULE = "phalanx.control.agent.node_agent"  # what a host template (`--for-host`) forks, and only that
# The template's imports and a warm standby's warm-up are done ahead of need: they yield to training on the same
# host (the local backend's nodes share one machine; on 2 cores a spare's refill importing torch slowed the
# replayed steps of a restart by a fifth) by running under SCHED_IDLE, which any runnable normal thread preempts
# at once (a nicer nice value still took the CPU from workers waking up from every collective). Workers run
# under the base policy again (a forked worker at once, a standby when it is activated) — so it is done only
# where a process may take the base policy back (root with CAP_SYS_NICE, or an RLIMIT_NICE that allows it),
# which is tried first.
BASE_POLICY_ENV = "PHALANX_BASE_SCHED"  # a standby forked under SCHED_IDLE: the policy to take back
_base_policy: int | None = None  # this template's scheduling policy before it yielded (None: it did not)


def restore_priority(policy: int) -> None:
    """Every thread of this process back to scheduling `policy` (Linux keeps it per thread); a refusal is said on
    stderr (the worker's log)."""
    try:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
    except OSError as err:
        print(f"phalanx: could not restore this process's scheduling policy {policy} ({err})", file=sys.stderr,
              flush=True)


def lower_priority() -> int | None:
    """Run under SCHED_IDLE if a child could take the current policy back (tried in a throwaway child). Returns
    the base policy, or None when left as it is."""
    base = os.sched_getscheduler(0)
    if base == os.SCHED_IDLE:
        return None
    pid = os.fork()
    if pid == 0:  # (no thread runs yet: forking here is safe)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, base, os.sched_param(0))
            os._exit(0)
        except OSError:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        return None
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return base


# what a worker imports before its first step (both recovery modes, and rank 0's TensorBoard); torch._dynamo: the
# model's init imports it, through torch._refs (0.75 s of CPU in every worker that imported it after its fork)
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.utils.tensorboard", "phalanx.resilience.run",
           "phalanx.train.trainer", "phalanx.worker")


_preloaded = False
_forks: tuple[str, ...] = FORKABLE  # the modules this template forks (a host template: the agent's)


def preload(extra: tuple[str, ...] = ()) -> None:
    """Import `PRELOAD` (and `extra`)."""
    global _preloaded
    for module in PRELOAD + extra:
        importlib.import_module(module)
    _preloaded = True


def preloaded() -> bool:
    """This process has the imports (it is a template, or was forked from one): forking it skips them."""
    return _preloaded


def _send(message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def _become_worker(request: dict, wakeup: tuple[int, int]) -> None:
    """In the forked child: turn into the worker `request` describes and run it. Never returns."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wakeup:
            os.close(fd)
        if request.get("session"):  # an agent: its session is its node (the local backend kills the session)
            os.setsid()
        else:
            os.setpgid(0, 0)  # a process group of its own: a stop reaches its children (as for a plain exec)
        if request.get("umask") is not None:
            os.umask(request["umask"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if request.get("log"):
            log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
        else:  # the launcher's stdout, passed down; stderr is the template's, the launcher's too
            os.dup2(request["stdout_fd"], 1)
            os.close(request["stdout_fd"])
        argv = request["argv"]
        try:  # (before the environment is replaced: setproctitle may move it)
            import setproctitle

            setproctitle.setproctitle(" ".join(argv))
        except ImportError:  # pragma: no cover - a dependency; without it `ps` shows the template's line
            pass
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if _base_policy is not None:
            if "--standby" in argv:  # warms up under the template's policy; takes the base back when activated
                os.environ[BASE_POLICY_ENV] = str(_base_policy)
            else:
                restore_priority(_base_policy)
        import importlib.util

        sys.argv = [importlib.util.find_spec(argv[2]).origin] + argv[3:]  # as `python -m MODULE args...` leaves it
        if argv[2] == AGENT_MODULE:
            try:
                code = importlib.import_module(AGENT_MODULE).main(argv[3:])
            except SystemExit as done:  # (argparse's refusal)
                code = done.code
            exit_without_teardown(code if isinstance(code, int) else 1)
        from phalanx.worker import entry

        entry()
    except BaseException:  # noqa: BLE001 - whatever went wrong goes to the worker's log, the exit says it failed
        import traceback

        traceback.print_exc()
    os._exit(127)


def serve(*, yielding: bool = True, agents: bool = False) -> NoReturn:  # (it exits when its stdin closes)
    """Answer fork requests on stdin. `agents`: a host template, which forks node agents instead of workers."""
    global _base_policy, _forks
    started = time.perf_counter()
    _base_policy = lower_priority() if yielding else None
    _forks = (AGENT_MODULE,) if agents else FORKABLE
    preload((AGENT_MODULE,) if agents else ())
    idle = _base_policy is not None
    if agents:  # what the agents inherit stays shared with this process: out of the collector's sight
        import gc

        gc.freeze()
        if _base_policy is not None:  # only the import yields: an agent is forked (and runs) at the base policy,
            restore_priority(_base_policy)  # even while a job's workers keep every core busy
            _base_policy = None
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler, so the wakeup fd hears of every exit)
    _send({"ready": True, "pid": os.getpid(), "import_s": round(time.perf_counter() - started, 3),
           "idle": idle})
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        while True:  # reap every child that ended and tell the agent how
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if 0 not in readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # the agent is gone: its workers stay (each in its own process group), as exec'd ones would
            exit_without_teardown(0)  # (not the interpreter's teardown of torch: ~0.9 s here, longer under
            #                            SCHED_IDLE, and the agent's exit waits for it)
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if line.strip():
                _fork(json.loads(line), (wake_r, wake_w))


def _fork(request: dict, wakeup: tuple[int, int]) -> None:
    argv = request.get("argv") or []
    if len(argv) < 3 or argv[1] != "-m" or argv[2] not in _forks:
        _send({"id": request.get("id"), "error": f"not a command this template forks: {argv[:3]}"})
        return
    if not request.get("log") and not isinstance(request.get("stdout_fd"), int):
        _send({"id": request.get("id"), "error": "a request names its output: log (a file) or stdout_fd"})
        return
    if _base_policy is not None and os.sched_getscheduler(0) != os.SCHED_IDLE:
        # the agent hurried this template's import (a worker waited for it): what it forks starts yielding again
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        pid = os.fork()
    except OSError as err:
        _send({"id": request.get("id"), "error": f"fork failed: {err}"})
        return
    if pid == 0:
        _become_worker(request, wakeup)
    _send({"id": request.get("id"), "pid": pid})


# ---- the requester's side: a forked worker as the agent (`control/agent/template.py`) or the launcher
# (`train/forked.py`) holds it ----------------------------------------------------------------------------------
class ForkedChild:
    """A worker this template forked, held by whoever asked for it: what they call on a `subprocess.Popen`
    (pid, args, returncode, poll, wait). `_exit_code()` says how it ended (from the template's reports), None while
    it runs."""

    pid: int
    args: list[str]
    returncode: int | None = None

    def _exit_code(self) -> int | None:  # (each holder's: how it reads its template's reports)
        raise NotImplementedError

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._exit_code()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode


def running(pid: int) -> bool:
    """`pid` is alive and not a zombie (a zombie has ended: its template reaps it and reports how)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def main() -> int:
    if "--for-launcher" in sys.argv[1:]:
        return serve(yielding=False)
    if "--for-host" in sys.argv[1:]:  # (its argument, the cluster's dir, names it in `ps`)
        return serve(agents=True)  # (its import yields: a restarted controller's must not slow a recovery)
    if "--for-node" not in sys.argv[1:]:
        print("usage: python -m phalanx.zygote --for-node NAME | --for-launcher | --for-host CLUSTER_DIR (started "
              "by a node agent, by `phalanx train`, or by a local cluster's controller, which speak to it on "
              "stdin/stdout)", file=sys.stderr)
        return 2
    return serve()


if __name__ == "__main__":  # (run as the importable module, whose state the agents it forks read: `preloaded`)
    from phalanx import zygote

    sys.exit(zygote.main())

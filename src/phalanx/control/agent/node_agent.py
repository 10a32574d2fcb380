"""The node agent: `python -m phalanx.control.agent.node_agent --config WORK_DIR/agent.json`, one per node.

It brings its node up and keeps reporting on it:
  1. heartbeats to the controller every `heartbeat_interval_s`, carrying its phase, the lifecycle script's result
     and the latest health, and holds a link open to it whose end says this process ended (`link.py`);
  2. runs the `on_create` lifecycle script in its work dir (output to lifecycle.log; on failure the tail
     goes into the report and the controller marks the node faulty). An executable script is run as is; a
     non-executable one with the interpreter its `#!` line names (like the kernel would), else /bin/sh;
  3. runs the health checks (`phalanx.control.agent.health`) now and then every `check_interval_s`.

The controller answers each heartbeat with what it wants: keep running, or terminate; the workers this
node must run (job assignments); and injected faults (`fail-health`
makes the next check report a failure, the same path a real failure takes). `WorkerSupervisor`
(`workers.py`) starts and stops the workers, kills hung ones, and every heartbeat reports each worker's
state and exit code; a worker's exit wakes the heartbeat loop, so it reaches the controller at once.

When the controller is unreachable the agent keeps its node — and its workers — as they are and retries,
re-reading the controller's endpoint file (a restarted controller may listen elsewhere). It exits when told to,
when its node is unknown to the controller (deleted), or when its work dir disappears; workers are stopped first.

Must not know: the reconciler's policy, SQLite, torch. Workers get the env from `phalanx.protocol`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from phalanx.control.agent import health
from phalanx.protocol import NODE_HANDLE, PROTOCOL_VERSION, ProtocolMismatch, check_version
from phalanx.protocol.messages import FULL_HEARTBEAT_MAX_S, HeartbeatReply
from phalanx.control.agent.deep_check import DeepCheckRunner
from phalanx.control.agent.link import Link, news, next_wait
from phalanx.control.agent.slurm_allocation import SlurmAllocation, ignoring_usr2
from phalanx.control.agent.join import TOKEN_ENV, act_on, free_ports, join
from phalanx.control.http import ApiError, ControllerUnreachable, KeepAlive
from phalanx.control.state.paths import PRIVATE_UMASK
from phalanx.control.agent.supervisor import WorkerSupervisor
from phalanx.control.agent.template import WorkerTemplate

log = logging.getLogger("phalanx.agent")
TAIL_LINES = 20


def lifecycle_command(script: str) -> list[str]:
    """How to run a lifecycle script: itself when executable; else the interpreter of its `#!` line (split
    like the kernel does: the interpreter and at most one argument), so a non-executable Python script is not
    fed to /bin/sh; else /bin/sh."""
    if os.access(script, os.X_OK):
        return [script]
    try:
        with open(script, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return ["/bin/sh", script]  # the shell reports the problem in lifecycle.log
    if not first.startswith(b"#!"):
        return ["/bin/sh", script]
    interpreter, _, arg = first[2:].decode(errors="replace").strip().replace("\t", " ").partition(" ")
    if not interpreter:
        return ["/bin/sh", script]
    return [interpreter, *([arg.strip()] if arg.strip() else []), script]


def output_tail(path: Path, lines: int = TAIL_LINES, max_chars: int = 4000) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])[-max_chars:]


class Agent:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.slurm = SlurmAllocation(cfg.get("slurm_requeue"))  # the batch host's death, the time limit's warning
        self.name: str = cfg["node"]
        # who the controller knows as this node: the handle it joined with (backend hosts), its backend's, its pid
        self.handle = cfg.get("handle") or os.environ.get(NODE_HANDLE) or str(os.getpid())
        self.work_dir = Path(cfg["work_dir"])
        self.token = Path(cfg["token_file"]).read_text().strip()
        self.endpoint_file = Path(cfg["endpoint_file"]) if cfg.get("endpoint_file") else None
        self.controller_url = cfg.get("controller_url")  # an agent that joined from another host (no endpoint file)
        self.address, self.ifname = cfg.get("address"), cfg.get("ifname")
        self.interval = float(cfg["heartbeat_interval_s"])
        self.stop = threading.Event()
        self.wake_checks = threading.Event()
        self.lock = threading.Lock()
        self.phase = "configuring"  # configuring → health-checking → ready | failed
        self.lifecycle: dict | None = None
        self.health: dict | None = None
        self.injected: list[str] = []
        self.injected_xids: list[int] = []  # `gpu-xid` faults: XIDs the next check reports
        self.exit_reason = ""
        self._lifecycle_proc: subprocess.Popen | None = None
        self._gpus = health.GpuMonitor(int(cfg["gpus"]), cfg["instance_type"])
        if int(cfg["gpus"]) == 0:  # a CPU instance type: its workers train on the CPU (gloo) even where the machine
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # has a GPU, which a local cluster's nodes would otherwise share
        self.deep = DeepCheckRunner(self.work_dir)
        self.wake = threading.Event()  # heartbeat now (a worker exited, or the agent is stopping)
        # (forked from this process at once when it came from a local cluster's host template: no thread runs yet)
        self.template = WorkerTemplate(self.name, self.work_dir, fork_now=True) \
            if cfg.get("worker_template", True) else None
        self.workers = WorkerSupervisor(self.name, self.token, float(cfg["hang_timeout_s"]), wake=self.wake.set,
                                        work_dir=self.work_dir, store_addr=self.store_addr, template=self.template,
                                        controller_url=self.endpoint_url)
        self.reply_sent_at: float | None = None  # `sent_at` of the last reply acted on (echoed back)
        self.next_heartbeat_s: float | None = None  # the last reply's request to come back sooner
        self.unheard = True  # the last heartbeat got no reply: the next is full (the controller may have missed news)
        # with its link open, a full heartbeat only on news, when poked, while hurried, and at least this often
        self.full_every = max(self.interval, FULL_HEARTBEAT_MAX_S)
        self.poke = threading.Event()  # the controller has news for this node (`link.py`)
        self._full_at, self._said = float("-inf"), None  # the last full heartbeat answered, and what it said

    # ---- bring-up and health (a thread, so heartbeats never wait on a slow script) -------------------
    def bring_up(self) -> None:
        try:
            ok = self.run_lifecycle()
            if not ok:
                self._set(phase="failed")
                return
            self._set(phase="health-checking")
            self.run_checks(first=True)
            self._set(phase="ready")
            while not self.stop.is_set():
                self.wake_checks.wait(float(self.cfg["check_interval_s"]))
                self.wake_checks.clear()
                if not self.stop.is_set():
                    self.run_checks()
        except Exception as err:  # a bug here must show up as a failed node, not a silent thread death
            log.exception("bring-up failed")
            self._set(phase="failed", lifecycle={"ok": False, "exit_code": None, "duration_s": 0.0, "log": None,
                                                  "detail": f"agent error during bring-up or health checks: {err!r}",
                                                  "tail": f"see {self.work_dir / 'agent.log'}"})

    def _set(self, **fields) -> None:
        with self.lock:
            for k, v in fields.items():
                setattr(self, k, v)

    def run_lifecycle(self) -> bool:
        script = self.cfg.get("on_create")
        if not script:
            self._set(lifecycle={"ok": True, "exit_code": None, "duration_s": 0.0, "tail": "", "log": None,
                                 "detail": "no on_create script"})
            return True
        log_path = self.work_dir / "lifecycle.log"
        cmd = lifecycle_command(script)
        env = dict(os.environ, PHALANX_NODE_NAME=self.name, PHALANX_GROUP=self.cfg["group"],
                   PHALANX_INSTANCE_TYPE=self.cfg["instance_type"], PHALANX_WORK_DIR=str(self.work_dir),
                   PHALANX_CLUSTER=self.cfg["cluster"])
        log.info("running lifecycle script %s (output: %s)", script, log_path)
        start = time.monotonic()
        timeout = float(self.cfg["lifecycle_timeout_s"])
        with open(log_path, "wb") as out:
            self._lifecycle_proc = proc = subprocess.Popen(ignoring_usr2(cmd), cwd=self.work_dir, stdout=out,
                                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                           env=env)
            try:
                code = proc.wait(timeout=timeout)
                detail = f"exited with code {code}"
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
                detail = f"timed out after {timeout:g} s and was killed"
        duration = time.monotonic() - start
        ok = code == 0 and not self.stop.is_set()
        if ok:
            detail = f"succeeded in {duration:.2f} s"
        result = {"ok": ok, "exit_code": code, "duration_s": round(duration, 3), "tail": output_tail(log_path),
                  "log": str(log_path), "detail": f"lifecycle script {script} {detail}"}
        self._set(lifecycle=result)
        if ok:
            log.info("lifecycle script succeeded in %.2f s", duration)
        else:
            log.error("lifecycle script %s %s; reporting the node as failed and waiting to be terminated",
                      script, detail)
        return ok

    def run_checks(self, *, first: bool = False) -> None:
        checks = [
            health.check_disk(self.work_dir, int(self.cfg["min_free_disk_mb"])),
            health.check_memory(int(self.cfg["min_free_memory_mb"])),
            health.check_workers(self.workers.exit_codes()),
            *self._gpus.check(),
        ]
        with self.lock:
            checks += [health.injected_failure(kind) for kind in self.injected]
            if self.injected_xids:  # as if NVML had delivered them since the last check (reported once)
                checks.append(health.xid_check(self.injected_xids, " (injected)"))
                self.injected_xids = []
        result = health.report(checks)
        if not result["ok"]:
            log.error("health check failed: %s; reporting it, the controller decides what happens next",
                      health.summarize_failure(result))
        self._set(health=result)

    # ---- heartbeats (the main thread) ---------------------------------------------------------------
    def endpoint_url(self) -> str | None:
        if self.controller_url:
            return self.controller_url
        try:
            ep = json.loads(self.endpoint_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return f"http://{ep['connect_host']}:{ep['api_port']}"

    def store_addr(self) -> str | None:
        """host:port of the controller's store (warm standbys wait on it)."""
        if self.cfg.get("store_addr"):
            return self.cfg["store_addr"]
        try:
            ep = json.loads(self.endpoint_file.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return f"{ep['connect_host']}:{ep['store_port']}"

    def heartbeat_body(self) -> dict:
        with self.lock:
            return {"protocol": PROTOCOL_VERSION, "handle": self.handle, "phase": self.phase, "lifecycle": self.lifecycle, "health": self.health,
                    "sent_at": time.time(), "workers": self.workers.report(), "reply_sent_at": self.reply_sent_at,
                    "deep_check": self.deep.result(), "standbys": self.workers.standby_ids(),
                    **({"time_limit_warned_at": warned} if (warned := self.slurm.time_limit_warned_at) else {}),
                    **({"address": self.address, "ifname": self.ifname, "free_ports": free_ports(self.address)}
                       if self.address else {})}

    def _poked(self) -> None:
        self.poke.set()
        self.wake.set()

    def _beat_will_do(self, body: dict, hurried: bool) -> bool:
        """Whether a beat on the link says all this heartbeat would: nothing reported changed since the last
        full heartbeat, no poke, no hurry, no reply missed since, and that one is recent (`full_every`)."""
        return not (hurried or self.unheard or self.poke.is_set()) and news(body) == self._said \
            and time.monotonic() < self._full_at + self.full_every

    def handle_reply(self, reply: dict, body: dict) -> None:
        check_version(reply.get("protocol"), "the controller")
        reply = HeartbeatReply.model_validate(reply)
        self.unheard = False
        if reply.action != "terminate":
            if self.template is not None and reply.state == "healthy":
                # torch imported now, not earlier: it would compete with the lifecycle script and the deep check
                self.template.start()
            self.workers.apply(reply.workers, standby=reply.standby)
            self.deep.apply(reply.deep_check)
        self.workers.acknowledged(body["workers"])
        self.reply_sent_at = reply.sent_at
        self.next_heartbeat_s = reply.next_heartbeat_s  # sooner while a job here changes generation
        for fault in reply.faults:
            if act_on(fault):  # kill-node, freeze-node, a worker signal: the controller cannot reach this host
                continue
            log.warning("fault injected by operator: %s; the next health check reports it", fault)
            with self.lock:
                if fault.startswith("xid:"):
                    self.injected_xids.append(int(fault[4:]))
                else:
                    self.injected.append(fault)
            self.wake_checks.set()
        if reply.action == "terminate":
            self.exit_reason = f"controller asked this node to terminate: {reply.reason or ''}"
            self.stop.set()
            self.wake.set()

    def watch_workers(self) -> None:
        while not self.stop.is_set():
            try:
                self.workers.poll()
            except Exception:  # a bug here must not silently end exit and hang detection
                log.exception("watching workers failed; next: retrying in 0.1 s")
            self.stop.wait(0.1)

    def run(self) -> int:
        threading.Thread(target=self.bring_up, name="bring-up", daemon=True).start()
        threading.Thread(target=self.watch_workers, name="workers", daemon=True).start()
        link = Link(self.name, self.handle, self.token, self.endpoint_url, interval=self.interval, stop=self.stop,
                    dropped=self.wake.set, poked=self._poked)
        link.start()
        url, down_since, session = self.endpoint_url(), None, KeepAlive()  # (one connection for the heartbeats)
        while not self.stop.is_set():
            if not self.work_dir.is_dir():
                self.exit_reason = f"work dir {self.work_dir} is gone (cluster deleted)"
                break
            self.wake.clear()
            started, hurried, self.next_heartbeat_s = time.monotonic(), self.next_heartbeat_s is not None, None
            try:
                if url is None:
                    raise ControllerUnreachable(f"no endpoint file at {self.endpoint_file}")
                body = self.heartbeat_body()
                if self._beat_will_do(body, hurried) and link.beat():
                    self.wake.wait(self.interval)
                    continue
                self.poke.clear()
                reply = session.request_json("POST", f"{url}/v1/nodes/{self.name}/heartbeat", self.token, body,
                                     timeout=max(2.0, 4 * self.interval))
                if down_since is not None:
                    log.info("controller reachable again at %s after %.1f s", url, time.monotonic() - down_since)
                    down_since = None
                self.handle_reply(reply, body)
                # (the next one unprompted within 1/2–1 × full_every: a poke to every agent must not leave them in step)
                self._full_at, self._said = time.monotonic() - random.random() * self.full_every / 2, news(body)
            except ControllerUnreachable as err:
                self.unheard = True
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("controller unreachable (%s); node and workers keep running, retrying every %g s",
                                err, self.interval)
                url = self.endpoint_url()
                self.slurm.controller_silent(time.monotonic() - down_since)
            except ProtocolMismatch as err:
                self.exit_reason = f"cannot work with this controller: {err}"
                break
            except ApiError as err:
                self.unheard = True
                if err.status == 409 and "protocol version" in str(err.detail):
                    self.exit_reason = f"the controller refuses this agent: {err.detail}"
                    break
                if err.status in (404, 410):
                    self.exit_reason = f"controller does not know node {self.name} ({err.detail})"
                    break
                log.error("heartbeat refused (%s); retrying in %g s", err, self.interval)
            period = min(self.next_heartbeat_s or self.interval, self.interval)  # (sooner, never later)
            self.wake.wait(next_wait(period, time.monotonic() - started))
        session.close()
        self.shutdown()
        return 0

    def shutdown(self) -> None:
        self.stop.set()
        self.wake_checks.set()
        self.workers.stop_all()
        self.deep.stop()
        proc = self._lifecycle_proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        log.info("agent exiting: %s", self.exit_reason or "stopped")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Phalanx node agent")
    parser.add_argument("--config", type=Path, help="agent.json written by the backend")
    parser.add_argument("--join", metavar="URL", help="join the cluster whose controller's API is at URL (backend "
                                                      "hosts): the node is named by the controller")
    parser.add_argument("--token-file", type=Path, help="with --join: the cluster's token (default: the "
                                                        "environment's PHALANX_CLUSTER_TOKEN)")
    parser.add_argument("--group", help="with --join: the instance group to join")
    parser.add_argument("--name", help="with --join: a particular waiting node of the group")
    parser.add_argument("--work-root", type=Path, default=Path("~/.phalanx/agents").expanduser(),
                        help="with --join: node work dirs go under WORK_ROOT/<cluster>/<node>")
    parser.add_argument("--address", help="with --join: the address peers reach this host at (default: the "
                                          "source address of the route to the controller)")
    parser.add_argument("--ifname", help="with --join: the interface for gloo/NCCL (default: the one holding "
                                         "--address)")
    args = parser.parse_args(argv)
    os.umask(PRIVATE_UMASK)  # its files, its lifecycle script's and its workers' are this user's only
    if args.join:
        if not ((args.token_file or os.environ.get(TOKEN_ENV)) and args.group):
            parser.error(f"--join needs --group, and --token-file or {TOKEN_ENV} in the environment")
        logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s: %(message)s")
        try:
            args.config = join(args.join, args.token_file, args.group, name=args.name, work_root=args.work_root,
                               address=args.address, ifname=args.ifname)
        except (OSError, ApiError, ControllerUnreachable, ProtocolMismatch, ValueError) as err:
            print(f"error: could not join the cluster at {args.join}: {err}", file=sys.stderr)
            return 2
        if args.ifname or not os.environ.get("GLOO_SOCKET_IFNAME"):
            ifname = json.loads(args.config.read_text()).get("ifname")
            if ifname:  # the workers' collectives use the interface peers reach this host on
                os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = ifname
        logging.getLogger().handlers.clear()
    elif not args.config:
        parser.error("give --config (an agent its backend started) or --join URL (an agent joining from its host)")
    cfg = json.loads(args.config.read_text())
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s agent {cfg['node']} %(levelname)s: %(message)s")
    agent = Agent(cfg)

    def on_term(signum, _frame):
        agent.exit_reason = f"received signal {signal.Signals(signum).name}"
        agent.stop.set()
        agent.wake.set()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    # Slurm's warning before the time limit (sbatch --signal=B:USR2@120): the controller learns it at once
    signal.signal(signal.SIGUSR2, lambda s, f: (agent.slurm.warned(), agent.wake.set()))
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())

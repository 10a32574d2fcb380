"""`phalanx observe`: a real Prometheus (the Debian package's `prometheus` binary) scraping a running cluster's
controller, set up from the cluster's own files.

    start_observer(name, port=9090)   write <cluster>/prometheus/prometheus.yml (the controller's /metrics,
                                      with the cluster token as a bearer credentials file), start Prometheus
                                      on 127.0.0.1:PORT with its TSDB in <cluster>/prometheus/data, wait until
                                      /-/ready answers, return {url, pid, config, data}
    stop_observer(name)               stop it (SIGTERM, SIGKILL after a grace); `cluster delete` calls it

Lifecycle: one Prometheus per cluster. Detached (the default) it runs in its own session, like the controller,
until `phalanx observe --stop` or `phalanx cluster delete`; its pid is in <cluster>/prometheus/prometheus.pid
and its log in prometheus.log. `--foreground` runs it until Ctrl-C. The token is never copied: the config
names the cluster's token file (mode 0600) as `credentials_file`.

Knows the cluster's files and the controller's address; nothing about policy or training.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from phalanx.control.backends.local import process_running
from phalanx.control.client.cluster import ClusterError, ClusterRefused, controller_pid, resolve_name
from phalanx.control.state.paths import PRIVATE_UMASK, ClusterPaths, open_private_log, write_atomic

INSTALL_HINT = ("install it: `apt-get install prometheus` (Debian/Ubuntu, as root), or `make system-deps`; "
                "any Prometheus ≥ 2.26 on PATH works, or set PHALANX_PROMETHEUS to its path")
STOP_GRACE_S = 10.0


class ObserveError(ClusterError):
    """Prometheus could not be set up or started (the message names the fix)."""


@dataclass(frozen=True)
class ObserverPaths:
    root: Path  # <cluster>/prometheus

    @classmethod
    def of(cls, paths: ClusterPaths) -> "ObserverPaths":
        return cls(paths.root / "prometheus")

    config = property(lambda self: self.root / "prometheus.yml")
    data = property(lambda self: self.root / "data")
    pid_file = property(lambda self: self.root / "prometheus.pid")
    log = property(lambda self: self.root / "prometheus.log")
    info = property(lambda self: self.root / "observe.json")


def prometheus_binary() -> str:
    found = os.environ.get("PHALANX_PROMETHEUS") or shutil.which("prometheus")
    if not found or not os.access(found, os.X_OK):
        raise ObserveError(f"prometheus is not installed (not on PATH); {INSTALL_HINT}")
    return found


def scrape_config(cluster: str, target: str, token_file: Path, interval_s: float) -> str:
    """prometheus.yml for one cluster: its controller's /metrics, authenticated with the cluster token."""
    tree = {
        "global": {"scrape_interval": _duration(interval_s), "evaluation_interval": _duration(interval_s),
                   "scrape_timeout": _duration(min(interval_s, 10.0))},
        "scrape_configs": [{
            "job_name": "phalanx",
            "metrics_path": "/metrics",
            "authorization": {"type": "Bearer", "credentials_file": str(token_file)},
            "static_configs": [{"targets": [target], "labels": {"cluster": cluster}}],
        }],
    }
    return json.dumps(tree, indent=2) + "\n"  # JSON is YAML: no YAML writer needed


def _duration(seconds: float) -> str:
    """Prometheus' duration format takes whole units: milliseconds."""
    return f"{max(1, round(seconds * 1000))}ms"


def running_observer(paths: ClusterPaths) -> dict | None:
    """The cluster's running Prometheus ({url, pid, port, ...}), or None."""
    op = ObserverPaths.of(paths)
    try:
        info = json.loads(op.info.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return info if process_running(info.get("pid"), str(op.config)) else None


def start_observer(name: str | None = None, *, port: int = 9090, interval_s: float = 2.0, detach: bool = True,
                   timeout_s: float = 60.0) -> dict | subprocess.Popen:
    """Start Prometheus for the cluster's running controller. Detached: returns {url, pid, port, config, data}
    once ready (an observer already running on the same port is returned as is). `detach=False`: returns the
    ready `Popen`; the caller waits on it and stops it."""
    paths = ClusterPaths.for_name(resolve_name(name))
    binary = prometheus_binary()
    running = running_observer(paths)
    if running:
        if running["port"] == port:
            return {**running, "already_running": True}
        raise ClusterRefused(f"Prometheus for cluster {paths.name} already runs on port {running['port']} "
                             f"(pid {running['pid']}); `phalanx observe --stop` first")
    ep = paths.read_endpoint()
    if ep is None or controller_pid(paths) is None:
        raise ClusterRefused(f"the controller of cluster {paths.name} is not running; "
                             f"`phalanx cluster start {paths.name}`, then `phalanx observe` again")
    op = ObserverPaths.of(paths)
    op.root.mkdir(mode=0o700, exist_ok=True)
    write_atomic(op.config, scrape_config(paths.name, f"{ep['connect_host']}:{ep['api_port']}", paths.token,
                                          interval_s))
    argv = [binary, f"--config.file={op.config}", f"--storage.tsdb.path={op.data}",
            f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=7d", "--log.level=warn"]
    with open_private_log(op.log) as log:
        proc = subprocess.Popen(argv, cwd=op.root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=detach, umask=PRIVATE_UMASK)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, op, timeout_s)
    except BaseException:
        _stop_pid(proc.pid, str(op.config))
        raise
    info = {"url": url, "pid": proc.pid, "port": port, "config": str(op.config), "data": str(op.data),
            "interval_s": interval_s}
    write_atomic(op.info, json.dumps(info))
    op.pid_file.write_text(str(proc.pid))
    return info if detach else proc


def _wait_ready(proc: subprocess.Popen, url: str, op: ObserverPaths, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ObserveError(f"prometheus exited with code {proc.returncode} while starting (port taken? "
                               f"`phalanx observe --port N`); its log ({op.log}) ends:\n{_tail(op.log)}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise ObserveError(f"prometheus did not become ready within {timeout_s:g} s; log:\n{_tail(op.log)}")


def stop_observer(name: str | None = None, *, paths: ClusterPaths | None = None) -> int | None:
    """Stop the cluster's Prometheus; its pid, or None when none ran. Its TSDB is kept (with the cluster dir)."""
    paths = paths or ClusterPaths.for_name(resolve_name(name))
    op = ObserverPaths.of(paths)
    try:
        pid = int(op.pid_file.read_text())
    except (FileNotFoundError, ValueError):
        return None
    stopped = _stop_pid(pid, str(op.config))
    op.pid_file.unlink(missing_ok=True)
    op.info.unlink(missing_ok=True)
    return pid if stopped else None


def _stop_pid(pid: int, marker: str) -> bool:
    if not process_running(pid, marker):
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while process_running(pid, marker):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
        time.sleep(0.05)
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it when it was our child
    except ChildProcessError:
        pass
    return True


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"

"""Hosts for the multi-host tests: Linux network namespaces on one bridge, each with its own address in
198.18.0.0/24 (a benchmarking range no real network uses). Needs root (CI runs as root); `Hosts.available()`
says why it cannot be made here.

    bridge phxb<tag>  198.18.0.1   this (the test's) namespace: the client reaches the controller through it
    phx<tag>c         198.18.0.2   the controller's host
    phx<tag>h<i>      198.18.0.<10+i>  host i (i = 1..N), its link to the bridge: veth phx<tag>v<i>

Faults act on a whole host: `kill` (SIGKILL every process in its namespace), `freeze` (SIGSTOP them all),
`cut` (its link down: it is partitioned, its processes run on). `close()` kills everything in the
namespaces and removes them and the bridge; it is safe to call twice.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

NET = "198.18.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


class Hosts:
    def __init__(self, count: int, tag: str | None = None):
        self.count = count
        self.tag = tag or str(os.getpid() % 100000)
        self.bridge = f"phxb{self.tag}"
        self.controller_ns = f"phx{self.tag}c"
        self.bridge_addr = f"{NET}.1"  # this (the test's) namespace, on the bridge
        self.controller_addr = f"{NET}.2"
        self.hosts = {f"h{i}": f"phx{self.tag}h{i}" for i in range(1, count + 1)}
        self.procs: list[subprocess.Popen] = []

    @staticmethod
    def available() -> str | None:
        """None when namespaces can be made here; else why not."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "the `ip` command (iproute2) is not installed"
        probe = f"phxprobe{os.getpid() % 100000}"
        made = _ip("netns", "add", probe, check=False)
        _ip("netns", "del", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` fails here: {made.stderr.strip()}"
        return None

    def address(self, host: str) -> str:
        return f"{NET}.{10 + int(host[1:])}"

    def veth(self, host: str) -> str:
        return f"phx{self.tag}v{host[1:]}"

    @staticmethod
    def sweep() -> None:
        """Remove what an earlier run left behind: every phx* namespace (its processes killed), veth and bridge
        (a second bridge on 198.18.0.0/24 would take this test's route)."""
        for ns in _ip("netns", "list", check=False).stdout.split("\n"):
            name = ns.split(" ")[0]
            if name.startswith("phx"):
                for pid in _ip("netns", "pids", name, check=False).stdout.split():
                    for sig in (signal.SIGCONT, signal.SIGKILL):
                        try:
                            os.kill(int(pid), sig)
                        except ProcessLookupError:
                            pass
                _ip("netns", "del", name, check=False)
        for line in _ip("-br", "link", "show", check=False).stdout.splitlines():
            name = line.split()[0].split("@")[0] if line.strip() else ""
            if name.startswith("phx"):
                _ip("link", "del", name, check=False)

    def up(self) -> "Hosts":
        self.sweep()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self._add_ns(self.controller_ns, f"phx{self.tag}vc", self.controller_addr)
        for host, ns in self.hosts.items():
            self._add_ns(ns, self.veth(host), self.address(host))
        return self

    def _add_ns(self, ns: str, veth: str, addr: str) -> None:
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")

    def run(self, where: str, argv: list[str], log_path, env: dict | None = None) -> subprocess.Popen:
        """Start `argv` in host `where` ("c" for the controller's), output to `log_path`."""
        ns = self.controller_ns if where == "c" else self.hosts[where]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(proc)
        return proc

    def pids(self, where: str) -> list[int]:
        ns = self.controller_ns if where == "c" else self.hosts[where]
        found = _ip("netns", "pids", ns, check=False).stdout.split()
        return [int(p) for p in found]

    def _signal(self, where: str, sig: signal.Signals) -> list[int]:
        pids = self.pids(where)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def kill(self, host: str) -> list[int]:
        return self._signal(host, signal.SIGKILL)

    def freeze(self, host: str) -> list[int]:
        return self._signal(host, signal.SIGSTOP)

    def thaw(self, host: str) -> list[int]:
        return self._signal(host, signal.SIGCONT)

    def cut(self, host: str) -> None:
        _ip("link", "set", self.veth(host), "down")

    def mend(self, host: str) -> None:
        _ip("link", "set", self.veth(host), "up")

    def close(self) -> None:
        for ns in [self.controller_ns, *self.hosts.values()]:
            if os.path.exists(f"/var/run/netns/{ns}"):
                for pid in self.pids("c" if ns == self.controller_ns else next(
                        h for h, n in self.hosts.items() if n == ns)):
                    for sig in (signal.SIGCONT, signal.SIGKILL):
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        for ns in [self.controller_ns, *self.hosts.values()]:
            while os.path.exists(f"/var/run/netns/{ns}") and time.monotonic() < deadline:
                if _ip("netns", "del", ns, check=False).returncode == 0:
                    break
                time.sleep(0.2)
        for veth in [f"phx{self.tag}vc", *(self.veth(h) for h in self.hosts)]:
            _ip("link", "del", veth, check=False)  # gone with its namespace, unless a process still holds that
        _ip("link", "del", self.bridge, check=False)

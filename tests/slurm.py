"""A real Slurm on this machine for the Slurm tests: slurmctld and one slurmd per emulated node (n1..nN), munge
for authentication, every config and state file in one directory. Follows ../shared/notes/slurm-local.md
(Debian 12, Slurm 22.05, as root).

Two ways to lay the nodes out:
- `LocalSlurm(root)`: every slurmd on 127.0.0.1, each on its own port.
- `LocalSlurm(root, hosts=Hosts(4).up())` (tests/netns.py): node nI's slurmd runs in network namespace hI with
  that host's own address (198.18.0.1I, the same port on every host), slurmctld in this namespace on the bridge
  (198.18.0.1). Everything a node starts (step daemons, batch scripts, agents, workers) lives in its namespace,
  and `kill_node` takes the host's link down before it kills them: no dying socket tells anyone (no FIN or RST
  reaches a peer), as when a real host dies.

    slurm = LocalSlurm(tmp_path / "slurm", nodes=4); slurm.start()   # ready: every node idle
    slurm.env                 # SLURM_CONF for the clients (sbatch, squeue, scontrol) and for Phalanx
    slurm.kill_slurmd("n2")   # a node's slurmd dies (its steps' processes live on: kill those separately)
    LocalSlurm(root, gpus=2)  # every node has 2 GPUs for Slurm (Gres=gpu:2): two character devices standing in
                              # for /dev/nvidia0-1, so Slurm allocates them and sets a step's CUDA_VISIBLE_DEVICES
    LocalSlurm(root, accounts=("ml", "vision"))  # accounting enforced, as on most real clusters: slurmdbd on a
                              # MariaDB of its own (Debian's slurmdbd and mariadb-server), root may use these
                              # accounts (the first its default), and Slurm refuses a job under any other
    slurm.stop()              # every daemon this harness started (munged only if it started it)

`LocalSlurm.available()` says why Slurm cannot be run here (not root, packages missing); the tests fail on
it rather than skip (CI runs as root and `make test` installs slurm-wlm and munge).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "sbatch", "munged")
ACCOUNTING = ("slurmdbd", "sacctmgr", "mariadbd", "mariadb-install-db", "mariadb")  # (only with `accounts`)


class LocalSlurm:
    def __init__(self, root: Path, nodes: int = 4, cpus: int = 2, port_base: int | None = None, hosts=None,
                 gpus: int = 0, accounts: tuple[str, ...] = ()):
        self.root = Path(root).resolve()  # daemons chdir to /: every path they get is absolute
        self.gpus = gpus
        self.accounts = tuple(accounts)
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.hosts = hosts  # netns.Hosts (node nI on host hI), or None: every node on 127.0.0.1
        if hosts is not None and hosts.count < nodes:
            raise ValueError(f"{nodes} Slurm nodes need {nodes} hosts; got {hosts.count}")
        # this namespace's address, where slurmctld listens and the nodes reach it (and a controller started here)
        self.here = "127.0.0.1" if hosts is None else hosts.bridge_addr
        self.cpus = cpus
        base = port_base or 6900 + (os.getpid() % 500) * 10
        self.ctld_port, self.node_port = base, base + 1
        self.dbd_port, self.db_port = base + 7, base + 8  # slurmdbd and its MariaDB, on 127.0.0.1 (with `accounts`)
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.started_munge = False

    @staticmethod
    def available(accounting: bool = False) -> str | None:
        if os.geteuid() != 0:
            return "the Slurm daemons of the test need root"
        missing = [d for d in DAEMONS + (ACCOUNTING if accounting else ()) if shutil.which(d) is None]
        if missing:
            return (f"{', '.join(missing)} not installed: install the Debian packages slurm-wlm and munge"
                    f"{', slurmdbd and mariadb-server' if accounting else ''}")
        return None

    def _write_configs(self) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        (self.root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
                                               "CgroupAutomount=no\n")
        host, r = socket.gethostname(), self.root
        last = self.node_port + len(self.nodes) - 1
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        if self.hosts is None:
            nodes = (f"NodeName=n[1-{len(self.nodes)}] NodeHostname={host} NodeAddr=127.0.0.1 "
                     f"Port=[{self.node_port}-{last}] CPUs={self.cpus} RealMemory=4000{gres} State=UNKNOWN")
        else:  # one host each: its own address, the same port
            nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr={self.hosts.address(self._host(n))} "
                              f"Port={self.node_port} CPUs={self.cpus} RealMemory=4000{gres} State=UNKNOWN"
                              for n in self.nodes)
        if self.gpus:  # Slurm wants a GPU to be a device file; /dev/null's numbers do (nothing opens them)
            devices = self.root / "dev"
            devices.mkdir(exist_ok=True)
            for i in range(self.gpus):
                path = devices / f"nvidia{i}"
                if not path.exists():
                    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            (self.root / "gres.conf").write_text(f"Name=gpu File={devices}/nvidia[0-{self.gpus - 1}]\n")
        self.conf.write_text(f"""{"GresTypes=gpu" if self.gpus else ""}
ClusterName=phxtest
SlurmctldHost={host}({self.here})
SlurmctldPort={self.ctld_port}
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
SlurmdTimeout=30
KillWait=5
MinJobAge=30
{self._accounting_conf()}
JobAcctGatherType=jobacct_gather/none
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")

    def _accounting_conf(self) -> str:
        if not self.accounts:
            return "AccountingStorageType=accounting_storage/none"
        return (f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
                f"AccountingStoragePort={self.dbd_port}\nAccountingStorageEnforce=associations")

    def run(self, *argv: str, check: bool = True, timeout: float = 30, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run(list(argv), env=env or self.env, capture_output=True, text=True, timeout=timeout,
                              cwd=cwd)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def start(self, timeout: float = 60) -> None:
        why = self.available(accounting=bool(self.accounts))
        if why:
            raise RuntimeError(f"cannot run Slurm here: {why}")
        self._write_configs()
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            key = Path("/etc/munge/munge.key")
            if not key.exists():  # the package's postinst makes one; mungekey as root makes it root's
                subprocess.run(["mungekey", "--create"], check=True, capture_output=True, timeout=30)
                shutil.chown(key, "munge", "munge")
            subprocess.run(["/etc/init.d/munge", "start"], check=True, capture_output=True, timeout=30)
            self.started_munge = True
        if self.accounts:
            self._start_accounting(timeout)
        self.run("slurmctld", "-f", str(self.conf))
        for n in self.nodes:
            self._start_slurmd(n)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.node_states()
            if len(states) == len(self.nodes) and all(s.startswith("idle") for s in states.values()):
                return
            time.sleep(0.3)
        raise RuntimeError(f"Slurm did not come up within {timeout:.0f} s: node states {self.node_states()}; "
                           f"slurmctld log tail:\n{self.log_tail('slurmctld')}")

    def _start_accounting(self, timeout: float) -> None:
        """MariaDB (its own data directory, socket and port), slurmdbd on it (its config beside slurm.conf, where it
        looks), then Slurm's cluster, the accounts, and root as a user of each (the first its default)."""
        r, db = self.root, self.root / "db"
        if not (db / "mysql").exists():
            self.run("mariadb-install-db", f"--datadir={db}", "--user=root", "--auth-root-authentication-method="
                     "normal", "--skip-test-db", timeout=60)
        subprocess.Popen(["mariadbd", "--no-defaults", f"--datadir={db}", f"--socket={r}/mysql.sock",
                          f"--port={self.db_port}", "--bind-address=127.0.0.1", "--user=root",
                          f"--pid-file={r}/mariadbd.pid", f"--log-error={r}/log/mariadbd.log",
                          "--innodb-buffer-pool-size=32M", "--skip-name-resolve"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
        sql = ["mariadb", "--no-defaults", f"--socket={r}/mysql.sock", "-uroot", "-e",
               "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm'; "
               "GRANT ALL ON *.* TO 'slurm'@'127.0.0.1'"]
        self._retry(lambda: self.run(*sql), timeout, "MariaDB", "mariadbd")
        dbd = r / "slurmdbd.conf"
        dbd.write_text(f"AuthType=auth/munge\nDbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={self.dbd_port}\n"
                       f"SlurmUser=root\nPidFile={r}/slurmdbd.pid\nLogFile={r}/log/slurmdbd.log\n"
                       f"StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\nStoragePort={self.db_port}\n"
                       f"StorageUser=slurm\nStoragePass=slurm\nStorageLoc=phalanx_test_acct\n")
        dbd.chmod(0o600)  # (slurmdbd refuses a config others can read)
        self.run("slurmdbd")
        self._retry(lambda: self.run("sacctmgr", "-i", "add", "cluster", "phxtest"), timeout, "slurmdbd", "slurmdbd")
        self.run("sacctmgr", "-i", "add", "account", *self.accounts, "Description=test", "Organization=test")
        self.run("sacctmgr", "-i", "add", "user", "root", f"Account={','.join(self.accounts)}",
                 f"DefaultAccount={self.accounts[0]}")

    def _retry(self, call, timeout: float, what: str, log: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                call()
                return
            except RuntimeError as err:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} did not come up within {timeout:.0f} s ({err}); log tail:\n"
                                       f"{self.log_tail(log)}") from None
                time.sleep(0.2)

    def user_accounts(self) -> list[str]:
        """The accounts root may submit under (its associations in this Slurm's accounting)."""
        done = self.run("sacctmgr", "-n", "-P", "show", "assoc", "user=root", "format=account")
        return sorted({line.strip() for line in done.stdout.splitlines() if line.strip()})

    def _host(self, node: str) -> str:
        return f"h{node[1:]}"

    def _start_slurmd(self, node: str) -> None:
        where = [] if self.hosts is None else ["ip", "netns", "exec", self.hosts.hosts[self._host(node)]]
        self.run(*where, "slurmd", "-f", str(self.conf), "-N", node)

    def node_states(self) -> dict[str, str]:
        done = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        return dict(line.split() for line in done.stdout.splitlines() if line.strip())

    def node_reason(self, node: str) -> str:
        return self.run("sinfo", "-h", "-n", node, "-o", "%E").stdout.strip()

    def jobs(self) -> list[dict]:
        done = self.run("squeue", "-h", "-o", "%i|%j|%T|%N|%r|%a|%k", check=False)
        keys = ("id", "name", "state", "nodes", "reason", "account", "comment")
        return [dict(zip(keys, line.split("|"))) for line in done.stdout.splitlines() if line.strip()]

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.root / "log" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"

    def _pid(self, name: str) -> int | None:
        try:
            return int((self.root / f"{name}.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def stepds(self, node: str | None = None) -> list[int]:
        """The slurmstepd processes of this Slurm (their environment names its slurm.conf); of one node's slurmd
        when given (a step daemon keeps its node's slurmd log open)."""
        mine, log = f"SLURM_CONF={self.conf}".encode(), str(self.root / "log" / f"slurmd-{node}.log")
        found = []
        for entry in os.listdir("/proc"):
            try:
                if not (entry.isdigit() and Path(f"/proc/{entry}/comm").read_text().strip() == "slurmstepd"
                        and mine in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")):
                    continue
                if node is None or any(os.readlink(f"/proc/{entry}/fd/{fd}") == log
                                       for fd in os.listdir(f"/proc/{entry}/fd")):
                    found.append(int(entry))
            except OSError:
                continue
        return found

    def kill_node(self, node: str) -> list[int]:
        """The host `node` dies: its slurmd, every step daemon on it and every process they started, all at once.
        Slurm hears of it when its slurmd stays silent for SlurmdTimeout, or at once from `mark_down`.

        All at once: every process is stopped (SIGSTOP) before any is killed (SIGKILL). Killed one by one, a step
        daemon sees its task die first and tells slurmctld (the batch script "killed by signal 9": a finished job,
        not a failed node), which no dead host does."""
        from phalanx.control.agent.join import descendants

        def send(pids, sig) -> None:
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

        slurmd, stepds = self._pid(f"slurmd-{node}"), self.stepds(node)
        host = {*stepds, *([slurmd] if slurmd else [])}
        if self.hosts is not None:  # the link first: nothing the dying processes send reaches anyone
            self.hosts.cut(self._host(node))
            host |= set(self.hosts.pids(self._host(node)))
        stopped: set[int] = set()
        # every process found before any is stopped; then again until none forked in between
        while new := {*host, *(kid for stepd in stepds for kid in descendants(stepd))} - stopped:
            send(new, signal.SIGSTOP)
            stopped |= new
        send(stopped, signal.SIGKILL)
        return sorted(stopped - {slurmd})  # the step daemons and their processes

    def kill_slurmd(self, node: str) -> None:
        pid = self._pid(f"slurmd-{node}")
        if pid:
            os.kill(pid, signal.SIGKILL)

    def reset(self, timeout: float = 60) -> None:
        """Between tests: every job cancelled, every slurmd running, every node resumed and idle."""
        self.run("scancel", "--full", "--user", "root", check=False, timeout=10)
        for n in self.nodes:
            if self.hosts is not None:
                self.hosts.mend(self._host(n))
            pid = self._pid(f"slurmd-{n}")
            if not (pid and _alive(pid)):
                self._start_slurmd(n)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = self.node_states()
            if not self.jobs() and all(s == "idle" for s in states.values()) and len(states) == len(self.nodes):
                return
            blocked = [n for n, s in states.items() if any(w in s for w in ("drain", "down", "fail"))]
            if blocked:
                self.run("scontrol", "update", f"nodename={','.join(blocked)}", "state=resume", check=False)
            time.sleep(0.3)
        raise RuntimeError(f"Slurm did not settle within {timeout:.0f} s: {self.node_states()}, jobs {self.jobs()}")

    def stop(self) -> None:
        """Stop every daemon this harness started; cancel every job first (their processes end with them)."""
        if not self.conf.exists():
            return
        self.run("scancel", "--full", "--user", "root", check=False, timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and self.jobs():
            time.sleep(0.2)
        pids = [p for p in (self._pid("slurmctld"), *(self._pid(f"slurmd-{n}") for n in self.nodes)) if p]
        pids += [p for p in (self._pid("slurmdbd"), self._pid("mariadbd")) if p]  # (with `accounts`)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        for pid in self.stepds():  # slurmstepd outlives a killed slurmd: end whatever step of this Slurm is left
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.started_munge:
            subprocess.run(["/etc/init.d/munge", "stop"], capture_output=True, timeout=30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False

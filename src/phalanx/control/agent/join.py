"""An agent on another host joins a cluster (backend `hosts`): `phalanx agent --controller URL --token-file F
--group G`, run by hand, by a lifecycle script or by `srun` on each host.

    join(...)          find this host's address towards the controller (the source address of a route to it)
                       and the interface holding it, claim a waiting node of the group (`POST /v1/join`), and
                       write the node's agent config into its work dir (`<work root>/<cluster>/<node>`): the
                       settings the controller sent, the lifecycle script's text, the controller's URL and
                       rendezvous store. Nothing is read from the controller's disk.
    free_ports(host)   ports free on this host just now (each heartbeat reports a few: a generation's
                       MASTER_PORT on this node is one of them)
    act_on(directive)  fault injection the controller cannot do from its host: `kill-node` (SIGKILL every
                       process this agent started, then itself), `freeze-node` (SIGSTOP itself: alive but
                       silent), `signal:PID:SIG` (one of its workers)

Standard library only. Must not know: the reconciler's policy, SQLite, torch.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import struct
import time
from pathlib import Path
from urllib.parse import urlparse

from phalanx.control.http import ApiError, ControllerUnreachable, request_json
from phalanx.protocol import PROTOCOL_VERSION, check_version

log = logging.getLogger("phalanx.agent")
SIOCGIFADDR = 0x8915
JOIN_RETRY_S = 120.0  # how long a join is retried while the cluster is still being created, or unanswered
JOIN_TIMEOUT_S = 10.0  # one join's answer waited for


def route_address(url: str) -> str:
    """This host's address on the route to the controller at `url` (no packet is sent: a UDP connect only
    picks the route)."""
    parsed = urlparse(url)
    if not parsed.hostname or not parsed.port:
        raise ValueError(f"--controller {url!r}: expected http://HOST:PORT (the controller's API, as `phalanx "
                         f"cluster describe` shows it)")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((parsed.hostname, parsed.port))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The network interface holding IPv4 `address` (what GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def slurm_handle() -> str | None:
    """`slurm:<job id>:<Slurm node>:<pid>` when Slurm started this agent (backend slurm reads the job and node
    from it: a faulty node is drained by that name); None otherwise."""
    job, node = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURMD_NODENAME")
    return f"slurm:{job}:{node}:{os.getpid()}" if job and node else None


def free_ports(host: str, count: int = 4) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


TOKEN_ENV = "PHALANX_CLUSTER_TOKEN"  # the token in the environment (the slurm backend's agents: no shared file)


def join(url: str, token_file: Path | None, group: str, *, name: str | None, work_root: Path, address: str | None,
         ifname: str | None) -> Path:
    """Claim a node of `group` with the token in `token_file` (None: in $PHALANX_CLUSTER_TOKEN); returns the path
    of the agent config written for it. The node's work dir keeps its own copy of the token (0600)."""
    token = (token_file.read_text() if token_file is not None else os.environ.get(TOKEN_ENV, "")).strip()
    if not token:
        raise ValueError(f"no cluster token: give --token-file, or set {TOKEN_ENV}")
    address = address or route_address(url)
    ifname = ifname or interface_of(address)
    handle = slurm_handle() or f"{socket.gethostname()}:{os.getpid()}"
    body = {"protocol": PROTOCOL_VERSION, "group": group, "name": name, "handle": handle, "address": address,
            "ifname": ifname, "work_root": str(work_root), "hostname": socket.gethostname()}
    deadline = time.monotonic() + JOIN_RETRY_S
    while True:
        try:
            reply = request_json("POST", f"{url.rstrip('/')}/v1/join", token, body, timeout=JOIN_TIMEOUT_S)
            break
        except ApiError as err:  # 503: the cluster is still being created, its nodes not all provisioned yet
            if err.status != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
        except ControllerUnreachable as err:  # (thousands of agents started at once: a join may time out) again,
            if not err.timed_out or time.monotonic() > deadline:  # with the same handle: a join whose answer was
                raise  # lost claimed its node. (Nothing listening, a wrong URL: said at once.)
            log.warning("join: %s; again in 1 s", err)
            time.sleep(1.0)
    check_version(reply.get("protocol"), "the controller")
    work = work_root / reply["cluster"] / reply["node"]
    work.mkdir(parents=True, exist_ok=True, mode=0o700)
    own_token = work / "token"
    own_token.write_text(token)
    own_token.chmod(0o600)
    script = None
    if reply.get("on_create") is not None:
        script = work / "on_create" / (reply.get("on_create_name") or "on_create.sh")
        script.parent.mkdir(exist_ok=True)
        script.write_text(reply["on_create"])
        script.chmod(0o700)
    cfg = {**reply["config"], "node": reply["node"], "work_dir": str(work), "on_create": str(script) if script else None,
           "token_file": str(own_token), "controller_url": url.rstrip("/"), "store_addr": reply["store_addr"],
           "address": address, "ifname": ifname, "handle": handle}
    path = work / "agent.json"
    path.write_text(json.dumps(cfg, indent=2))
    log.info("joined cluster %s as node %s (handle %s, address %s, interface %s); work dir %s", reply["cluster"],
             reply["node"], handle, address, ifname or "?", work)
    return path


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def act_on(directive: str) -> bool:
    """Carry out a fault directive meant for this host; False for one that is not (a health-check fault)."""
    me = os.getpid()
    if directive == "kill-node":
        log.warning("fault injected by operator: kill-node; SIGKILL to every process of this agent, then itself")
        for pid in descendants(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(me, signal.SIGKILL)
    elif directive == "freeze-node":
        log.warning("fault injected by operator: freeze-node; SIGSTOP to this agent (alive but silent)")
        os.kill(me, signal.SIGSTOP)
    elif directive.startswith("signal:"):
        _, pid, sig = directive.split(":")
        if int(pid) in descendants(me):
            log.warning("fault injected by operator: signal %s to worker pid %s", signal.Signals(int(sig)).name, pid)
            os.kill(int(pid), int(sig))
        else:
            log.error("fault directive %s names no process of this agent; ignored", directive)
    else:
        return False
    return True

"""Opening the seam's stores safely: the cluster's key namespace (an HMAC of the cluster token), a TCPStore
server bound to one address only, a worker's client, the rendezvous store of a restart-mode generation, and
the signed assignment a warm standby acts on. See docs/control-plane.md, "Trust boundary".

Must not know: what the keys mean (`keys.py`), how jobs are scheduled. Imports torch only inside functions
(agents import this package and must start fast).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import timedelta
from typing import Mapping

from phalanx.protocol.env import CLUSTER_TOKEN, JOB_ID, MASTER_ADDR, MASTER_PORT, RANK, parse_store_addr
from phalanx.protocol.keys import standby_key

def _derive(token: str, purpose: str) -> bytes:
    return hmac.new(token.encode(), f"phalanx/{purpose}/v1".encode(), hashlib.sha256).digest()


def store_namespace(token: str) -> str:
    """The prefix every key of a cluster's stores lives under: derived from the cluster token by an HMAC, so
    the token never appears in a store. Not secret from a client that can connect: see the module doc."""
    return "phx-" + _derive(token, "store-namespace").hex()[:32]


def namespaced(store, token: str | None):
    """`store` with every key under the cluster's namespace (no token: `store` itself — torchrun, tests)."""
    import torch.distributed as dist

    return dist.PrefixStore(store_namespace(token), store) if token else store


def listen_socket(host: str, port: int):
    """A socket bound to `host:port` (0: a free port) and listening: what `serve_store` serves on. No torch, so
    a caller can learn the port, and refuse a taken one, before importing it. OSError when it cannot be bound."""
    import socket

    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def serve_store(host: str, port: int, timeout: timedelta | None = None, *, sock=None):
    """A TCPStore server listening on `host` only. torch's own (`TCPStore(is_master=True)`, and env://'s
    rank 0) listens on every interface whatever `host` says (checked: torch 2.13, both backends); handing it
    a socket bound here (`master_listen_fd`, which the store then owns) is the only way to choose.
    `sock`: one `listen_socket(host, port)` already made (clients that connected meanwhile are served).
    OSError when `host:port` cannot be bound (port taken, address not on this machine)."""
    import torch.distributed as dist

    sock = sock if sock is not None else listen_socket(host, port)
    bound = sock.getsockname()[1]
    extra = {} if timeout is None else {"timeout": timeout}
    return dist.TCPStore(host, bound, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                         **extra)


def connect_store(addr: str, token: str | None, timeout: timedelta):
    """Worker side: a client of the controller's store at `addr` ("host:port"), under the cluster's namespace."""
    import torch.distributed as dist

    host, port = parse_store_addr(addr)
    return namespaced(dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout), token)


def env_rendezvous_store(env: Mapping[str, str], timeout: timedelta):
    """The store a restart-mode generation's default process group rendezvouses on, instead of env://'s
    (whose rank 0 listens on every interface): rank 0 serves MASTER_ADDR:MASTER_PORT bound to MASTER_ADDR
    only, the other ranks connect; keys under the cluster's namespace. Applies under a node agent (the
    controller picked MASTER_ADDR, the node's address, and a port free there) and to a loopback MASTER_ADDR
    (`phalanx train`); None otherwise (srun, torchrun: MASTER_ADDR may be a name this host does not bind):
    torch's env:// as usual."""
    import ipaddress

    import torch.distributed as dist

    host = env.get(MASTER_ADDR, "")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not host or not env.get(MASTER_PORT) or not (env.get(JOB_ID) or loopback):
        return None
    port = int(env[MASTER_PORT])
    if int(env.get(RANK, "0")) == 0:
        store = serve_store(host, port, timeout)
    else:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    return namespaced(store, env.get(CLUSTER_TOKEN))


def standby_assignment(token: str, standby_id: str, env: Mapping[str, str], log_path: str) -> str:
    """Controller side: the value of `standby_key(standby_id)` — the rank's env without the cluster token (the
    standby has it from its agent; no store holds it) and its log file, signed for this standby with a key
    derived from the token."""
    body = json.dumps({"env": {k: v for k, v in env.items() if k != CLUSTER_TOKEN}, "log": log_path})
    return json.dumps({"body": body, "mac": _assignment_mac(token, standby_id, body)})


def open_standby_assignment(token: str, standby_id: str, raw: bytes | str) -> dict:
    """Worker side: {"env", "log"} of a `standby_assignment`; ValueError unless the controller of this cluster
    signed it for this standby (anyone who reaches the store can write the key)."""
    try:
        sealed = json.loads(raw)
        body, mac = sealed["body"], sealed["mac"]
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"malformed standby assignment ({err})") from None
    if not isinstance(body, str) or not isinstance(mac, str) or not hmac.compare_digest(
            mac, _assignment_mac(token, standby_id, body)):
        raise ValueError("standby assignment not signed with this cluster's token")
    return json.loads(body)


def _assignment_mac(token: str, standby_id: str, body: str) -> str:
    return hmac.new(_derive(token, "standby-assignment"), f"{standby_key(standby_id)}\n{body}".encode(),
                    hashlib.sha256).hexdigest()

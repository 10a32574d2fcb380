"""Cut this process's connections to its generation's peers: what a dead host's kernel would have done, had it
lived to close them.

A peer process that dies on a live host has its sockets closed by that host's kernel; gloo sees the connection
close and the collective waiting on it fails at once (a peer fault: the survivor leaves the generation with its
state). A host that dies whole, loses power or its link, sends nothing: gloo would wait out the group's
timeout (minutes). When the controller has published the next generation without that host, the survivor's
watch thread calls `cut_connections`: it shuts down every established TCP connection of this process except
those to the rendezvous store (`keep`), which the next generation needs; the collective then fails as if the
peer had closed it. Every connection cut belongs to the generation being left.

Linux only (/proc/self/net/tcp*, /proc/self/fd). Knows nothing about generations, gloo or training.
"""

from __future__ import annotations

import logging
import os
import socket
import struct

log = logging.getLogger("phalanx.sockets")
STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1", "05": "FIN_WAIT2",
          "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK", "0A": "LISTEN", "0B": "CLOSING"}


def _ipv4(hex_addr: str) -> str:
    return socket.inet_ntoa(struct.pack("<I", int(hex_addr, 16)))


def _remote(hex_host: str, port: int, v4: bool) -> str:
    if v4:
        return f"{_ipv4(hex_host)}:{port}"
    words = struct.unpack("<4I", bytes.fromhex(hex_host))  # (each 32-bit word in host order)
    return f"[{socket.inet_ntop(socket.AF_INET6, struct.pack('>4I', *words))}]:{port}"


def _sockets() -> dict[str, int]:
    """This process's socket inodes → one of its descriptors."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            fds.setdefault(link[8:-1], int(fd))
    return fds


def _connections(keep_host: str, keep_port: int, mine: dict[str, int]) -> list[tuple[str, str, str, bool]]:
    """This process's TCP connections that are not listening: (inode, far end, state, kept), kept when the far end
    is (keep_host, keep_port) (IPv6: any host on keep_port)."""
    found = []
    for path, v4 in (("/proc/self/net/tcp", True), ("/proc/self/net/tcp6", False)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if inode not in mine or state == "0A":
                continue
            host, port = remote.split(":")
            kept = int(port, 16) == keep_port and (not v4 or _ipv4(host) == keep_host)
            found.append((inode, _remote(host, int(port, 16), v4), STATES.get(state, state), kept))
    return found


def cut_connections(keep: tuple[str, int]) -> int:
    """Shut down (both directions) this process's established TCP connections, except those to `keep` (host
    as an IPv4 address, port). Returns how many were cut; logs their far ends and the other connections seen."""
    host, port = keep
    try:
        host = socket.gethostbyname(host)
    except OSError:
        pass
    mine = _sockets()
    cut, others = [], []
    for inode, far, state, kept in _connections(host, port, mine):
        if kept or state != "ESTABLISHED":
            others.append(f"{far} {state}{' (kept)' if kept else ''}")
            continue
        try:  # a duplicate: shutdown acts on the connection, which the owner's descriptor shares
            with socket.socket(fileno=os.dup(mine[inode])) as s:
                s.shutdown(socket.SHUT_RDWR)
            cut.append(far)
        except OSError as err:
            others.append(f"{far} {state} (not cut: {err})")
    log.warning("cut %d connections (%s); also seen: %s", len(cut), ", ".join(cut) or "none",
                ", ".join(others) or "none")
    return len(cut)

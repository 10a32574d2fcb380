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

import os
import socket
import struct

ESTABLISHED = "01"


def _ipv4(hex_addr: str) -> str:
    return socket.inet_ntoa(struct.pack("<I", int(hex_addr, 16)))


def _connections(keep_host: str, keep_port: int) -> set[str]:
    """Socket inodes of this process's network namespace's established TCP connections, except those whose far
    end is (keep_host, keep_port) (IPv6: any host on keep_port)."""
    inodes = set()
    for path, v4 in (("/proc/self/net/tcp", True), ("/proc/self/net/tcp6", False)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            host, port = remote.split(":")
            kept = int(port, 16) == keep_port and (not v4 or _ipv4(host) == keep_host)
            if state == ESTABLISHED and not kept:
                inodes.add(inode)
    return inodes


def cut_connections(keep: tuple[str, int]) -> int:
    """Shut down (both directions) this process's established TCP connections, except those to `keep` (host
    as an IPv4 address, port). Returns how many were cut."""
    host, port = keep
    try:
        host = socket.gethostbyname(host)
    except OSError:
        pass
    inodes, cut = _connections(host, port), 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if not (link.startswith("socket:[") and link[8:-1] in inodes):
            continue
        try:  # a duplicate: shutdown acts on the connection, which the owner's descriptor shares
            with socket.socket(fileno=os.dup(int(fd))) as s:
                s.shutdown(socket.SHUT_RDWR)
            cut += 1
        except OSError:
            continue
    return cut

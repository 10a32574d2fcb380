"""The protocol version. Every heartbeat carries the agent's, every worker started by an agent gets the
controller's (`PHALANX_PROTOCOL`); a side that meets another version refuses with `ProtocolMismatch`, which
says which side to upgrade, instead of failing later on a field it does not know.

Bump it when a message, env variable or store key changes meaning (adding an optional field does not).
"""

from __future__ import annotations

PROTOCOL_VERSION = 7  # 2: a heartbeat names its node by an opaque `handle`, no longer by `pid`; 3: agents join
# from other hosts (`JoinRequest`) and report their address, interface and free ports; 4: a heartbeat reply may
# ask for the next heartbeat sooner (`next_heartbeat_s`); 5: the link carries the agent's beats up and the
# controller's pokes down, and an agent sends a full heartbeat only on news (`messages.LINK_POKE`); 6: replies no
# longer relay progress: each worker writes it for its agent on the node (`PHALANX_PROGRESS_FILE`); 7: an
# assignment may ask its agent to ship the rank logs to the controller (`ship_log`: a host without its files)
PROTOCOL_ENV = "PHALANX_PROTOCOL"


class ProtocolMismatch(RuntimeError):
    """The other side speaks another protocol version: one of them must be upgraded."""


def check_version(theirs: object, who: str) -> None:
    """Refuse a peer of another protocol version (`who`: what the peer is, for the message)."""
    if theirs is None:
        raise ProtocolMismatch(f"{who} sent no protocol version (an older Phalanx?); this side speaks version "
                               f"{PROTOCOL_VERSION}: run the same Phalanx version on the controller, agents and "
                               f"workers")
    try:
        version = int(theirs)
    except (TypeError, ValueError):
        raise ProtocolMismatch(f"{who} sent protocol version {theirs!r}, not an integer") from None
    if version != PROTOCOL_VERSION:
        newer = "upgrade this side" if version > PROTOCOL_VERSION else f"upgrade the {who.removeprefix('the ').split()[0]}"
        raise ProtocolMismatch(f"{who} speaks protocol version {version}, this side {PROTOCOL_VERSION}: {newer} "
                               f"(the controller, agents and workers must run the same Phalanx version)")

"""Answering one agent heartbeat: record what the node reports (its phase, health, workers), then build the
reply (what the node must run, or that it must terminate). The HTTP handler (`api.py`) refuses first what
it must (another protocol version, a terminated node, another agent's handle) and calls this; the policy
tests' fake agents call it too, so they exercise the same handling.

Must not know: HTTP, processes.
"""

from __future__ import annotations

from typing import Callable

from phalanx.control.state.store import ENDED, Node, NodeState, Store
from phalanx.protocol import PROTOCOL_VERSION
from phalanx.protocol.messages import Heartbeat, HeartbeatReply


def answer_heartbeat(store: Store, jobs, deep_checks, controller_id: float, node: Node, hb: Heartbeat,
                     now: float, poke: Callable[[], None] | None = None) -> dict:
    """The reply to `hb` from `node` (already checked to be its agent's), as sent on the wire (the fields
    set, so an agent reads exactly what the controller decided). `poke` wakes the reconciler: called when the
    heartbeat brings news for a job changing generation (a worker's state changed, or the node is hurried), so
    the decision it waits on is taken now, not at the next tick."""
    if hb.handle != node.handle:
        store.update_node(node.name, handle=hb.handle)  # (its first heartbeat: written now, not batched)
    # never older than a sign of life already seen: a heartbeat answered after a queue of seconds, its agent's
    # retry answered before it and its beats since, dated the node back to its arrival (and it was judged silent)
    store.observe_node(node.name, last_heartbeat=max(now, node.last_heartbeat or now), health=hb.health,
                       report={"phase": hb.phase, "lifecycle": hb.lifecycle, "deep_check": hb.deep_check,
                               "standbys": hb.standbys, "address": hb.address, "ifname": hb.ifname,
                               "free_ports": hb.free_ports})
    changed = jobs.ingest(node, hb.workers, hb.reply_sent_at)
    if hb.time_limit_warned_at is not None:
        jobs.time_limit_warned(node.name, hb.time_limit_warned_at)
    status = store.cluster()["status"]
    sent_at, workers, standby = jobs.assignments(store.node(node.name))
    common = {"protocol": PROTOCOL_VERSION, "sent_at": sent_at, "controller": controller_id, "workers": [],
              "faults": []}
    if node.state == NodeState.REPLACING:
        reply = HeartbeatReply(**common, action="terminate", reason=node.reason)
    elif status in ENDED:
        reply = HeartbeatReply(**common, action="terminate", reason=f"cluster is {status}")
    else:
        soon = jobs.next_heartbeat_s(node, now)
        reply = HeartbeatReply(**{**common, "faults": store.take_directives(node.name), "workers": workers},
                               action="run", state=node.state.value, standby=standby,
                               deep_check=deep_checks.assignment(node),
                               **({"next_heartbeat_s": soon} if soon is not None else {}))
    if poke is not None and (changed or reply.next_heartbeat_s is not None):
        poke()
    return reply.model_dump(exclude_unset=True)

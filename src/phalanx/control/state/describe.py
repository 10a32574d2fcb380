"""What `phalanx cluster describe` shows (`GET /v1/cluster`, or read from state.db when the controller is down):
the cluster's status, its groups with their members and spares, the controller's and the store's addresses.

A read-only view over `Store`. Must not know: HTTP, the reconciler's policy.
"""

from __future__ import annotations

from phalanx.control.state.store import S, Store


def describe(store: Store) -> dict:
    """What `cluster describe` shows: status, groups with counts and spares, controller, store."""
    c, spec = store.cluster(), store.spec()
    nodes = store.nodes(include_terminated=False)
    groups = []
    for g in store.groups():
        mine = [n for n in nodes if n.group == g["name"]]
        members = [n for n in mine if not n.is_spare and n.live]
        spares = [n for n in mine if n.is_spare and n.live]
        groups.append({
            "name": g["name"], "instance_type": g["instance_type"], "count": g["count"], "spares": g["spares"],
            "on_create": g["on_create"], "members_healthy": sum(n.state == S.HEALTHY for n in members),
            "members": len(members), "spares_ready": sum(n.state == S.HEALTHY for n in spares),
            "spares_total": len(spares), "provision_failures": g["provision_failures"],
        })
    host = c["api_host"]
    return {
        "name": c["name"], "status": c["status"], "status_reason": c["status_reason"], "backend": spec.backend,
        "node_recovery": spec.node_recovery, "created_at": c["created_at"], "groups": groups,
        "controller": {"pid": c["controller_pid"], "started_at": c["controller_started_at"],
                       "api": f"http://{host}:{c['api_port']}" if c["api_port"] else None},
        "store": {"addr": f"{host}:{c['store_port']}" if c["store_port"] else None},
        "health": spec.health.model_dump(),
    }

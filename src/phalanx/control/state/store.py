"""The controller's truth: SQLite (WAL) in the cluster directory, and the node state machine.

    provisioning ──► configuring ──► health-checking ──► healthy
          │              │                 │                │
          └──────────────┴────► faulty ◄───┴────────────────┘
                                  │
                                  ▼
                              replacing ──► terminated      (any state ──► terminated on delete)

Every transition goes through `transition()`, which refuses illegal moves and writes an event with a
reason (through the controller's one event writer, `event_records.py`), so the events table is a complete
history. The job tables (`jobs`, `generations`, `workers`) are read and written through
`phalanx.control.state.jobs`, on this connection.

One connection shared by the controller's threads behind a lock (a few writes per heartbeat interval;
SQLite serialises writers anyway). Knows nothing about processes, HTTP or the reconciler's policy.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from phalanx.control.spec import ClusterSpec
from phalanx.control.state.event_records import EventRecords
from phalanx.control.state.node_rows import (  # noqa: F401 - the rows' types, imported from here by their users
    ALLOWED, BRINGUP_STATES, ENDED, FAULT_CAUSES, JSON_COLUMNS, ClusterStatus, IllegalTransition, Node, NodeState, S,
    _encoded, _node, failing, with_fields)
from phalanx.control.state.schema import JOIN_MINE, JOIN_WAITING, SCHEMA, migrate
from phalanx.observability.events import EventKind

OBSERVED = frozenset({"last_heartbeat", "acked_at", "health", "report"})  # what a heartbeat reports, batched
NO_NEWS = OBSERVED | {"handle", "job"}  # columns no heartbeat reply depends on: a write of them pokes no agent
FLUSH_S = 1.0  # the reconciler writes the batched observations at most this often (and FLUSH_RATE rows a second)...
FLUSH_ROWS = 512  # ...in transactions of at most this many nodes, the store's lock let go between them
FLUSH_RATE = 1024  # (4,096 nodes: every 4 s, not every second; a flush of them holds the store's lock ~32 ms)


class Store(EventRecords):
    """All reads and writes of a cluster's state.db."""

    def __init__(self, path: Path | str, clock: Callable[[], float] = time.time, *, owner: bool = False):
        """`owner`: this Store is the only writer of the database while it is open (the controller), so it keeps
        every node's row in memory, refreshed on its own writes: a reconciler tick reads every node several times
        and a heartbeat reads its node thrice, which from SQLite (with the JSON columns parsed) took ~10 ms per
        read of 1,024 nodes. Nodes read are shared: treat their `health`, `report` and `directives` as read-only.
        Without it (CLIs, beside a running controller) every read goes to SQLite."""
        self.path = Path(path)
        self._owner = owner
        self._rows: dict[str, Node] | None = None  # owner: name → Node, loaded on the first read
        self._order: list[str] | None = None  # owner: names by (created_at, name), rebuilt when a node is added
        self._observed: dict[str, dict] = {}  # owner: node → heartbeat observations not yet in SQLite, as stored
        self._touched: set[str] = set()  # owner: nodes whose row changed since `take_touched`, but by a beat
        self._version = 0  # owner: counts the writes of nodes' rows and groups, and health reports with a failure
        self._flushed_at = float("-inf")  # (time.monotonic) the last flush_observed that wrote
        self._cluster_row: dict | None = None  # owner: the cluster's row, until update_cluster
        self.job_memo: dict | None = {} if owner else None  # owner: `JobRecords`' reads, until its next write
        self.reports_memo: dict | None = {} if owner else None  # owner: node → worker reports ingested (`JobRecords`)
        self.generation_rows: dict | None = {} if owner else None  # owner: (job, generation) → rank → WorkerRecord
        self.clock = clock  # the time it stamps rows and events with (tests drive a fake one)
        # told of a write an agent's heartbeat reply depends on (`changed`): the controller pokes the agents' links
        self.on_change: Callable[[tuple[str, ...] | None], None] | None = None
        self.make_way: Callable[[], None] | None = None  # lets heartbeats queued for the lock in (`flush_observed`)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=10.0)
        self._db.row_factory = sqlite3.Row
        self._db.executescript("PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA foreign_keys=ON;")
        migrate(self._db)  # (nobody else holds this store yet)
        self.log = self.event_log()  # the controller's one event writer (`EventRecords`)

    @property
    def owner(self) -> bool:  # opened by the controller, the one writer of its state: reads may be kept in memory
        return self._owner

    @property
    def version(self) -> int | None:  # what a scan of every node finds is the same until it moves; None: not the owner
        return self._version if self._owner else None

    @property
    def lock(self) -> threading.RLock:  # held around every statement and transaction (re-entrant)
        return self._lock

    def close(self) -> None:
        with self._lock:
            try:
                self.make_way = None  # (the lock is held here: nothing queued for it could go in)
                self.flush_observed()  # the heartbeats' last observations
            finally:
                self._db.close()

    def _exec(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        """Run one statement and fetch its rows under the lock (never inside another thread's transaction)."""
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    execute = _exec  # one statement under the store's lock (for the record modules built on this connection)

    @contextmanager
    def transaction(self):
        """BEGIN IMMEDIATE … COMMIT under the lock; rolled back (and re-raised) on any error."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # ---- cluster and groups -------------------------------------------------------------------
    def initialize(self, spec: ClusterSpec) -> None:
        """Create the schema and the cluster's rows (status `creating`). Run once, at `cluster create`."""
        now = self.clock()
        with self._lock:
            self._db.executescript(SCHEMA)
            migrate(self._db)  # (the indexes on columns a migration may add)
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT INTO cluster (name, spec_json, status, status_reason, created_at) VALUES (?,?,?,?,?)",
                (spec.name, spec.model_dump_json(), ClusterStatus.CREATING.value, "cluster create", now),
            )
            for g in spec.instance_groups:
                self._db.execute(
                    "INSERT INTO groups (name, instance_type, count, spares, on_create) VALUES (?,?,?,?,?)",
                    (g.name, g.instance_type, g.count, g.spares, str(g.on_create) if g.on_create else None),
                )
            self._db.execute("COMMIT")
        self.record_event(EventKind.CLUSTER, f"cluster {spec.name} created from spec; status creating")

    def spec(self) -> ClusterSpec:
        return ClusterSpec.model_validate_json(self.cluster()["spec_json"])

    def cluster(self) -> dict:
        """The cluster's row (a copy; the owner's read from memory: every heartbeat asks for its status)."""
        with self._lock:
            row = self._cluster_row if self._owner else None
            if row is None:
                row = dict(self._exec("SELECT * FROM cluster")[0])
                self._cluster_row = row if self._owner else None
            return dict(row)

    def changed(self, nodes: tuple[str, ...] | None = None) -> None:
        """Something the heartbeat replies of `nodes` (None: every node) depend on was written: a node's state or
        directives, a job's or generation's row, the cluster's status, an event. Tells `on_change`."""
        if self.on_change is not None:
            self.on_change(nodes)

    def update_cluster(self, **fields) -> None:
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._lock:
            self._cluster_row = None
            self._exec(f"UPDATE cluster SET {cols}", tuple(fields.values()))
        if fields.get("status") in ENDED:  # the one cluster field a reply depends on: every agent must terminate
            self.changed()

    def set_status(self, status: ClusterStatus, reason: str) -> None:
        if (old := self.cluster()["status"]) == status.value:
            return
        self.update_cluster(status=status.value, status_reason=reason)
        self.record_event(EventKind.CLUSTER, reason, from_state=old, to_state=status.value)

    def groups(self) -> list[dict]:
        return [dict(r) for r in self._exec("SELECT * FROM groups ORDER BY name")]

    def update_group(self, name: str, **fields) -> None:
        cols = ", ".join(f"{k}=?" for k in fields)
        with self._lock:
            self._exec(f"UPDATE groups SET {cols} WHERE name=?", (*fields.values(), name))
            self._version += 1

    # ---- nodes --------------------------------------------------------------------------------
    def add_node(self, group: str, *, is_spare: bool, work_root: Path, reason: str) -> Node:
        return self.add_nodes(group, [(is_spare, reason)], work_root=work_root)[0]

    def add_nodes(self, group: str, wanted: list[tuple[bool, str]], *, work_root: Path) -> list[Node]:
        """New nodes in state provisioning, one per (is_spare, reason), named `<group>-<n>` (never reused), in one
        transaction: 4,096 one at a time, each waiting its turn at the lock, took ~100 s of a cluster's creation."""
        now, names = self.clock(), []
        with self._lock:
            with self.transaction() as db:
                (index,) = db.execute("SELECT next_index FROM groups WHERE name=?", (group,)).fetchone()
                for i, (is_spare, reason) in enumerate(wanted):
                    names.append(name := f"{group}-{index + i}")
                    row = (name, group, S.PROVISIONING.value, int(is_spare), reason, str(work_root / name), now, now)
                    db.execute("INSERT INTO nodes (name, group_name, state, is_spare, reason, work_dir, created_at, "
                               "state_since) VALUES (?,?,?,?,?,?,?,?)", row)
                    self.log.emit(EventKind.TRANSITION, reason, node=name, to_state=S.PROVISIONING.value)
                db.execute("UPDATE groups SET next_index=? WHERE name=?", (index + len(wanted), group))
            for name in names:
                self._written(name)
        return [self.node(name) for name in names]

    def claim_node(self, group: str, handle: str, work_root: str, name: str | None = None) -> Node | None:
        """An agent joining from its host: the node of `group` (or the one named) that waits for an agent (provisioning,
        no handle) becomes this agent's, its work dir WORK_ROOT/<cluster>/<node> on that host; members before spares.
        The same agent joining again before its first heartbeat (its answer lost) gets the one it claimed. Else None."""
        which, args = " AND name=?" if name else "", (group, S.PROVISIONING.value, *([name] if name else []))
        with self._lock:  # (two lookups on indexes: one sorting every waiting node took 7 ms a join at 4,096)
            mine = self._exec(JOIN_MINE.format(name=which), (*args, handle))
            if mine and self.node(mine[0]["name"]).last_heartbeat is None:  # (the owner's view: heartbeats batched)
                return self.node(mine[0]["name"])
            rows = self._exec(JOIN_WAITING.format(name=which), args)
            if not rows:
                return None
            claimed = rows[0]["name"]
            cluster = self.cluster()["name"]
            self.update_node(claimed, handle=handle, work_dir=f"{work_root.rstrip('/')}/{cluster}/{claimed}")
            return self.node(claimed)

    def node(self, name: str) -> Node | None:
        if self._owner:
            return self._cached().get(name)
        return next(map(_node, self._exec("SELECT * FROM nodes WHERE name=?", (name,))), None)

    def nodes(self, *, include_terminated: bool = True) -> list[Node]:
        if self._owner:
            with self._lock:
                rows = self._cached()
                if self._order is None:
                    self._order = sorted(rows, key=lambda n: (rows[n].created_at, n))
                found = [rows[n] for n in self._order]
            return found if include_terminated else [n for n in found if n.state != S.TERMINATED]
        where = "" if include_terminated else f" WHERE state != '{S.TERMINATED.value}'"
        return [_node(r) for r in self._exec(f"SELECT * FROM nodes{where} ORDER BY created_at, name")]

    def _cached(self) -> dict[str, Node]:
        with self._lock:
            if self._rows is None:
                self._rows = {r["name"]: _node(r) for r in self._db.execute("SELECT * FROM nodes").fetchall()}
            return self._rows

    def _written(self, name: str) -> None:
        """The owner's view of node `name` after a committed write of its row: read back from SQLite."""
        if not self._owner:
            return
        with self._lock:
            if self._rows is None:
                return
            if name not in self._rows:
                self._order = None
            if self._observed.get(name):  # its heartbeat's observations first: the row read back must hold them
                self._write_observed({name: self._observed.pop(name)})
            row = self._db.execute("SELECT * FROM nodes WHERE name=?", (name,)).fetchone()
            self._touched.add(name)
            self._version += 1
            if row is None:
                self._rows.pop(name, None)
            else:
                self._rows[name] = _node(row)

    def update_node(self, name: str, **fields) -> None:
        """Record observations (heartbeat time, handle, health) — never the state; see `transition`."""
        self.update_nodes({name: fields})

    def observe_node(self, name: str, **fields) -> None:
        """A heartbeat's observations (`OBSERVED` columns): in the owner's view at once, in SQLite at the next
        `flush_observed` (the reconciler's tick, at most every FLUSH_S; a second per FLUSH_RATE nodes) or the node's
        next write: two UPDATEs per heartbeat were most of its handling at a thousand agents. A controller killed
        loses those times, which its agents send again. Not the owner, or a node not read yet: `update_node` now."""
        assert set(fields) <= OBSERVED, f"not a heartbeat's observation: {set(fields) - OBSERVED}"
        with self._lock:
            cached = self._rows.get(name) if self._owner and self._rows is not None else None
            if cached is None:
                self.update_node(name, **fields)
                return
            self._rows[name] = with_fields(cached, fields)
            self._touched.add(name)
            if failing(fields.get("health")):  # a check fails: what a scan of every node finds may have moved
                self._version += 1
            # as stored (JSON encoded now, not in a flush's lump); one equal to the row's is in SQLite or pending
            self._observed.setdefault(name, {}).update(
                _encoded({k: v for k, v in fields.items() if k not in JSON_COLUMNS or v != getattr(cached, k)}))

    def take_touched(self) -> set[str]:
        """The owner's nodes whose rows changed since the last call, other than by `observe_beats`."""
        with self._lock:
            touched, self._touched = self._touched, set()
        return touched

    def node_map(self) -> dict[str, Node]:  # name → row, read under `lock`: the owner's view itself (never changed)
        return self._cached() if self._owner else {n.name: n for n in self.nodes()}

    def observe_beats(self, beats: dict[str, float]) -> None:
        """`observe_node(name, last_heartbeat=at)` for many nodes under one lock (the agents' beats, folded at a tick:
        thousands a second); a time not newer than the node's is ignored (not the owner: each written at once)."""
        with self._lock:
            rows = self._cached() if self._owner else None
            for name, at in beats.items():
                cached = rows.get(name) if rows is not None else None
                if cached is None:
                    self.update_node(name, last_heartbeat=at)
                elif cached.last_heartbeat is None or at > cached.last_heartbeat:
                    rows[name] = with_fields(cached, {"last_heartbeat": at})
                    self._observed.setdefault(name, {})["last_heartbeat"] = at

    def flush_observed(self, *, every_s: float = 0.0) -> int:
        """Write the observations `observe_node` kept, FLUSH_ROWS nodes per transaction, `make_way` between them
        (heartbeats queued for the lock meanwhile: `server/heartbeat_route.LockQueue`; else 1 ms); not when the last
        flush that wrote was less than `every_s` ago, nor one second per FLUSH_RATE nodes waiting. Returns the nodes
        written. (One transaction of 4,096 rows took 32 ms here, under the lock every heartbeat's answer takes.)"""
        with self._lock:
            every_s = max(every_s, len(self._observed) / FLUSH_RATE) if every_s else 0.0
            if not self._observed or time.monotonic() - self._flushed_at < every_s:
                return 0
            names = list(self._observed)
        written = 0
        for start in range(0, len(names), FLUSH_ROWS):
            if start:  # (a lock is not fair: taken back at once, it lets in almost none of those waiting for it)
                self.make_way() if self.make_way else time.sleep(0.001)
            with self._lock:  # popped and written under one hold: `_written` never misses one in flight
                pending = {n: self._observed.pop(n) for n in names[start:start + FLUSH_ROWS] if n in self._observed}
                self._write_observed(pending)
                written += len(pending)
        self._flushed_at = time.monotonic()
        return written

    def _write_observed(self, pending: dict[str, dict]) -> None:
        by_columns: dict[tuple, list] = {}
        for name, fields in pending.items():
            if fields:
                encoded = _encoded(fields)
                by_columns.setdefault(tuple(encoded), []).append((*encoded.values(), name))
        if not by_columns:
            return
        with self.transaction() as db:
            for columns, rows in by_columns.items():
                db.executemany(f"UPDATE nodes SET {', '.join(f'{c}=?' for c in columns)} WHERE name=?", rows)

    def update_nodes(self, fields_by_node: dict[str, dict]) -> None:
        """`update_node` of many nodes: FLUSH_ROWS rows per transaction, the lock let go between them (one
        autocommit per node, under the scheduler's lock, was 0.8 s of a tick at 4,096 nodes). The owner's rows
        take the values written, without reading them back (a heartbeat's path)."""
        names = list(fields_by_node)
        for start in range(0, len(names), FLUSH_ROWS):
            chunk = {n: fields_by_node[n] for n in names[start:start + FLUSH_ROWS]}
            assert not any("state" in f for f in chunk.values()), "use transition() to change a node's state"
            with self._lock:
                for name, fields in chunk.items():
                    for column in _encoded(dict.fromkeys(fields)):  # written now: an older observation of it
                        self._observed.get(name, {}).pop(column, None)  # must not be flushed over it
                self._write_observed(chunk)
                self._version += 1
                for name, fields in chunk.items():
                    cached = self._rows.get(name) if self._owner and self._rows is not None else None
                    if cached is not None:
                        self._touched.add(name)
                        self._rows[name] = with_fields(cached, {k: bool(v) if k == "is_spare" else v
                                                                for k, v in fields.items()})
                    else:
                        self._written(name)
        if changed := tuple(n for n, f in fields_by_node.items() if set(f) - NO_NEWS):
            self.changed(changed)

    def add_directive(self, name: str, directive: str) -> None:
        """Queue something for the node's agent (handed over with the next heartbeat reply)."""
        with self._lock:
            node = self.node(name)
            self.update_node(name, directives=[*node.directives, directive])

    def take_directives(self, name: str) -> list:
        with self._lock:
            node = self.node(name)
            if node.directives:
                self.update_node(name, directives=[])
            return node.directives

    def transition(self, name: str, to: NodeState, reason: str, **fields) -> Node:
        """Move a node to `to`, recording an event with `reason`. Refuses moves the state machine forbids."""
        now = self.clock()
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT state FROM nodes WHERE name=?", (name,)).fetchone()
                if row is None:
                    raise KeyError(f"no node named {name!r}")
                frm = NodeState(row["state"])
                if to not in ALLOWED[frm]:
                    raise IllegalTransition(f"node {name}: {frm.value} → {to.value} is not a legal transition")
                extra = "".join(f", {k}=?" for k in fields)
                self._db.execute(f"UPDATE nodes SET state=?, reason=?, state_since=?{extra} WHERE name=?",
                                 (to.value, reason, now, *fields.values(), name))
                self.log.emit(EventKind.TRANSITION, reason, node=name, from_state=frm.value, to_state=to.value)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._written(name)
        self.changed((name,))
        return self.node(name)


def open_existing(path: Path, *, owner: bool = False) -> Store:
    """Open a cluster's state.db that must already exist (never an empty one by accident); `owner`: see `Store`."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no cluster state at {path}")
    return Store(path, owner=owner)

"""The cluster's SQLite schema (state.db), and the migrations that bring a state.db written by an older
Phalanx up to it. `store.py` and `jobs.py` read and write these tables.

Must not know: policy, processes, HTTP.
"""

from __future__ import annotations

import sqlite3

SCHEMA = """
CREATE TABLE IF NOT EXISTS cluster (
    name TEXT PRIMARY KEY, spec_json TEXT NOT NULL, status TEXT NOT NULL, status_reason TEXT,
    created_at REAL NOT NULL, controller_pid INTEGER, controller_started_at REAL,
    api_host TEXT, api_port INTEGER, store_port INTEGER
);
CREATE TABLE IF NOT EXISTS groups (
    name TEXT PRIMARY KEY, instance_type TEXT NOT NULL, count INTEGER NOT NULL, spares INTEGER NOT NULL,
    on_create TEXT, next_index INTEGER NOT NULL DEFAULT 0,
    provision_failures INTEGER NOT NULL DEFAULT 0   -- consecutive nodes that never became healthy
);
CREATE TABLE IF NOT EXISTS nodes (
    name TEXT PRIMARY KEY, group_name TEXT NOT NULL REFERENCES groups(name), state TEXT NOT NULL,
    is_spare INTEGER NOT NULL, reason TEXT, health_json TEXT, report_json TEXT, directives_json TEXT,
    last_heartbeat REAL, handle TEXT,      -- the backend's opaque handle (local: the agent's pid)
    work_dir TEXT NOT NULL, job TEXT,
    created_at REAL NOT NULL, state_since REAL NOT NULL,
    acked_at REAL,      -- `sent_at` of the last heartbeat reply the agent says it acted on
    fault_cause TEXT    -- why it went faulty, one of store.FAULT_CAUSES
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL, node TEXT, job TEXT, kind TEXT NOT NULL,
    from_state TEXT, to_state TEXT, reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL UNIQUE, name TEXT NOT NULL, state TEXT NOT NULL,
    kind TEXT NOT NULL,                       -- train (phalanx.worker + config) | command (any argv)
    group_name TEXT NOT NULL, nodes_requested INTEGER NOT NULL, workers_per_node INTEGER NOT NULL,
    argv_json TEXT NOT NULL, cwd TEXT NOT NULL, env_json TEXT NOT NULL, config_json TEXT,
    job_dir TEXT NOT NULL, checkpoint_dir TEXT NOT NULL,
    nodes_json TEXT NOT NULL DEFAULT '[]',    -- nodes of the current generation, in rank order
    auto_resume INTEGER NOT NULL, max_retries INTEGER NOT NULL,
    recovery TEXT NOT NULL DEFAULT 'restart',  -- restart | checkpointless
    straggler_json TEXT,                      -- {"factor", "steps", "policy"} (NULL: the defaults)
    elastic_json TEXT,                        -- elastic jobs: settings, target, last change (NULL: fixed size)
    priority INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,      -- generations started
    retries INTEGER NOT NULL DEFAULT 0,       -- restarts after application errors
    node_faults INTEGER NOT NULL DEFAULT 0,   -- generations ended by a node fault
    generation INTEGER NOT NULL DEFAULT 0, last_step INTEGER, reason TEXT,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, ended_at REAL
);
CREATE TABLE IF NOT EXISTS generations (
    job TEXT NOT NULL REFERENCES jobs(id), generation INTEGER NOT NULL, nodes_json TEXT NOT NULL,
    master_addr TEXT NOT NULL, master_port INTEGER NOT NULL, store_addr TEXT,
    started_at REAL NOT NULL,
    stop_at REAL,          -- workers told to stop (a fault, a cancel); NULL while the generation runs
    ended_at REAL,         -- every worker confirmed gone (or all exited 0)
    outcome TEXT,          -- succeeded | node-fault | app-error | cancelled
    end_reason TEXT, faults_json TEXT NOT NULL DEFAULT '[]',
    start_step INTEGER,    -- first progress reported (the resumed step)
    last_step INTEGER, first_step_at REAL,  -- first step finished after start_step
    restored_json TEXT,    -- checkpointless: how its state was restored (reported by its rank 0)
    standbys_json TEXT NOT NULL DEFAULT '{}',  -- rank → id of the warm standby told to become it
    PRIMARY KEY (job, generation)
);
CREATE TABLE IF NOT EXISTS workers (
    job TEXT NOT NULL, generation INTEGER NOT NULL, rank INTEGER NOT NULL, node TEXT NOT NULL,
    local_rank INTEGER NOT NULL, pid INTEGER,
    state TEXT NOT NULL,   -- running | stopping | exited | lost (its node died with it)
                           -- | carried (a checkpointless survivor: the process serves the next generation)
    exit_code INTEGER, detail TEXT, hang TEXT, frozen INTEGER NOT NULL DEFAULT 0,  -- hung with its beat stopped
    stopped INTEGER NOT NULL DEFAULT 0, step INTEGER,
    started_at REAL, ended_at REAL, PRIMARY KEY (job, generation, rank)
);
CREATE TABLE IF NOT EXISTS counters (  -- monotonic counts /metrics reads without scanning the events
    name TEXT NOT NULL, label TEXT NOT NULL, value INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (name, label)
);
CREATE INDEX IF NOT EXISTS events_node ON events(node);
CREATE INDEX IF NOT EXISTS events_job ON events(job);
CREATE INDEX IF NOT EXISTS workers_node ON workers(node, state);  -- each heartbeat reads its node's live workers
"""


# A join's two lookups (`Store.claim_node`), on the indexes `migrate` makes; `{name}`: "" or " AND name=?"
JOIN_MINE = ("SELECT name FROM nodes WHERE group_name=? AND state=?{name} AND handle=? "
             "ORDER BY is_spare, created_at, name LIMIT 1")
JOIN_WAITING = ("SELECT name FROM nodes WHERE group_name=? AND state=?{name} AND handle IS NULL "
                "ORDER BY is_spare, created_at, name LIMIT 1")


def migrate(db: sqlite3.Connection) -> None:
    """Bring an existing state.db up to `SCHEMA` (a fresh file has no tables yet: nothing to do).

    - Before node handles (protocol 1) a node's agent was known by `nodes.pid`: it is copied into the opaque
      `handle`, so `cluster delete` still finds the agents of a cluster made by the older version.
    - Before the Prometheus metrics a state.db had no `counters` table and no `nodes.fault_cause`: both are
      added empty (the counts of faults before the upgrade are not reconstructed from the events' free text;
      a counter that starts at the upgrade is what Prometheus expects of a restarted process anyway).
    - Before straggler settings a job had none: `jobs.straggler_json` is added, NULL (the defaults).
    - Before elastic jobs: `jobs.elastic_json` (NULL: a fixed-size job) and `jobs.priority` (0) are added.
    - Before the index `workers_node` a heartbeat scanned the workers table: the index is added.
    - The indexes a join looks its node up by, `nodes_waiting` and `nodes_handle` (without them each join sorted
      every waiting node: 7 ms at 4,096, under the store's lock), are made here, for a new state.db too (after
      `SCHEMA`): an older one has no `handle` column until it is added above.
    """
    columns = {row[1] for row in db.execute("PRAGMA table_info(nodes)")}
    if columns and "handle" not in columns:
        db.execute("ALTER TABLE nodes ADD COLUMN handle TEXT")
        db.execute("UPDATE nodes SET handle = CAST(pid AS TEXT) WHERE pid IS NOT NULL")
    if columns and "fault_cause" not in columns:
        db.execute("ALTER TABLE nodes ADD COLUMN fault_cause TEXT")
    if columns:
        db.execute("CREATE INDEX IF NOT EXISTS nodes_waiting ON nodes(group_name, state, is_spare, created_at, name) "
                   "WHERE handle IS NULL")
        db.execute("CREATE INDEX IF NOT EXISTS nodes_handle ON nodes(handle)")
        db.execute("CREATE TABLE IF NOT EXISTS counters (name TEXT NOT NULL, label TEXT NOT NULL, "
                   "value INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (name, label))")
    job_columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    if job_columns:  # (before it, each heartbeat read every worker row the cluster ever had)
        db.execute("CREATE INDEX IF NOT EXISTS workers_node ON workers(node, state)")
    if job_columns and "straggler_json" not in job_columns:
        db.execute("ALTER TABLE jobs ADD COLUMN straggler_json TEXT")
    if job_columns and "elastic_json" not in job_columns:
        db.execute("ALTER TABLE jobs ADD COLUMN elastic_json TEXT")
        db.execute("ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0")

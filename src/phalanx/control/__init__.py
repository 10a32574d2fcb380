"""The control plane: `server/` (the controller daemon and its HTTP API), `state/` (SQLite: nodes, jobs,
events), `policy/` (reconciler, scheduler, checkpointless recovery, deep checks), `backends/` (where nodes
come from: the `Backend` interface, `local`), `agent/` (the node agent: workers, hangs, standbys, health),
`client/` (the Python API and CLIs). docs/architecture.md draws it, and follows a failure through it.

Talks to workers only through `phalanx.protocol`. Must not know: models, parallelism, the training loop."""

"""The control plane: a controller daemon (SQLite state, reconciler, HTTP API, rendezvous store), node
agents (bring-up, heartbeats, health checks) and the seam to workers. No torch model code here."""

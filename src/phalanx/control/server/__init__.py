"""The controller process: `daemon` (startup, the rendezvous store, shutdown) and `api` (the HTTP API:
heartbeats in, assignments out, the CLI's requests, Prometheus /metrics).

Must not know: how a node is started (a `Backend` does it), what a worker does beyond the protocol."""

"""What Phalanx tells about itself: one vocabulary of events (`events.EventKind`) for the controller's
ledger (SQLite, `phalanx cluster events`) and a run's `metrics.jsonl`. The goodput ledger, the Prometheus
collector and the dashboard (next) read these.

Must not know: policy, models; imports nothing heavy (agents and the CLI import it)."""

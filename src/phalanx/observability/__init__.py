"""What Phalanx tells about itself: one event stream. `events.py` holds the vocabulary (`EventKind`), the
record (`Event`) and the one writer (`EventLog`) the controller, the node agents and the training runtime
emit through; `run_events.py` the run's events.jsonl that every source appends to, and its reader. The
goodput ledger, the Prometheus collector and the dashboard (next) read these.

Must not know: policy, models; imports nothing heavy (agents and the CLI import it)."""

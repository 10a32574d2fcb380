"""What Phalanx tells about itself: one event stream. `events.py` holds the vocabulary (`EventKind`), the
record (`Event`) and the one writer (`EventLog`) the controller, the node agents and the training runtime
emit through; `run_events.py` the run's events.jsonl that every source appends to, and its reader;
`goodput.py` the goodput ledger computed from a run's files (events.jsonl and rank 0's metrics.jsonl).

Must not know: policy, models; imports nothing heavy (agents and the CLI import it)."""

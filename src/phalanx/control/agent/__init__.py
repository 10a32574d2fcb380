"""The node agent and what runs inside it: `node_agent` (registration, heartbeats, the controller's
replies), `supervisor` (the workers it is told to run), `hang` (the hang rule), `standby` (the warm standby
pool), `health` (the node's health checks), `deep_check`/`deep_probe` (its part of a deep health check).

Must not know: scheduling or recovery policy, SQLite, torch (only `deep_probe`, a process of its own, imports
torch)."""

"""Decisions, made from the state and applied through a `Backend`: `reconciler` (nodes: bring-up, health,
replacement from the spare pool), `scheduler` (jobs: generations, the fault policy, resume or fail) with
its mixins `admission` (which jobs are accepted) and `assignments` (what each agent is told), `inplace`
(checkpointless recovery), `deep_check` (deep health check rounds).

Must not know: processes, signals, /proc, HTTP status codes beyond a refusal's, torch."""

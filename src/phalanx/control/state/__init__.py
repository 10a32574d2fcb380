"""The controller's truth on disk: `store` (SQLite: the cluster, its nodes and their state machine,
events), `jobs` (jobs, generations and worker records on the same database), `paths` (the cluster
directory's layout, private by default).

Must not know: policy (what a state means for what happens next), HTTP, processes."""

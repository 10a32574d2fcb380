"""The user's side: `cluster` and `jobs` (the Python API: create, start, delete; submit, describe, logs)
and the CLIs over them (`cli`, `job_cli`). Talks to the controller over HTTP, and reads its files directly
when it is down.

Must not know: policy internals, torch (a CLI that does not train must start fast)."""

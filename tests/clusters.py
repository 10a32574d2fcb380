"""Shared by the control-plane tests: a private PHALANX_HOME whose teardown deletes every cluster and fails if
any agent, worker or child of theirs survived (even when the test failed), and a polling helper."""

from __future__ import annotations

import os
from pathlib import Path
import shutil
import signal
import time

import pytest

from phalanx.control.backends.local import process_running, processes_mentioning, session_members
from phalanx.control.client.cluster import delete_cluster
from phalanx.control.state.paths import ClusterPaths, list_clusters
from phalanx.control.state.store import Store


def keep_for_debugging(name: str, folder: Path) -> None:
    """PHALANX_TEST_KEEP=1: copy cluster `name`'s files (logs, database, Slurm output) to folder/kept-NAME before
    a teardown deletes it."""
    if os.environ.get("PHALANX_TEST_KEEP"):
        shutil.copytree(ClusterPaths.for_name(name).root, folder / f"kept-{name}", dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.sock"))


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A private PHALANX_HOME. Teardown: delete every cluster, then fail if any process of it survived."""
    root = tmp_path / "home"
    monkeypatch.setenv("PHALANX_HOME", str(root))
    yield root
    sessions, workers, tracebacks = set(), set(), []
    for name in list_clusters():
        paths = ClusterPaths.for_name(name)
        store = Store(paths.db)
        sessions.update(int(n.handle) for n in store.nodes() if n.handle and n.handle.isdigit())  # local: a pid
        workers.update(r["pid"] for r in store.execute("SELECT pid FROM workers") if r["pid"])
        store.close()
        for log in [paths.controller_log, *paths.root.glob("nodes/*/agent.log")]:
            if "Traceback" in log.read_text():
                tracebacks.append(f"{log}:\n{log.read_text()[-3000:]}")
    errors = []
    for name in list_clusters():
        keep_for_debugging(name, tmp_path)
        try:
            delete_cluster(name, timeout_s=15)
        except Exception as err:  # keep cleaning up; reported below
            errors.append(f"delete {name}: {err!r}")
    leftovers = set(processes_mentioning(str(root)))
    for sid in sessions:
        leftovers.update(session_members(sid))
    leftovers.update(p for p in workers if process_running(p, "python"))
    described = {}
    for pid in leftovers:
        try:
            described[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
        except OSError:
            described[pid] = "?"
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not errors, errors
    assert not tracebacks, "\n".join(tracebacks)  # a reconciler/agent error must not pass silently
    assert not leftovers, f"processes left behind after cluster delete: {described}"


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def story(info: dict) -> list[str]:
    """A job's generations as a failure message reads them: outcome, size, why it ended, its faults."""
    return [f"generation {g['generation']} on {len(g['nodes'])} nodes: {g['outcome']} ({g['end_reason']}); faults "
            f"{[f.get('detail') for f in g['faults']]}" for g in info["generations"]]


def generations(info: dict, count: int) -> list[dict]:
    """A job's generations, asserted to be `count` of them; a failure says how each one ended."""
    gens = info["generations"]
    assert len(gens) == count, f"{len(gens)} generations, expected {count}:\n" + "\n".join(story(info))
    return gens

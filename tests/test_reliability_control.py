"""The control plane as a new user meets it: private files, lifecycle scripts run by their `#!` line, limits a
machine can run, exit codes (2 bad input or refusal, 1 failure) with one clear line in Phalanx's words, default
timeouts that agree, no torch import for commands that do not train, tables not cut when piped, and offline
views that say they are offline.

Most tests start nothing; one creates a real one-node cluster and walks it through its paths.
"""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clusters import home, wait_for  # noqa: F401  (home is a fixture)
from phalanx.cli import app
from phalanx.control.backends.local import processes_mentioning
from phalanx.control.client.cluster import ClusterClient, create_cluster
from phalanx.control.http import readable_detail
from phalanx.control.client.jobs import JobClient, timeout_warning
from phalanx.control.state.paths import ClusterPaths, list_clusters
from phalanx.control.spec import LOCAL_MAX_NODES, HealthSpec, SpecError, load_spec

runner = CliRunner()
PY = sys.executable


def write_spec(dir: Path, *, name="c1", count=1, spares=0, script: str | None = None, executable=True,
               group_extra: dict | None = None, **top) -> Path:
    group = {"name": "workers", "instance_type": "local.cpu-1", "count": count, "spares": spares,
             "warm_standby": False, "worker_template": False, **(group_extra or {})}  # no torch worker runs here
    if script is not None:
        path = dir / "on_create"
        path.write_text(script)
        path.chmod(0o755 if executable else 0o644)
        group["on_create"] = "on_create"
    tree = {"name": name, "backend": "local", "instance_groups": [group], **top}
    path = dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def cli(*args, env: dict | None = None):
    result = runner.invoke(app, [str(a) for a in args], env={"COLUMNS": None, **(env or {})})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        traceback.print_exception(result.exception)  # a crash, not an error line: show where (stderr)
    return result.exit_code, result.output


def flat(text: str) -> str:
    return " ".join(text.split())


PYDANTIC_WORDS = ("Value error", "Extra inputs are not permitted", "Input should be", "Field required",
                  "pydantic", "{'type'", "'loc'")


# ---- 4: spec errors in Phalanx's words; 3: the local backend's node cap ----------------------------------
def test_spec_errors_name_the_field_and_the_fix_in_phalanx_words(tmp_path, home):
    path = write_spec(tmp_path, bogus=1)
    tree = yaml.safe_load(path.read_text())
    tree["instance_groups"][0]["cout"] = 2
    tree["instance_groups"][0]["spares"] = "x"
    tree["health"] = {"hang_timeout_s": 0}
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(SpecError) as err:
        load_spec(path)
    msg = str(err.value)
    assert ("instance_groups.0.cout: unknown field; valid fields: name, instance_type, count, spares, on_create"
            in msg), msg
    assert "bogus: unknown field; valid fields: name, backend, node_recovery, instance_groups, health, api" in msg
    assert "instance_groups.0.spares: must be a valid integer" in msg and "(got 'x')" in msg
    assert "health.hang_timeout_s: must be greater than 0 (got 0)" in msg
    assert not any(word in msg for word in PYDANTIC_WORDS), msg
    code, out = cli("cluster", "create", "-f", path)
    assert code == 2 and "instance_groups.0.cout: unknown field" in out and "Traceback" not in out, out
    assert not home.exists(), "nothing may be created"


def test_the_local_backend_refuses_more_nodes_than_it_runs(tmp_path, home):
    load_spec(write_spec(tmp_path, count=LOCAL_MAX_NODES - 4, spares=4))  # the cap itself is fine
    path = write_spec(tmp_path, count=2, spares=10_000)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    msg = flat(str(err.value))
    assert "10002 nodes in total" in msg and f"at most {LOCAL_MAX_NODES} nodes" in msg and "lower count or spares" \
        in msg, msg
    code, out = cli("cluster", "create", "-f", path)
    assert code == 2 and "10002 nodes in total" in flat(out), out
    assert not home.exists() and processes_mentioning(str(home)) == []


# ---- 4: refusals exit 2, in one line -------------------------------------------------------------------
def test_refusals_exit_2_in_one_line(tmp_path, home):
    code, out = cli("job", "submit", "--nodes", 1, "--cluster", "nope", "--", "true")
    assert code == 2 and "no cluster named 'nope'" in out, out
    code, out = cli("job", "list")
    assert code == 2 and "no clusters under" in out, out

    code, out = cli("fault", "inject", "--node", "workers-0", "--kind", "gpu-xid")
    assert code == 2 and out.strip().splitlines() == [
        "error: --xid is required with --kind gpu-xid (e.g. --xid 13: the job restarts on the same nodes; --xid "
        "79: the node is replaced)"], out
    code, out = cli("fault", "inject", "--node", "workers-0", "--kind", "kill-node", "--xid", 79)
    assert code == 2 and "--xid goes with --kind gpu-xid only" in out, out

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out = cli("cluster", "create", "-f", write_spec(tmp_path, api={"port": port}))
    assert code == 2 and f"api.port: cannot listen on 127.0.0.1:{port}" in flat(out) and "nothing was started" \
        in flat(out), out
    assert list_clusters() == [] and processes_mentioning(str(home)) == []


def test_the_apis_validation_errors_read_as_field_and_message():
    detail = [{"type": "value_error", "loc": ["body"], "msg": "Value error, xid is required with kind gpu-xid",
               "input": {"kind": "gpu-xid"}},
              {"type": "extra_forbidden", "loc": ["body", "bogus"], "msg": "Extra inputs are not permitted",
               "input": 1}]
    text = readable_detail(detail)
    assert text == "xid is required with kind gpu-xid; bogus: unknown field", text
    assert readable_detail("node x is terminated") == "node x is terminated"


# ---- 5: default timeouts agree ---------------------------------------------------------------------------
def test_default_pg_timeout_outlasts_the_default_hang_timeout():
    from phalanx.train.config import TrainConfig

    pg = TrainConfig.model_fields["pg_timeout_s"].default
    hang = HealthSpec().hang_timeout_s
    assert pg > hang, (pg, hang)
    assert timeout_warning(pg, hang) is None  # what every default `job submit` printed before
    assert "pg_timeout_s=300 is not above the cluster's hang_timeout_s=300" in timeout_warning(300, 300)


# ---- 6: commands that do not train import no torch ----------------------------------------------------
def test_cluster_and_job_commands_do_not_import_torch(tmp_path):
    script = (
        "import json, sys\n"
        "from typer.testing import CliRunner\n"
        "from phalanx.cli import app\n"
        "codes = [CliRunner().invoke(app, args).exit_code for args in (['cluster', 'list'], ['job', 'list'],\n"
        "         ['cluster', 'list-nodes'], ['fault', 'inject', '--node', 'n', '--kind', 'gpu-xid'])]\n"
        "torch = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3]\n"
        "print(json.dumps({'codes': codes, 'torch': torch}))\n"
    )
    env = {**os.environ, "PHALANX_HOME": str(tmp_path / "empty-home")}
    done = subprocess.run([PY, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["codes"] == [0, 2, 2, 2], result
    assert result["torch"] == [], f"torch imported by a command that does not train: {result['torch']}"


# ---- 7: tables are not cut when the output is not a terminal ---------------------------------------------
def test_tables_keep_their_width_when_not_writing_to_a_terminal(monkeypatch):
    from rich.table import Table

    from phalanx.control.client.cli import WideConsole

    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    console = WideConsole(file=buf, highlight=False)
    long_name = "a-training-job-with-a-rather-long-name-" + "x" * 25
    t = Table("JOBID", "NAME", "STATE", "NODES", "GEN", "ATTEMPTS", "STEP", "TIME", "NODELIST(REASON)")
    t.add_row("1", long_name, "running", "4", "1", "1", "12", "0:01:02", "workers-0,workers-1,workers-2,workers-3")
    console.print(t)
    row = next(line for line in buf.getvalue().splitlines() if "running" in line)
    assert long_name in row and "workers-0,workers-1,workers-2,workers-3" in row, buf.getvalue()
    monkeypatch.setenv("COLUMNS", "60")  # an explicit COLUMNS still wins
    assert WideConsole(file=io.StringIO()).width == 60


# ---- 1, 2, 4, 7, 8 on a real one-node cluster ------------------------------------------------------------
@pytest.mark.slow
def test_a_private_cluster_a_python_lifecycle_script_and_honest_offline_views(tmp_path, home):
    marker = tmp_path / "ran-by-python"
    script = (f"#!{PY}\n"  # not executable: run with the interpreter its #! line names, not /bin/sh
              "import os, sys\n"
              f"open({str(marker)!r}, 'w').write(os.environ['PHALANX_NODE_NAME'] + ' ' + sys.executable)\n"
              "print('configured by python')\n")
    spec = write_spec(tmp_path, script=script, executable=False)
    code, out = cli("cluster", "create", "-f", spec)
    assert code == 0, out
    assert marker.read_text() == f"workers-0 {PY}"
    paths = ClusterPaths.for_name("c1")
    assert "configured by python" in (paths.node_dir("workers-0") / "lifecycle.log").read_text()

    code, out = cli("cluster", "create", "-f", spec)  # the same name again: a refusal
    assert code == 2 and "cluster 'c1' already exists" in out, out

    long_name = "a-command-job-with-a-long-name-" + "y" * 33  # 64 characters, the longest allowed
    code, out = cli("job", "submit", "--nodes", 1, "--name", long_name, "--", PY, "-c", "print('hello')")
    assert code == 0, out
    assert JobClient("c1").wait(long_name, timeout_s=60)["state"] == "succeeded"
    code, out = cli("job", "submit", tmp_path / "missing.yaml", "--nodes", 1)  # a training config error
    lines = out.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"error: config file {tmp_path / 'missing.yaml'} "
                                                                 f"does not exist"), out
    code, out = cli("job", "submit", "--nodes", 1, "--name", "sleeper", "--", PY, "-c", "import time; time.sleep(120)")
    assert code == 0, out
    wait_for(lambda: JobClient("c1").describe("sleeper")["state"] == "running", 30, "the sleeper to run")
    code, out = cli("job", "describe", "sleeper")  # a running generation has no end reason yet
    assert code == 0 and "state running" in flat(out), out

    # 1: nothing under the cluster dir is readable by group or others (controller, agent, lifecycle, job files)
    exposed = [f"{p} {stat.filemode(p.lstat().st_mode)}" for p in [paths.root, *paths.root.rglob("*")]
               if not p.is_symlink() and p.lstat().st_mode & 0o077]
    assert exposed == [], exposed
    assert (paths.root / "jobs").is_dir() and (paths.node_dir("workers-0") / "agent.log").is_file()

    # 7: piped output keeps whole rows
    code, out = cli("job", "list")
    row = next(line for line in out.splitlines() if "succeeded" in line)
    assert code == 0 and long_name in row, out
    code, out = cli("cluster", "list-nodes")
    row = next(line for line in out.splitlines() if "workers-0" in line)
    assert code == 0 and all(word in row for word in ("workers", "member", "healthy", "ok")), out

    # 4: the API's own validation refusal reads as one line, not a pydantic dump
    with pytest.raises(Exception) as refused:
        ClusterClient("c1").call("POST", "/v1/nodes/workers-0/faults", {"kind": "gpu-xid"})
    assert refused.value.status == 422 and "xid is required with kind gpu-xid" in refused.value.detail
    assert not any(word in refused.value.detail for word in PYDANTIC_WORDS), refused.value.detail

    # 8: with the controller stopped, what is shown says it is the last record, not live
    code, out = cli("cluster", "stop")
    assert code == 0, out
    code, out = cli("job", "list")
    text = flat(out)
    assert code == 0 and "unknown (controller down since" in text and "last recorded running)" in text, out
    assert "`phalanx cluster start c1`" in text and "succeeded" in text, out  # a final state stays as it is
    code, out = cli("job", "describe", "sleeper")
    assert code == 0 and "state unknown (controller down since" in flat(out), out
    code, out = cli("cluster", "list")
    assert code == 0 and "unknown (controller down since" in flat(out) and "phalanx cluster start c1" in flat(out)
    code, out = cli("cluster", "list-nodes")
    assert code == 0 and "controller down since" in flat(out) and "not live" in flat(out), out
    assert JobClient("c1").describe("sleeper")["controller_down_since"] is not None
    code, out = cli("cluster", "stop")  # stopping a stopped controller: a refusal
    assert code == 2 and "is not running" in out, out

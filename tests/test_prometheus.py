"""A real Prometheus (the Debian package, `make system-deps`) scraping a real local cluster, started the way
`phalanx observe` starts it: a training job runs, a node is killed (auto-resume, a spare), and Prometheus'
own HTTP API must then hold the cluster's series — and every PromQL expression of every panel of the Grafana
dashboard (deploy/grafana/phalanx.json) must return data. A missing `prometheus` fails the test (it names
the fix); it is never skipped."""

from __future__ import annotations

import json
import math
import shutil
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from clusters import home, wait_for  # noqa: F401  (home is a fixture)
from conftest import tiny_config
from phalanx.cli import app
from phalanx.control.backends.local import free_port, process_running
from phalanx.control.client.cluster import create_cluster
from phalanx.control.client.jobs import JobClient
from phalanx.control.client.observe import ObserveError, ObserverPaths, prometheus_binary, running_observer
from phalanx.control.state.paths import ClusterPaths
from phalanx.train.config import dump_config

DASHBOARD = Path(__file__).parent.parent / "deploy" / "grafana" / "phalanx.json"
# Grafana's variables, as the dashboard's defaults resolve them: every job, a rate window of a minute
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$job": ".+"}
runner = CliRunner()


def cli(*args) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def require_prometheus() -> None:
    try:
        prometheus_binary()
    except ObserveError as err:
        pytest.fail(f"{err} — this test drives a real Prometheus: run `make system-deps` (as root) first")


def query(url: str, expr: str) -> list[dict]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def values(result: list[dict]) -> list[float]:
    return [float(s["value"][1]) for s in result]


def panel_expressions() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    found = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    assert len(found) >= 14 and all(expr for _, expr in found)
    return found


def resolve(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a Grafana variable the test does not resolve: {expr}"
    return expr


def test_a_missing_prometheus_names_the_fix(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("PHALANX_PROMETHEUS", raising=False)
    with pytest.raises(ObserveError, match="make system-deps") as err:
        prometheus_binary()
    assert "apt-get install prometheus" in str(err.value)


def test_grafana_dashboard_is_importable():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36 and dash["__inputs"][0]["name"] == "DS_PROMETHEUS"
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in dash["panels"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


@pytest.mark.slow
def test_prometheus_scrapes_a_cluster_and_every_dashboard_panel_has_data(tmp_path, home, demo_data):  # noqa: F811
    require_prometheus()
    spec = tmp_path / "c1.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "c1", "instance_groups": [{"name": "workers", "instance_type": "local.cpu-1", "count": 2,
                                            "spares": 1, "warm_standby": False}],
        "health": {"heartbeat_timeout_s": 5.0, "hang_timeout_s": 60.0}}))
    create_cluster(spec, timeout_s=60)
    port = free_port()
    code, out = cli("observe", "--cluster", "c1", "--port", port, "--interval", "1")
    assert code == 0 and f"http://127.0.0.1:{port}" in out, out
    paths = ClusterPaths.for_name("c1")
    observer = running_observer(paths)
    url = observer["url"]
    try:
        config = ObserverPaths.of(paths).config.read_text()
        assert str(paths.token) in config and paths.read_token() not in config  # the token is never copied
        wait_for(lambda: values(query(url, 'up{job="phalanx"}')) == [1.0], 30, "Prometheus to scrape the controller")

        jobs = JobClient("c1")
        config_path = tmp_path / "tiny.yaml"
        config_path.write_text(yaml.safe_dump(dump_config(tiny_config(
            tmp_path / "run", demo_data, training={"max_steps": 16, "log_interval": 4},
            checkpoint={"interval": 4, "keep": 10}))))
        jobs.submit(config_path, nodes=2, auto_resume=True, name="tiny")
        wait_for(lambda: (i := jobs.describe("tiny"))["last_step"] is not None and i["last_step"] >= 6, 90,
                 "the job to pass step 6 (a checkpoint at 4 committed)")
        wait_for(lambda: values(query(url, "phalanx_job_step")) and values(query(url, "phalanx_job_step"))[0] >= 1,
                 20, "Prometheus to scrape the job's steps while it trains")
        victim = jobs.describe("tiny")["generations"][0]["nodes"][1]  # rank 1's node
        code, out = cli("fault", "inject", "--node", victim, "--kind", "kill-node")
        assert code == 0, out
        info = jobs.wait("tiny", timeout_s=120)
        assert info["state"] == "succeeded" and info["attempts"] == 2, info["reason"]

        # the final state scraped: the restart, the replacement, the recovery's phases
        wait_for(lambda: values(query(url, 'phalanx_jobs{state="succeeded"}')) == [1.0]
                 and values(query(url, 'phalanx_job_restarts_total{cause="node-fault"}')) == [1.0]
                 and sum(values(query(url, "phalanx_job_recovery_phase_seconds_count"))) > 0,
                 20, "Prometheus to scrape the job's end and its recovery")
        assert values(query(url, 'phalanx_node_replacements_total{reason="agent-gone"}')) == [1.0]
        assert values(query(url, 'phalanx_node_faults_total{cause="agent-gone"}')) == [1.0]
        assert values(query(url, 'sum(phalanx_nodes{state="healthy"})'))[0] >= 2
        (step,) = values(query(url, "phalanx_job_step"))
        assert step == 16
        assert values(query(url, "phalanx_job_tokens_total"))[0] > 0
        categories = {s["metric"]["category"]: float(s["value"][1]) for s in query(url, "phalanx_job_goodput_seconds")}
        assert categories["productive"] > 0 and categories["failure_detection"] > 0 and categories["recovery"] > 0
        assert 0 < values(query(url, "phalanx_job_goodput_ratio"))[0] < 1
        phases = {s["metric"]["phase"] for s in query(url, "phalanx_job_recovery_phase_seconds_count > 0")}
        assert {"detect", "regroup", "first_step"} <= phases, phases

        empty = []
        for title, expr in panel_expressions():
            result = query(url, resolve(expr))
            if not any(math.isfinite(v) for v in values(result)):
                empty.append(f"{title}: {expr} → {result}")
        assert not empty, "dashboard panels without data:\n" + "\n".join(empty)
    finally:
        code, out = cli("observe", "--cluster", "c1", "--stop")
        assert code == 0 and f"pid {observer['pid']} stopped" in out, out
        assert not process_running(observer["pid"], "prometheus")
        shutil.rmtree(ObserverPaths.of(paths).root)

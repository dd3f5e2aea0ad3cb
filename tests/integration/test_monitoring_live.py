"""The monitoring profile for real: Prometheus (Debian's package) scrapes a real CPU fleet and every query of the
Grafana dashboard returns data.

The shipped monitoring/prometheus.yml is used with its jobs as they are; only the service discovery (Compose
DNS names) is replaced by the localhost addresses of the session's two replicas, a proxy of this module's own
and a real trainer running the tiny recipe with its exporter on. Every PromQL expression of
monitoring/grafana/dashboards/lorafleet.json is then run through Prometheus's HTTP API while the trainer
trains (until the test stops it: a run that ended first, on a fast machine, would leave queries and its `up` to a
race); one that has not returned a finite value by the deadline (or if the trainer died) fails the test, naming its
panel. `promtool check metrics` lints what the proxy and the trainer serve.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from lorafleet.ports import free_port
from lorafleet_ops.processes import Service, wait_healthy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_CONFIG = REPO / "monitoring" / "prometheus.yml"
DASHBOARD = REPO / "monitoring" / "grafana" / "dashboards" / "lorafleet.json"
# Grafana's built-in interval variables, as Grafana expands them for the shipped 15 s scrape interval.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s"}
RUN = "monitoring-it"
DATA_DEADLINE_S = 240


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, Grafana's variables expanded."""
    queries = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            queries.append((panel["title"], expr))
    return queries


def local_config(targets: dict[str, list[str]], scrape_interval: str) -> dict[str, Any]:
    """The shipped config with each job's targets replaced by `targets[job]` (static), every other key kept."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = scrape_interval
    jobs = config["scrape_configs"]
    assert sorted(job["job_name"] for job in jobs) == sorted(targets), "the live test must scrape every job"
    for job in jobs:
        for key in [key for key in job if key.endswith("_sd_configs")]:
            del job[key]
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return config


def host_port(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


@pytest.fixture(scope="module")
def fleet(shared_replicas: list[Service], start_proxy: Callable[..., Service],
          adapter_root: Path) -> Iterator[tuple[list[Service], Service, Path]]:
    root = adapter_root / "monitoring"
    root.mkdir()
    proxy = start_proxy(shared_replicas, root=root)
    yield shared_replicas, proxy, root
    for card in httpx.get(proxy.url + "/v1/models", timeout=10).json()["data"][1:]:
        httpx.post(proxy.url + "/v1/unload_lora_adapter", json={"lora_name": card["id"]}, timeout=60)
    proxy.stop()


def query(prometheus: str, expr: str) -> list[float]:
    """The finite values of an instant query (an empty list = no data)."""
    answer = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", f"{expr}: {answer}"
    values = [float(item["value"][1]) for item in answer["data"]["result"]]
    return [value for value in values if math.isfinite(value)]


def test_every_dashboard_query_returns_data_from_a_real_fleet(
    fleet, start_trainer, log_dir: Path, tmp_path: Path, debian_tool
) -> None:
    replicas, proxy, root = fleet
    trainer_port = free_port()
    config = local_config({"proxy": [host_port(proxy.url)], "replicas": [host_port(r.url) for r in replicas],
                           "trainer": [f"127.0.0.1:{trainer_port}"]}, scrape_interval="1s")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    prometheus = Service("prometheus", [debian_tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                                        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                        f"--web.listen-address=127.0.0.1:{port}"],
                         {}, log_dir / "prometheus.log", f"http://127.0.0.1:{port}").start()
    trainer = None
    try:
        wait_healthy([prometheus], timeout_s=60, path="/-/ready")
        trainer = start_trainer("monitoring-trainer", root, RUN, proxy.url, HF_HUB_OFFLINE="1", MAX_STEPS=100_000,
                                TRAINER_METRICS_PORT=trainer_port)
        empty = dashboard_queries()
        deadline = time.monotonic() + DATA_DEADLINE_S
        while empty and trainer.alive and time.monotonic() < deadline:
            time.sleep(2)
            empty = [(panel, expr) for panel, expr in empty if not query(prometheus.url, expr)]
        up = {item["metric"]["job"]: item["value"][1]
              for item in httpx.get(prometheus.url + "/api/v1/query", params={"query": "max by (job) (up)"},
                                    timeout=10).json()["data"]["result"]}
        assert not empty, (f"dashboard queries without data after {DATA_DEADLINE_S}s (trainer alive: "
                           f"{trainer.alive}, up by job: {up}):\n" + "\n".join(f"  {p}: {e}" for p, e in empty)
                           + f"\ntrainer log:\n{trainer.log_tail(30)}")
        assert up == {"proxy": "1", "replicas": "1", "trainer": "1"}
        assert not query(prometheus.url, "lorafleet_proxy_no_such_metric"), "the emptiness check cannot fail"
        for name, url in (("proxy", proxy.url), ("trainer", f"http://127.0.0.1:{trainer_port}")):
            lint = subprocess.run([debian_tool("promtool"), "check", "metrics"], input=httpx.get(url + "/metrics").text,
                                  capture_output=True, text=True, timeout=30, check=False)
            assert lint.returncode == 0, f"{name}'s metrics break Prometheus naming: {lint.stdout}{lint.stderr}"
        replicas_up = query(prometheus.url, 'count(up{job="replicas"} == 1)')
        assert replicas_up == [len(replicas)], f"Prometheus scrapes {replicas_up} of {len(replicas)} replicas"
    finally:
        if trainer is not None:
            trainer.stop()
        prometheus.stop()

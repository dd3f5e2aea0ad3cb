"""The monitoring profile: Prometheus's config passes promtool and scrapes what the stack exposes; Grafana gets
the data source and the dashboard from files. The live proof (every dashboard query returns data from a real
fleet) is tests/integration/test_monitoring_live.py.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from typing import Any

import yaml
from lorafleet.settings import StackSettings
from lorafleet_testing.compose_helpers import REPO, ComposeRunner, EnvFileMaker

MONITORING = REPO / "monitoring"
PROMETHEUS_CONFIG = MONITORING / "prometheus.yml"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "lorafleet.json"
DATASOURCES = MONITORING / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = MONITORING / "grafana" / "provisioning" / "dashboards" / "lorafleet.yml"


def default_of(field: str) -> Any:
    return StackSettings.model_fields[field].default


def jobs() -> dict[str, dict[str, Any]]:
    return {job["job_name"]: job for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]}


def test_promtool_accepts_the_shipped_config(debian_tool: Callable[[str], str]) -> None:
    done = subprocess.run([debian_tool("promtool"), "check", "config", str(PROMETHEUS_CONFIG)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_rejects_a_broken_config(debian_tool: Callable[[str], str], tmp_path: Any) -> None:
    broken = tmp_path / "prometheus.yml"
    broken.write_text(PROMETHEUS_CONFIG.read_text().replace("type: A", "type: AAAAA"))
    done = subprocess.run([debian_tool("promtool"), "check", "config", str(broken)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0


def test_the_profile_renders_with_pinned_images_on_loopback(
    run_compose: ComposeRunner, make_env_file: EnvFileMaker, project: dict
) -> None:
    for base in ("gpu", "cpu"):
        result = run_compose("config", "--services", env_file=make_env_file(), profiles=(base, "monitoring"))
        assert result.returncode == 0, result.stderr
        assert {"prometheus", "grafana", "proxy"} <= set(result.stdout.split())
    for name in ("prometheus", "grafana"):
        service = project["services"][name]
        assert service["profiles"] == ["monitoring"]
        image, _, tag = service["image"].rpartition(":")
        assert image and tag and tag != "latest", f"{name}: pin the image tag ({service['image']})"
        assert [p["host_ip"] for p in service["ports"]] == ["127.0.0.1"], f"{name} publishes beyond loopback"


def test_prometheus_scrapes_every_part_of_the_stack_where_it_listens(project: dict) -> None:
    services, networks = project["services"], project["networks"]
    prometheus = services["prometheus"]
    fleet = set(prometheus["networks"]) & set(services["proxy"]["networks"])
    assert fleet and all(networks[n].get("internal") for n in fleet), "Prometheus must scrape on the fleet network"
    assert not set(services["grafana"]["networks"]) & fleet, "Grafana needs no access to the fleet"
    assert set(services["grafana"]["networks"]) & set(prometheus["networks"])

    scrape = jobs()
    assert scrape["proxy"]["static_configs"] == [{"targets": [f"proxy:{default_of('proxy_port')}"]}]
    (replicas,) = scrape["replicas"]["dns_sd_configs"]
    dns_host, dns_port = services["proxy"]["environment"]["PROXY_UPSTREAM_DNS"].split(":")
    assert (replicas["names"], replicas["type"], str(replicas["port"])) == ([dns_host], "A", dns_port)
    (trainer,) = scrape["trainer"]["dns_sd_configs"]
    trainers = [name for name, svc in services.items()  # the one-shot doctor reads TRAINER_VLLM_URL too
                if "TRAINER_VLLM_URL" in svc.get("environment", {}) and not name.startswith("doctor")]
    assert sorted(trainer["names"]) == sorted(trainers) and trainer["port"] == default_of("trainer_metrics_port")
    for name in trainers:
        assert services[name]["environment"]["TRAINER_METRICS_HOST"] == "0.0.0.0", f"{name} is not reachable"
        assert fleet & set(services[name]["networks"]), f"{name} is not on the network Prometheus scrapes"

    mounts = {v["target"]: v for v in prometheus["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"]["source"] == str(PROMETHEUS_CONFIG)


def test_grafana_is_provisioned_with_the_data_source_and_the_dashboard(project: dict) -> None:
    grafana = project["services"]["grafana"]
    mounts = {v["target"]: v["source"] for v in grafana["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == str(MONITORING / "grafana" / "provisioning")
    (provider,) = yaml.safe_load(DASHBOARD_PROVIDERS.read_text())["providers"]
    assert mounts[provider["options"]["path"]] == str(DASHBOARD.parent)
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"

    dashboard = json.loads(DASHBOARD.read_text())
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    assert rows == ["Fleet", "Sync", "Training"]
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        assert panel["targets"] and all(target["expr"].strip() for target in panel["targets"]), panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what the panel shows"

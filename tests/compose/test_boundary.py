"""The security boundary in the rendered compose config (issue 12), and checks that they catch each way to break it.

- The keyless fleet port listens only on the proxy's address in an internal network that holds nothing but the
  proxy and the trainer; it is never published, and the proxy never shares the host's network.
- Replicas sit on internal networks shared with the proxy alone (their dev routes, which vLLM's API key does not
  guard, are reachable through the proxy only), run offline, and have the API key the proxy sends.
- Keys only where needed: PROXY_API_KEY in the proxy, PROXY_UPSTREAM_TOKEN in proxy, replicas and the operator's
  one-shot doctor (`make doctor`), which asks each replica directly and is started by `docker compose run` only.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from lorafleet.settings import StackSettings
from lorafleet_testing.compose_helpers import COMPOSE_FILE, REPO, REQUIRED_SECRET_VALUE, EnvFileMaker

ALL_INTERFACES = {"", "0.0.0.0", "::", "[::]", "*"}
TRAINERS = {"trainer", "trainer-cpu"}
REPLICAS = {"vllm", "vllm-cpu"}
# The operator's one-shot checklist (`make doctor`, `docker compose run doctor`): it asks each replica directly.
OPERATORS = {"doctor", "doctor-cpu"}
# The monitoring profile's Prometheus scrapes /metrics of the proxy, the trainer and every replica; it holds no key.
SCRAPERS = {"prometheus"}


def members(project: dict[str, Any], network: str) -> set[str]:
    return {name for name, svc in project["services"].items() if network in (svc.get("networks") or {})}


def fleet_port_exposures(project: dict[str, Any]) -> list[str]:
    """Every way the rendered project lets something other than proxy and trainer reach the fleet port."""
    problems = []
    proxy = project["services"]["proxy"]
    fleet_port = int(proxy["environment"].get("PROXY_PORT", StackSettings.model_fields["proxy_port"].default))
    host = proxy["environment"].get("PROXY_FLEET_HOST", StackSettings.model_fields["proxy_fleet_host"].default)
    if proxy.get("network_mode"):
        problems.append(f"the proxy uses network_mode {proxy['network_mode']}")
    if host in ALL_INTERFACES:
        problems.append(f"PROXY_FLEET_HOST={host!r} binds every interface of the proxy container")
    attached = proxy.get("networks") or {}
    homes = [network for network, how in attached.items() if host in ((how or {}).get("aliases") or [])]
    if not homes:
        problems.append(f"PROXY_FLEET_HOST={host!r} is no network alias of the proxy: nothing ties it to one network")
    for network in homes:
        if not project["networks"][network].get("internal"):
            problems.append(f"the fleet port's network {network} is not internal")
        strangers = members(project, network) - TRAINERS - OPERATORS - SCRAPERS - {"proxy"}
        if strangers:
            problems.append(f"{sorted(strangers)} share the fleet port's network {network}")
        if not members(project, network) & TRAINERS:
            problems.append(f"no trainer is on the fleet port's network {network}")
    for name, svc in project["services"].items():
        for port in svc.get("ports") or []:
            if int(port["target"]) == fleet_port:
                problems.append(f"{name} publishes the fleet port: {port}")
    return problems


def replica_exposures(project: dict[str, Any]) -> list[str]:
    """Every way the rendered project lets replicas reach the internet or be reached other than by the proxy."""
    problems = []
    for name in REPLICAS:
        svc = project["services"][name]
        if svc.get("ports") or svc.get("network_mode"):
            problems.append(f"{name} is published or shares another network stack")
        for network in svc.get("networks") or {}:
            if not project["networks"][network].get("internal"):
                problems.append(f"{name} is on {network}, which has a route out")
            strangers = members(project, network) - REPLICAS - OPERATORS - SCRAPERS - {"proxy"}
            if strangers:
                problems.append(f"{sorted(strangers)} can reach {name} on {network}, bypassing the proxy")
        if svc["environment"].get("HF_HUB_OFFLINE") != "1":
            problems.append(f"{name} is not offline (HF_HUB_OFFLINE)")
    return problems


def keys_out_of_place(project: dict[str, Any]) -> list[str]:
    problems = []
    for name, svc in project["services"].items():
        env = svc.get("environment") or {}
        holds = {key for key in ("PROXY_API_KEY", "PROXY_UPSTREAM_TOKEN") if env.get(key)}
        allowed = {"proxy": {"PROXY_API_KEY", "PROXY_UPSTREAM_TOKEN"}}.get(
            name, {"PROXY_UPSTREAM_TOKEN"} if name in REPLICAS | OPERATORS else set())
        if holds - allowed:
            problems.append(f"{name} holds {sorted(holds - allowed)}")
        if allowed - holds:
            problems.append(f"{name} lacks {sorted(allowed - holds)}")
    return problems


# --- the rendered stack ----------------------------------------------------------------------------------------


def test_rendered_config_cannot_expose_the_fleet_port(project: dict) -> None:
    assert fleet_port_exposures(project) == []


def test_replicas_have_no_egress_and_only_the_proxy_reaches_them(project: dict) -> None:
    assert replica_exposures(project) == []


def test_keys_are_only_where_they_are_needed(project: dict) -> None:
    assert keys_out_of_place(project) == []
    proxy, replica = project["services"]["proxy"]["environment"], project["services"]["vllm"]["environment"]
    assert proxy["PROXY_UPSTREAM_TOKEN"] == replica["PROXY_UPSTREAM_TOKEN"] == REQUIRED_SECRET_VALUE


RUN_KEYS_MOUNT = "/run/lorafleet/run-keys"


def run_key_mounts(project: dict[str, Any]) -> list[str]:
    """The run keys (docs/guides/security.md#run-keys): the directory of hashes in the proxy alone, read-only, where
    RUN_KEYS_DIR points; the keys themselves in no service of the stack (`make train RUN=b` mounts b's into its
    trainer alone)."""
    problems = []
    for name, svc in project["services"].items():
        for volume in svc.get("volumes") or []:
            source = str(volume.get("source", ""))
            if "run-keys" not in source:
                continue
            if name != "proxy" or not source.endswith("run-keys/hashes"):
                problems.append(f"{name} mounts {source}")
            elif not volume.get("read_only") or volume.get("target") != RUN_KEYS_MOUNT:
                problems.append(f"proxy mounts {source} at {volume.get('target')} read_only={volume.get('read_only')}")
    if project["services"]["proxy"]["environment"].get("RUN_KEYS_DIR") != RUN_KEYS_MOUNT:
        problems.append("the proxy's RUN_KEYS_DIR is not the mounted run keys")
    return problems


def test_run_keys_are_on_in_the_stack_and_only_the_proxy_sees_their_hashes(project: dict) -> None:
    assert run_key_mounts(project) == []
    broken = copy.deepcopy(project)
    broken["services"]["vllm"].setdefault("volumes", []).append(
        {"type": "bind", "source": str(REPO / "run-keys" / "keys"), "target": "/keys"})
    assert run_key_mounts(broken) == [f"vllm mounts {REPO / 'run-keys' / 'keys'}"]


def test_make_train_hands_a_run_its_own_key_file_and_nothing_else() -> None:
    dry = subprocess.run(["make", "-n", "train", "RUN=b", "CPU=1"], cwd=REPO, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert "-m lorafleet_ops.commands.run_key b --dir run-keys/hashes --key-file run-keys/keys/b.key" in dry
    assert f"-v {REPO}/run-keys/keys/b.key:/run/secrets/lorafleet-run-key:ro" in dry
    assert "-e TRAINER_RUN_KEY_FILE=/run/secrets/lorafleet-run-key" in dry
    assert dry.count("run-keys/") == 4, dry  # the test, the key's making (hashes, key), the one mount


# --- the checks fail where they should ---------------------------------------------------------------------------


def _mutated(project: dict, change: str) -> dict:
    broken = copy.deepcopy(project)
    services, networks = broken["services"], broken["networks"]
    proxy = services["proxy"]
    if change == "bind all":
        proxy["environment"]["PROXY_FLEET_HOST"] = "0.0.0.0"
    elif change == "alias on public":
        proxy["networks"]["public"] = {"aliases": ["proxy-fleet"]}
    elif change == "fleet not internal":
        networks["fleet"]["internal"] = False
    elif change == "publish fleet port":
        proxy["ports"].append({"target": int(proxy["environment"]["PROXY_PORT"]), "published": "8000"})
    elif change == "replica on fleet":
        services["vllm"]["networks"]["fleet"] = {}
    elif change == "host network":
        proxy["network_mode"] = "host"
    return broken


@pytest.mark.parametrize(
    "change", ["bind all", "alias on public", "fleet not internal", "publish fleet port", "replica on fleet",
               "host network"])
def test_the_fleet_port_check_catches(project: dict, change: str) -> None:
    assert fleet_port_exposures(_mutated(project, change))


def test_the_replica_checks_catch_egress_a_trainer_and_keys_in_the_wrong_place(project: dict) -> None:
    egress = copy.deepcopy(project)
    egress["services"]["vllm-cpu"]["networks"]["egress"] = {}
    assert replica_exposures(egress)
    trainer = copy.deepcopy(project)
    trainer["services"]["trainer"]["networks"]["replicas"] = {}
    assert replica_exposures(trainer)
    leaked = copy.deepcopy(project)
    leaked["services"]["trainer"]["environment"]["PROXY_UPSTREAM_TOKEN"] = "x"
    assert keys_out_of_place(leaked) == ["trainer holds ['PROXY_UPSTREAM_TOKEN']"]


def test_the_online_opt_out_gives_replicas_egress(
    compose_bin: Path, tool_env: dict[str, str], make_env_file: EnvFileMaker
) -> None:
    done = subprocess.run(
        [str(compose_bin), "-f", str(COMPOSE_FILE), "-f", str(REPO / "compose.online.yaml"), "--env-file",
         str(make_env_file()), "--profile", "*", "config", "--format", "json"],
        cwd=REPO, env=tool_env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    online = json.loads(done.stdout)
    for name in REPLICAS:
        assert "egress" in online["services"][name]["networks"] and online["services"][name]["environment"][
            "HF_HUB_OFFLINE"] == "0", name
    assert fleet_port_exposures(online) == []

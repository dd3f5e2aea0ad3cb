"""deploy/kubernetes: every overlay renders (kubectl's kustomize), validates against the Kubernetes API schemas of
the oldest and newest supported minor (kubernetes-validate --strict) and has the stack's properties (k8s_checks).
The second half breaks a rendered overlay on purpose, one property at a time: each check must catch it."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import k8s_checks as checks
import pytest
import yaml
from k8s_manifests import KUBERNETES_VERSIONS, OVERLAYS, Obj, find, main_container, tool

DEVICE = {"gpu": "gpu", "cpu": "cpu", "example": "gpu"}
DNS = {f"ns[kubernetes.io/metadata.name=kube-system]/pod[k8s-app=kube-dns]:53/{proto}" for proto in ("UDP", "TCP")}
# The doors of SECURITY.md's table: who may connect to each port, and where each pod may connect to.
INGRESS = {
    "proxy:8000/TCP": {"trainer"},
    "proxy:8080/TCP": {"pod[lorafleet.dev/proxy-client=true]"},
    "replica:8000/TCP": {"proxy"},
    "trainer:9400/TCP": set(),
}
EGRESS = {
    "replica": DNS,
    "proxy": DNS | {"replica:8000/TCP"},
    "trainer": DNS | {"proxy:8000/TCP", "internet:443/TCP"},
    "model-fetch": DNS | {"internet:443/TCP"},
}
# overlays/example adds its Ingress controller to the public port and the monitoring component's Prometheus.
PROMETHEUS = "ns[kubernetes.io/metadata.name=monitoring]/pod[app.kubernetes.io/name=prometheus]"
INGRESS_NGINX = "ns[kubernetes.io/metadata.name=ingress-nginx]/pod[app.kubernetes.io/name=ingress-nginx]"
EXAMPLE_EXTRA = {"proxy:8000/TCP": {PROMETHEUS}, "proxy:8080/TCP": {INGRESS_NGINX}, "replica:8000/TCP": {PROMETHEUS},
                 "trainer:9400/TCP": {PROMETHEUS}}


def expected_ingress(overlay: str) -> dict[str, set[str]]:
    extra = EXAMPLE_EXTRA if overlay == "example" else {}
    return {door: peers | extra.get(door, set()) for door, peers in INGRESS.items()}


def problems(objects: list[Obj], overlay: str, env_example: dict[str, Any]) -> list[str]:
    return checks.all_problems(objects, DEVICE[overlay], expected_ingress(overlay), EGRESS, env_example)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_has_every_property(rendered: dict[str, list[Obj]], overlay: str, env_example: dict[str, Any]) -> None:
    assert problems(rendered[overlay], overlay, env_example) == []


def validate(paths: list[Path], version: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", version, *map(str, paths)],
                          capture_output=True, text=True, timeout=120)


def write(tmp_path: Path, name: str, objects: list[Obj]) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    return path


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_api_schemas(rendered: dict[str, list[Obj]], version: str,
                                                        tmp_path: Path) -> None:
    result = validate([write(tmp_path, overlay, objects) for overlay, objects in rendered.items()], version)
    assert result.returncode == 0, result.stdout + result.stderr


def test_validation_rejects_a_misspelt_field(fresh: Callable[[str], list[Obj]], tmp_path: Path) -> None:
    objects = fresh("gpu")
    pod = find(objects, "Job", "trainer")["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecs"] = pod.pop("terminationGracePeriodSeconds")
    result = validate([write(tmp_path, "broken", objects)], KUBERNETES_VERSIONS[0])
    assert result.returncode != 0 and "terminationGracePeriodSecs" in result.stdout + result.stderr


# --- each property, broken on purpose ------------------------------------------------------------------------------
def container(objects: list[Obj], component: str) -> Obj:
    return main_container(objects, component).spec


def pod(objects: list[Obj], component: str) -> Obj:
    return main_container(objects, component).pod


def env_entry(objects: list[Obj], component: str, name: str) -> Obj:
    return next(entry for entry in container(objects, component)["env"] if entry["name"] == name)


def config(objects: list[Obj]) -> dict[str, str]:
    return next(obj for obj in objects if obj["kind"] == "ConfigMap")["data"]


def policy(objects: list[Obj], name: str) -> Obj:
    return find(objects, "NetworkPolicy", name)["spec"]


BREAKS: dict[str, tuple[str, Callable[[list[Obj]], object], str]] = {
    # name: (overlay, how to break it, what the problem says)
    "replica without a GPU limit": (
        "gpu", lambda o: container(o, "replica")["resources"]["limits"].pop("nvidia.com/gpu"), "want exactly 1"),
    "replica with two GPUs": (
        "gpu", lambda o: container(o, "replica")["resources"]["limits"].update({"nvidia.com/gpu": 2}),
        "want exactly 1"),
    "replica claiming devices": (
        "gpu", lambda o: env_entry(o, "replica", "REPLICA_DEVICE_ASSIGNMENT").update(value="claim"), "scheduler"),
    "GPU on the proxy": (
        "cpu", lambda o: container(o, "proxy")["resources"]["limits"].update({"nvidia.com/gpu": 1}), "asks for"),
    "writable store in a replica": (
        "gpu", lambda o: next(m for m in container(o, "replica")["volumeMounts"] if m["name"] == "adapters")
        .pop("readOnly"), "writable"),
    "store not at ADAPTER_ROOT": (
        "cpu", lambda o: env_entry(o, "proxy", "ADAPTER_ROOT").update(value="/store"), "ADAPTER_ROOT=/store"),
    "missing liveness probe": ("gpu", lambda o: container(o, "replica").pop("livenessProbe"), "no livenessProbe"),
    "probe on a closed port": (
        "cpu", lambda o: container(o, "proxy")["readinessProbe"]["httpGet"].update(port=9999), "does not open"),
    "startup shorter than the model load": (
        "gpu", lambda o: container(o, "replica")["startupProbe"].update(failureThreshold=6), "for the model load"),
    "latest tag": ("cpu", lambda o: container(o, "proxy").update(image="lorafleet/proxy:latest"), "not tagged"),
    "untagged image": ("example", lambda o: container(o, "trainer").update(image="lorafleet/trainer"), "not tagged"),
    "key in the ConfigMap": ("gpu", lambda o: config(o).update(PROXY_API_KEY="s3cret"), "holds ['PROXY_API_KEY']"),
    "key as a literal": (
        "gpu", lambda o: env_entry(o, "proxy", "PROXY_API_KEY").update(value="s3cret"), "does not come from"),
    "key where it is not needed": (
        "cpu", lambda o: container(o, "trainer")["env"].append(env_entry(o, "proxy", "PROXY_UPSTREAM_TOKEN")),
        "holds PROXY_UPSTREAM_TOKEN"),
    "Secret shipped": ("gpu", lambda o: o.append({"kind": "Secret", "metadata": {"name": "keys"}}), "is rendered"),
    "no requests": ("gpu", lambda o: container(o, "trainer")["resources"].pop("requests"), "no requests.cpu"),
    "Service links": ("cpu", lambda o: find(o, "Job", "model-fetch")["spec"]["template"]["spec"].pop(
        "enableServiceLinks"), "enableServiceLinks"),
    "root": ("cpu", lambda o: pod(o, "replica")["securityContext"].update(runAsUser=0), "securityContext"),
    "short trainer grace": ("gpu", lambda o: pod(o, "trainer").update(terminationGracePeriodSeconds=30), "90s"),
    "shm on disk": (
        "gpu", lambda o: next(v for v in pod(o, "replica")["volumes"] if v["name"] == "dshm")["emptyDir"].pop("medium"),
        "/dev/shm"),
    "two proxies": ("gpu", lambda o: find(o, "Deployment", "proxy")["spec"].update(replicas=2), "one pod"),
    "discovery through a ClusterIP": (
        "gpu", lambda o: find(o, "Service", "vllm")["spec"].pop("clusterIP"), "not a headless Service"),
    "discovery on the wrong port": (
        "cpu", lambda o: env_entry(o, "proxy", "PROXY_UPSTREAM_DNS").update(value="vllm:8001"), "does not lead"),
    "no PodDisruptionBudget": (
        "gpu", lambda o: o.remove(find(o, "PodDisruptionBudget", "vllm")), "PodDisruptionBudget"),
    "setting the schema rejects": ("gpu", lambda o: config(o).update(MAX_STALENESS="-1"), "MAX_STALENESS"),
    "misspelt setting": ("cpu", lambda o: config(o).update(MAX_STALNESS="2"), "MAX_STALNESS"),
    "topology setting missing": (
        "gpu", lambda o: container(o, "proxy")["env"].remove(env_entry(o, "proxy", "PROXY_UPSTREAM_DNS")),
        "PROXY_UPSTREAM_DNS"),
    "replicas online": (
        "gpu", lambda o: container(o, "replica")["env"].remove(env_entry(o, "replica", "HF_HUB_OFFLINE")),
        "HF_HUB_OFFLINE"),
    "fleet port open to all": (
        "gpu", lambda o: policy(o, "proxy-fleet-ingress")["ingress"][0].pop("from"),
        "port proxy:8000/TCP lets in ['*'"),
    "replicas reachable by the trainer": (
        "cpu", lambda o: policy(o, "replica-ingress")["ingress"][0]["from"].append(
            {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "trainer"}}}), "replica:8000/TCP lets in"),
    "no default deny": ("gpu", lambda o: o.remove(find(o, "NetworkPolicy", "default-deny")), "no default-deny"),
    "replicas with egress": (
        "gpu", lambda o: policy(o, "proxy-egress").update(podSelector={}), "replica may connect to"),
    "new port without a door": (
        "gpu", lambda o: container(o, "proxy")["ports"].append({"name": "debug", "containerPort": 5678}),
        "proxy:5678/TCP has no decided door"),
    "policy on a port nobody opens": (
        "cpu", lambda o: container(o, "trainer").pop("ports"), "expected but nothing listens"),
}


@pytest.mark.parametrize("name", BREAKS)
def test_a_broken_overlay_fails_its_check(fresh: Callable[[str], list[Obj]], env_example: dict[str, Any],
                                          name: str) -> None:
    overlay, breaks, says = BREAKS[name]
    objects = fresh(overlay)
    assert problems(objects, overlay, env_example) == []
    breaks(objects)
    found = problems(objects, overlay, env_example)
    assert any(says in problem for problem in found), f"{name}: no problem says {says!r}: {found}"

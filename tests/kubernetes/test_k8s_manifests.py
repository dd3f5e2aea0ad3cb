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
from k8s_manifests import (
    KUBERNETES_VERSIONS,
    OVERLAYS,
    RUN_LABEL,
    WITH_RUN,
    Obj,
    containers,
    find,
    main_container,
    run_trainers,
    tool,
)

DEVICE = {"gpu": "gpu", "cpu": "cpu", "example": "gpu"}
# Every rendering: the overlays, and each with the named run b's component (`gpu+run-b`, ...).
RENDERINGS = (*OVERLAYS, *WITH_RUN)
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


def problems(objects: list[Obj], rendering: str, env_example: dict[str, Any]) -> list[str]:
    """A named run's trainer has the same doors as the default run's (both are component=trainer)."""
    overlay = WITH_RUN.get(rendering, rendering)
    return checks.all_problems(objects, DEVICE[overlay], expected_ingress(overlay), EGRESS, env_example)


@pytest.mark.parametrize("overlay", RENDERINGS)
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


def store_mount(objects: list[Obj], component: str, path: str) -> Obj:
    return next(m for m in container(objects, component)["volumeMounts"] if m["mountPath"] == path)


def pod(objects: list[Obj], component: str) -> Obj:
    return main_container(objects, component).pod


def env_entry(objects: list[Obj], component: str, name: str) -> Obj:
    return next(entry for entry in container(objects, component)["env"] if entry["name"] == name)


def config(objects: list[Obj]) -> dict[str, str]:
    return next(obj for obj in objects if obj["kind"] == "ConfigMap")["data"]


def policy(objects: list[Obj], name: str) -> Obj:
    return find(objects, "NetworkPolicy", name)["spec"]


def run_b(objects: list[Obj]) -> Obj:
    """Run b's trainer container (the component's Job trainer-b)."""
    return next(c for c in run_trainers(objects) if c.run == "b").spec


def run_b_pod(objects: list[Obj]) -> Obj:
    return next(c for c in run_trainers(objects) if c.run == "b").pod


def named(items: list[Obj], name: str) -> Obj:
    return next(item for item in items if item["name"] == name)


def run_keys_volume(objects: list[Obj]) -> Obj:
    return named(pod(objects, "proxy")["volumes"], "run-keys")


def run_key_volume(objects: list[Obj]) -> Obj:
    return named(run_b_pod(objects)["volumes"], "run-key")


def mount_secret(workload_pod: Obj, spec: Obj, secret: str) -> None:
    """Give a container a volume of `secret`, mounted at /run/secrets/extra."""
    workload_pod["volumes"].append({"name": "extra", "secret": {"secretName": secret}})
    spec.setdefault("volumeMounts", []).append({"name": "extra", "mountPath": "/run/secrets/extra", "readOnly": True})


def secret_env(secret: str) -> Obj:
    return {"name": "TRAINER_RUN_KEY_FILE", "valueFrom": {"secretKeyRef": {"name": secret, "key": "key"}}}


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
    "writable models in a replica": (
        "gpu", lambda o: next(m for m in container(o, "replica")["volumeMounts"] if m["name"] == "adapters")
        .pop("readOnly"), "want its models alone, read-only"),
    "a replica holding the whole store": (
        "cpu", lambda o: next(m for m in container(o, "replica")["volumeMounts"] if m["name"] == "adapters")
        .update(mountPath="/adapters", subPath=""), "want its models alone"),
    "a replica's init container holding runs/": (
        "gpu", lambda o: named(pod(o, "replica")["initContainers"], "wait-for-model")["volumeMounts"][0]
        .update(mountPath="/adapters/runs", subPath="runs"), "want its models alone"),
    "a trainer mounting the content store": (
        "cpu", lambda o: (pod(o, "trainer")["volumes"].append(
            {"name": "content", "persistentVolumeClaim": {"claimName": "content", "readOnly": True}}),
            container(o, "trainer")["volumeMounts"].append(
            {"name": "content", "mountPath": "/adapters/.content", "readOnly": True})),
        "container trainer: mounts the content store"),
    "a replica writing the content store": (
        "gpu", lambda o: named(container(o, "replica")["volumeMounts"], "content").pop("readOnly"),
        "mounts the content store at /adapters/.content readOnly=None (want /adapters/.content, ro)"),
    "a read-only content store in the proxy": (
        "example", lambda o: named(container(o, "proxy")["volumeMounts"], "content").update(readOnly=True),
        "(want /adapters/.content, rw)"),
    "a replica without the content store": (
        "cpu", lambda o: container(o, "replica")["volumeMounts"].remove(
            named(container(o, "replica")["volumeMounts"], "content")), "the replica does not mount the content"),
    "trainer holding the whole store": (
        "gpu", lambda o: store_mount(o, "trainer", "/adapters/runs/run1").update(mountPath="/adapters", subPath=""),
        "mounts /adapters of the store"),
    "trainer holding every run": (
        "cpu", lambda o: store_mount(o, "trainer", "/adapters/runs/run1").update(subPath="runs"), "want ('runs/run1'"),
    "run b's trainer in run1's directory": (
        "cpu+run-b", lambda o: next(m for m in run_b(o)["volumeMounts"] if m["mountPath"] == "/adapters/runs/b")
        .update(subPath="runs/run1"), "want ('runs/b'"),
    "writable models in the trainer": (
        "example", lambda o: store_mount(o, "trainer", "/adapters/models").pop("readOnly"), "want ('models', True)"),
    "run b's directory never made": (
        "gpu+run-b", lambda o: named(run_b_pod(o)["initContainers"], "run-dir")["env"][0].update(value="run1"),
        "no run-dir init container that makes runs/b"),
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
    # run keys: the proxy's hashes
    "run keys not mounted": (
        "cpu", lambda o: container(o, "proxy")["volumeMounts"].remove(named(container(o, "proxy")["volumeMounts"],
                                                                            "run-keys")),
        "mounts the Secret lorafleet-run-keys 0 times"),
    "run keys required": (
        "gpu", lambda o: run_keys_volume(o)["secret"].update(optional=False), "lorafleet-run-keys is not optional"),
    "run keys writable": (
        "example", lambda o: named(container(o, "proxy")["volumeMounts"], "run-keys").pop("readOnly"),
        "mounts lorafleet-run-keys writable"),
    "RUN_KEYS_DIR elsewhere": (
        "gpu+run-b", lambda o: env_entry(o, "proxy", "RUN_KEYS_DIR").update(value="/run/run-keys"),
        "is not where lorafleet-run-keys is mounted"),
    "run keys unreadable": (
        "cpu", lambda o: run_keys_volume(o)["secret"].update(defaultMode=0o400), "cannot read lorafleet-run-keys"),
    "run keys through a subPath": (
        "gpu", lambda o: named(container(o, "proxy")["volumeMounts"], "run-keys").update(subPath="b"),
        "would never reach the proxy"),
    "hashes in a replica": (
        "cpu", lambda o: mount_secret(pod(o, "replica"), container(o, "replica"), "lorafleet-run-keys"),
        "which only the proxy reads"),
    # run keys: each run's own key
    "run key through env": (
        "cpu+run-b", lambda o: run_b(o)["env"].append(secret_env("lorafleet-run-b")), "through env"),
    "run key through envFrom": (
        "gpu+run-b", lambda o: run_b(o).setdefault("envFrom", []).append({"secretRef": {"name": "lorafleet-run-b"}}),
        "takes Secret lorafleet-run-b through env"),
    "run key in a replica": (
        "gpu+run-b", lambda o: mount_secret(pod(o, "replica"), container(o, "replica"), "lorafleet-run-b"),
        "Deployment/vllm container vllm: mounts Secret lorafleet-run-b"),
    "run key in the default run's trainer": (
        "example+run-b", lambda o: mount_secret(pod(o, "trainer"), container(o, "trainer"), "lorafleet-run-b"),
        "Job/trainer container trainer: mounts Secret lorafleet-run-b"),
    "run key in model-fetch": (
        "cpu+run-b", lambda o: mount_secret(find(o, "Job", "model-fetch")["spec"]["template"]["spec"],
                                            find(o, "Job", "model-fetch")["spec"]["template"]["spec"]["containers"][0],
                                            "lorafleet-run-b"), "Job/model-fetch container model-fetch: mounts"),
    "run key in the init container": (
        "gpu+run-b", lambda o: run_b_pod(o)["initContainers"][0].setdefault("volumeMounts", []).append(
            {"name": "run-key", "mountPath": "/run/secrets/lorafleet-run-key", "subPath": "key", "readOnly": True}),
        "container wait-for-fleet: mounts Secret lorafleet-run-b"),
    "another run's key": (
        "cpu+run-b", lambda o: run_key_volume(o)["secret"].update(secretName="lorafleet-run-c"),
        "mounts Secret lorafleet-run-c, run c's key"),
    "key file outside the mount": (
        "gpu+run-b", lambda o: named(run_b(o)["env"], "TRAINER_RUN_KEY_FILE").update(value="/run/secrets/key"),
        "TRAINER_RUN_KEY_FILE='/run/secrets/key' is not the file"),
    "no key file": (
        "example+run-b", lambda o: run_b(o)["env"].remove(named(run_b(o)["env"], "TRAINER_RUN_KEY_FILE")),
        "TRAINER_RUN_KEY_FILE=None is not the file"),
    "run key optional": (
        "cpu+run-b", lambda o: run_key_volume(o)["secret"].update(optional=True), "would start without it"),
    "run key writable": (
        "gpu+run-b", lambda o: named(run_b(o)["volumeMounts"], "run-key").pop("readOnly"), "its run key writable"),
    "run key unreadable": (
        "cpu+run-b", lambda o: run_key_volume(o)["secret"].update(defaultMode=0o400), "cannot read its run key"),
    "run trainer as another run": (
        "gpu+run-b", lambda o: run_b(o)["env"].append({"name": "RUN_NAME", "value": "c"}) or
        run_b(o)["env"].remove(named(run_b(o)["env"], "RUN_NAME")), "RUN_NAME='c'"),
    "run trainer on the default run's URL": (
        "cpu+run-b", lambda o: named(run_b(o)["env"], "TRAINER_VLLM_URL").update(value="http://proxy:8000"),
        "is not run b's"),
    "run trainer past the fleet port": (
        "example+run-b", lambda o: named(run_b(o)["env"], "TRAINER_VLLM_URL").update(
            value="http://proxy-public:8080/runs/b"), "Job/trainer-b container trainer: TRAINER_VLLM_URL"),
    # a named run's trainer: the base trainer's security and doors
    "run trainer with a token": (
        "gpu+run-b", lambda o: run_b_pod(o).pop("automountServiceAccountToken"), "Job/trainer-b: mounts a service"),
    "run trainer as root": (
        "cpu+run-b", lambda o: run_b_pod(o)["securityContext"].update(runAsUser=0), "pod securityContext"),
    "run trainer on the host network": (
        "gpu+run-b", lambda o: run_b_pod(o).update(hostNetwork=True), "pod hostNetwork True"),
    "run trainer's container escalates": (
        "example+run-b", lambda o: run_b(o)["securityContext"].update(allowPrivilegeEscalation=True),
        "containers' securityContext"),
    "run trainer's short grace": (
        "cpu+run-b", lambda o: run_b_pod(o).update(terminationGracePeriodSeconds=30), "Job/trainer-b"),
    "run trainer not a trainer": (
        "gpu+run-b", lambda o: find(o, "Job", "trainer-b")["spec"]["template"]["metadata"]["labels"].update(
            {"app.kubernetes.io/component": "trainer-b"}), "not trainer"),
    "run trainer cut off from the fleet": (
        "cpu+run-b", lambda o: policy(o, "trainer-egress")["podSelector"].update(
            matchExpressions=[{"key": RUN_LABEL, "operator": "DoesNotExist"}]), "(Job/trainer-b)"),
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


# --- a named run's component ---------------------------------------------------------------------------------------
RUN_ENV = {"RUN_NAME": "b", "TRAINER_VLLM_URL": "http://proxy:8000/runs/b",
           "TRAINER_RUN_KEY_FILE": "/run/secrets/lorafleet-run-key"}


def by_name(items: list[Obj]) -> dict[str, Obj]:
    return {item["name"]: item for item in items}


@pytest.mark.parametrize("rendering", WITH_RUN)
def test_a_named_runs_trainer_is_the_overlays_trainer_with_its_run_and_key(rendered: dict[str, list[Obj]],
                                                                           rendering: str) -> None:
    """components/run-b adds one workload, Job trainer-b: Job trainer as the overlay made it (image, GPUs,
    resources, tolerations, init containers, security), with run b's name, URL, key file and directory of the store
    (made by its run-dir, mounted in place of run1's), and nothing else."""
    objects, plain = rendered[rendering], rendered[WITH_RUN[rendering]]
    added = {(obj["kind"], obj["metadata"]["name"]) for obj in objects} - {
        (obj["kind"], obj["metadata"]["name"]) for obj in plain}
    assert added == {("Job", "trainer-b")}
    assert [(c.where, c.run) for c in run_trainers(objects)] == [("Job/trainer-b container trainer", "b")]
    trainer, named_run = find(objects, "Job", "trainer"), find(objects, "Job", "trainer-b")
    assert trainer == find(plain, "Job", "trainer")  # the component leaves the default run's trainer alone
    assert named_run["metadata"]["namespace"] == trainer["metadata"]["namespace"]
    assert named_run["metadata"]["labels"] == {**trainer["metadata"]["labels"], RUN_LABEL: "b"}
    assert named_run["spec"]["template"]["metadata"] == {
        **trainer["spec"]["template"]["metadata"],
        "labels": {**trainer["spec"]["template"]["metadata"]["labels"], RUN_LABEL: "b"}}
    ours, theirs = named_run["spec"]["template"]["spec"], trainer["spec"]["template"]["spec"]
    own = ("containers", "volumes", "initContainers")
    assert {k: v for k, v in ours.items() if k not in own} == {k: v for k, v in theirs.items() if k not in own}
    makes_b = [{**init, "env": [{"name": "RUN_NAME", "value": "b"}]} if init["name"] == "run-dir" else init
               for init in theirs["initContainers"]]
    assert ours["initContainers"] == makes_b
    assert by_name(ours["volumes"]) == {**by_name(theirs["volumes"]), "run-key": {
        "name": "run-key", "secret": {"secretName": "lorafleet-run-b", "defaultMode": 0o440}}}
    (run_container,), (base_container,) = ours["containers"], theirs["containers"]
    rest = ("env", "volumeMounts")
    assert {k: v for k, v in run_container.items() if k not in rest} == \
        {k: v for k, v in base_container.items() if k not in rest}
    run_env = {name: {"name": name, "value": value} for name, value in RUN_ENV.items()}
    assert by_name(run_container["env"]) == {**by_name(base_container["env"]), **run_env}
    by_path = {mount["mountPath"]: mount for mount in base_container["volumeMounts"]}
    assert by_path.pop("/adapters/runs/run1")["subPath"] == "runs/run1"
    assert {mount["mountPath"]: mount for mount in run_container["volumeMounts"]} == {**by_path, **{
        mount["mountPath"]: mount for mount in (
            {"name": "adapters", "mountPath": "/adapters/runs/b", "subPath": "runs/b"},
            {"name": "run-key", "mountPath": "/run/secrets/lorafleet-run-key", "subPath": "key", "readOnly": True})}}


@pytest.mark.parametrize("rendering", RENDERINGS)
def test_only_the_proxy_and_run_bs_trainer_mount_run_keys(rendered: dict[str, list[Obj]], rendering: str) -> None:
    """Which container mounts which run-key Secret, read off the rendering (run_key_problems checks the rest)."""
    mounts = {(c.where, name) for c in containers(rendered[rendering]) for name, _, _ in checks.secret_mounts(c)
              if name.startswith(checks.RUN_SECRET_PREFIX)}
    want = {("Deployment/proxy container proxy", checks.RUN_KEYS_SECRET)}
    if rendering in WITH_RUN:
        want.add(("Job/trainer-b container trainer", "lorafleet-run-b"))
    assert mounts == want
